package sandbox

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/vmm"
)

// TestPublishCapPerSandbox: one sandbox may publish at most the engine's
// cap of host ports (the default here), so it cannot take the whole range
// from the others; the cap holds under concurrent publishes, and
// publishing a port again still answers its host port. Root: the slots
// are real network namespaces with their nftables maps (no VM: the
// sandbox records stand for running ones).
func TestPublishCapPerSandbox(t *testing.T) {
	testutil.RequireRoot(t)
	ctx := context.Background()
	nm, err := netns.New(netns.Options{Prefix: "fdtp", Network: netip.MustParsePrefix("10.180.112.0/20"),
		Ports: netns.PortRange{First: 28700, Last: 28799}})
	if err != nil {
		t.Fatal(err)
	}
	reclaim := func() {
		if err := nm.Reclaim(ctx, func(int) bool { return false }); err != nil {
			t.Errorf("reclaim: %v", err)
		}
	}
	reclaim()
	t.Cleanup(reclaim)
	e, err := New(Config{DataDir: t.TempDir(), Backend: fakeBackend{}, Daemon: true, Net: nm})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	limit := DefaultMaxPortsPerSandbox
	vmmProc := sleeper(t)
	sandbox := func(id string, slot int) {
		if _, err := nm.Create(ctx, slot, netns.DefaultPolicy); err != nil {
			t.Fatal(err)
		}
		testutil.Check(t, e.state.Put(&state.Sandbox{ID: id, Status: state.StatusRunning,
			Handle: vmm.Handle{Backend: "fake", Process: vmmProc}, Net: &state.Network{Slot: slot}}))
	}
	sandbox("sb-aaaaaaaaaa", 0)
	sandbox("sb-bbbbbbbbbb", 1)
	sandbox("sb-cccccccccc", 2)

	// One after another: the range has 100 ports; a takes only its cap.
	for port := 1000; port < 1100; port++ {
		_, err := e.Publish(ctx, "sb-aaaaaaaaaa", port)
		switch {
		case port < 1000+limit && err != nil:
			t.Fatalf("publish %d of a: %v", port, err)
		case port >= 1000+limit && (!errdefs.IsResourceExhausted(err) || !strings.Contains(err.Error(), fmt.Sprintf("%d ports, the limit per sandbox", limit))):
			t.Fatalf("publish %d of a: %v, want ResourceExhausted naming the cap %d", port, err, limit)
		}
	}
	// Publishing a port again still answers, even at the cap.
	again, err := e.Publish(ctx, "sb-aaaaaaaaaa", 1000)
	if err != nil {
		t.Fatalf("publish 1000 of a again: %v", err)
	}

	// At once: of 3×limit concurrent publishes, exactly limit pass, and
	// each repeats a port by two callers at once.
	var mu sync.Mutex
	ok := map[int]int{} // guest port -> host port
	var wg sync.WaitGroup
	for i := range 3 * limit {
		wg.Add(1)
		go func() {
			defer wg.Done()
			port := 2000 + i/2
			p, err := e.Publish(ctx, "sb-bbbbbbbbbb", port)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				if hp, seen := ok[port]; seen && hp != p.HostPort {
					t.Errorf("port %d published twice at once: host ports %d and %d", port, hp, p.HostPort)
				}
				ok[port] = p.HostPort
			case !errdefs.IsResourceExhausted(err):
				t.Errorf("publish %d of b: %v", port, err)
			}
		}()
	}
	wg.Wait()
	if len(ok) != limit {
		t.Errorf("%d ports of b published at once, want the cap %d", len(ok), limit)
	}

	// What is recorded and what the host holds agree, without duplicates.
	for i, id := range []string{"sb-aaaaaaaaaa", "sb-bbbbbbbbbb"} {
		sb, err := e.Get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[int]bool{}
		for _, p := range sb.Net.Ports {
			if seen[p.GuestPort] {
				t.Errorf("%s records port %d twice", id, p.GuestPort)
			}
			seen[p.GuestPort] = true
			if id == "sb-aaaaaaaaaa" && p.GuestPort == 1000 && p.HostPort != again.HostPort {
				t.Errorf("port 1000 of a: recorded %d, answered %d", p.HostPort, again.HostPort)
			}
		}
		info, err := nm.Info(ctx, i)
		if err != nil {
			t.Fatal(err)
		}
		if len(sb.Net.Ports) != limit || len(info.Published) != limit {
			t.Errorf("%s: %d ports recorded, %d on the host, want %d", id, len(sb.Net.Ports), len(info.Published), limit)
		}
	}
	// The range is not gone: a third sandbox still publishes.
	if _, err := e.Publish(ctx, "sb-cccccccccc", 80); err != nil {
		t.Errorf("a third sandbox cannot publish: %v", err)
	}
}
