package sandbox

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/cleanup"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image"
	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/vmm"
)

// SnapshotSpec describes a snapshot to build from an image.
type SnapshotSpec struct {
	Tag   string
	Image string // built-in image name; ignored when Built or OCI is set
	// OCIRef and OCI, when OCI is set, import an OCI image (a registry
	// reference, a docker-save tarball or an OCI layout) as the image.
	OCIRef    string
	OCI       *image.OCIOptions
	Built     *image.Image // an image built already
	MemoryMiB int
	VCPUs     int
	// Warmup commands run in the parent (sh -c) before it is saved.
	Warmup []string
	// BootTimeout bounds the parent's boot until its agent answers.
	BootTimeout time.Duration
	// Network gives the machine a NIC, configured in the guest before the
	// snapshot; every child then gets its own network namespace.
	Network bool
}

// Limits on snapshot shapes.
const (
	MinMemoryMiB = 64
	MaxMemoryMiB = 64 << 10
	MaxVCPUs     = 64
)

func (s *SnapshotSpec) validate() error {
	if err := snapshot.ValidateTag(s.Tag); err != nil {
		return err
	}
	if s.MemoryMiB == 0 {
		s.MemoryMiB = 256
	}
	if s.VCPUs == 0 {
		s.VCPUs = 1
	}
	if s.MemoryMiB < MinMemoryMiB || s.MemoryMiB > MaxMemoryMiB {
		return errdefs.InvalidArgument("memory %d MiB: want %d to %d", s.MemoryMiB, MinMemoryMiB, MaxMemoryMiB)
	}
	if s.VCPUs < 1 || s.VCPUs > MaxVCPUs {
		return errdefs.InvalidArgument("vcpus %d: want 1 to %d", s.VCPUs, MaxVCPUs)
	}
	if s.Built == nil && s.OCI == nil {
		if err := image.ValidateName(s.Image); err != nil {
			return err
		}
	}
	for _, w := range s.Warmup {
		if w == "" {
			return errdefs.InvalidArgument("empty warmup command")
		}
	}
	if s.BootTimeout == 0 {
		// A python parent boots in seconds under KVM but has taken over
		// three minutes under TCG on a loaded two-core host.
		s.BootTimeout = 6 * time.Minute
	}
	return nil
}

// CreateSnapshot boots a parent VM from an image (built-in, built
// already, or imported from an OCI image first), warms it, and saves it as
// a snapshot named spec.Tag. A taken tag is refused before any import or
// build. On any failure nothing is left behind. A parent whose guest
// got stuck before its agent answered is booted once more.
func (e *Engine) CreateSnapshot(ctx context.Context, spec SnapshotSpec) (*snapshot.Snapshot, error) {
	snap, err := e.createSnapshot(ctx, spec)
	if errors.Is(err, errStuck) && ctx.Err() == nil {
		e.log.Warn("parent VM stuck at boot; booting it once more", "snapshot", spec.Tag, "err", err)
		e.progress(ctx, "parent VM stuck at boot; booting it once more")
		snap, err = e.createSnapshot(ctx, spec)
	}
	return snap, err
}

func (e *Engine) createSnapshot(ctx context.Context, spec SnapshotSpec) (*snapshot.Snapshot, error) {
	if err := spec.validate(); err != nil {
		return nil, err
	}
	if spec.Network && e.cfg.Net == nil {
		return nil, errdefs.FailedPrecondition("a snapshot with a network needs per-child network namespaces, which need root")
	}
	if _, err := e.snaps.Get(spec.Tag); err == nil {
		return nil, errdefs.AlreadyExists("snapshot %q already exists (forkd rmi %s to replace it)", spec.Tag, spec.Tag)
	} else if !errdefs.IsNotFound(err) {
		return nil, err
	}
	img := spec.Built
	if img == nil {
		var err error
		if spec.OCI != nil {
			img, err = e.images.FromOCI(ctx, spec.OCIRef, *spec.OCI)
		} else {
			img, err = e.images.Build(ctx, spec.Image)
		}
		if err != nil {
			return nil, err
		}
	}
	// The disk's identity before the parent boots: one swapped during the
	// build fails the commit.
	var rootfsID *snapshot.FileID
	if img.Rootfs != "" {
		var err error
		if rootfsID, err = snapshot.Identify(img.Rootfs); err != nil {
			return nil, err
		}
	}
	w, err := e.snaps.Create(spec.Tag)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := w.Abort(); err != nil { // no-op after Commit
			e.log.Warn("discard staging snapshot", "snapshot", spec.Tag, "err", err)
		}
	}()
	id := "build-" + newID()[3:]
	bootSpec := vmm.BootSpec{
		Name:       id,
		RunDir:     filepath.Join(e.runDir, id),
		Resources:  vmm.Resources{MemoryMiB: spec.MemoryMiB, VCPUs: spec.VCPUs},
		Kernel:     img.Kernel,
		Initrd:     img.Initrd,
		Cmdline:    img.Cmdline,
		MemoryFile: w.MemoryPath(),
		ConsoleLog: filepath.Join(w.Dir(), "console.log"),
		Launch:     vmm.Launch{User: e.cfg.VMMUser},
	}
	if img.Rootfs != "" {
		bootSpec.Disks = []vmm.Disk{{Path: img.Rootfs, ReadOnly: true}}
	}
	// The parent, its record and its network live only while the snapshot
	// is made: what the build acquired is undone, last first, however it
	// ends.
	var undo cleanup.Stack
	defer func() {
		if err := undo.Run(); err != nil {
			e.log.Warn("clean up after the parent", "snapshot", spec.Tag, "err", err)
		}
	}()
	if img.Rootfs != "" {
		// The disk slot (see disk.go): a root on a disk is an overlay
		// over the root file system. Its image goes with the run dir,
		// which the backend removes once the parent has run.
		undo.Add(func() error { return os.RemoveAll(bootSpec.RunDir) })
		scratch, err := parentDisk(bootSpec.RunDir)
		if err != nil {
			return nil, err
		}
		bootSpec.Disks = append(bootSpec.Disks, scratch)
	}
	var buildRec *state.Sandbox
	if spec.Network {
		// The parent holds a network slot like a child, recorded so that a
		// crash mid-build leaves nothing the next reconcile cannot find.
		sb := &state.Sandbox{ID: newID(), Snapshot: spec.Tag, Status: state.StatusBuilding, Starter: starter(),
			Handle: vmm.Handle{Backend: e.cfg.Backend.Name(), RunDir: bootSpec.RunDir}, Created: time.Now().UTC()}
		if err := e.state.PutWithSlot(sb, e.cfg.Net.MaxSlots()); err != nil {
			return nil, err
		}
		undo.Add(func() error { return e.state.Delete(sb.ID) })
		undo.Add(func() error {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
			defer cancel()
			if err := e.release(rctx, sb); err != nil {
				return fmt.Errorf("release parent network: %w", err)
			}
			return nil
		})
		buildRec = sb
		launch, nics, done, err := e.isolate(ctx, sb, &NetSpec{Policy: netns.DefaultPolicy})
		defer done()
		if err != nil {
			return nil, err
		}
		bootSpec.Launch, bootSpec.NICs = launch, nics
		bootSpec.Cmdline = append(append([]string(nil), bootSpec.Cmdline...), guestNetCmdline()...)
	}
	e.progress(ctx, "booting parent VM (%s, %d MiB, %d vCPU, %s)", img.Name, spec.MemoryMiB, spec.VCPUs, e.cfg.Backend.Capabilities().Accelerator)
	start := time.Now()
	m, err := e.cfg.Backend.Boot(ctx, bootSpec)
	if err != nil {
		return nil, fmt.Errorf("boot parent: %w", err)
	}
	if buildRec != nil {
		// Record the parent's process, for reconcile.
		h := m.Handle()
		if _, err := e.state.Update(buildRec.ID, func(r *state.Sandbox) error { r.Handle = h; return nil }); err != nil {
			e.log.Warn("record parent", "snapshot", spec.Tag, "err", err)
		}
	}
	stopped := false
	stopParent := func() error {
		if stopped {
			return nil
		}
		stopped = true
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if err := m.Stop(sctx); err != nil {
			return fmt.Errorf("stop parent: %w", err)
		}
		return nil
	}
	undo.Add(stopParent)
	if err := e.warm(ctx, m, spec, bootSpec.ConsoleLog); err != nil {
		return nil, err
	}
	e.progress(ctx, "parent ready in %.1fs; saving snapshot", time.Since(start).Seconds())
	if err := m.Pause(ctx); err != nil {
		return nil, fmt.Errorf("pause parent: %w", err)
	}
	if err := m.SaveState(ctx, vmm.SaveSpec{StateFile: w.StatePath()}); err != nil {
		return nil, fmt.Errorf("save parent: %w", err)
	}
	// The parent must never run again: it writes through its shared
	// mapping, and children see those writes on pages they did not copy.
	handle := m.Handle()
	if err := stopParent(); err != nil {
		e.log.Warn("stop parent", "snapshot", spec.Tag, "err", err)
	}
	if err := os.Chmod(w.MemoryPath(), 0o600); err != nil {
		return nil, err
	}
	ver, err := e.cfg.Backend.Version(ctx)
	if err != nil {
		return nil, err
	}
	hash, err := contentHash(w.StatePath(), w.MemoryPath())
	if err != nil {
		return nil, err
	}
	md := snapshot.Metadata{
		Backend:        e.cfg.Backend.Name(),
		BackendVersion: ver,
		Accelerator:    e.cfg.Backend.Capabilities().Accelerator,
		Machine:        handle.Config,
		Image:          img.Name,
		Kernel:         snapshot.FileRef{Path: img.Kernel, SHA256: img.KernelSHA256},
		Initrd:         snapshot.FileRef{Path: img.Initrd, SHA256: img.InitrdSHA256},
		MemoryMiB:      spec.MemoryMiB,
		VCPUs:          spec.VCPUs,
		Python:         img.Python,
		Preload:        img.Preload,
		Warmup:         spec.Warmup,
		ContentHash:    hash,
		Network:        spec.Network,
		DiskSlot:       len(bootSpec.Disks) > scratchIndex,
	}
	if img.Rootfs != "" {
		md.Rootfs = snapshot.FileRef{Path: img.Rootfs, SHA256: img.RootfsSHA256, ID: rootfsID}
	}
	snap, err := w.Commit(md)
	if err != nil {
		return nil, err
	}
	e.log.Info("snapshot created", "snapshot", spec.Tag, "image", img.Name, "seconds", time.Since(start).Seconds())
	return snap, nil
}

// preloadTimeout is the least bound of a parent's init: its warm
// interpreter's imports.
const preloadTimeout = 15 * time.Minute

// warm waits for the parent's agent, sets its identity and runs the warmup
// commands.
func (e *Engine) warm(ctx context.Context, m vmm.Machine, spec SnapshotSpec, consoleLog string) error {
	bctx, cancel := context.WithTimeout(ctx, spec.BootTimeout)
	defer cancel()
	wctx, stuck := context.WithCancelCause(bctx)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		if err := parentStuck.wait(wctx, m); err != nil {
			stuck(err)
		}
	}()
	c, err := DialAgent(wctx, m, agent.Options{})
	stuck(nil)
	<-watched
	if err != nil {
		if cause := context.Cause(wctx); errors.Is(cause, errStuck) {
			return errdefs.Unavailable("parent agent: %w%s", cause, ConsoleTail(consoleLog))
		}
		return fmt.Errorf("parent agent: %w%s%s", err, GuestReport(ctx, m), ConsoleTail(consoleLog))
	}
	defer c.Close()
	// Init starts the warm interpreter and imports its preload (pandas and
	// matplotlib for code-interpreter): under emulation on a busy host that
	// takes minutes, as long as the boot or longer, so it gets its own
	// budget, never under preloadTimeout.
	ictx, icancel := context.WithTimeout(ctx, max(spec.BootTimeout, preloadTimeout))
	defer icancel()
	if err := c.Init(ictx, initRequest("parent", 0)); err != nil {
		return fmt.Errorf("parent init (the warm interpreter's preload): %w", err)
	}
	for _, cmd := range spec.Warmup {
		e.progress(ctx, "warmup: %s", cmd)
		var out limitedBuffer
		res, err := c.Exec(ctx, agent.ExecRequest{Shell: cmd, Stdout: &out, Stderr: &out, Timeout: 10 * time.Minute})
		if err != nil {
			return fmt.Errorf("warmup %q: %w", cmd, err)
		}
		if res.ExitCode != 0 || res.Signal != "" {
			return errdefs.FailedPrecondition("warmup %q failed (exit %d%s): %s", cmd, res.ExitCode, sigSuffix(res.Signal), out.String())
		}
	}
	return nil
}

func sigSuffix(sig string) string {
	if sig == "" {
		return ""
	}
	return ", signal " + sig
}

// DialAgent connects to a machine's agent and completes the handshake,
// retrying until ctx ends (the guest may still be booting).
func DialAgent(ctx context.Context, m vmm.Machine, opts agent.Options) (*agent.Client, error) {
	var last error
	for {
		conn, err := m.DialAgent(ctx)
		if err == nil {
			c, err := agent.Dial(ctx, conn, opts)
			if err == nil {
				return c, nil
			}
			conn.Close()
			last = err
		} else {
			last = err
			if errdefs.IsFailedPrecondition(err) {
				return nil, err
			}
		}
		select {
		case <-ctx.Done():
			if last == nil {
				last = ctx.Err()
			}
			return nil, fmt.Errorf("agent did not answer: %w", last)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// initRequest is what every VM is told after boot or restore: the time,
// fresh entropy, who it is, and its guest pids limit (0: the agent's
// default).
func initRequest(id string, pidsLimit int) proto.InitRequest {
	ent := make([]byte, 64)
	rand.Read(ent)
	return proto.InitRequest{Time: time.Now(), Entropy: ent, SandboxID: id, Hostname: id, PIDsLimit: pidsLimit}
}

// ConsoleTail returns the end of a guest's console log at path, to add
// to the error of a guest that did not answer ("" when there is none).
func ConsoleTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil || len(b) == 0 {
		return ""
	}
	if len(b) > 800 {
		b = b[len(b)-800:]
	}
	return "\nguest console:\n" + string(b)
}

// contentHash hashes a snapshot's state and memory files.
func contentHash(paths ...string) (string, error) {
	h := sha256.New()
	buf := make([]byte, 1<<20)
	for _, p := range paths {
		f, err := os.Open(p)
		if err != nil {
			return "", err
		}
		_, err = io.CopyBuffer(h, f, buf)
		f.Close()
		if err != nil {
			return "", err
		}
	}
	runtime.KeepAlive(buf)
	return hex.EncodeToString(h.Sum(nil)), nil
}

// limitedBuffer keeps the last 4 KiB written to it.
type limitedBuffer struct{ b []byte }

func (l *limitedBuffer) Write(p []byte) (int, error) {
	l.b = append(l.b, p...)
	if len(l.b) > 4096 {
		l.b = l.b[len(l.b)-4096:]
	}
	return len(p), nil
}

func (l *limitedBuffer) String() string { return string(l.b) }
