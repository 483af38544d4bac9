package sandbox_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
)

// TestForkBombUnderCPULimit is the probe's fork bomb, ten times, in a child
// limited to half a core (and 400 MiB, 40 VMM tasks), with a ping every
// second meanwhile, through one shared agent session as the daemon has:
// no call may fail with a corrupt or lossy channel, each exec must end by
// its timeout plus the host's grace, and the agent keeps answering.
func TestForkBombUnderCPULimit(t *testing.T) {
	testutil.RequireRoot(t)
	e := testvm.EngineWith(t, func(c *sandbox.Config) { c.Daemon = true })
	ctx := ctxT(t, 20*time.Minute)
	if _, err := e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: "bomb", Image: "minimal"}); err != nil {
		t.Fatal(err)
	}
	res, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "bomb", N: 1, Limits: &state.Limits{CPUs: 0.5, MemoryMiB: 400, PIDs: 40}})
	if err != nil {
		t.Fatal(err)
	}
	id := res.Children[0].ID
	c, release, err := e.Agent(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	const runs, timeout = 10, 6 * time.Second
	for i := 0; i < runs; i++ {
		pctx, stopPings := context.WithCancel(ctx)
		var wg sync.WaitGroup
		var mu sync.Mutex
		var pingErrs []error
		var slowest time.Duration
		wg.Add(1)
		go func() {
			defer wg.Done()
			for pctx.Err() == nil {
				start := time.Now()
				cctx, cancel := context.WithTimeout(pctx, 30*time.Second)
				_, err := c.Ping(cctx)
				cancel()
				mu.Lock()
				if err != nil && pctx.Err() == nil {
					pingErrs = append(pingErrs, err)
				}
				slowest = max(slowest, time.Since(start))
				mu.Unlock()
				select {
				case <-pctx.Done():
				case <-time.After(time.Second):
				}
			}
		}()
		var out strings.Builder
		start := time.Now()
		r, err := c.Exec(ctx, agent.ExecRequest{Shell: "bomb(){ bomb | bomb & }; bomb; sleep 2; echo survived", Stdout: &out, Timeout: timeout})
		took := time.Since(start)
		stopPings()
		wg.Wait()
		// On time: the guest's answer, or the host's own deadline (the
		// timeout plus its grace) when the starved guest is later still;
		// never a broken channel.
		if took > timeout+agent.DefaultCallGrace+2*time.Second {
			t.Fatalf("run %d: a %v timeout took %v", i, timeout, took)
		}
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("run %d: exec: %v (after %v)", i, err, took)
		}
		if err != nil {
			r = &proto.ExecResult{TimedOut: true, ExitCode: -1}
		}
		for _, perr := range pingErrs {
			t.Errorf("run %d: ping: %v", i, perr)
		}
		if cerr := c.Err(); cerr != nil {
			t.Fatalf("run %d: the agent session ended: %v", i, cerr)
		}
		// The next run starts once the agent has killed this bomb. The
		// agent reads the count itself: a probe of its own would need a
		// fork, which the bomb's last tasks may still make fail.
		for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(time.Second) {
			var pids strings.Builder
			rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			_, err := c.ReadFile(rctx, "/sys/fs/cgroup/workload/pids.current", &pids)
			cancel()
			if err != nil {
				t.Fatalf("run %d: read the workload's task count: %v", i, err)
			}
			if n, err := strconv.Atoi(strings.TrimSpace(pids.String())); err == nil && n < 5 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("run %d: the bomb still runs 2 min after its timeout: %s tasks", i, strings.TrimSpace(pids.String()))
			}
		}
		t.Logf("run %d: exec %v (exit %d, timed out %v, %q), slowest ping %v, resends so far %d",
			i, took.Round(time.Millisecond), r.ExitCode, r.TimedOut, strings.TrimSpace(out.String()), slowest.Round(time.Millisecond), c.Resends())
	}
	if out, code := run(t, e, id, "echo alive"); code != 0 || out != "alive\n" {
		t.Fatalf("after the bombs: %q exit %d", out, code)
	}
}
