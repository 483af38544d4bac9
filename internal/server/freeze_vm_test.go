package server

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/cgroup"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
)

// TestIdleFreezeVM: a daemon with --idle-freeze 1s freezes idle children
// (their VMM takes no CPU), and a frozen child answers exec, files, eval
// and a request on a published port (one that computes longer than the
// idle time too) as if it had never stopped, with its
// clock right; a TTL expires a frozen child, and killing one leaves
// nothing (a task frozen by the v1 freezer ignores SIGKILL until thawed).
func TestIdleFreezeVM(t *testing.T) {
	testvm.Require(t)
	testutil.RequireRoot(t) // the cgroup freezer and per-child networks
	var cm *cgroup.Manager
	d := startDaemon(t, testvm.Backend(t), sandbox.Admission{MaxSandboxes: 10}, func(ec *sandbox.Config, _ *Config) {
		ec.CacheDir = testvm.CacheDir(t)
		ec.AgentPath = testvm.AgentBinary(t)
		ec.VMMUser = testvm.VMMUser()
		ec.IdleFreeze = time.Second
		var err error
		if ec.Net, ec.Cgroups, err = sandbox.HostIsolation(ec.DataDir, ec.Logger); err != nil {
			t.Fatal(err)
		}
		cm = ec.Cgroups
	})
	if cm == nil || !cm.CanFreeze() {
		t.Fatal("no cgroup freezer on this host (root with cgroup v1 freezer or v2 needed)")
	}
	ictx, stopIdle := context.WithCancel(context.Background())
	idleDone := make(chan struct{})
	go func() { defer close(idleDone); d.e.RunIdle(ictx) }()
	t.Cleanup(func() { stopIdle(); <-idleDone })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	c := d.tcp
	const guestPIDs = 512 // each child's cap on tasks in its guest

	network := true
	op, err := c.CreateSnapshot(ctx, apiv1.CreateSnapshotRequest{Tag: "py", Image: "python", MemoryMiB: 256, Network: &network})
	if err != nil {
		t.Fatal(err)
	}
	if op, err = c.WaitOperation(ctx, op.ID); err != nil || op.Status != apiv1.OperationSucceeded {
		t.Fatalf("snapshot: %+v %v", op, err)
	}
	res, err := c.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: "py", N: 2,
		GuestPIDsLimit: guestPIDs,
		Network:        &apiv1.NetworkSpec{Publish: []int{8000}}})
	if err != nil || len(res.Sandboxes) != 2 {
		t.Fatalf("create: %+v %v", res, err)
	}
	sb, other := res.Sandboxes[0], res.Sandboxes[1]
	id := sb.ID
	// The guest's server answers /index.html at once and /slow after 3 s
	// of computing (longer than the idle time).
	if _, err := c.WriteFile(ctx, id, "/tmp/srv.py", strings.NewReader(guestServer), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartProcess(ctx, id, apiv1.StartProcessRequest{ExecRequest: apiv1.ExecRequest{
		Args: []string{"python3", "/tmp/srv.py"}}}); err != nil {
		t.Fatal(err)
	}
	base := fmt.Sprintf("http://127.0.0.1:%d", sb.Network.Ports[0].HostPort)
	url := base + "/index.html"
	// The server is up once it answers (the child is awake meanwhile).
	for deadline := time.Now().Add(2 * time.Minute); ; {
		if body, err := get(ctx, url); err == nil && body == "frozen-ok\n" {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("the guest's HTTP server never answered: %q %v", body, err)
		}
		time.Sleep(200 * time.Millisecond)
	}

	// frozen waits until the daemon shows id frozen, then checks that its
	// VMM takes no CPU for a second, and that the traffic of all frozen
	// children but unwatched of them is watched. A second during which
	// the daemon woke a sandbox (a packet for one, say a peer's
	// retransmission) proves nothing: it waits for the next.
	unwatched := 0
	frozen := func(t *testing.T, id string) {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); ; {
			s, err := c.GetSandbox(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			if s.Status == apiv1.SandboxFrozen {
				w, a := d.e.FreezeStats().Wakes, cpuTicks(t, s.PID)
				time.Sleep(time.Second)
				b, woke := cpuTicks(t, s.PID), d.e.FreezeStats().Wakes-w
				if woke == 0 {
					if b != a {
						t.Errorf("frozen VMM %d took %d ticks of CPU in a second without a wake", s.PID, b-a)
					}
					// Frozen children's traffic is watched, not polled.
					if st := d.e.FreezeStats(); st.Frozen-st.Watched != unwatched {
						t.Errorf("%d frozen, %d of them with their traffic watched (want all but %d)", st.Frozen, st.Watched, unwatched)
					}
					return
				}
				t.Logf("%d wakes while VMM %d was checked (%d ticks of CPU): checking again", woke, s.PID, b-a)
			}
			if time.Now().After(deadline) {
				t.Fatalf("sandbox %s did not stay frozen for a second without a wake in 30 s (now %s)", id, s.Status)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	// awake runs one request against a frozen child, which must answer
	// within a few seconds, and then be running.
	awake := func(t *testing.T, what string, f func(ctx context.Context) error) {
		t.Helper()
		frozen(t, id)
		qctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		start := time.Now()
		err := f(qctx)
		t.Logf("%s on a frozen child: %v in %v", what, err, time.Since(start).Round(time.Millisecond))
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if s, err := c.GetSandbox(ctx, id); err != nil || s.Status != apiv1.SandboxRunning {
			t.Errorf("after %s: %+v %v", what, s, err)
		}
	}

	t.Run("exec", func(t *testing.T) {
		awake(t, "exec", func(ctx context.Context) error {
			r, err := c.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"echo", "hi"}})
			if err == nil && r.Stdout != "hi\n" {
				err = fmt.Errorf("stdout %q", r.Stdout)
			}
			return err
		})
	})
	// clockRight asks the guest its time, which must be the host's
	// within 2 s.
	clockRight := func(ctx context.Context) error {
		r, err := c.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"date", "+%s"}})
		if err != nil {
			return err
		}
		guest, err := strconv.ParseInt(strings.TrimSpace(r.Stdout), 10, 64)
		if err != nil {
			return err
		}
		if skew := time.Now().Unix() - guest; skew < -2 || skew > 2 {
			return fmt.Errorf("guest clock %d, host %d: %d s off", guest, time.Now().Unix(), skew)
		}
		return nil
	}
	t.Run("clock", func(t *testing.T) {
		frozen(t, id)
		time.Sleep(3 * time.Second) // frozen a while longer
		awake(t, "clock", clockRight)
		// Its clock was right without being set: the daemon sets the
		// clock of a woken guest only when it does not count the host's
		// TSC, and these guests do (tsc=reliable under TCG).
		ac, release, err := d.e.Agent(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		defer release()
		if !proto.ClockFollowsHost(ac.Clocksource()) {
			t.Errorf("guest clocksource %q: the wake set its clock, the path without a set is untested", ac.Clocksource())
		}
	})
	// A guest whose clock stops while frozen is told the time by the
	// first request after the wake; one that comes meanwhile waits for
	// it. These guests keep time by the TSC, so the daemon is told to set
	// it anyway.
	t.Run("clock set once for two requests", func(t *testing.T) {
		d.e.SetClockAfterWake(true)
		defer d.e.SetClockAfterWake(false)
		// The counts are the daemon's, for all sandboxes: a round in which
		// a packet woke one (the other child, say; its wake may be
		// counted just before the round and its thaw within it) proves
		// nothing. A round with other counts than wanted is run again, up
		// to three; the third must have them.
		for round := 1; ; round++ {
			frozen(t, id)
			before := d.e.FreezeStats()
			var wg sync.WaitGroup
			errs := make([]error, 2)
			for i := range errs {
				wg.Go(func() { errs[i] = clockRight(ctx) })
			}
			wg.Wait()
			after := d.e.FreezeStats()
			for i, err := range errs {
				if err != nil {
					t.Errorf("request %d: %v", i, err)
				}
			}
			n, sets := after.Wakes-before.Wakes, after.ClockSets-before.ClockSets
			if n == 1 && sets == 1 {
				break
			}
			if round == 3 {
				t.Errorf("two requests on a frozen child: %d wakes, %d clock sets; want 1 and 1", n, sets)
				break
			}
			t.Logf("round %d: %d wakes, %d clock sets, %d of the wakes for traffic: again", round, n, sets, after.TrafficWakes-before.TrafficWakes)
		}
		// The clock set is an init, which applies a pids limit too: the
		// child's own, not the agent's default.
		r, err := c.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"cat", "/sys/fs/cgroup/workload/pids.max"}})
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.TrimSpace(r.Stdout); got != strconv.Itoa(guestPIDs) {
			t.Errorf("guest pids.max %q after the clock set, want %d", got, guestPIDs)
		}
	})
	t.Run("files", func(t *testing.T) {
		awake(t, "write", func(ctx context.Context) error {
			_, err := c.WriteFile(ctx, id, "/tmp/f", strings.NewReader("kept"), 0o644)
			return err
		})
		awake(t, "read", func(ctx context.Context) error {
			var b strings.Builder
			_, err := c.ReadFile(ctx, id, "/tmp/f", &b)
			if err == nil && b.String() != "kept" {
				err = fmt.Errorf("read %q", b.String())
			}
			return err
		})
	})
	t.Run("eval", func(t *testing.T) {
		awake(t, "eval", func(ctx context.Context) error {
			r, err := c.Eval(ctx, id, apiv1.EvalRequest{Code: "6 * 7"})
			if err == nil && r.Value != "42" {
				err = fmt.Errorf("eval %+v", r)
			}
			return err
		})
	})
	// getWoken GETs the page of the guest's server on the frozen child:
	// its packets, and nothing else, must wake it.
	getWoken := func(t *testing.T, what string) {
		t.Helper()
		var before int64
		awake(t, what, func(ctx context.Context) error {
			before = d.e.FreezeStats().TrafficWakes
			body, err := get(ctx, url)
			if err == nil && body != "frozen-ok\n" {
				err = fmt.Errorf("body %q", body)
			}
			return err
		})
		if n := d.e.FreezeStats().TrafficWakes - before; n < 1 {
			t.Errorf("%d wakes for traffic during the %s", n, what)
		}
	}
	t.Run("published port", func(t *testing.T) { getWoken(t, "GET") })
	// Where no watch can be made (no packet socket), the idle tick reads
	// the frozen child's counter, and its packets still wake it.
	t.Run("published port, counter read", func(t *testing.T) {
		d.e.SetTrafficWatch(false)
		unwatched = 1 // id; the other child, if frozen, keeps its watch
		defer func() { d.e.SetTrafficWatch(true); unwatched = 0 }()
		// A request wakes id if it froze before: its next freeze is
		// without a watch.
		if _, err := c.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"true"}}); err != nil {
			t.Fatal(err)
		}
		getWoken(t, "GET, counter read")
	})
	// A request that keeps the guest computing longer than the idle
	// time: its VMM's CPU use keeps it awake until it answers.
	t.Run("slow request", func(t *testing.T) {
		awake(t, "slow GET", func(ctx context.Context) error {
			body, err := get(ctx, base+"/slow")
			if err == nil && body != "slow-ok\n" {
				err = fmt.Errorf("body %q", body)
			}
			return err
		})
	})
	// Idle reclaim: once frozen for its reclaim time the child's VMM is
	// paged out to swap, and it still answers everything, its files and
	// its interpreter's state kept.
	t.Run("reclaim", func(t *testing.T) {
		if total, free, err := proc.Swap(); err != nil || total == 0 || free < 256<<20 {
			testutil.Unavailable(t, fmt.Sprintf("idle reclaim needs swap with 256 MiB free (have %d of %d, %v): scripts/zram-swap.sh", free, total, err))
		}
		if _, err := c.Eval(ctx, id, apiv1.EvalRequest{Code: "kept = 'interp'"}); err != nil {
			t.Fatal(err)
		}
		s, err := c.GetSandbox(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		before, compactions, pageIns := d.e.FreezeStats().Reclaims, d.e.FreezeStats().ZramCompactions, d.e.FreezeStats().PageIns
		d.e.SetIdleReclaim(time.Second)
		defer d.e.SetIdleReclaim(0)
		// paged waits until the daemon froze the child and paged its VMM
		// out, to the end (a wake during a page-out stops it): a warmed
		// python guest's VMM holds some tens of MiB of its own, of which
		// the last wake brought back some; at least 8 MiB more than
		// before must be in swap.
		paged := func(t *testing.T) {
			t.Helper()
			before, err := proc.SwapBytes(s.PID)
			if err != nil {
				t.Fatal(err)
			}
			reclaims := d.e.FreezeStats().Reclaims
			frozen(t, id)
			for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
				swapped, err := proc.SwapBytes(s.PID)
				if err != nil {
					t.Fatal(err)
				}
				if swapped >= before+8<<20 && d.e.FreezeStats().Reclaims > reclaims {
					t.Logf("VMM %d: %d MiB in swap, %d MiB before", s.PID, swapped>>20, before>>20)
					return
				}
				if time.Now().After(deadline) {
					t.Fatalf("VMM %d frozen, %d KiB in swap, %d KiB before: not paged out (%+v)", s.PID, swapped>>10, before>>10, d.e.FreezeStats())
				}
			}
		}
		paged(t)
		awake(t, "exec after a page-out", func(ctx context.Context) error {
			r, err := c.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"cat", "/tmp/f"}})
			if err == nil && r.Stdout != "kept" {
				err = fmt.Errorf("stdout %q", r.Stdout)
			}
			return err
		})
		paged(t)
		awake(t, "eval after a page-out", func(ctx context.Context) error {
			r, err := c.Eval(ctx, id, apiv1.EvalRequest{Code: "kept"})
			if err == nil && r.Value != "'interp'" {
				err = fmt.Errorf("eval %+v", r)
			}
			return err
		})
		paged(t)
		awake(t, "GET after a page-out", func(ctx context.Context) error {
			body, err := get(ctx, url)
			if err == nil && body != "frozen-ok\n" {
				err = fmt.Errorf("body %q", body)
			}
			return err
		})
		// The second page-out noted what the wake before had brought
		// back, and the wake after it read that back beside the guest:
		// over a MiB. (The third reads back too unless the eval's pages
		// grew the set by more than a quarter.)
		d.e.WaitPageIns()
		if st := d.e.FreezeStats(); st.Reclaims-before < 3 || st.SwappedBytes <= 0 || st.PageIns-pageIns < 1 || st.PageInBytes < 1<<20 {
			t.Errorf("freeze stats %+v after three page-outs", st)
		}
		// The other child, paged out once meanwhile and not woken
		// since, reads back at its wake what this one's first wake
		// from a page-out faulted back: what its own will want.
		sib, err := c.GetSandbox(ctx, other.ID)
		if err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			if swapped, err := proc.SwapBytes(sib.PID); err != nil {
				t.Fatal(err)
			} else if swapped >= 8<<20 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the other child's VMM %d was not paged out (%+v)", sib.PID, d.e.FreezeStats())
			}
		}
		siblings := d.e.FreezeStats().SiblingPageIns
		if r, err := c.Exec(ctx, other.ID, apiv1.ExecRequest{Args: []string{"echo", "sibling"}}); err != nil || r.Stdout != "sibling\n" {
			t.Fatalf("exec in the other child after its page-out: %+v %v", r, err)
		}
		d.e.WaitPageIns()
		if st := d.e.FreezeStats(); st.SiblingPageIns != siblings+1 {
			t.Errorf("the other child's wake did not read back its sibling's pages: %+v", st)
		}
		// What the wakes brought back left holes in zram's pool, which
		// the daemon compacts a few seconds after such a wake.
		if swaps, err := os.ReadFile("/proc/swaps"); err == nil && strings.Contains(string(swaps), "/dev/zram") {
			for deadline := time.Now().Add(time.Minute); d.e.FreezeStats().ZramCompactions == compactions; time.Sleep(100 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("zram not compacted in a minute after three wakes from paged out (%+v)", d.e.FreezeStats())
				}
			}
		}
	})
	t.Run("metrics", func(t *testing.T) {
		st := d.e.FreezeStats()
		if st.Freezes < 7 || st.Wakes < 7 || st.WakeSeconds <= 0 || st.ClockSets < 1 {
			t.Errorf("freeze stats %+v after seven wakes", st)
		}
		t.Logf("freeze stats %+v: mean wake %.0f ms", st, 1000*st.WakeSeconds/float64(st.Wakes))
	})
	t.Run("ttl", func(t *testing.T) {
		frozen(t, other.ID)
		s, err := c.SetTimeout(ctx, other.ID, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		waitGone(t, ctx, d, other.ID, s.ExpiresAt.Add(10*time.Second))
		if _, err := cm.Open(other.ID); !errdefs.IsNotFound(err) {
			t.Errorf("cgroup of the expired child: %v", err)
		}
	})
	t.Run("kill", func(t *testing.T) {
		frozen(t, id)
		if err := c.DeleteSandbox(ctx, id); err != nil {
			t.Fatal(err)
		}
		if _, err := cm.Open(id); !errdefs.IsNotFound(err) {
			t.Errorf("cgroup of the killed child: %v", err)
		}
		assertNoLeak(t, d)
	})
}

// guestServer is a guest's HTTP server on port 8000: /index.html answers
// at once, /slow after computing for 3 s.
const guestServer = `import http.server, time

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow":
            end = time.monotonic() + 3
            while time.monotonic() < end:
                pass
            body = b"slow-ok\n"
        elif self.path == "/index.html":
            body = b"frozen-ok\n"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

http.server.HTTPServer(("", 8000), Handler).serve_forever()
`

// get GETs url and returns its body.
func get(ctx context.Context, url string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// cpuTicks is the user and system CPU time process pid has taken.
func cpuTicks(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	// Fields after the command's closing parenthesis; utime and stime
	// are the 14th and 15th of the line.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return u + s
}
