package netns

import (
	"context"
	"testing"
)

// Inbound keeps each slot's counter file open: it must never read a link
// that is gone (a stale file fails, and is opened afresh), and Destroy
// closes it.
func TestInboundFollowsTheLink(t *testing.T) {
	setupWorld(t)
	t.Parallel()
	m := testManager(t, "fdtf", "10.180.96.0/20", false)
	ctx := context.Background()
	n := mustCreate(t, m, 5, DefaultPolicy)
	if _, err := m.Inbound(5); err != nil {
		t.Fatal(err)
	}
	if m.counters[5] == nil {
		t.Fatal("no counter file kept open")
	}
	// The link goes behind the manager's back: its open file fails, and
	// the open afresh finds no link.
	if err := deleteLink(n.HostLink); err != nil {
		t.Fatal(err)
	}
	if c, err := m.Inbound(5); err == nil {
		t.Fatalf("Inbound of a deleted link: %d, no error", c)
	}
	if err := m.Destroy(ctx, 5); err != nil {
		t.Fatal(err)
	}
	mustCreate(t, m, 5, DefaultPolicy)
	if _, err := m.Inbound(5); err != nil {
		t.Fatalf("Inbound of the slot made again: %v", err)
	}
	if err := m.Destroy(ctx, 5); err != nil {
		t.Fatal(err)
	}
	if len(m.counters) != 0 {
		t.Fatalf("counter files left open after Destroy: %v", m.counters)
	}
	assertNothingLeft(t, m)
}
