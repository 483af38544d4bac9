package sandbox

import (
	"context"
	"testing"
	"time"
)

// After a thaw the first hold tells the guest the time and the holds that
// come meanwhile wait for it; a setting that failed (an agent that did not
// answer) is taken on by the next hold; a sandbox forgotten meanwhile (a
// kill) releases its waiters all the same.
func TestWakeClockHandOff(t *testing.T) {
	e := fakeEngine(t)
	st := &idleState{slot: -1, resync: true}
	e.idle.m["a"] = st
	take := func() wakeClock {
		e.idle.mu.Lock()
		defer e.idle.mu.Unlock()
		return st.takeClock()
	}
	released := func(c wakeClock) bool {
		select {
		case <-c.wait:
			return true
		default:
			return false
		}
	}
	first := take()
	if first.set == nil || first.wait != nil {
		t.Fatalf("the first hold after a thaw: %+v, want the clock to set", first)
	}
	second := take()
	if second.set != nil || second.wait == nil || released(second) {
		t.Fatalf("a hold while the clock is set: %+v, want to wait", second)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := e.settleClock(ctx, "a", nil, second, time.Now()); err == nil {
		t.Fatal("a waiting hold whose request ended did not fail")
	}
	e.clockDone("a", first, false)
	if !released(second) {
		t.Fatal("a waiting hold was not released when the setting failed")
	}
	third := take() // what the released hold takes on
	if third.set == nil {
		t.Fatalf("after a failed setting the next hold got %+v, want the clock to set", third)
	}
	fourth := take()
	done := make(chan error, 1)
	go func() { done <- e.settleClock(context.Background(), "a", nil, fourth, time.Now()) }()
	e.clockDone("a", third, true)
	if err := <-done; err != nil {
		t.Fatalf("a hold waiting for a setting that worked: %v", err)
	}
	if c := take(); c.set != nil || c.wait != nil {
		t.Fatalf("the clock is owed again once set: %+v", c)
	}
	e.clockDone("a", wakeClock{}, false) // nothing taken: nothing to do

	st.resync = true
	setter, waiter := take(), take()
	delete(e.idle.m, "a")
	e.clockDone("a", setter, true)
	if !released(waiter) {
		t.Fatal("a forgotten sandbox's waiting hold was not released")
	}
}
