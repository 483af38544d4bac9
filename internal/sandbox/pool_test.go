package sandbox

import (
	"context"
	"errors"
	"testing"

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

	t.Run("restore", func(t *testing.T) {
		e := fakeEngine(t)
		pk, f := parked(t, e)
		sb := &state.Sandbox{ID: newID(), Status: state.StatusStarting}
		// fakeParked's Restore fails (not implemented).
		_, err := e.restoreParked(ctx, snap, ForkSpec{Net: &NetSpec{}}, sb, pk)
		if !errdefs.IsNotImplemented(err) || !errors.Is(err, boom) {
			t.Fatalf("restoreParked = %v, want the restore's failure (its class kept) and the discard's", err)
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
		_, err := e.restoreParked(ctx, snap, ForkSpec{Net: &NetSpec{}}, &state.Sandbox{ID: taken.ID}, pk)
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
	p := &pool{e: e, size: 2, entries: map[string][]*parkedVMM{}, filling: map[string]chan struct{}{}}
	testutil.Check(t, p.close())
	p.refill(&snapshot.Snapshot{Metadata: snapshot.Metadata{Tag: "t"}})
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.recent) != 0 || len(p.filling) != 0 {
		t.Fatalf("refill after close: recent %v, filling %d", p.recent, len(p.filling))
	}
}
