// Package sandbox orchestrates forkd's work: building warm snapshots,
// forking children from them, and tracking, reaching and killing those
// children. It joins the VMM backend, the snapshot store, the state store,
// the image builder and the guest agent.
//
// VMs run detached from the process that starts them: a CLI command forks
// children and exits; the next command finds them in the state store and
// re-adopts them by pid and start time.
package sandbox

import (
	"context"
	"crypto/rand"
	"encoding/base32"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/cgroup"
	"github.com/forkd/forkd/internal/disk"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/hub"
	"github.com/forkd/forkd/internal/image"
	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/progress"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/vmm"
)

// Config configures an Engine.
type Config struct {
	// DataDir holds snapshots, state, run dirs and the image cache.
	DataDir string
	// Backend runs the VMs.
	Backend vmm.Backend
	// AgentPath is the static forkd-agent binary put into images.
	AgentPath string
	// CacheDir holds built images (default <DataDir>/cache).
	CacheDir string
	// VMMUser, if set, is the unprivileged user VMM processes drop to
	// once they have opened their files.
	VMMUser string
	// Net, if set, gives every child of a snapshot with a NIC its own
	// network namespace (root only). Cgroups, if set, lets children have
	// resource limits.
	Net     *netns.Manager
	Cgroups *cgroup.Manager
	// Pool, if positive, keeps that many VMMs restored and stopped for
	// each of the snapshots forked most recently, for as long as the
	// engine lives (forkd serve). Children with limits do not use them.
	Pool int
	// PoolMax lets a snapshot's pool grow to its largest fork of the last
	// ten minutes, with at most PoolMax VMMs in the pools of all
	// snapshots together (never fewer than Pool for each of them).
	PoolMax int
	// Fault, if set, is called at each step of a child's creation
	// ("recorded", "isolated", "restored", "published") and once a
	// branch has switched its source's disk ("disk-switched"); an error
	// it returns fails the child or the branch there. For tests of
	// rollback.
	Fault func(step string) error
	// MaxParallel bounds concurrent restores across all of the engine's
	// forks (default: the CPU count under emulation, twice it with a
	// hardware accelerator; see DefaultMaxParallel).
	MaxParallel int
	// MaxChildren bounds one fork request (default 1000).
	MaxChildren int
	// MaxPortsPerSandbox bounds the host ports one sandbox may publish
	// (default DefaultMaxPortsPerSandbox), so that no sandbox takes the
	// whole port range from the others.
	MaxPortsPerSandbox int
	// MaxBranches bounds the branches taken at once (default
	// DefaultMaxBranches); more are refused, to be retried.
	MaxBranches int
	// Daemon keeps the state database open and agent connections cached.
	Daemon bool
	// Unresponsive is what happens to a sandbox whose agent stops
	// answering, unless its own policy says otherwise: UnresponsiveKeep
	// (the default) or UnresponsiveKill.
	Unresponsive string
	// Liveness tunes the agents' liveness watch (agent.Options Silence,
	// ProbeTimeout and CallGrace; zero fields take the agent package's
	// defaults). For tests.
	Liveness agent.Options
	// IdleFreeze, if positive, is how long a daemon's running sandbox may
	// go without requests or inbound traffic before RunIdle freezes it
	// (a sandbox's own IdleFreezeSecs overrides it).
	IdleFreeze time.Duration
	// IdleReclaim, if positive, is how long RunIdle leaves a sandbox
	// frozen before it pages its VMM's memory out to swap (once per
	// freeze; needs swap on the host).
	IdleReclaim time.Duration
	// OnEvent, if set, receives events outside requests (a sandbox found
	// unresponsive, and so on); it must not block.
	OnEvent func(Event)
	// QemuImg is the qemu-img binary sandboxes' disks are made with (""
	// finds it in PATH).
	QemuImg string
	// Progress receives human progress lines; may be nil.
	Progress io.Writer
	Logger   *slog.Logger
}

// DefaultMaxChildren is the largest fork an engine takes by default.
const DefaultMaxChildren = 1000

// Engine does the work. Its methods are safe for concurrent use.
type Engine struct {
	cfg    Config
	log    *slog.Logger
	snaps  *snapshot.Store
	disks  *disk.Store
	state  *state.Store
	images *image.Builder
	runDir string

	restores chan struct{} // one token per restore in progress
	branches chan struct{} // one token per branch being taken
	pool     *pool         // nil without Config.Pool
	hub      *hub.Hub

	mu    sync.Mutex               // guards conns
	conns map[string]*agent.Client // daemon mode: one agent session per sandbox
	dials keyedLocks               // daemon mode: serialises dials per sandbox
	// ends serialises the goroutines that release one sandbox (a kill,
	// the expirer's reclaim): each re-reads the record under it, so none
	// releases what another already did — a slot a new child may have
	// taken since.
	ends keyedLocks
	idle idler // daemon mode: the idle watch's state (freeze.go)
}

// keyedLocks are mutexes by key (a sandbox id), each kept only while a
// goroutine holds or waits for it, so that ids never seen again leave
// nothing behind in a long-running daemon.
type keyedLocks struct {
	mu sync.Mutex
	m  map[string]*keyedLock
}

type keyedLock struct {
	sync.Mutex
	users int
}

// lock locks key's mutex and returns the unlock.
func (k *keyedLocks) lock(key string) (unlock func()) {
	k.mu.Lock()
	if k.m == nil {
		k.m = map[string]*keyedLock{}
	}
	l := k.m[key]
	if l == nil {
		l = &keyedLock{}
		k.m[key] = l
	}
	l.users++
	k.mu.Unlock()
	l.Lock()
	return func() {
		l.Unlock()
		k.mu.Lock()
		if l.users--; l.users == 0 {
			delete(k.m, key)
		}
		k.mu.Unlock()
	}
}

// tryLock locks key's mutex if nobody holds it, and returns the unlock.
func (k *keyedLocks) tryLock(key string) (unlock func(), ok bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.m == nil {
		k.m = map[string]*keyedLock{}
	}
	l := k.m[key]
	if l == nil {
		l = &keyedLock{}
		k.m[key] = l
	}
	if !l.TryLock() {
		if l.users == 0 {
			delete(k.m, key)
		}
		return nil, false
	}
	l.users++
	return func() {
		l.Unlock()
		k.mu.Lock()
		if l.users--; l.users == 0 {
			delete(k.m, key)
		}
		k.mu.Unlock()
	}, true
}

// held returns how many keys have a mutex now.
func (k *keyedLocks) held() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.m)
}

// DefaultMaxParallel is how many restores run at once by default. Under
// emulation (TCG) a restore is CPU-bound, so more restores than CPUs only
// share them: fork of 50 on 2 cores took 13.8–14.6 s with 2 at once
// against 14.5–19.3 s with 4, each child ready in 0.57 s p50 against
// 1.1–1.6 s. With KVM a restore waits more than it computes, and twice
// the CPUs keep them busy.
func DefaultMaxParallel(b vmm.Backend) int {
	if b.Capabilities().Accelerator == "tcg" {
		return runtime.NumCPU()
	}
	return 2 * runtime.NumCPU()
}

// New opens the data dir.
func New(cfg Config) (*Engine, error) {
	if cfg.DataDir == "" {
		return nil, errdefs.InvalidArgument("no data dir")
	}
	if cfg.Backend == nil {
		return nil, errdefs.InvalidArgument("no VMM backend")
	}
	if cfg.MaxParallel <= 0 {
		cfg.MaxParallel = DefaultMaxParallel(cfg.Backend)
	}
	if cfg.MaxChildren <= 0 {
		cfg.MaxChildren = DefaultMaxChildren
	}
	if cfg.MaxBranches <= 0 {
		cfg.MaxBranches = DefaultMaxBranches
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if cfg.CacheDir == "" {
		cfg.CacheDir = filepath.Join(cfg.DataDir, "cache")
	}
	if cfg.Progress == nil {
		cfg.Progress = io.Discard
	}
	if cfg.Unresponsive == "" {
		cfg.Unresponsive = UnresponsiveKeep
	}
	if err := ValidateUnresponsive(cfg.Unresponsive); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return nil, fmt.Errorf("data dir: %w", err)
	}
	// Disk layers name each other by absolute paths.
	abs, err := filepath.Abs(cfg.DataDir)
	if err != nil {
		return nil, fmt.Errorf("data dir: %w", err)
	}
	cfg.DataDir = abs
	if cfg.CacheDir, err = filepath.Abs(cfg.CacheDir); err != nil {
		return nil, fmt.Errorf("cache dir: %w", err)
	}
	snaps, err := snapshot.Open(filepath.Join(cfg.DataDir, "snapshots"))
	if err != nil {
		return nil, err
	}
	st, err := state.Open(filepath.Join(cfg.DataDir, "state.db"), state.Options{Persistent: cfg.Daemon})
	if err != nil {
		return nil, err
	}
	disks, err := disk.Open(filepath.Join(cfg.DataDir, "disks"))
	if err != nil {
		return nil, err
	}
	disks.QemuImg = cfg.QemuImg
	runDir := filepath.Join(cfg.DataDir, "run")
	if err := os.MkdirAll(runDir, 0o700); err != nil {
		return nil, err
	}
	e := &Engine{
		cfg:      cfg,
		log:      cfg.Logger,
		snaps:    snaps,
		disks:    disks,
		state:    st,
		runDir:   runDir,
		restores: make(chan struct{}, cfg.MaxParallel),
		branches: make(chan struct{}, cfg.MaxBranches),
		conns:    map[string]*agent.Client{},
		idle: idler{
			m: map[string]*idleState{}, reclaimAfter: cfg.IdleReclaim, siblings: map[string]proc.Notes{}, noting: map[string]bool{},
			pageOut: proc.PageOut, resident: proc.ResidentAnon, pageIn: proc.PageIn, swapFree: hostSwapFree,
			swapsToZram: proc.SwapsToZram, compact: proc.CompactZramSwap,
			noteResident: proc.NoteResident, place: proc.Place, codeLayout: proc.ReadCodeLayout,
			inbound: cfg.Net.Inbound,
		},
		images: &image.Builder{
			CacheDir:  cfg.CacheDir,
			AgentPath: cfg.AgentPath,
			Progress:  cfg.Progress,
			Logger:    cfg.Logger,
		},
	}
	e.pool = newPool(e, cfg.Pool, cfg.PoolMax)
	if e.hub, err = e.newHub(); err != nil {
		st.Close()
		return nil, err
	}
	return e, nil
}

// Close releases the engine's resources and discards its parked VMMs.
// Sandboxes keep running.
func (e *Engine) Close() error {
	perr := e.pool.close()
	e.mu.Lock()
	for id, c := range e.conns {
		c.Close()
		delete(e.conns, id)
	}
	e.mu.Unlock()
	return errors.Join(perr, e.state.Close())
}

// Snapshots is the engine's snapshot store.
func (e *Engine) Snapshots() *snapshot.Store { return e.snaps }

// State is the engine's sandbox database.
func (e *Engine) State() *state.Store { return e.state }

// Images is the engine's image builder.
func (e *Engine) Images() *image.Builder { return e.images }

// Backend is the engine's VMM backend.
func (e *Engine) Backend() vmm.Backend { return e.cfg.Backend }

// Config returns the engine's configuration.
func (e *Engine) Config() Config { return e.cfg }

// fault runs the test hook Config.Fault at step.
func (e *Engine) fault(step string) error {
	if e.cfg.Fault == nil {
		return nil
	}
	return e.cfg.Fault(step)
}

// progress reports a human progress line to ctx's writer (package
// progress), else Config.Progress.
func (e *Engine) progress(ctx context.Context, format string, args ...any) {
	fmt.Fprintf(progress.Writer(ctx, e.cfg.Progress), format+"\n", args...)
}

var idEncoding = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// newID returns a fresh sandbox id: "sb-" and 10 random base32 characters.
func newID() string {
	var b [7]byte
	rand.Read(b[:])
	return "sb-" + idEncoding.EncodeToString(b[:])[:10]
}

// ValidateID checks a sandbox id's shape before it names anything.
func ValidateID(id string) error {
	if len(id) != 13 || !strings.HasPrefix(id, "sb-") {
		return errdefs.InvalidArgument("sandbox id %s: want sb- and 10 characters", errdefs.Quote(id))
	}
	for _, r := range id[3:] {
		if !(r >= 'a' && r <= 'z' || r >= '2' && r <= '7') {
			return errdefs.InvalidArgument("sandbox id %s: bad character %q", errdefs.Quote(id), r)
		}
	}
	return nil
}
