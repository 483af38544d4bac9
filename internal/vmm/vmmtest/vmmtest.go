// Package vmmtest is the conformance suite every vmm backend runs:
// vmmtest.Run(t, newEnv) checks the contracts written on vmm.Backend and
// vmm.Machine against real VMs.
package vmmtest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/vmm"
)

// Env is what a backend gives the suite.
type Env struct {
	Backend vmm.Backend
	// Boot is a template: Kernel, Initrd, Cmdline, Resources (and Disks)
	// of a guest that runs the probe's peer. Name, RunDir and MemoryFile
	// are filled in by the suite.
	Boot vmm.BootSpec
	// Probe returns once the guest in m answers on its agent channel.
	Probe func(ctx context.Context, m vmm.Machine) error
	// Dir is a scratch directory on a disk filesystem.
	Dir string
}

// Run runs the suite. newEnv is called once; its Env is shared by the
// subtests, which run one after another.
func Run(t *testing.T, newEnv func(t *testing.T) Env) {
	env := newEnv(t)
	s := &suite{env: env}
	t.Run("BootProbeStop", s.bootProbeStop)
	t.Run("PauseResume", s.pauseResume)
	t.Run("SaveStateNeedsPause", s.saveStateNeedsPause)
	t.Run("SnapshotRestore", s.snapshotRestore)
	t.Run("Attach", s.attach)
	t.Run("RestoreFailuresLeaveNothing", s.restoreFailures)
	t.Run("ProcessDeathSeen", s.processDeath)
}

type suite struct {
	env Env
	n   int
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func (s *suite) name() string {
	s.n++
	return fmt.Sprintf("vt%d-%d", os.Getpid(), s.n)
}

// boot starts a guest, with RAM in a file when memFile is set, and waits
// for its probe.
func (s *suite) boot(t *testing.T, memFile string) vmm.Machine {
	t.Helper()
	ctx := ctxFor(t, 5*time.Minute)
	spec := s.env.Boot
	spec.Name = s.name()
	spec.RunDir = filepath.Join(s.env.Dir, spec.Name)
	spec.MemoryFile = memFile
	spec.ConsoleLog = filepath.Join(s.env.Dir, spec.Name+".console")
	m, err := s.env.Backend.Boot(ctx, spec)
	if err != nil {
		t.Fatalf("Boot: %v", err)
	}
	t.Cleanup(func() { stop(t, m) })
	if err := s.env.Probe(ctx, m); err != nil {
		b, _ := os.ReadFile(spec.ConsoleLog)
		t.Fatalf("probe after boot: %v\nconsole:\n%s", err, b)
	}
	return m
}

// stop stops m, logging a failure: it is teardown (processDeath checks
// Stop itself).
func stop(t *testing.T, m vmm.Machine) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := m.Stop(ctx); err != nil {
		t.Logf("Stop: %v", err)
	}
}

func (s *suite) bootProbeStop(t *testing.T) {
	m := s.boot(t, "")
	h := m.Handle()
	if h.Backend != s.env.Backend.Name() || h.Process.PID <= 0 || h.RunDir == "" || len(h.Config) == 0 {
		t.Fatalf("incomplete handle %+v", h)
	}
	ctx := ctxFor(t, time.Minute)
	if err := m.Stop(ctx); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if proc.Alive(h.Process) {
		t.Fatal("process alive after Stop")
	}
	if _, err := os.Stat(h.RunDir); !os.IsNotExist(err) {
		t.Fatalf("run dir left after Stop: %v", err)
	}
	if err := m.Stop(ctx); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	if st, err := m.Wait(ctx); err != nil || !st.Exited {
		t.Fatalf("Wait after Stop = %+v, %v", st, err)
	}
	if err := m.Pause(ctx); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("Pause after Stop = %v, want FailedPrecondition", err)
	}
	if _, err := m.DialAgent(ctx); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("DialAgent after Stop = %v, want FailedPrecondition", err)
	}
}

func (s *suite) pauseResume(t *testing.T) {
	m := s.boot(t, "")
	ctx := ctxFor(t, 2*time.Minute)
	for i := 0; i < 2; i++ {
		if err := m.Pause(ctx); err != nil {
			t.Fatalf("Pause #%d: %v", i+1, err)
		}
	}
	pctx, cancel := context.WithTimeout(ctx, 700*time.Millisecond)
	err := s.env.Probe(pctx, m)
	cancel()
	if err == nil {
		t.Fatal("guest answered while paused")
	}
	for i := 0; i < 2; i++ {
		if err := m.Resume(ctx); err != nil {
			t.Fatalf("Resume #%d: %v", i+1, err)
		}
	}
	if err := s.env.Probe(ctx, m); err != nil {
		t.Fatalf("probe after resume: %v", err)
	}
}

func (s *suite) saveStateNeedsPause(t *testing.T) {
	m := s.boot(t, filepath.Join(s.env.Dir, s.name()+".mem"))
	ctx := ctxFor(t, time.Minute)
	err := m.SaveState(ctx, vmm.SaveSpec{StateFile: filepath.Join(s.env.Dir, "unpaused.state")})
	if !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("SaveState while running = %v, want FailedPrecondition", err)
	}
}

// snapshot boots a parent and saves it; it returns the restore template.
func (s *suite) snapshot(t *testing.T) vmm.RestoreSpec {
	t.Helper()
	base := filepath.Join(s.env.Dir, s.name())
	m := s.boot(t, base+".mem")
	ctx := ctxFor(t, time.Minute)
	if err := m.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	if err := m.SaveState(ctx, vmm.SaveSpec{StateFile: base + ".state"}); err != nil {
		t.Fatalf("SaveState: %v", err)
	}
	cfg := m.Handle().Config
	if err := m.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	return vmm.RestoreSpec{Config: cfg, MemoryFile: base + ".mem", StateFile: base + ".state", Disks: s.env.Boot.Disks}
}

func (s *suite) restore(t *testing.T, tmpl vmm.RestoreSpec) vmm.Machine {
	t.Helper()
	ctx := ctxFor(t, 3*time.Minute)
	spec := tmpl
	spec.Name = s.name()
	spec.RunDir = filepath.Join(s.env.Dir, spec.Name)
	m, err := s.env.Backend.Restore(ctx, spec)
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	t.Cleanup(func() { stop(t, m) })
	if err := s.env.Probe(ctx, m); err != nil {
		t.Fatalf("probe after restore: %v", err)
	}
	return m
}

func (s *suite) snapshotRestore(t *testing.T) {
	tmpl := s.snapshot(t)
	before := testutil.FileSHA256(t, tmpl.MemoryFile)
	// A hold file stays open in the VMM for its life.
	hold, err := os.Open(tmpl.StateFile)
	if err != nil {
		t.Fatal(err)
	}
	tmpl.Hold = []*os.File{hold}
	a := s.restore(t, tmpl)
	hold.Close()
	tmpl.Hold = nil
	b := s.restore(t, tmpl)
	if a.Handle().Process.PID == b.Handle().Process.PID {
		t.Fatal("two restores share a process")
	}
	ctx := ctxFor(t, time.Minute)
	mm, err := a.Memory(ctx)
	if err != nil {
		t.Fatalf("Memory: %v", err)
	}
	if mm.PID != a.Handle().Process.PID || len(mm.Regions) == 0 || mm.Regions[0].Size == 0 {
		t.Fatalf("Memory = %+v", mm)
	}
	if s.env.Backend.Capabilities().Park {
		p, err := s.env.Backend.(vmm.Parker).Park(ctx, vmm.ParkSpec{
			Name: s.name(), RunDir: filepath.Join(s.env.Dir, "parked"), Config: tmpl.Config,
			MemoryFile: tmpl.MemoryFile, Disks: tmpl.Disks,
		})
		if err != nil {
			t.Fatalf("Park: %v", err)
		}
		c, err := p.Restore(ctx, tmpl)
		if err != nil {
			if derr := p.Discard(ctx); derr != nil {
				t.Logf("Discard: %v", derr)
			}
			t.Fatalf("parked Restore: %v", err)
		}
		t.Cleanup(func() { stop(t, c) })
		if err := s.env.Probe(ctx, c); err != nil {
			t.Fatalf("probe of parked restore: %v", err)
		}
		if _, err := p.Restore(ctx, tmpl); !errdefs.IsFailedPrecondition(err) {
			t.Fatalf("second parked Restore = %v, want FailedPrecondition", err)
		}
	}
	stop(t, a)
	stop(t, b)
	if after := testutil.FileSHA256(t, tmpl.MemoryFile); after != before {
		t.Fatal("memory file changed while children ran")
	}
}

func (s *suite) attach(t *testing.T) {
	m := s.boot(t, "")
	ctx := ctxFor(t, time.Minute)
	h := m.Handle()
	a, err := s.env.Backend.Attach(ctx, h)
	if err != nil {
		t.Fatalf("Attach: %v", err)
	}
	if err := s.env.Probe(ctx, a); err != nil {
		t.Fatalf("probe through attached machine: %v", err)
	}
	if err := a.Stop(ctx); err != nil {
		t.Fatalf("Stop through attached machine: %v", err)
	}
	if st, err := m.Wait(ctx); err != nil || !st.Exited {
		t.Fatalf("Wait = %+v, %v", st, err)
	}
	if _, err := s.env.Backend.Attach(ctx, h); !errdefs.IsNotFound(err) {
		t.Fatalf("Attach to a stopped machine = %v, want NotFound", err)
	}
	// A handle whose start time does not match is never adopted.
	h.Process.StartTime++
	if _, err := s.env.Backend.Attach(ctx, h); !errdefs.IsNotFound(err) {
		t.Fatalf("Attach with a wrong start time = %v, want NotFound", err)
	}
}

func (s *suite) restoreFailures(t *testing.T) {
	tmpl := s.snapshot(t)
	ctx := ctxFor(t, 2*time.Minute)
	garbage := filepath.Join(s.env.Dir, "garbage.state")
	if err := os.WriteFile(garbage, []byte("this is not device state"), 0o600); err != nil {
		t.Fatal(err)
	}
	cases := map[string]func(*vmm.RestoreSpec){
		"garbage state":  func(r *vmm.RestoreSpec) { r.StateFile = garbage },
		"missing state":  func(r *vmm.RestoreSpec) { r.StateFile = garbage + ".missing" },
		"missing memory": func(r *vmm.RestoreSpec) { r.MemoryFile = garbage + ".missing" },
		"corrupt config": func(r *vmm.RestoreSpec) { r.Config = []byte("{") },
	}
	for name, mutate := range cases {
		spec := tmpl
		spec.Name = s.name()
		spec.RunDir = filepath.Join(s.env.Dir, spec.Name)
		mutate(&spec)
		m, err := s.env.Backend.Restore(ctx, spec)
		if err == nil {
			stop(t, m)
			t.Errorf("%s: Restore succeeded", name)
			continue
		}
		if _, serr := os.Stat(spec.RunDir); !os.IsNotExist(serr) {
			t.Errorf("%s: run dir left behind (%v)", name, err)
		}
	}
}

func (s *suite) processDeath(t *testing.T) {
	m := s.boot(t, "")
	ctx := ctxFor(t, time.Minute)
	if err := syscall.Kill(m.Handle().Process.PID, syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9: %v", err)
	}
	st, err := m.Wait(ctx)
	if err != nil || !st.Exited {
		t.Fatalf("Wait after kill -9 = %+v, %v", st, err)
	}
	if err := m.Stop(ctx); err != nil {
		t.Fatalf("Stop of a dead machine: %v", err)
	}
}
