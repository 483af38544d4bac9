package sandbox_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
)

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// run executes a shell command in sandbox id and returns its stdout and
// exit code.
func run(t *testing.T, e *sandbox.Engine, id, cmd string) (string, int) {
	t.Helper()
	var out bytes.Buffer
	var code int
	withAgent(t, e, id, func(ctx context.Context, c *agent.Client) {
		res, err := c.Exec(ctx, agent.ExecRequest{Shell: cmd, Stdout: &out, Stderr: &out})
		if err != nil {
			t.Fatalf("exec in %s: %v", id, err)
		}
		code = res.ExitCode
	})
	return out.String(), code
}

// withAgent calls f with the agent of sandbox id, for a minute at most.
func withAgent(t *testing.T, e *sandbox.Engine, id string, f func(context.Context, *agent.Client)) {
	t.Helper()
	ctx := ctxT(t, time.Minute)
	c, release, err := e.Agent(ctx, id)
	if err != nil {
		t.Fatalf("agent of %s: %v", id, err)
	}
	defer release()
	f(ctx, c)
}

// TestForkTen is the core acceptance path: snapshot the minimal image, fork
// 10 children, and check isolation, liveness, refcounts and cleanup.
func TestForkTen(t *testing.T) {
	e := testvm.Engine(t)
	ctx := ctxT(t, 15*time.Minute)
	snap, err := e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: "base", Image: "minimal"})
	if err != nil {
		t.Fatal(err)
	}
	memBefore := testutil.FileSHA256(t, snap.MemoryPath())

	res, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "base", N: 10})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Children) != 10 {
		t.Fatalf("%d children", len(res.Children))
	}
	ids := make([]string, 10)
	for i, c := range res.Children {
		ids[i] = c.ID
		if c.ReadyMS <= 0 || c.Sandbox == nil || c.Sandbox.Status != state.StatusRunning {
			t.Fatalf("child %d not ready: %+v", i, c)
		}
	}
	t.Logf("fork of 10: wall %.0f ms", res.WallMS)

	// exec works in every child and each knows its own identity.
	for _, id := range ids {
		out, code := run(t, e, id, "hostname")
		if code != 0 || strings.TrimSpace(out) != id {
			t.Fatalf("hostname in %s = %q (exit %d)", id, out, code)
		}
	}
	// The agent relaxed the timer slack of its runtime's monitor (its
	// first thread after the main one); the commands it starts keep the
	// kernel's default.
	out, code := run(t, e, ids[0], "cat /proc/self/timerslack_ns; cat /proc/$(ls /proc/1/task | sort -n | sed -n 2p)/timerslack_ns")
	if f := strings.Fields(out); code != 0 || !slices.Equal(f, []string{"50000", "2000000"}) {
		t.Errorf("timer slack of a command, then of the agent's monitor thread: %q (exit %d)", out, code)
	}
	// An emulated CPU does not speculate: under TCG the guest kernel runs
	// without speculation mitigations (no retpolines); under KVM it keeps
	// them.
	accel := e.Backend().Capabilities().Accelerator
	out, code = run(t, e, ids[0], "cat /proc/cmdline /sys/devices/system/cpu/vulnerabilities/spectre_v2; test -d /proc/pressure && echo psi || echo none")
	off := strings.Contains(out, " mitigations=off")
	if code != 0 || off != (accel == "tcg") || off && !strings.Contains(out, "\nVulnerable") {
		t.Errorf("guest kernel command line and spectre_v2 under %s: %q (exit %d)", accel, out, code)
	}
	// Nor does it account pressure stalls under TCG (psi=0): nothing in a
	// guest reads them, and each context switch would pay for them.
	if strings.Contains(out, " psi=0") != (accel == "tcg") {
		t.Errorf("guest kernel command line under %s: %q", accel, out)
	}
	if accel == "tcg" && !strings.HasSuffix(out, "\nnone\n") {
		t.Errorf("guest's /proc/pressure under TCG: %q, want none", out)
	}
	// A file written in one child is absent in the others.
	if _, code := run(t, e, ids[0], "echo secret > /tmp/mine && cat /tmp/mine"); code != 0 {
		t.Fatal("write in child 0 failed")
	}
	for _, id := range ids[1:] {
		if _, code := run(t, e, id, "test -e /tmp/mine"); code == 0 {
			t.Fatalf("child %s sees child 0's file", id)
		}
	}

	// rmi is refused while children live.
	err = e.RemoveSnapshot("base")
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("RemoveSnapshot with live children = %v", err)
	}

	// A child killed behind our back shows as dead; siblings live on.
	victim, err := e.Get(ctx, ids[3])
	if err != nil {
		t.Fatal(err)
	}
	syscall.Kill(victim.Handle.Process.PID, syscall.SIGKILL)
	deadline := time.Now().Add(10 * time.Second)
	for proc.Alive(victim.Handle.Process) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	list, err := e.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range list {
		want := state.StatusRunning
		if sb.ID == ids[3] {
			want = state.StatusDead
		}
		if sb.Status != want {
			t.Fatalf("%s status %s, want %s", sb.ID, sb.Status, want)
		}
	}
	for _, id := range []string{ids[2], ids[4]} {
		if out, code := run(t, e, id, "echo alive"); code != 0 || strings.TrimSpace(out) != "alive" {
			t.Fatalf("sibling %s after a death: %q %d", id, out, code)
		}
	}

	// kill --all leaves no process, socket, run dir or record.
	killed, err := e.KillAll(ctx, "")
	if err != nil || len(killed) != 10 {
		t.Fatalf("KillAll = %v, %v", killed, err)
	}
	for _, c := range res.Children {
		if proc.Alive(c.Sandbox.Handle.Process) {
			t.Fatalf("%s still running", c.ID)
		}
		if _, err := os.Stat(c.Sandbox.Handle.RunDir); !os.IsNotExist(err) {
			t.Fatalf("%s run dir left: %v", c.ID, err)
		}
	}
	entries, _ := os.ReadDir(filepath.Join(e.Config().DataDir, "run"))
	if len(entries) != 0 {
		t.Fatalf("run dir not empty: %v", entries)
	}
	if list, _ := e.List(ctx); len(list) != 0 {
		t.Fatalf("records left: %v", list)
	}
	if got := testutil.FileSHA256(t, snap.MemoryPath()); got != memBefore {
		t.Fatal("snapshot memory file changed while children ran")
	}
	if err := e.RemoveSnapshot("base"); err != nil {
		t.Fatalf("RemoveSnapshot after kill: %v", err)
	}
}

// TestBadTagsRefused checks every entry point refuses hostile tags before
// touching anything.
func TestBadTagsRefused(t *testing.T) {
	e := testvm.Engine(t)
	ctx := ctxT(t, time.Minute)
	for _, tag := range []string{"../x", "/etc", "a/b", "", strings.Repeat("x", 200), ".staging-x"} {
		t.Run("tag "+tag, func(t *testing.T) {
			if _, err := e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: tag, Image: "minimal"}); !errdefs.IsInvalidArgument(err) {
				t.Errorf("CreateSnapshot(%q) = %v", tag, err)
			}
			if _, err := e.Fork(ctx, sandbox.ForkSpec{Tag: tag, N: 1}); !errdefs.IsInvalidArgument(err) {
				t.Errorf("Fork(%q) = %v", tag, err)
			}
			if err := e.RemoveSnapshot(tag); !errdefs.IsInvalidArgument(err) {
				t.Errorf("RemoveSnapshot(%q) = %v", tag, err)
			}
		})
	}
	for _, n := range []int{0, -1, 100000} {
		t.Run(fmt.Sprint("n ", n), func(t *testing.T) {
			if _, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "x", N: n}); !errdefs.IsInvalidArgument(err) {
				t.Errorf("Fork(n=%d) = %v", n, err)
			}
		})
	}
	for _, id := range []string{"../../etc", "sb-", "sb-ABCDEFGHIJ", "x"} {
		t.Run("id "+id, func(t *testing.T) {
			if err := e.Kill(ctx, id); !errdefs.IsInvalidArgument(err) {
				t.Errorf("Kill(%q) = %v", id, err)
			}
		})
	}
	if _, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "missing", N: 1}); !errdefs.IsNotFound(err) {
		t.Errorf("Fork(missing) = %v", err)
	}
	entries, _ := os.ReadDir(e.Snapshots().Root())
	if len(entries) != 0 {
		t.Errorf("snapshot store not empty: %v", entries)
	}
}
