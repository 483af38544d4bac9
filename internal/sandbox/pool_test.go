package sandbox

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/testutil"
)

// A parked VMM that fails to become a child is discarded, and what goes
// wrong while it is rolled back comes back with the failure, which keeps
// its class.
func TestRestoreParkedRollsBack(t *testing.T) {
	ctx := context.Background()
	snap := &snapshot.Snapshot{Metadata: snapshot.Metadata{Tag: "t"}}
	boom := errors.New("discard failed")
	parked := func(t *testing.T, e *Engine) (*parkedVMM, *fakeParked) {
		f := &fakeParked{discarded: make(chan struct{}), discardErr: boom}
		pk := &parkedVMM{p: f, sb: &state.Sandbox{ID: newID(), Status: state.StatusParked}, snap: snap}
		testutil.Check(t, e.state.Put(pk.sb))
		return pk, f
	}
	discarded := func(t *testing.T, f *fakeParked) {
		t.Helper()
		select {
		case <-f.discarded:
		default:
			t.Error("VMM not discarded")
		}
	}

	t.Run("wake", func(t *testing.T) {
		e := fakeEngine(t)
		pk, f := parked(t, e)
		pk.sb.Handle.Process = gone(t) // the stopped VMM died meanwhile
		sb := &state.Sandbox{ID: newID(), Status: state.StatusStarting}
		_, err := e.restoreParked(ctx, ForkSpec{Net: &NetSpec{}}, sb, pk)
		if !errdefs.IsNotFound(err) || !errors.Is(err, boom) {
			t.Fatalf("restoreParked = %v, want the wake's failure (its class kept) and the discard's", err)
		}
		discarded(t, f)
		// The record was renamed: it is the caller's to release.
		if _, err := e.state.Get(sb.ID); err != nil {
			t.Errorf("child's record: %v", err)
		}
	})

	t.Run("rename", func(t *testing.T) {
		e := fakeEngine(t)
		pk, f := parked(t, e)
		taken := &state.Sandbox{ID: newID(), Status: state.StatusRunning}
		testutil.Check(t, e.state.Put(taken))
		_, err := e.restoreParked(ctx, ForkSpec{Net: &NetSpec{}}, &state.Sandbox{ID: taken.ID}, pk)
		if !errdefs.IsAlreadyExists(err) || !errors.Is(err, boom) {
			t.Fatalf("restoreParked = %v, want the rename's failure (its class kept) and the discard's", err)
		}
		discarded(t, f)
		// Nothing is the caller's: the parked record went with its VMM.
		if _, err := e.state.Get(pk.sb.ID); !errdefs.IsNotFound(err) {
			t.Errorf("parked record: %v, want it removed", err)
		}
		if _, err := e.state.Get(taken.ID); err != nil {
			t.Errorf("the other sandbox's record: %v", err)
		}
	})
}

// Once the pool is closed (the engine closing), a fork that ends late
// refills nothing: no VMM would be parked that nobody discards.
func TestPoolRefillAfterClose(t *testing.T) {
	e := fakeEngine(t)
	p := testPool(e, 2, 8)
	testutil.Check(t, p.close())
	p.refill(&snapshot.Snapshot{Metadata: snapshot.Metadata{Tag: "t"}}, 1)
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.recent) != 0 || len(p.filling) != 0 {
		t.Fatalf("refill after close: recent %v, filling %d", p.recent, len(p.filling))
	}
}

// testPool is a pool as newPool makes it, without its trimmer.
func testPool(e *Engine, size, limit int) *pool {
	return &pool{e: e, size: size, max: limit, slots: make(chan struct{}, 1), stop: make(chan struct{}),
		entries: map[string][]*parkedVMM{}, filling: map[string]chan struct{}{}, demand: map[string]poolDemand{}}
}

// A snapshot's pool follows its largest fork of the last ten minutes, up
// to the bound over all pools, and shrinks back to the base size once
// that demand is older; what the trim takes off is discarded.
func TestPoolFollowsDemand(t *testing.T) {
	e := fakeEngine(t)
	p := testPool(e, 2, 10)
	now := time.Now()
	p.recent = []string{"t"}
	p.noteDemandLocked("t", 6, now)
	p.noteDemandLocked("t", 3, now.Add(time.Minute)) // smaller, recent: kept at 6
	if got := p.targetLocked("t", now.Add(2*time.Minute)); got != 6 {
		t.Fatalf("target after forks of 6 and 3 = %d, want 6", got)
	}
	p.noteDemandLocked("t", 50, now)
	if got := p.targetLocked("t", now); got != 10 {
		t.Fatalf("target after a fork of 50 = %d, want the bound 10", got)
	}
	p.noteDemandLocked("t", 6, now)
	if got := p.targetLocked("other", now); got != 2 {
		t.Fatalf("target of a snapshot without demand = %d, want the base 2", got)
	}
	var fakes []*fakeParked
	for range 6 {
		f := &fakeParked{discarded: make(chan struct{})}
		fakes = append(fakes, f)
		p.entries["t"] = append(p.entries["t"], &parkedVMM{p: f, sb: &state.Sandbox{ID: newID()}})
	}
	p.trim(now.Add(time.Minute))
	if n := len(p.entries["t"]); n != 6 {
		t.Fatalf("trim within the window left %d entries, want 6", n)
	}
	p.trim(now.Add(poolDemandWindow + time.Second))
	if n := len(p.entries["t"]); n != 2 {
		t.Fatalf("trim after the window left %d entries, want 2", n)
	}
	closed := 0
	for _, f := range fakes {
		select {
		case <-f.discarded:
			closed++
		default:
		}
	}
	if closed != 4 {
		t.Fatalf("%d entries discarded, want the 4 trimmed", closed)
	}
	// A fork after the window sets the demand anew, smaller or not.
	p.noteDemandLocked("t", 3, now.Add(poolDemandWindow+time.Second))
	if got := p.targetLocked("t", now.Add(poolDemandWindow+time.Second)); got != 3 {
		t.Fatalf("target after a later fork of 3 = %d, want 3", got)
	}
}
