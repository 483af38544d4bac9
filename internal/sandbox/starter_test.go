package sandbox

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/vmm"
)

// sleeper starts a process that stands for a forkd starter or a VMM and
// returns its identity; it is killed and reaped when the test ends.
func sleeper(t *testing.T) proc.Identity {
	t.Helper()
	cmd := exec.Command("sleep", "600")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	id, err := proc.Self(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// gone returns the identity of a process that has exited.
func gone(t *testing.T) proc.Identity {
	t.Helper()
	cmd := exec.Command("sleep", "600")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	id, err := proc.Self(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	cmd.Process.Kill()
	cmd.Wait()
	return id
}

// A record being made belongs to its starter while the starter lives: kill
// refuses it, kill --all passes it by, and reconcile leaves another live
// process's records alone but aborts those whose starter crashed, killing
// their VMM even when only the run dir names it.
func TestInFlightRecordsBelongToTheirStarter(t *testing.T) {
	e := fakeEngine(t)
	ctx := context.Background()
	other, crashed, vmmProc := sleeper(t), gone(t), sleeper(t)
	rec := func(id, status string, starter *proc.Identity, vmmID proc.Identity) *state.Sandbox {
		dir := filepath.Join(e.runDir, id)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		sb := &state.Sandbox{ID: id, Status: status, Starter: starter,
			Handle: vmm.Handle{Backend: "fake", RunDir: dir, Process: vmmID}}
		if err := e.state.Put(sb); err != nil {
			t.Fatal(err)
		}
		return sb
	}
	mine := rec("sb-mineaaaaaa", state.StatusStarting, starter(), proc.Identity{})
	elsewhere := rec("sb-otheraaaaa", state.StatusStarting, &other, proc.Identity{})
	abandoned := rec("sb-crashaaaaa", state.StatusStarting, &crashed, proc.Identity{})
	build := rec("sb-buildaaaaa", state.StatusBuilding, &crashed, vmmProc)

	for _, sb := range []*state.Sandbox{mine, elsewhere} {
		if err := e.Kill(ctx, sb.ID); !errdefs.IsFailedPrecondition(err) {
			t.Errorf("Kill of %s, in flight = %v, want refused", sb.ID, err)
		}
	}
	killed, err := e.KillAll(ctx, "")
	if err != nil || !slices.Equal(killed, []string{abandoned.ID}) {
		t.Fatalf("KillAll = %v, %v; want only the abandoned child", killed, err)
	}
	if _, err := e.state.Get(mine.ID); err != nil {
		t.Fatalf("in-flight record gone after KillAll: %v", err)
	}

	rep, err := e.Reconcile(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Our own starting record cannot be in flight while we reconcile (a
	// daemon reconciles before it forks), so it is aborted too.
	if !slices.Equal(rep.Aborted, []string{mine.ID}) {
		t.Errorf("aborted %v, want %v", rep.Aborted, []string{mine.ID})
	}
	if proc.Alive(vmmProc) {
		t.Error("VMM of a build whose starter crashed still runs")
	}
	for id, want := range map[string]bool{mine.ID: false, elsewhere.ID: true, build.ID: false} {
		_, err := e.state.Get(id)
		if kept := err == nil; kept != want {
			t.Errorf("record %s kept = %v, want %v", id, kept, want)
		}
		if _, err := os.Stat(filepath.Join(e.runDir, id)); (err == nil) != want {
			t.Errorf("run dir %s kept = %v, want %v", id, err == nil, want)
		}
	}
}

// Agent calls on ids that name nothing leave no per-sandbox state behind
// in a long-running daemon.
func TestUnknownIDsLeaveNoDialLock(t *testing.T) {
	e := fakeEngine(t)
	for _, id := range []string{"sb-aaaaaaaaaa", "sb-bbbbbbbbbb", "sb-cccccccccc"} {
		if _, _, err := e.Agent(context.Background(), id); !errdefs.IsNotFound(err) {
			t.Fatalf("Agent(%s) = %v, want not found", id, err)
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.dials.held() != 0 || len(e.conns) != 0 {
		t.Fatalf("%d dial locks, %d clients left for unknown ids", e.dials.held(), len(e.conns))
	}
}

// The expirer's reclaim works from a record read at the start of its pass;
// once a kill has released and removed that record, the stale copy must
// release nothing (its slot may be a new child's by then).
func TestStaleReclaimReleasesNothing(t *testing.T) {
	e := fakeEngine(t)
	dir := filepath.Join(e.runDir, "sb-deadaaaaaa")
	testutil.MkdirAll(t, dir, 0o700)
	sb := &state.Sandbox{ID: "sb-deadaaaaaa", Status: state.StatusDead, Handle: vmm.Handle{Backend: "fake", RunDir: dir}}
	if err := e.state.Put(sb); err != nil {
		t.Fatal(err)
	}
	stale := *sb
	if err := e.Kill(context.Background(), sb.ID); err != nil {
		t.Fatal(err)
	}
	// Something new where the dead sandbox's resources were.
	testutil.MkdirAll(t, dir, 0o700)
	NewExpirer(e).reclaim(&stale)
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("stale reclaim released what is no longer the dead sandbox's: %v", err)
	}
	if e.ends.held() != 0 {
		t.Fatalf("%d end locks left", e.ends.held())
	}
}

// fakeParked is a parked VMM that records being discarded (and fails to
// be, with discardErr).
type fakeParked struct {
	h          vmm.Handle
	discarded  chan struct{}
	discardErr error
}

func (f *fakeParked) Handle() vmm.Handle { return f.h }
func (f *fakeParked) Restore(context.Context, vmm.RestoreSpec) (vmm.Machine, error) {
	return nil, errdefs.NotImplemented("fake")
}
func (f *fakeParked) Discard(context.Context) error { close(f.discarded); return f.discardErr }

// The pool hands out only a live VMM parked for this very snapshot: one
// parked for an earlier snapshot of the tag, or one that died, is
// discarded and the child restores from scratch.
func TestPoolTakesOnlyLiveVMMsOfThisSnapshot(t *testing.T) {
	e := fakeEngine(t)
	p := testPool(e, 4, 16)
	now := time.Now()
	snap := &snapshot.Snapshot{Metadata: snapshot.Metadata{Tag: "t", Created: now, ContentHash: "new"}}
	older := &snapshot.Snapshot{Metadata: snapshot.Metadata{Tag: "t", Created: now.Add(-time.Hour), ContentHash: "old"}}
	entry := func(s *snapshot.Snapshot, id proc.Identity) *parkedVMM {
		f := &fakeParked{h: vmm.Handle{Process: id}, discarded: make(chan struct{})}
		return &parkedVMM{p: f, sb: &state.Sandbox{ID: newID(), Handle: f.h}, snap: s}
	}
	live := sleeper(t)
	good := entry(snap, live)
	stale, dead := entry(older, live), entry(snap, gone(t))
	p.entries["t"] = []*parkedVMM{good, stale, dead} // taken from the end
	if got := p.take(snap, ForkSpec{}); got != good {
		t.Fatalf("take = %+v, want the live VMM of this snapshot", got)
	}
	for _, pk := range []*parkedVMM{stale, dead} {
		select {
		case <-pk.p.(*fakeParked).discarded:
		case <-time.After(10 * time.Second):
			t.Fatalf("VMM parked for %s (pid %d) not discarded", pk.snap.ContentHash, pk.sb.Handle.Process.PID)
		}
	}
	if got := p.take(snap, ForkSpec{}); got != nil {
		t.Fatalf("take from an empty pool = %+v", got)
	}
}
