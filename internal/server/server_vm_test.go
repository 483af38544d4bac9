package server

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
)

// TestServerVM drives a real daemon (in-process server on real listeners,
// real QEMU VMs) through the typed client. Subtests share one snapshot and
// run in order.
func TestServerVM(t *testing.T) {
	testvm.Require(t)
	d := startDaemon(t, testvm.Backend(t), sandbox.Admission{MaxSandboxes: 20}, func(ec *sandbox.Config, _ *Config) {
		ec.CacheDir = testvm.CacheDir(t)
		ec.AgentPath = testvm.AgentBinary(t)
		ec.VMMUser = testvm.VMMUser()
		var err error
		if ec.Net, ec.Cgroups, err = sandbox.HostIsolation(ec.DataDir, ec.Logger); err != nil {
			t.Fatal(err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	c := d.tcp

	t.Run("snapshot", func(t *testing.T) {
		op, err := c.CreateSnapshot(ctx, apiv1.CreateSnapshotRequest{Tag: "base", Image: "minimal"})
		if err != nil || op.Status != apiv1.OperationRunning || op.Snapshot != "base" {
			t.Fatalf("create snapshot: %+v %v", op, err)
		}
		if _, err := c.CreateSnapshot(ctx, apiv1.CreateSnapshotRequest{Tag: "base"}); !errdefs.IsAlreadyExists(err) {
			t.Errorf("second create while writing: %v", err)
		}
		if s, err := c.GetSnapshot(ctx, "base"); err != nil || s.Status != apiv1.SnapshotWriting {
			t.Errorf("snapshot while written: %+v %v", s, err)
		}
		if op, err = c.WaitOperation(ctx, op.ID); err != nil || op.Status != apiv1.OperationSucceeded {
			t.Fatalf("operation: %+v %v", op, err)
		}
		s, err := c.GetSnapshot(ctx, "base")
		if err != nil || s.Status != apiv1.SnapshotReady || s.SizeBytes <= 0 || s.Refcount != 0 || s.Image != "minimal" {
			t.Fatalf("snapshot: %+v %v", s, err)
		}
	})

	t.Run("sandboxes", func(t *testing.T) {
		res, err := c.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: "base", N: 5, Metadata: map[string]string{"job": "t1"}, Limits: apiv1.Limits{MemoryLimitMiB: 512}})
		if err != nil || len(res.Sandboxes) != 5 || len(res.Failed) != 0 {
			t.Fatalf("create 5: %+v %v", res, err)
		}
		ids := map[string]bool{}
		for _, sb := range res.Sandboxes {
			if sb.Status != apiv1.SandboxRunning || sb.PID == 0 || sb.MemoryLimitMiB != 512 || sb.Metadata["job"] != "t1" {
				t.Errorf("sandbox %+v", sb)
			}
			ids[sb.ID] = true
		}
		if len(ids) != 5 {
			t.Fatalf("ids %v", ids)
		}
		id := res.Sandboxes[0].ID
		if s, _ := c.GetSnapshot(ctx, "base"); s.Refcount != 5 {
			t.Errorf("refcount %d, want 5", s.Refcount)
		}
		if err := c.DeleteSnapshot(ctx, "base"); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "in use") {
			t.Errorf("delete snapshot in use: %v", err)
		}
		if l, err := c.ListSandboxes(ctx, client.ListOptions{Snapshot: "base", Metadata: map[string]string{"job": "t1"}}); err != nil || len(l) != 5 {
			t.Errorf("list by snapshot and metadata: %d %v", len(l), err)
		}
		if l, _ := c.ListSandboxes(ctx, client.ListOptions{Metadata: map[string]string{"job": "other"}}); len(l) != 0 {
			t.Errorf("list by other metadata: %d", len(l))
		}

		// Buffered exec: output, exit code, stderr apart; binary output.
		r, err := c.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"sh", "-c", "echo out; echo err >&2; exit 3"}})
		if err != nil || r.Stdout != "out\n" || r.Stderr != "err\n" || r.ExitCode != 3 {
			t.Errorf("exec: %+v %v", r, err)
		}
		r, err = c.Exec(ctx, id, apiv1.ExecRequest{Shell: `printf '\377\376'`})
		if err != nil || !bytes.Equal(r.StdoutB64, []byte{0xff, 0xfe}) {
			t.Errorf("binary exec: %+v %v", r, err)
		}
		r, err = c.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"cat"}, Stdin: []byte("fed in")})
		if err != nil || r.Stdout != "fed in" {
			t.Errorf("exec with stdin: %+v %v", r, err)
		}
		if r, err = c.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"sleep", "5"}, TimeoutSecs: 0.3}); err != nil || !r.TimedOut {
			t.Errorf("exec timeout: %+v %v", r, err)
		}
		if _, err := c.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"/no/such/binary"}}); err == nil {
			t.Errorf("exec of a missing binary succeeded")
		}

		// Streamed exec delivers lines as they are produced.
		tw := &timedWriter{}
		r, err = c.ExecStream(ctx, id, apiv1.ExecRequest{Shell: "for i in 1 2 3 4; do echo line$i; sleep 0.4; done; echo e >&2"}, nil, tw, tw)
		if err != nil || r.ExitCode != 0 {
			t.Fatalf("stream: %+v %v", r, err)
		}
		if got := tw.text(); got != "line1\nline2\nline3\nline4\ne\n" {
			t.Errorf("streamed output %q", got)
		}
		if first, last := tw.at[0], tw.at[len(tw.at)-1]; last.Sub(first) < 1000*time.Millisecond {
			t.Errorf("lines arrived within %v of each other: not streamed", last.Sub(first))
		}

		// Files.
		id2 := res.Sandboxes[1].ID
		if w, err := c.WriteFile(ctx, id2, "/tmp/d/f.txt", strings.NewReader("hello files"), 0o640); err != nil || w.Bytes != 11 {
			t.Errorf("write: %+v %v", w, err)
		}
		var buf bytes.Buffer
		if _, err := c.ReadFile(ctx, id2, "/tmp/d/f.txt", &buf); err != nil || buf.String() != "hello files" {
			t.Errorf("read: %q %v", buf.String(), err)
		}
		if fi, err := c.Stat(ctx, id2, "/tmp/d/f.txt"); err != nil || fi.Size != 11 || fi.Mode&0o777 != 0o640 || fi.Type != apiv1.FileTypeFile {
			t.Errorf("stat: %+v %v", fi, err)
		}
		if created, err := c.MakeDir(ctx, id2, "/tmp/d/sub"); err != nil || !created {
			t.Errorf("mkdir: %v %v", created, err)
		}
		if err := c.Rename(ctx, id2, "/tmp/d/f.txt", "/tmp/d/sub/g.txt"); err != nil {
			t.Errorf("rename: %v", err)
		}
		if l, err := c.ListDir(ctx, id2, "/tmp/d", 2); err != nil || len(l) != 2 {
			t.Errorf("list: %+v %v", l, err)
		}
		if _, err := c.ReadFile(ctx, id2, "/tmp/d/f.txt", &buf); !errdefs.IsNotFound(err) {
			t.Errorf("read renamed file: %v", err)
		}
		if err := c.Remove(ctx, id2, "/tmp/d", false); err == nil {
			t.Errorf("non-recursive remove of a full dir succeeded")
		}
		if err := c.Remove(ctx, id2, "/tmp/d", true); err != nil {
			t.Errorf("remove: %v", err)
		}
		// A sandbox's files are its own.
		if _, err := c.Stat(ctx, id, "/tmp/d"); !errdefs.IsNotFound(err) {
			t.Errorf("sibling sees the file: %v", err)
		}

		if p, err := c.Ping(ctx, id); err != nil || p.Hostname != id || p.LatencyMS <= 0 {
			t.Errorf("ping: %+v %v", p, err)
		}
		if _, err := c.Eval(ctx, id, apiv1.EvalRequest{Code: "1+1"}); !errdefs.IsNotImplemented(err) {
			t.Errorf("eval without python: %v, want NotImplemented", err)
		}

		for sid := range ids {
			if err := c.DeleteSandbox(ctx, sid); err != nil {
				t.Errorf("delete %s: %v", sid, err)
			}
		}
		if _, err := c.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"true"}}); !errdefs.IsNotFound(err) {
			t.Errorf("exec after delete: %v", err)
		}
		assertNoLeak(t, d)
	})

	t.Run("processes", func(t *testing.T) {
		res, err := c.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: "base"})
		if err != nil {
			t.Fatal(err)
		}
		id := res.Sandboxes[0].ID
		defer func() { _ = c.DeleteSandbox(ctx, id) }()
		// A background cat fed through stdin, attached, waited for.
		p, err := c.StartProcess(ctx, id, apiv1.StartProcessRequest{ExecRequest: apiv1.ExecRequest{Args: []string{"cat"}}, StdinOpen: true, Tag: "echo"})
		if err != nil || p.PID <= 0 || !p.Running || p.Tag != "echo" {
			t.Fatalf("start: %+v %v", p, err)
		}
		if list, err := c.ListProcesses(ctx, id); err != nil || len(list) == 0 || list[len(list)-1].PID != p.PID {
			t.Fatalf("list: %+v %v", list, err)
		}
		if err := c.SendStdin(ctx, id, p.PID, []byte("hello "), false); err != nil {
			t.Fatal(err)
		}
		if err := c.SendStdin(ctx, id, p.PID, []byte("world\n"), true); err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		r, err := c.StreamProcess(ctx, id, p.PID, &out, io.Discard)
		if err != nil || r.ExitCode != 0 || out.String() != "hello world\n" {
			t.Fatalf("stream: %q %+v %v", out.String(), r, err)
		}
		if r, err := c.WaitProcess(ctx, id, p.PID); err != nil || r.ExitCode != 0 {
			t.Fatalf("wait: %+v %v", r, err)
		}
		// A signal ends one; a kill another.
		sl, err := c.StartProcess(ctx, id, apiv1.StartProcessRequest{ExecRequest: apiv1.ExecRequest{Shell: "sleep 600"}})
		if err != nil {
			t.Fatal(err)
		}
		if err := c.SignalProcess(ctx, id, sl.PID, "TERM"); err != nil {
			t.Fatal(err)
		}
		if r, err := c.WaitProcess(ctx, id, sl.PID); err != nil || r.Signal != "SIGTERM" {
			t.Fatalf("after TERM: %+v %v", r, err)
		}
		if err := c.SignalProcess(ctx, id, sl.PID, "NOPE"); !errdefs.IsInvalidArgument(err) {
			t.Fatalf("a bad signal: %v", err)
		}
		if err := c.KillProcess(ctx, id, 999999); !errdefs.IsNotFound(err) && !errdefs.IsInvalidArgument(err) {
			t.Fatalf("kill of no process: %v", err)
		}
	})

	t.Run("network", func(t *testing.T) {
		testutil.RequireRoot(t) // per-child networks; without root the snapshot has no NIC
		res, err := c.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: "base", N: 1, Limits: apiv1.Limits{CPUs: 1, PIDsLimit: 128},
			Network: &apiv1.NetworkSpec{Egress: "allowlist", Allow: []apiv1.NetworkRule{{CIDR: "198.51.100.0/24", Proto: "tcp", Ports: []string{"80"}}}, Publish: []int{8080}}})
		if err != nil || len(res.Sandboxes) != 1 {
			t.Fatalf("create: %+v %v", res, err)
		}
		sb := res.Sandboxes[0]
		n := sb.Network
		if n == nil || n.Address == "" || n.Egress != "allowlist" || len(n.Allow) != 1 || len(n.Ports) != 1 || n.Ports[0].GuestPort != 8080 ||
			sb.CPUs != 1 || sb.PIDsLimit != 128 {
			t.Fatalf("sandbox %+v network %+v", sb, n)
		}
		got, err := c.SetNetwork(ctx, sb.ID, apiv1.NetworkSpec{Egress: "deny"})
		if err != nil || got.Network.Egress != "deny" || len(got.Network.Allow) != 0 {
			t.Fatalf("set network: %+v %v", got, err)
		}
		if _, err := c.SetNetwork(ctx, sb.ID, apiv1.NetworkSpec{Egress: "sometimes"}); !errdefs.IsInvalidArgument(err) {
			t.Fatalf("bad egress: %v", err)
		}
		p, err := c.Publish(ctx, sb.ID, 80)
		if err != nil || p.GuestPort != 80 || p.HostPort == 0 || p.HostPort == n.Ports[0].HostPort {
			t.Fatalf("publish: %+v %v", p, err)
		}
		if again, err := c.Publish(ctx, sb.ID, 80); err != nil || again.HostPort != p.HostPort {
			t.Fatalf("publish again: %+v %v", again, err)
		}
		if err := c.DeleteSandbox(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		assertNoLeak(t, d)
	})

	t.Run("timeout", func(t *testing.T) {
		// Each child's time counts from when it was ready: long enough
		// for the later one to be ready before the first expires.
		res, err := c.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: "base", N: 2, TimeoutSecs: 5})
		if err != nil || len(res.Sandboxes) != 2 {
			t.Fatalf("create: %+v %v", res, err)
		}
		a, b := res.Sandboxes[0], res.Sandboxes[1]
		if a.ExpiresAt.IsZero() || time.Until(a.ExpiresAt) > 5*time.Second {
			t.Errorf("expires_at %v", a.ExpiresAt)
		}
		// Push one deadline out, then bring it in with the timeout route.
		if sb, err := c.SetTimeout(ctx, b.ID, time.Hour); err != nil || time.Until(sb.ExpiresAt) < 50*time.Minute {
			t.Fatalf("set timeout: %+v %v", sb, err)
		}
		waitGone(t, ctx, d, a.ID, a.ExpiresAt.Add(5*time.Second))
		if _, err := c.GetSandbox(ctx, b.ID); err != nil {
			t.Fatalf("sandbox with a later deadline is gone: %v", err)
		}
		sb, err := c.SetTimeout(ctx, b.ID, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		waitGone(t, ctx, d, b.ID, sb.ExpiresAt.Add(5*time.Second))
		assertNoLeak(t, d)
	})

	t.Run("limit", func(t *testing.T) {
		const tries = 50
		var wg sync.WaitGroup
		var mu sync.Mutex
		var ok, limited []string
		var other []error
		for range tries {
			wg.Add(1)
			go func() {
				defer wg.Done()
				res, err := c.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: "base", N: 1})
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil && len(res.Sandboxes) == 1:
					ok = append(ok, res.Sandboxes[0].ID)
				case errdefs.IsResourceExhausted(err):
					limited = append(limited, err.Error())
				default:
					other = append(other, err)
				}
			}()
		}
		wg.Wait()
		if len(ok) != 20 || len(limited) != tries-20 || len(other) != 0 {
			t.Errorf("%d created, %d refused with 429, other errors %v; want 20 and 30", len(ok), len(limited), other)
		}
		if len(limited) > 0 && !strings.Contains(limited[0], "limit of 20") {
			t.Errorf("429 message %q", limited[0])
		}
		if l, _ := c.ListSandboxes(ctx, client.ListOptions{}); len(l) != len(ok) {
			t.Errorf("%d listed, %d created", len(l), len(ok))
		}
		if n, _ := d.srv.cfg.Admitter.Live(); n != len(ok) {
			t.Errorf("live count %d", n)
		}
		for _, id := range ok {
			if err := c.DeleteSandbox(ctx, id); err != nil {
				t.Error(err)
			}
		}
		assertNoLeak(t, d)
	})

	t.Run("caller leaves", func(t *testing.T) {
		// A caller that hangs up during a create never learns the ids, so
		// the daemon must not keep the sandboxes.
		for _, after := range []time.Duration{20 * time.Millisecond, 80 * time.Millisecond, 140 * time.Millisecond, 200 * time.Millisecond, 260 * time.Millisecond} {
			cctx, cancel := context.WithTimeout(ctx, after)
			res, err := c.CreateSandboxes(cctx, apiv1.CreateSandboxesRequest{SnapshotTag: "base", N: 2})
			cancel()
			t.Logf("hang-up after %v: %v", after, err)
			if err == nil { // ready before the hang-up: the caller has them
				for _, sb := range res.Sandboxes {
					c.DeleteSandbox(ctx, sb.ID)
				}
			}
			// Settled: no request in the daemon and no record, twice in a
			// row (a request the client gave up on may reach its handler
			// late, and make records then).
			settled := 0
			for deadline := time.Now().Add(time.Minute); ; time.Sleep(100 * time.Millisecond) {
				if list, err := d.e.State().List(); err == nil && len(list) == 0 && requestsInFlight(t, d) == 0 {
					if settled++; settled == 2 {
						break
					}
				} else {
					settled = 0
				}
				if time.Now().After(deadline) {
					list, _ := d.e.State().List()
					t.Fatalf("hang-up after %v: after a minute, %d records and %v requests in flight", after, len(list), requestsInFlight(t, d))
				}
			}
			assertNoLeak(t, d)
		}
	})

	t.Run("delete snapshot", func(t *testing.T) {
		if err := c.DeleteSnapshot(ctx, "base"); err != nil {
			t.Fatal(err)
		}
		if _, err := c.GetSnapshot(ctx, "base"); !errdefs.IsNotFound(err) {
			t.Errorf("snapshot after delete: %v", err)
		}
	})
}

// requestsInFlight reads the daemon's gauge of the requests it serves.
func requestsInFlight(t *testing.T, d *daemon) float64 {
	t.Helper()
	mfs, err := d.srv.Metrics().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "forkd_http_requests_in_flight" && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("no forkd_http_requests_in_flight gauge")
	return 0
}

// waitGone waits until sandbox id is gone, failing after deadline.
func waitGone(t *testing.T, ctx context.Context, d *daemon, id string, deadline time.Time) {
	t.Helper()
	for {
		_, err := d.tcp.GetSandbox(ctx, id)
		if errdefs.IsNotFound(err) {
			return
		}
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("get %s: %v", id, err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox %s still there at %v", id, deadline)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// assertNoLeak checks that no sandbox, run dir or VMM process is left.
func assertNoLeak(t *testing.T, d *daemon) {
	t.Helper()
	if list, err := d.e.State().List(); err != nil || len(list) != 0 {
		t.Errorf("records left: %d %v", len(list), err)
	}
	if ents, _ := os.ReadDir(filepath.Join(d.data, "run")); len(ents) != 0 {
		t.Errorf("run dirs left: %v", ents)
	}
	if pids := testutil.ProcessesUnder(filepath.Join(d.data, "run")); len(pids) != 0 {
		t.Errorf("VMM processes left: %v", pids)
	}
}

// timedWriter records when each write arrived.
type timedWriter struct {
	mu  sync.Mutex
	buf bytes.Buffer
	at  []time.Time
}

func (w *timedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.at = append(w.at, time.Now())
	return w.buf.Write(p)
}

func (w *timedWriter) text() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}
