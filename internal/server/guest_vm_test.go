package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/testvm"
)

// TestGuestProtectsItselfVM drives hostile workloads through the API
// against real guests (the python image, 256 MiB): the guest must keep
// its agent answering whatever its workload does. Subtests share one
// snapshot and each makes its own sandbox.
func TestGuestProtectsItselfVM(t *testing.T) {
	testvm.Require(t)
	d := startDaemon(t, testvm.Backend(t), sandbox.Admission{MaxSandboxes: 20}, func(ec *sandbox.Config, _ *Config) {
		ec.CacheDir = testvm.CacheDir(t)
		ec.AgentPath = testvm.AgentBinary(t)
		ec.VMMUser = testvm.VMMUser()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	c := d.tcp
	op, err := c.CreateSnapshot(ctx, apiv1.CreateSnapshotRequest{Tag: "py", Image: "python", MemoryMiB: 256})
	if err != nil {
		t.Fatal(err)
	}
	if op, err = c.WaitOperation(ctx, op.ID); err != nil || op.Status != apiv1.OperationSucceeded {
		t.Fatalf("snapshot: %+v %v", op, err)
	}
	sandboxOf := func(t *testing.T, req apiv1.CreateSandboxesRequest) string {
		t.Helper()
		req.SnapshotTag = "py"
		res, err := c.CreateSandboxes(ctx, req)
		if err != nil || len(res.Sandboxes) != 1 {
			t.Fatalf("create: %+v %v", res, err)
		}
		id := res.Sandboxes[0].ID
		t.Cleanup(func() { c.DeleteSandbox(context.Background(), id) })
		return id
	}
	// quick runs one call that must answer within a few seconds.
	quick := func(t *testing.T, what string, f func(ctx context.Context) error) {
		t.Helper()
		qctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		start := time.Now()
		err := f(qctx)
		t.Logf("%s: %v in %v", what, err, time.Since(start).Round(time.Millisecond))
		if err != nil {
			t.Errorf("%s: %v", what, err)
		}
	}
	t.Run("files", func(t *testing.T) {
		id := sandboxOf(t, apiv1.CreateSandboxesRequest{})
		if _, err := c.WriteFile(ctx, id, "/dev/null", strings.NewReader("discarded"), 0); err != nil {
			t.Errorf("PUT /dev/null: %v", err)
		}
		for _, p := range []string{"/dev/hvc0", "/dev/console", "/proc/sys/vm/drop_caches", "/sys/kernel/forkd"} {
			if _, err := c.WriteFile(ctx, id, p, strings.NewReader("garbage"), 0); !errdefs.IsInvalidArgument(err) {
				t.Errorf("PUT %s: %v, want 400 invalid_argument", p, err)
			}
		}
		r, err := c.Exec(ctx, id, apiv1.ExecRequest{Shell: "test -c /dev/null && test -c /dev/hvc0 && test -c /dev/console && echo nodes"})
		if err != nil || r.Stdout != "nodes\n" {
			t.Errorf("device nodes after the writes: %+v %v", r, err)
		}
		quick(t, "ping", func(ctx context.Context) error { _, err := c.Ping(ctx, id); return err })
	})

	t.Run("memory", func(t *testing.T) {
		id := sandboxOf(t, apiv1.CreateSandboxesRequest{})
		if _, err := c.Eval(ctx, id, apiv1.EvalRequest{Code: "x = 41"}); err != nil {
			t.Fatal(err)
		}
		// The workload runs in its own cgroup; the kernel's OOM killer never
		// picks the agent (PID 1: an oom_score of 0).
		r, err := c.Exec(ctx, id, apiv1.ExecRequest{Shell: "cat /proc/self/cgroup /proc/1/oom_score; cat /proc/self/oom_score_adj"})
		if err != nil || r.Stdout != "0::/workload\n0\n0\n" {
			t.Errorf("cgroup, agent's oom_score, own oom_score_adj: %+v %v", r, err)
		}
		// Fill every in-RAM file system the workload can write.
		fill := "dd if=/dev/zero of=/tmp/fill bs=1M; dd if=/dev/zero of=/root/fill bs=1M; dd if=/dev/zero of=/dev/shm/fill bs=1M; df -k / /tmp /dev/shm /run /dev"
		ectx, cancel := context.WithTimeout(ctx, 4*time.Minute)
		start := time.Now()
		r, err = c.Exec(ectx, id, apiv1.ExecRequest{Shell: fill, TimeoutSecs: 180})
		cancel()
		if err != nil {
			t.Fatalf("exec filling the guest's memory did not come back: %v after %v", err, time.Since(start))
		}
		t.Logf("fill: exit %d in %d ms\n%s%s", r.ExitCode, r.DurationMS, r.Stdout, r.Stderr)
		if r.TimedOut || strings.Count(r.Stderr, "No space left on device") != 3 {
			t.Errorf("fill: %+v, want three ENOSPC", r)
		}
		quick(t, "ping", func(ctx context.Context) error { _, err := c.Ping(ctx, id); return err })
		quick(t, "exec", func(ctx context.Context) error {
			r, err := c.Exec(ctx, id, apiv1.ExecRequest{Shell: "echo alive"})
			if err == nil && r.Stdout != "alive\n" {
				t.Errorf("exec after the fill: %+v", r)
			}
			return err
		})
		quick(t, "read", func(ctx context.Context) error {
			var b bytes.Buffer
			_, err := c.ReadFile(ctx, id, "/etc/hostname", &b)
			return err
		})
		quick(t, "write to a full file system", func(ctx context.Context) error {
			_, err := c.WriteFile(ctx, id, "/root/more", strings.NewReader("more"), 0)
			switch {
			case err == nil:
				return errors.New("a write to a full file system succeeded")
			case errdefs.IsResourceExhausted(err):
				return nil // ENOSPC, answered
			}
			return err
		})
		// The warm interpreter lived through it, its state kept.
		quick(t, "eval", func(ctx context.Context) error {
			e, err := c.Eval(ctx, id, apiv1.EvalRequest{Code: "x + 1"})
			if err == nil && e.Value != "42" {
				t.Errorf("eval after the fill: %+v", e)
			}
			return err
		})
		// With the file systems still full, a process that allocates
		// without end is killed inside the workload's cgroup; the agent and
		// the interpreter live on.
		hog := "python3 -c 'l = []\nwhile True: l.append(b\"x\" * (8 << 20))'"
		if r, err := c.Exec(ctx, id, apiv1.ExecRequest{Shell: hog, TimeoutSecs: 120}); err != nil || r.TimedOut || r.ExitCode == 0 {
			t.Errorf("memory hog: %+v %v", r, err)
		} else {
			t.Logf("memory hog: exit %d signal %q in %d ms: %s", r.ExitCode, r.Signal, r.DurationMS, r.Stderr)
		}
		quick(t, "ping after the hog", func(ctx context.Context) error { _, err := c.Ping(ctx, id); return err })
		quick(t, "eval after the hog", func(ctx context.Context) error {
			e, err := c.Eval(ctx, id, apiv1.EvalRequest{Code: "x + 1"})
			if err == nil && e.Value != "42" {
				t.Errorf("eval after the hog: %+v", e)
			}
			return err
		})
		quick(t, "free and write", func(ctx context.Context) error {
			if err := c.Remove(ctx, id, "/tmp/fill", false); err != nil {
				return err
			}
			_, err := c.WriteFile(ctx, id, "/root/more", strings.NewReader("more"), 0)
			return err
		})
		if sb, err := c.GetSandbox(ctx, id); err != nil || sb.Status != apiv1.SandboxRunning {
			t.Errorf("sandbox after the fill: %+v %v", sb, err)
		}
	})

	t.Run("pids", func(t *testing.T) {
		// Pings go on answering while the guest runs a fork bomb.
		pinging := func(t *testing.T, id string) (stop func()) {
			done, finished := make(chan struct{}), make(chan struct{})
			go func() {
				defer close(finished)
				var worst time.Duration
				var n int
				for {
					select {
					case <-done:
						t.Logf("%d pings during the bomb, the slowest %v", n, worst.Round(time.Millisecond))
						return
					case <-time.After(200 * time.Millisecond):
					}
					pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
					start := time.Now()
					_, err := c.Ping(pctx, id)
					cancel()
					worst, n = max(worst, time.Since(start)), n+1
					if err != nil {
						t.Errorf("ping during the bomb: %v after %v", err, time.Since(start))
					}
				}
			}()
			return func() { close(done); <-finished }
		}
		// The exec lasts until its timeout (the bomb's tasks keep its
		// output open); 341 tasks took over 30 s to reach in a CI guest
		// on a loaded host.
		bomb := apiv1.ExecRequest{Shell: "bomb() { bomb | bomb & }; bomb; sleep 10", TimeoutSecs: 60}
		for _, limit := range []int{64, 0} {
			id := sandboxOf(t, apiv1.CreateSandboxesRequest{GuestPIDsLimit: limit})
			r, err := c.Exec(ctx, id, apiv1.ExecRequest{Shell: "cat /sys/fs/cgroup/workload/pids.max"})
			want, _ := strconv.Atoi(strings.TrimSpace(r.Stdout))
			// The default of a 256 MiB guest: one task per 512 KiB of its
			// workload's 170.5 MiB.
			if err != nil || limit > 0 && want != limit || limit == 0 && want != 341 {
				t.Fatalf("guest_pids_limit %d: pids.max %+v %v", limit, r, err)
			}
			if limit > 0 {
				// fork fails with EAGAIN at the limit. The children are
				// killed and reaped before the script ends: left asleep,
				// they would hold the limit through the bomb below and
				// the exec after it, which a fast guest reaches within
				// their sleep.
				fork := "import errno, os, signal, time\npids = []\ntry:\n    while True:\n        p = os.fork()\n        if p == 0:\n            time.sleep(60)\n            os._exit(0)\n        pids.append(p)\nexcept OSError as e:\n    print(len(pids), errno.errorcode[e.errno], flush=True)\nfor p in pids:\n    os.kill(p, signal.SIGKILL)\n    os.waitpid(p, 0)\n"
				r, err := c.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"python3", "-c", fork}, TimeoutSecs: 60})
				var n int
				var code string
				if err == nil {
					fmt.Sscan(r.Stdout, &n, &code)
				}
				if err != nil || code != "EAGAIN" || n >= limit || n < limit/2 {
					t.Errorf("forks up to the limit of %d: %+v %v", limit, r, err)
				}
			}
			stop := pinging(t, id)
			start := time.Now()
			r, err = c.Exec(ctx, id, bomb)
			stop()
			if err != nil {
				t.Fatalf("fork bomb under a limit of %d: %v after %v", want, err, time.Since(start))
			}
			t.Logf("fork bomb under a limit of %d: exit %d in %d ms, %d lines of stderr", want, r.ExitCode, r.DurationMS, strings.Count(r.Stderr, "\n"))
			if !strings.Contains(r.Stderr, "Cannot fork") {
				t.Errorf("fork bomb never met the limit of %d: %q", want, r.Stderr[:min(len(r.Stderr), 500)])
			}
			// The bomb's answer came once its killed tasks were reaped:
			// the next command finds the limit free at once, not EAGAIN.
			quick(t, "exec after the bomb", func(ctx context.Context) error {
				r, err := c.Exec(ctx, id, apiv1.ExecRequest{Shell: "cat /sys/fs/cgroup/workload/pids.current"})
				t.Logf("tasks left: %s", r.Stdout)
				if n, _ := strconv.Atoi(strings.TrimSpace(r.Stdout)); err == nil && (n == 0 || n > 8) {
					t.Errorf("%d tasks in the workload after the bomb", n)
				}
				return err
			})
		}
	})
}
