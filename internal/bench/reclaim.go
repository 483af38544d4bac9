package bench

import (
	"context"
	"time"

	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/sandbox"
)

// scaleReclaimed turns the idle watch's reclaim on (after d), waits until
// it has paged every child out, and turns it off; it measures their
// memory, times an exec in each (woken from paged out), measures their
// memory again, then times an exec in each woken from frozen once more
// and measures their memory; then pages them out, measures, times an exec
// in each and measures again twice more (reclaimRound).
func scaleReclaimed(ctx context.Context, e *sandbox.Engine, ids []string, pids []int, d time.Duration, r *ScaleResult, say func(string, ...any)) error {
	if d <= 0 {
		return nil
	}
	if total, free, err := proc.Swap(); err != nil {
		return err
	} else if total == 0 || free == 0 {
		say("no page-outs: this host has no swap free (scripts/zram-swap.sh)")
		return nil
	}
	say("waiting for the idle watch to freeze them and page them out (after %s)", d)
	if r.AllReclaimedMS, r.Reclaimed = pageOutAll(ctx, e, len(ids)-r.ChildrenLost, d, say); r.Reclaimed == 0 {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		say("nothing was paged out (the daemon's log says why)")
		return nil
	}
	var err error
	if r.ReclaimedMemory, err = childMemory(pids, &r.ChildrenLost); err != nil {
		return err
	}
	say("exec in each child, woken from paged out")
	before := e.FreezeStats()
	var failed int
	r.ExecReclaimed, r.ExecAwakeReclaimed, r.MeanWakeReclaimedMS, failed = execEach(ctx, e, ids, say)
	r.ExecFailed += failed
	e.WaitPageIns()
	after := e.FreezeStats()
	r.SiblingPageIns = after.SiblingPageIns - before.SiblingPageIns
	r.SiblingCodePageIns = after.SiblingCodePageIns - before.SiblingCodePageIns
	_, r.SiblingPageInMiB, r.SiblingPageInMS = pageInsSince(before, after)
	if r.AfterWakeMemory, err = childMemory(pids, &r.ChildrenLost); err != nil {
		return err
	}
	// Reclaim stays off: the daemon pages a child out once per freeze
	// of IdleReclaim, so one that is woken again sooner finds its pages
	// as the last wake left them.
	waitFrozen(ctx, e, len(ids)-r.ChildrenLost, say)
	say("exec in each child again, woken from frozen, not paged out again")
	r.ExecAfterReclaim, r.ExecAwakeAfterReclaim, r.MeanWakeAfterReclaimMS, failed = execEach(ctx, e, ids, say)
	r.ExecFailed += failed
	if r.AfterReclaimMemory, err = childMemory(pids, &r.ChildrenLost); err != nil {
		return err
	}

	say("waiting for the idle watch to page them out a second time")
	again, failed, err := reclaimRound(ctx, e, ids, pids, &r.ChildrenLost, d, "second", say)
	r.ExecFailed += failed
	if err != nil {
		return err
	}
	if r.AllReclaimedAgainMS, r.ReclaimedAgain = again.AllReclaimedMS, again.Reclaimed; again.Reclaimed == 0 {
		return nil
	}
	r.ReclaimedAgainMemory = again.Memory
	r.ExecReclaimedAgain, r.ExecAwakeReclaimedAgain, r.MeanWakeReclaimedAgainMS = again.Exec, again.ExecAwake, again.MeanWakeMS
	r.PageIns, r.PageInMiB, r.PageInMS, r.AfterWakeAgainMemory = again.PageIns, again.PageInMiB, again.PageInMS, again.AfterWakeMemory

	say("waiting for the idle watch to page them out a third time")
	third, failed, err := reclaimRound(ctx, e, ids, pids, &r.ChildrenLost, d, "third", say)
	r.ExecFailed += failed
	if err == nil && third.Reclaimed > 0 {
		r.ReclaimedThird = third
	}
	return err
}

// reclaimRound pages every child out once more (the nth time), measures
// their memory, times an exec in each, woken from paged out, and measures
// their memory again; if nothing was paged out, only how long it waited.
// It returns how many execs failed too, and counts the children whose VMM
// went away in lost.
func reclaimRound(ctx context.Context, e *sandbox.Engine, ids []string, pids []int, lost *int, d time.Duration, nth string, say func(string, ...any)) (*ReclaimRound, int, error) {
	var rr ReclaimRound
	if rr.AllReclaimedMS, rr.Reclaimed = pageOutAll(ctx, e, len(ids)-*lost, d, say); rr.Reclaimed == 0 {
		if ctx.Err() != nil {
			return nil, 0, ctx.Err()
		}
		say("nothing was paged out the %s time (the daemon's log says why)", nth)
		return &rr, 0, nil
	}
	var err error
	if rr.Memory, err = childMemory(pids, lost); err != nil {
		return nil, 0, err
	}
	say("exec in each child, woken from its %s page-out", nth)
	before := e.FreezeStats()
	var failed int
	rr.Exec, rr.ExecAwake, rr.MeanWakeMS, failed = execEach(ctx, e, ids, say)
	e.WaitPageIns()
	rr.PageIns, rr.PageInMiB, rr.PageInMS = pageInsSince(before, e.FreezeStats())
	// A woken child that read nothing back learns afresh; a failed exec
	// woke none.
	rr.Relearned = max(rr.Exec.N-int(rr.PageIns), 0)
	rr.AfterWakeMemory, err = childMemory(pids, lost)
	return &rr, failed, err
}

// pageInsSince returns how many wakes read pages back between the freeze
// stats before and after, and the mean MiB and ms each read.
func pageInsSince(before, after sandbox.FreezeStats) (n int64, mib, ms float64) {
	if n = after.PageIns - before.PageIns; n > 0 {
		mib = float64(after.PageInBytes-before.PageInBytes) / (1 << 20) / float64(n)
		ms = 1000 * (after.PageInSeconds - before.PageInSeconds) / float64(n)
	}
	return n, mib, ms
}

// pageOutAll waits until the idle watch has frozen n sandboxes, turns its
// reclaim on (after d) until it has paged all those frozen out, or none
// for half a minute (swap full), and off again: a child woken early in an
// exec round after must not be paged out again before the memory after it
// is measured. It returns how long the page-outs took, in ms, and how many
// sandboxes they left paged out; it stops waiting once ctx ends.
func pageOutAll(ctx context.Context, e *sandbox.Engine, n int, d time.Duration, say func(string, ...any)) (ms float64, reclaimed int) {
	waitFrozen(ctx, e, n, say)
	want := e.FreezeStats().Frozen
	e.SetIdleReclaim(d)
	defer e.SetIdleReclaim(0)
	start, got, grew := time.Now(), 0, time.Now()
	for got < want && time.Since(grew) < d+30*time.Second && pause(ctx) {
		if m := e.FreezeStats().Reclaimed; m > got {
			got, grew = m, time.Now()
		}
	}
	return msSince(start), e.FreezeStats().Reclaimed
}

// childMemory measures the memory of the VMMs pids still running,
// counting those gone in lost (living).
func childMemory(pids []int, lost *int) (*ChildMemory, error) {
	pids, err := living(pids, lost)
	if err != nil {
		return nil, err
	}
	var priv, swap []float64
	var sumPriv, sumSwap float64
	for _, pid := range pids {
		t, _, err := smapsPrivate(pid, "")
		if err != nil {
			return nil, err
		}
		sw, err := proc.SwapBytes(pid)
		if err != nil {
			return nil, err
		}
		p, s := float64(t)/1024, float64(sw)/(1<<20)
		priv, swap = append(priv, p), append(swap, s)
		sumPriv, sumSwap = sumPriv+p, sumSwap+s
	}
	m := &ChildMemory{PrivateMiB: Summarize(priv), SwapMiB: Summarize(swap)}
	n := float64(len(pids))
	m.ZramUsedPerOrig = zramUsedPerOrig(false)
	m.HostMiB = (sumPriv + sumSwap*m.ZramUsedPerOrig) / n
	m.ZramCompactedPerOrig = zramUsedPerOrig(true)
	m.HostCompactedMiB = (sumPriv + sumSwap*m.ZramCompactedPerOrig) / n
	return m, nil
}
