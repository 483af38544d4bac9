package netns

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
)

var errInjected = errors.New("injected failure")

// TestCreateDestroyCycles runs 200 create/destroy cycles with real taps,
// half of them made to fail at each step of Create in turn (or cancelled),
// and checks by listing the host that nothing of ours is left after each
// failure and at the end. The first 40 cycles run one at a time and are
// timed; the rest run on 4 workers at once.
func TestCreateDestroyCycles(t *testing.T) {
	setupWorld(t)
	t.Parallel()
	m := testManager(t, "fdtc", "10.180.48.0/20", false)
	var failMu sync.Mutex
	failAt := map[int]string{} // slot -> step to fail at
	m.failAt = func(slot int, step string) error {
		failMu.Lock()
		defer failMu.Unlock()
		if failAt[slot] == step {
			return errInjected
		}
		return nil
	}
	policy := Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("198.51.100.0/24"), Proto: "tcp", Ports: []PortRange{{80, 80}, {443, 443}}}}}

	var statMu sync.Mutex
	var creates, destroys []time.Duration
	cycle := func(i, slot int, timed bool) error {
		ctx := context.Background()
		var want error
		failMu.Lock()
		delete(failAt, slot)
		if i%2 == 1 {
			k := (i / 2) % (len(createSteps) + 1)
			if k < len(createSteps) {
				failAt[slot] = createSteps[k]
				want = errInjected
			} else {
				c, cancel := context.WithCancel(ctx)
				cancel()
				ctx, want = c, context.Canceled
			}
		}
		failMu.Unlock()
		t0 := time.Now()
		_, err := m.Create(ctx, slot, policy)
		dc := time.Since(t0)
		if want != nil {
			if !errors.Is(err, want) {
				return fmt.Errorf("cycle %d slot %d: create = %v, want %v", i, slot, err, want)
			}
			return slotGone(m, slot)
		}
		if err != nil {
			return fmt.Errorf("cycle %d slot %d: %v", i, slot, err)
		}
		if i%4 == 0 {
			if _, err := m.Publish(ctx, slot, 8080, "tcp"); err != nil {
				return fmt.Errorf("cycle %d slot %d: publish: %v", i, slot, err)
			}
		}
		t1 := time.Now()
		if err := m.Destroy(ctx, slot); err != nil {
			return fmt.Errorf("cycle %d slot %d: destroy: %v", i, slot, err)
		}
		dd := time.Since(t1)
		if timed {
			statMu.Lock()
			creates, destroys = append(creates, dc), append(destroys, dd)
			statMu.Unlock()
		}
		return slotGone(m, slot)
	}

	start := time.Now()
	for i := range 40 {
		if err := cycle(i, 100+i%3, true); err != nil {
			t.Fatal(err)
		}
	}
	assertNothingLeft(t, m)
	seq := time.Since(start)
	lastCreates, lastDestroys := creates, destroys

	// The usual case: other sandboxes exist, so the host table stays.
	creates, destroys = nil, nil
	mustCreate(t, m, 99, policy)
	for i := range 20 {
		if err := cycle(2*i, 100, true); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.Destroy(context.Background(), 99); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, m)
	start = time.Now()

	const workers = 4
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 40 + w; i < 200; i += workers {
				if err := cycle(i, 200+w*2+(i/workers)%2, false); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	assertNothingLeft(t, m)
	t.Logf("200 cycles: 40 sequential in %v, 160 on %d workers in %v", seq.Round(time.Millisecond), workers, time.Since(start).Round(time.Millisecond))
	t.Logf("per slot, sequential, other slots alive: create %s; destroy %s", quantiles(creates), quantiles(destroys))
	t.Logf("per slot, sequential, the only slot (host table made and removed each time): create %s; destroy %s", quantiles(lastCreates), quantiles(lastDestroys))
}

// slotGone checks by listing that slot has no namespace and no host link.
func slotGone(m *Manager, slot int) error {
	n := m.netFor(slot)
	if _, err := os.Lstat(n.NetNSPath); err == nil {
		return fmt.Errorf("slot %d: netns %s left", slot, n.NetNS)
	}
	if _, err := netlink.LinkByName(n.HostLink); err == nil {
		return fmt.Errorf("slot %d: link %s left", slot, n.HostLink)
	}
	return nil
}

func quantiles(d []time.Duration) string {
	if len(d) == 0 {
		return "n/a"
	}
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	q := func(p float64) time.Duration { return s[int(p*float64(len(s)-1))].Round(10 * time.Microsecond) }
	return fmt.Sprintf("p50 %v p90 %v max %v (n=%d)", q(0.5), q(0.9), s[len(s)-1].Round(10*time.Microsecond), len(s))
}
