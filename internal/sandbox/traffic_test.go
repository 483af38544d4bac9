package sandbox

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestCountedWakeRetried: traffic the idle tick reads on the counter of a
// frozen sandbox without a watch is owed a wake until one works. One wake
// runs at a time; a failed one (here: the engine has no record of the
// sandbox, so no agent to reach) is tried again trafficRetry later; once
// the sandbox is awake, the tick takes the count.
func TestCountedWakeRetried(t *testing.T) {
	e := fakeEngine(t)
	var count atomic.Uint64
	count.Store(10)
	e.idle.inbound = func(int) (uint64, error) { return count.Load(), nil }
	const id = "sb-countedaaa"
	st := &idleState{frozen: true, slot: 3, inbound: 10}
	e.idle.m[id] = st
	var reclaims sync.WaitGroup
	tick := func() {
		e.idleTick(context.Background(), &reclaims)
		reclaims.Wait()
	}
	locked := func(f func()) {
		e.idle.mu.Lock()
		defer e.idle.mu.Unlock()
		f()
	}
	// settled waits for the wake in flight, if any, to end.
	settled := func() {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			waking := false
			locked(func() { waking = st.counted.waking })
			if !waking {
				return
			}
			if time.Now().After(deadline) {
				t.Fatal("a counted wake never ended")
			}
		}
	}
	wakes := func() int64 { return e.FreezeStats().TrafficWakes }

	count.Store(11)
	tick()
	settled()
	var failedAt time.Time
	var inbound uint64
	locked(func() { failedAt, inbound = st.counted.failedAt, st.inbound })
	if n := wakes(); n != 1 || failedAt.IsZero() || inbound != 10 {
		t.Fatalf("after new traffic: %d wakes, failure noted %v, count %d; want 1, true, 10 (kept while frozen)", n, !failedAt.IsZero(), inbound)
	}
	// Within trafficRetry of the failure, ticks start nothing.
	for range 3 {
		tick()
		settled()
	}
	if n := wakes(); n != 1 {
		t.Fatalf("%d wakes within %v of a failed one, want 1", n, trafficRetry)
	}
	// trafficRetry later, the tick tries again.
	locked(func() { st.counted.failedAt = time.Now().Add(-trafficRetry) })
	tick()
	settled()
	if n := wakes(); n != 2 {
		t.Fatalf("%d wakes once trafficRetry had passed, want 2", n)
	}
	// Awake (a wake worked, or a request thawed it): the tick takes the
	// count and wakes nothing.
	locked(func() { st.frozen = false })
	tick()
	settled()
	locked(func() { inbound = st.inbound })
	if n := wakes(); n != 2 || inbound != 11 {
		t.Fatalf("awake: %d wakes, count %d; want 2 and 11", n, inbound)
	}
}
