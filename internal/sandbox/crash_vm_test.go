package sandbox_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
)

// crashEnv tells a re-executed test binary to be the forkd process that
// crashes: "<data dir>|<step>".
const crashEnv = "FORKD_TEST_CRASH"

// TestCrashAtAnyStepLeavesNothing SIGKILLs a real forkd process (this test
// binary, re-executed) in the middle of a fork of three networked, limited
// children with a published port, at each step of a child's creation, and
// in the middle of a networked snapshot build; the next daemon start's
// reconcile must leave nothing of the dead process behind: no record, VMM,
// namespace, link, nftables table, cgroup, run dir or staging dir.
func TestCrashAtAnyStepLeavesNothing(t *testing.T) {
	if v := os.Getenv(crashEnv); v != "" {
		dir, step, _ := strings.Cut(v, "|")
		crashingForkd(t, dir, step)
		return
	}
	testutil.RequireRoot(t)
	dir := t.TempDir()
	ctx := ctxT(t, 10*time.Minute)
	cli := newEngine(t, dir, false)
	defer cli.Close()
	// A failure midway must not leave detached VMMs, namespaces or
	// cgroups on the host: whatever is left is reconciled away.
	var daemon *sandbox.Engine
	t.Cleanup(func() {
		if daemon != nil {
			daemon.Close()
		}
		d := newEngine(t, dir, true)
		defer d.Close()
		cctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		d.Reconcile(cctx)
		d.KillAll(cctx, "")
	})
	if _, err := cli.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: "crash", Image: "minimal", Network: true}); err != nil {
		t.Fatal(err)
	}
	// "ready": a child is running when the process dies, its batch not
	// yet answered; "pool": the same with children taken from parked
	// VMMs, which come up before the others have started.
	for _, step := range []string{"recorded", "isolated", "restored", "published", "ready", "pool", "build"} {
		cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), crashEnv+"="+dir+"|"+step)
		var out strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// Killed whatever happens, so that the cleanup's reconcile sees
		// its records as abandoned.
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		if step == "build" {
			// Kill it once the parent VM runs and is recorded.
			for deadline := time.Now().Add(2 * time.Minute); !buildRecorded(t, cli); {
				if time.Now().After(deadline) {
					cmd.Process.Kill()
					cmd.Wait()
					t.Fatalf("no recorded build after 2 min:\n%s", out.String())
				}
				time.Sleep(50 * time.Millisecond)
			}
			cmd.Process.Kill()
		}
		cmd.Wait()
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
			t.Fatalf("%s: the forkd process was not killed (%v):\n%s", step, cmd.ProcessState, out.String())
		}

		d := newEngine(t, dir, true)
		daemon = d
		rep, err := d.Reconcile(ctx)
		if err != nil {
			t.Fatalf("%s: reconcile: %v", step, err)
		}
		t.Logf("crash at %s: reconcile %+v", step, rep)
		if len(rep.Adopted) != 0 || (step != "build" && len(rep.Aborted) == 0) {
			t.Errorf("%s: reconcile %+v: want aborted children, none adopted", step, rep)
		}
		assertNothingLeft(t, d)
		ents, _ := os.ReadDir(filepath.Join(dir, "snapshots"))
		if len(ents) != 1 || ents[0].Name() != "crash" {
			t.Errorf("%s: snapshot store holds %v, want only crash", step, ents)
		}
		d.Close()
		daemon = nil
	}
}

// newEngine opens an engine over dir, as a daemon (which may reconcile)
// or as a CLI command.
func newEngine(t *testing.T, dir string, daemon bool) *sandbox.Engine {
	t.Helper()
	cfg := testvm.Config(t, dir)
	cfg.Daemon = daemon
	e, err := sandbox.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// buildRecorded reports whether a snapshot parent is recorded with its VMM.
func buildRecorded(t *testing.T, e *sandbox.Engine) bool {
	list, err := e.State().List()
	if err != nil {
		return false
	}
	for _, sb := range list {
		if sb.Status == state.StatusBuilding && sb.Handle.Process.PID != 0 {
			return true
		}
	}
	return false
}

// crashingForkd is the forkd process that dies: it forks three children
// and SIGKILLs itself when the first reaches step, or builds a snapshot
// until the test kills it.
func crashingForkd(t *testing.T, dir, step string) {
	cfg := testvm.Config(t, dir)
	at := step
	if step == "pool" {
		at = "ready"
	}
	cfg.Fault = func(s string) error {
		if s == at {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {}
		}
		return nil
	}
	e, err := sandbox.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	switch step {
	case "build":
		_, err = e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: "crash2", Image: "minimal", Network: true})
	case "pool":
		// Parked VMMs for every child (children with limits never use
		// them), as a daemon with --pool keeps.
		if err := e.PrimePool(ctx, "crash", 3); err != nil {
			t.Fatal(err)
		}
		_, err = e.Fork(ctx, sandbox.ForkSpec{Tag: "crash", N: 3, Net: &sandbox.NetSpec{Publish: []int{80}}})
	default:
		_, err = e.Fork(ctx, sandbox.ForkSpec{Tag: "crash", N: 3, Net: &sandbox.NetSpec{Publish: []int{80}},
			Limits: &state.Limits{MemoryMiB: 512, PIDs: 128}})
	}
	t.Fatalf("still alive after %s: %v", step, err)
}
