package sandbox

import (
	"testing"
	"time"
)

// TestCountedWakeRetried: traffic read on the counter of a frozen
// sandbox without a watch is owed a wake until one works. One wake runs at
// a time; a failed one (here: a sandbox the engine has no record of) is
// tried again trafficRetry later; once awake, the count is taken.
func TestCountedWakeRetried(t *testing.T) {
	e := fakeEngine(t)
	st := &idleState{frozen: true, slot: 3, inbound: 10}
	e.idle.m["sb-counted00"] = st
	now := time.Now()
	if !st.countInbound(11, now) {
		t.Fatal("new traffic on a frozen sandbox: no wake")
	}
	if st.countInbound(12, now) {
		t.Fatal("a second wake started while one runs")
	}
	e.wakeCounted("sb-counted00")
	if st.counted.waking || st.counted.failedAt.IsZero() {
		t.Fatalf("after a failed wake: %+v, want not waking, failure noted", st.counted)
	}
	if got := e.FreezeStats().TrafficWakes; got != 1 {
		t.Fatalf("traffic wakes %d, want 1", got)
	}
	failed := st.counted.failedAt
	if st.countInbound(12, failed.Add(trafficRetry/2)) {
		t.Fatal("retried before trafficRetry")
	}
	if st.inbound != 10 {
		t.Fatalf("a frozen sandbox's count moved to %d before it woke", st.inbound)
	}
	if !st.countInbound(12, failed.Add(trafficRetry)) {
		t.Fatal("a failed wake was not tried again")
	}
	st.frozen, st.counted.waking = false, false // the retry worked
	if st.countInbound(13, failed.Add(2*trafficRetry)) || st.inbound != 13 {
		t.Fatalf("awake: count %d, want 13 and no wake", st.inbound)
	}
}
