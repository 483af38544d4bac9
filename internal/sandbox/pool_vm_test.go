package sandbox_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/netns"
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
	deadline := time.Now().Add(time.Minute)
	for {
		parked, _ := e.PoolStats()
		if parked["pl"] == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool not filled: %v", parked)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if list, _ := e.List(ctx); len(list) != 1 {
		t.Fatalf("parked VMMs listed as sandboxes: %d listed", len(list))
	}
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
	// Children with limits never take a parked VMM.
	lim, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "pl", N: 1, Limits: &state.Limits{PIDs: 256}})
	if err != nil {
		t.Fatal(err)
	}
	if _, hits := e.PoolStats(); hits != 2 {
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
