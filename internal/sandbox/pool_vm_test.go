package sandbox_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
)

// TestPool: after a fork, VMMs are parked for the snapshot; the next
// children take them (with their own id, policy and published port), are
// not listed while parked, and nothing is left once the pool is closed.
func TestPool(t *testing.T) {
	testutil.RequireRoot(t)
	e := testvm.EngineWith(t, func(c *sandbox.Config) { c.Pool = 2 })
	ctx := ctxT(t, 10*time.Minute)
	if _, err := e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: "pl", Image: "minimal", Network: true,
		Warmup: []string{"busybox httpd -p 80 -h /etc"}}); err != nil {
		t.Fatal(err)
	}
	first, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "pl", N: 1})
	if err != nil {
		t.Fatal(err)
	}
	waitParked(t, e, "pl", 2)
	if list, _ := e.List(ctx); len(list) != 1 {
		t.Fatalf("parked VMMs listed as sandboxes: %d listed", len(list))
	}
	// Pool entries wait restored and stopped, in the background class,
	// with all but what an exec uses in swap if the host swaps to zram.
	recs, err := e.State().List()
	if err != nil {
		t.Fatal(err)
	}
	_, swapFree, _ := proc.Swap()
	if zram, _ := proc.SwapsToZram(); !zram {
		swapFree = 0
	}
	for _, r := range recs {
		if r.Status == state.StatusParked {
			if st := procState(t, r.Handle.Process.PID); st != "T" {
				t.Fatalf("pool entry %s in state %s, want T (stopped)", r.ID, st)
			}
			if sw, err := proc.SwapBytes(r.Handle.Process.PID); swapFree > 1<<30 && (err != nil || sw < 1<<20) {
				t.Fatalf("pool entry %s has %d bytes in swap (%v), want all but what an exec uses", r.ID, sw, err)
			}
		}
	}
	time.Sleep(3 * time.Second) // the entries' guest clocks fall behind while stopped
	res, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "pl", N: 2,
		Net: &sandbox.NetSpec{Policy: netns.Policy{Mode: netns.ModeDeny}, Publish: []int{80}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, hits := e.PoolStats(); hits != 2 {
		t.Fatalf("%d forks took a parked VMM, want 2", hits)
	}
	for _, c := range res.Children {
		sb := c.Sandbox
		if out, code := run(t, e, sb.ID, "hostname"); code != 0 || strings.TrimSpace(out) != sb.ID {
			t.Fatalf("pooled child hostname %q (exit %d), want %s", out, code, sb.ID)
		}
		out, code := run(t, e, sb.ID, "date +%s")
		secs, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
		if code != 0 || err != nil || time.Since(time.Unix(secs, 0)).Abs() > 5*time.Second {
			t.Fatalf("pooled child's clock %q (exit %d), host %d", out, code, time.Now().Unix())
		}
		if st := procState(t, sb.Handle.Process.PID); st == "T" {
			t.Fatalf("pooled child %s still stopped", sb.ID)
		}
		var p netns.Policy
		json.Unmarshal(sb.Net.Policy, &p)
		if p.Mode != netns.ModeDeny || len(sb.Net.Ports) != 1 {
			t.Fatalf("pooled child network %+v", sb.Net)
		}
		body, err := httpGet("http://" + sb.Net.Address + "/hostname")
		if err != nil || strings.TrimSpace(body) != sb.ID {
			t.Fatalf("pooled child over the network: %q %v", body, err)
		}
		got, err := e.State().Get(sb.ID)
		if err != nil || got.Status != state.StatusRunning {
			t.Fatalf("record of %s: %+v %v", sb.ID, got, err)
		}
	}
	// The pool follows demand: after a fork of 3 (2 from the pool), it
	// refills to 3.
	waitParked(t, e, "pl", 2)
	if _, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "pl", N: 3}); err != nil {
		t.Fatal(err)
	}
	if _, hits := e.PoolStats(); hits != 4 {
		t.Fatalf("%d forks took a pool entry, want 4", hits)
	}
	waitParked(t, e, "pl", 3)
	// Children with limits never take a parked VMM.
	lim, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "pl", N: 1, Limits: &state.Limits{PIDs: 256}})
	if err != nil {
		t.Fatal(err)
	}
	if _, hits := e.PoolStats(); hits != 4 {
		t.Fatalf("a child with limits took a parked VMM (hits %d)", hits)
	}
	if _, err := e.KillAll(ctx, ""); err != nil {
		t.Fatal(err)
	}
	_ = first
	_ = lim
	// Removing the snapshot discards its parked VMMs first.
	if err := e.RemoveSnapshot("pl"); err != nil {
		t.Fatal(err)
	}
	if parked, _ := e.PoolStats(); parked["pl"] != 0 {
		t.Fatalf("parked VMMs kept after rmi: %v", parked)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, e)
}

// procState returns the state letter of pid (/proc/PID/stat field 3).
func procState(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	return f[0]
}

// waitParked waits up to two minutes until tag's pool holds n entries.
func waitParked(t *testing.T, e *sandbox.Engine, tag string, n int) {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
		parked, _ := e.PoolStats()
		if parked[tag] == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool of %s not filled to %d: %v", tag, n, parked)
		}
	}
}
