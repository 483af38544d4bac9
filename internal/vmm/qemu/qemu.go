// Package qemu is the QEMU backend of package vmm: KVM where /dev/kvm works,
// TCG (software emulation) elsewhere.
//
// A booted parent maps its RAM from a file with share=on; a snapshot is QMP
// stop + migrate with x-ignore-shared (device state only, the RAM stays in
// the file). A restored child repeats the parent's machine identity with
// share=off (MAP_PRIVATE), starts with -incoming defer, and loads the state
// through an fd passed over QMP. Children never get a balloon, virtio-mem or
// any RAM discard: QEMU 7.2 punches holes in the shared file even with
// share=off, corrupting every sibling.
//
// A running child is branched into a new snapshot in one of two ways.
// Paused, SaveDevices writes its device state alone (xen-save-devices-state)
// behind the head of its snapshot's state (splice.go), while the caller
// copies the pages the child wrote. Live, SaveLive runs QEMU's precopy
// migration into a consumer in this process (consume.go) that passes guest
// pages on and keeps the rest as the state. Both take QEMU 7.2's migration
// stream apart (stream.go).
package qemu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/launch"
	"github.com/forkd/forkd/internal/vmm"
)

// Options configure the backend. Zero values pick sensible defaults.
type Options struct {
	// Binary is the qemu-system-x86_64 to run.
	Binary string
	// Accel is "kvm", "tcg" or "auto" (KVM when usable).
	Accel string
	// Machine is "microvm" (default) or "q35".
	Machine string
	// TBSizeMiB is the TCG translation cache per VM (default 32).
	TBSizeMiB int
	// Sandbox enables QEMU's seccomp filter (-sandbox on) with every
	// optional restriction that still lets a VM run.
	Sandbox bool
}

// Backend drives QEMU processes.
type Backend struct {
	opts   Options
	accel  string
	reason string

	verOnce sync.Once
	verDone chan struct{} // closed once version or verErr is set
	version string
	verErr  error
}

var (
	_ vmm.Backend           = (*Backend)(nil)
	_ vmm.Parker            = (*Backend)(nil)
	_ vmm.Machine           = (*Machine)(nil)
	_ vmm.DeviceSaver       = (*Machine)(nil)
	_ vmm.LiveSaver         = (*Machine)(nil)
	_ vmm.DiskSnapshotter   = (*Machine)(nil)
	_ vmm.DiskSwitchChecker = (*Machine)(nil)
	_ vmm.Parked            = (*parked)(nil)
)

// New returns a QEMU backend. It resolves the binary and accelerator now so
// that a misconfigured host fails early.
func New(opts Options) (*Backend, error) {
	if opts.Binary == "" {
		opts.Binary = "qemu-system-x86_64"
	}
	bin, err := exec.LookPath(opts.Binary)
	if err != nil {
		return nil, errdefs.FailedPrecondition("qemu binary %q not found (install qemu-system-x86)", opts.Binary)
	}
	opts.Binary = bin
	if opts.Machine == "" {
		opts.Machine = "microvm"
	}
	if opts.Machine != "microvm" && opts.Machine != "q35" {
		return nil, errdefs.InvalidArgument("qemu machine %q: want microvm or q35", opts.Machine)
	}
	if opts.TBSizeMiB == 0 {
		opts.TBSizeMiB = 32
	}
	b := &Backend{opts: opts, verDone: make(chan struct{})}
	switch opts.Accel {
	case "", "auto":
		if ok, why := kvmUsable(); ok {
			b.accel, b.reason = "kvm", why
		} else {
			b.accel, b.reason = "tcg", "KVM not usable: "+why
		}
	case "kvm", "tcg":
		b.accel, b.reason = opts.Accel, "requested"
	default:
		return nil, errdefs.InvalidArgument("accelerator %q: want kvm, tcg or auto", opts.Accel)
	}
	if b.accel == "tcg" {
		noHugePages()
	}
	return b, nil
}

// noHugePages turns transparent huge pages off for this process, and so
// for every QEMU it starts from now on (the flag is inherited through fork
// and exec). QEMU asks for huge pages for its TCG translation buffer, so
// that each 2 MiB of it it touches costs 2 MiB: 14 of its 16 MiB were
// resident in a child that had run for a second, 9.3 MiB without. Guest
// RAM loses nothing: a child's pages are private copies of a file's,
// 4 KiB each either way. A kernel without the flag (before 3.15) keeps
// huge pages.
var noHugePages = sync.OnceFunc(func() { _ = unix.Prctl(unix.PR_SET_THP_DISABLE, 1, 0, 0, 0) })

// Name implements vmm.Backend.
func (b *Backend) Name() string { return "qemu" }

// AccelReason says why the accelerator was chosen.
func (b *Backend) AccelReason() string { return b.reason }

// Capabilities implements vmm.Backend.
func (b *Backend) Capabilities() vmm.Capabilities {
	return vmm.Capabilities{BootMemoryInFile: true, Park: true, Accelerator: b.accel}
}

var versionRE = regexp.MustCompile(`version (\d+\.\d+(\.\d+)?)`)

// Version implements vmm.Backend. The answer is asked once and kept for
// the backend's life, so it does not depend on the first caller's ctx (a
// request cancelled then must not fail every later boot): ctx only bounds
// this caller's wait.
func (b *Backend) Version(ctx context.Context) (string, error) {
	b.verOnce.Do(func() { go b.askVersion() })
	select {
	case <-b.verDone:
	case <-ctx.Done():
		select {
		case <-b.verDone: // answered meanwhile: an answer beats a cancel
		default:
			return "", ctx.Err()
		}
	}
	return b.version, b.verErr
}

func (b *Backend) askVersion() {
	defer close(b.verDone)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, b.opts.Binary, "--version").Output()
	if err != nil {
		b.verErr = fmt.Errorf("qemu --version: %w", err)
		return
	}
	m := versionRE.FindSubmatch(out)
	if m == nil {
		b.verErr = fmt.Errorf("qemu --version: unrecognised output %q", out)
		return
	}
	b.version = string(m[1])
}

func (b *Backend) newConfig(ctx context.Context, spec vmm.BootSpec) (machineConfig, error) {
	ver, err := b.Version(ctx)
	if err != nil {
		return machineConfig{}, err
	}
	c := machineConfig{
		Version:   ver,
		Machine:   b.opts.Machine,
		Accel:     b.accel,
		MemoryMiB: spec.Resources.MemoryMiB,
		VCPUs:     spec.Resources.VCPUs,
		Disks:     len(spec.Disks),
	}
	for i, d := range spec.Disks {
		if d.Serial != "" {
			if c.DiskSerials == nil {
				c.DiskSerials = make([]string, len(spec.Disks))
			}
			c.DiskSerials[i] = d.Serial
		}
	}
	for _, n := range spec.NICs {
		c.NICs = append(c.NICs, n.MAC)
	}
	c.Lean = true
	if b.accel == "tcg" {
		c.TBSizeMiB = b.opts.TBSizeMiB
		c.CPU = "qemu64,+arat"
		if c.Machine == "microvm" {
			// The guest never uses the PIT once its local APIC timer
			// runs, but the firmware leaves it counting, and QEMU then
			// wakes 36 times a second for its edges: 3/4 of an idle
			// child's wake-ups, and half its CPU.
			c.NoPIT = true
			c.TSCkHz = hostTSCkHz()
			if c.TSCkHz == 0 {
				return c, errdefs.FailedPrecondition("cannot tell the host TSC rate that microvm under TCG needs; set FORKD_TSC_KHZ or use the q35 machine")
			}
		}
	} else {
		c.CPU = "host"
	}
	c.Argv = c.identityArgs()
	return c, nil
}

// Boot implements vmm.Backend.
func (b *Backend) Boot(ctx context.Context, spec vmm.BootSpec) (vmm.Machine, error) {
	if spec.Resources.MemoryMiB < 64 || spec.Resources.VCPUs < 1 {
		return nil, errdefs.InvalidArgument("machine shape %d MiB / %d vCPUs: need at least 64 MiB and 1 vCPU", spec.Resources.MemoryMiB, spec.Resources.VCPUs)
	}
	if spec.Kernel == "" {
		return nil, errdefs.InvalidArgument("boot: no kernel")
	}
	if err := checkDisks(spec.Disks); err != nil {
		return nil, err
	}
	cfg, err := b.newConfig(ctx, spec)
	if err != nil {
		return nil, err
	}
	cmdline := append(slices.Clone(baseCmdline), spec.Cmdline...)
	if cfg.TSCkHz > 0 {
		cmdline = append(cmdline, fmt.Sprintf("tsc_early_khz=%d", cfg.TSCkHz))
	}
	if cfg.Accel == "tcg" {
		cmdline = append(cmdline, tcgCmdline...)
	}
	args := cfg.identityArgs()
	args.add(cfg.instanceArgs(instance{
		name:       spec.Name,
		memoryFile: spec.MemoryFile,
		shared:     true,
		console:    spec.ConsoleLog,
		disks:      spec.Disks,
		nics:       spec.NICs,
	})...)
	args.add("-kernel", spec.Kernel, "-append", strings.Join(cmdline, " "))
	if spec.Initrd != "" {
		args.add("-initrd", spec.Initrd)
	}
	m, err := b.start(ctx, spec.RunDir, cfg, args, nil, spec.Launch)
	if err != nil {
		return nil, err
	}
	m.memoryFile = spec.MemoryFile
	q, err := m.monitor(ctx)
	if err != nil {
		return nil, m.fail(err)
	}
	q.close()
	return m, nil
}

// Park implements vmm.Parker: it starts QEMU with -incoming defer, waiting
// for a snapshot's state.
func (b *Backend) Park(ctx context.Context, spec vmm.ParkSpec) (vmm.Parked, error) {
	cfg, err := decodeConfig(spec.Config)
	if err != nil {
		return nil, err
	}
	if err := b.compatible(ctx, cfg); err != nil {
		return nil, err
	}
	if len(spec.Disks) != cfg.Disks || len(spec.NICs) != len(cfg.NICs) {
		return nil, errdefs.InvalidArgument("restore needs %d disks and %d NICs like its snapshot, got %d and %d", cfg.Disks, len(cfg.NICs), len(spec.Disks), len(spec.NICs))
	}
	if err := checkDisks(spec.Disks); err != nil {
		return nil, err
	}
	if _, err := os.Stat(spec.MemoryFile); err != nil {
		return nil, errdefs.NotFound("memory file: %w", err)
	}
	args := cfg.identityArgs()
	args.add(cfg.instanceArgs(instance{
		name:       spec.Name,
		memoryFile: spec.MemoryFile,
		shared:     false,
		disks:      spec.Disks,
		nics:       spec.NICs,
		incoming:   true,
	})...)
	m, err := b.start(ctx, spec.RunDir, cfg, args, spec.Hold, spec.Launch)
	if err != nil {
		return nil, err
	}
	m.memoryFile = spec.MemoryFile
	q, err := m.monitor(ctx)
	if err != nil {
		return nil, m.fail(err)
	}
	if err := q.execute(ctx, "migrate-set-capabilities", ignoreShared, nil, -1); err != nil {
		q.close()
		return nil, m.fail(err)
	}
	return &parked{m: m, q: q}, nil
}

// compatible checks that a snapshot's machine can run here.
func (b *Backend) compatible(ctx context.Context, cfg machineConfig) error {
	ver, err := b.Version(ctx)
	if err != nil {
		return err
	}
	if majorMinor(ver) != majorMinor(cfg.Version) {
		return errdefs.FailedPrecondition("snapshot was made by QEMU %s; this host has %s", cfg.Version, ver)
	}
	if cfg.Accel != b.accel {
		return errdefs.FailedPrecondition("snapshot was made under %s; this backend uses %s", cfg.Accel, b.accel)
	}
	return nil
}

// jailArgs returns the options that make QEMU of version ver drop to
// user and chroot into jail once it has opened its files. QEMU 8.1 added
// -run-with chroot= and 9.0 removed -chroot; 9.1 added -run-with user=
// and 10.0 removed -runas.
func jailArgs(ver, user, jail string) []string {
	switch {
	case versionAtLeast(ver, 9, 1):
		return []string{"-run-with", "user=" + escapeOpt(user) + ",chroot=" + escapeOpt(jail)}
	case versionAtLeast(ver, 8, 1):
		return []string{"-runas", user, "-run-with", "chroot=" + escapeOpt(jail)}
	}
	return []string{"-runas", user, "-chroot", jail}
}

// versionAtLeast reports whether QEMU version v (major.minor[.micro]) is
// major.minor or later; false when v does not parse.
func versionAtLeast(v string, major, minor int) bool {
	f := strings.SplitN(v, ".", 3)
	if len(f) < 2 {
		return false
	}
	ma, err1 := strconv.Atoi(f[0])
	mi, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil {
		return false
	}
	return ma > major || ma == major && mi >= minor
}

func majorMinor(v string) string {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return v
	}
	return parts[0] + "." + parts[1]
}

// Restore implements vmm.Backend.
func (b *Backend) Restore(ctx context.Context, spec vmm.RestoreSpec) (vmm.Machine, error) {
	p, err := b.Park(ctx, vmm.ParkSpec{
		Name: spec.Name, RunDir: spec.RunDir, Config: spec.Config,
		MemoryFile: spec.MemoryFile, Disks: spec.Disks, NICs: spec.NICs,
		Hold: spec.Hold, Launch: spec.Launch,
	})
	if err != nil {
		return nil, err
	}
	return p.Restore(ctx, spec)
}

// parked is a QEMU process in -incoming defer, its monitor negotiated.
type parked struct {
	mu sync.Mutex
	m  *Machine
	q  *qmp // nil once used
}

// Restore implements vmm.Parked. Only spec.StateFile is read; the rest was
// fixed by Park.
func (p *parked) Restore(ctx context.Context, spec vmm.RestoreSpec) (vmm.Machine, error) {
	p.mu.Lock()
	q := p.q
	p.q = nil
	p.mu.Unlock()
	if q == nil {
		return nil, errdefs.FailedPrecondition("parked machine already used")
	}
	defer q.close()
	m := p.m
	state, err := os.Open(spec.StateFile)
	if err != nil {
		return nil, m.fail(errdefs.NotFound("state file: %w", err))
	}
	defer state.Close()
	if err := q.execute(ctx, "getfd", map[string]any{"fdname": "state"}, nil, int(state.Fd())); err != nil {
		return nil, m.fail(err)
	}
	if err := q.execute(ctx, "migrate-incoming", map[string]any{"uri": "fd:state"}, nil, -1); err != nil {
		return nil, m.fail(err)
	}
	if err := q.waitMigration(ctx); err != nil {
		return nil, m.fail(err)
	}
	if err := q.execute(ctx, "cont", nil, nil, -1); err != nil {
		return nil, m.fail(err)
	}
	return m, nil
}

// Handle implements vmm.Parked.
func (p *parked) Handle() vmm.Handle { return p.m.Handle() }

// Discard implements vmm.Parked.
func (p *parked) Discard(ctx context.Context) error {
	p.mu.Lock()
	if p.q != nil {
		p.q.close()
		p.q = nil
	}
	p.mu.Unlock()
	return p.m.Stop(ctx)
}

// start launches QEMU detached (own session) in runDir and records its
// identity. extra files become fds 3, 4, ... in QEMU and stay open for its
// life.
func (b *Backend) start(ctx context.Context, runDir string, cfg machineConfig, args argv, extra []*os.File, launch vmm.Launch) (*Machine, error) {
	if runDir == "" {
		return nil, errdefs.InvalidArgument("no run dir")
	}
	if err := os.MkdirAll(runDir, 0o700); err != nil {
		return nil, err
	}
	if b.opts.Sandbox {
		// Dropping to launch.User, QEMU itself calls setuid after the
		// filter is in place; it then has no privilege left to elevate.
		opts := "on,obsolete=deny,spawn=deny,resourcecontrol=deny"
		if launch.User == "" {
			opts += ",elevateprivileges=deny"
		}
		args.add("-sandbox", opts)
	}
	if launch.User != "" {
		// QEMU opens its files as root, then drops to the user and
		// chroots into an empty directory before running guest code.
		jail := filepath.Join(runDir, "jail")
		if err := os.Mkdir(jail, 0o555); err != nil && !os.IsExist(err) {
			os.RemoveAll(runDir)
			return nil, err
		}
		ver, err := b.Version(ctx)
		if err != nil {
			os.RemoveAll(runDir)
			return nil, err
		}
		args.add(jailArgs(ver, launch.User, jail)...)
	}
	logf, err := os.OpenFile(filepath.Join(runDir, logFile), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		os.RemoveAll(runDir)
		return nil, err
	}
	defer logf.Close()
	cmd := launchCommand(b.opts.Binary, args, launch)
	cmd.Dir = runDir
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.ExtraFiles = extra
	if err := startIn(cmd, launch); err != nil {
		os.RemoveAll(runDir)
		return nil, fmt.Errorf("start qemu: %w", err)
	}
	m := newChild(b, cmd, runDir, cfg)
	if m.handle.Process.StartTime == 0 {
		return nil, m.fail(fmt.Errorf("qemu exited at once"))
	}
	return m, nil
}

// logTail returns the end of a machine's QEMU log, for error messages.
func logTail(runDir string) string {
	b, err := os.ReadFile(filepath.Join(runDir, logFile))
	if err != nil {
		return ""
	}
	b = bytes.TrimSpace(b)
	if len(b) > 600 {
		b = b[len(b)-600:]
	}
	return string(b)
}

// launchCommand builds the exec.Cmd that starts QEMU: its own session (it
// outlives whoever started it), in its cgroup v2 directory when given.
func launchCommand(bin string, args argv, launch vmm.Launch) *exec.Cmd {
	cmd := exec.Command(bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if launch.CgroupFD > 0 {
		cmd.SysProcAttr.UseCgroupFD = true
		cmd.SysProcAttr.CgroupFD = launch.CgroupFD
	}
	return cmd
}

// startIn starts cmd from an OS thread inside launch's network namespace
// and thread-bound contexts, so QEMU is born there.
func startIn(cmd *exec.Cmd, l vmm.Launch) error {
	if l.NetNS == "" && len(l.Enter) == 0 {
		return cmd.Start()
	}
	steps := make([]launch.Step, len(l.Enter))
	for i, f := range l.Enter {
		steps[i] = launch.Step(f)
	}
	return launch.Start(l.NetNS, cmd, steps...)
}

var errStopped = errors.New("machine stopped")

// baseCmdline is the start of every guest's kernel command line. Besides
// the console and the watchdogs, it turns off proactive compaction: its
// kcompactd thread wakes twice a second to score memory fragmentation, the
// largest cost an idle guest had left once its tick could stop (an idle
// child's QEMU woke 40-48 times a second with it, 7-14 without).
var baseCmdline = []string{"console=ttyS0", "panic=-1", "quiet", "nowatchdog", "nosoftlockup",
	"sysctl.vm.compaction_proactiveness=0"}

// tcgCmdline is what a guest kernel under TCG is told more.
//
// Its clock: the TSC a TCG guest reads is the host's own, so it is
// stable; but the kernel's clocksource watchdog compares it with jiffies,
// which an emulated CPU loses under host load, and on a busy host it
// marks the TSC unstable and falls back to jiffies. Without a
// high-resolution clocksource the tick never stops (no NO_HZ): an idle
// guest then takes 250 timer interrupts a second, and costs its host ten
// times the CPU.
//
// No speculation mitigations: an emulated CPU does not speculate, and
// TCG translates the guest's retpolines and barriers into host code that
// keeps none of their effect on the host's speculation, so they only
// cost: without them the first exec after a page-out took 6-28 ms less
// at the p50, in three pairs of 30-child runs (docs/benchmarks.md). Under
// KVM the guest's mitigations stay.
//
// No pressure stall accounting (PSI): nothing in a guest reads it, and it
// runs on every context switch, and in a worker every two seconds, which
// comes due at a wake. Without it an exec ran 2 % fewer translated blocks,
// and six in a row 4-7 % fewer pages of them (docs/benchmarks.md).
var tcgCmdline = []string{"tsc=reliable", "mitigations=off", "psi=0"}
