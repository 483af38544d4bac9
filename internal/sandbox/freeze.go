package sandbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/state"
)

// Idle freezing (daemon mode): a running sandbox that has had no request
// in flight, no request, no inbound network traffic and no work of its own
// (its VMM's CPU use under BusyCPU) for its idle time is frozen whole (its VMM's tasks stop in the cgroup freezer: no CPU, no
// wake-ups), and thawed by the next request of any kind before that
// request reaches the guest, or by the first packet the host sends towards
// it (a watch on its host link: netns.InboundWatch; where none can be
// made, its traffic counter read every IdlePoll). After
// a thaw the guest is told the time. A frozen sandbox keeps its memory,
// its TTL (the expirer kills it frozen or not) and its network. Idle
// reclaim (reclaim.go) pages out what sandboxes frozen long enough hold.

// DefaultIdleFreeze is forkd serve's --idle-freeze default.
const DefaultIdleFreeze = 10 * time.Second

// MaxIdleFreezeSecs bounds a sandbox's own idle-freeze time.
const MaxIdleFreezeSecs = 86400

// IdlePoll is how often the idle watch looks at the sandboxes' traffic
// and idle times: a running sandbox's inbound traffic keeps it awake, and
// wakes a frozen one whose link could not be watched within it.
const IdlePoll = 100 * time.Millisecond

// BusyCPU is the share of one host core a sandbox's VMM may use and
// still count as idle: an idle guest's VMM takes 0.2–0.7 % here (its
// timer, QEMU's loop), one that computes (a server answering a request,
// a background job) takes far more and is never frozen for it.
const BusyCPU = 0.03

// cpuWindow is how often the idle watch reads each running sandbox's CPU
// time; a freeze is decided only on such a reading, so that the window
// before a freeze was measured.
const cpuWindow = time.Second

// idleRescan is how often the idle watch reloads the list of sandboxes.
const idleRescan = 2 * time.Second

// ValidateIdleFreezeSecs checks a sandbox's own idle-freeze time.
func ValidateIdleFreezeSecs(secs int) error {
	if secs < -1 || secs > MaxIdleFreezeSecs {
		return errdefs.InvalidArgument("idle_freeze_secs = %d: want 1 to %d, 0 (the daemon's --idle-freeze) or -1 (never)", secs, MaxIdleFreezeSecs)
	}
	return nil
}

// FreezeStats count the idle watch's work since the engine started.
type FreezeStats struct {
	Frozen int `json:"frozen"` // sandboxes frozen now
	// Watched counts those of Frozen whose inbound traffic is watched
	// (netns.InboundWatch); the others' counters are read every
	// IdlePoll.
	Watched int   `json:"watched"`
	Freezes int64 `json:"freezes"` // freezes done
	Wakes   int64 `json:"wakes"`   // thaws done for a request or traffic
	// TrafficWakes counts the wakes inbound traffic asked for.
	TrafficWakes int64 `json:"traffic_wakes"`
	// WakeSeconds is the sum of the wakes' latencies (thaw and clock
	// resync), for a mean.
	WakeSeconds float64 `json:"wake_seconds"`
	// ClockSets counts the wakes after which the guest was told the time
	// (its clocksource does not follow the host's).
	ClockSets int64 `json:"clock_sets"`
	Reclaimed int   `json:"reclaimed"` // frozen sandboxes paged out now
	Reclaims  int64 `json:"reclaims"`  // page-outs that moved memory to swap
	// SwappedBytes is what the page-outs moved to swap, summed.
	SwappedBytes int64 `json:"swapped_bytes"`
	// ZramCompactions counts the compactions of zram's pools the idle
	// watch asked for, ZramCompactedBytes the RAM they freed.
	ZramCompactions    int64 `json:"zram_compactions"`
	ZramCompactedBytes int64 `json:"zram_compacted_bytes"`
	// PageIns counts the wakes that read a paged-out sandbox's pages
	// back (while its guest ran), PageInBytes what they read and
	// PageInSeconds how long that took, summed.
	PageIns       int64   `json:"page_ins"`
	PageInBytes   int64   `json:"page_in_bytes"`
	PageInSeconds float64 `json:"page_in_seconds"`
	// SiblingPageIns counts those of PageIns that followed a sandbox's
	// first page-out and read back what a sibling's wake used;
	// SiblingCodePageIns those of them that found the sibling's
	// translated code by block in the sandbox's own code buffer
	// (proc.CodeLayout), not by offset.
	SiblingPageIns     int64 `json:"sibling_page_ins"`
	SiblingCodePageIns int64 `json:"sibling_code_page_ins"`
}

// idleState is what the idle watch knows of one sandbox.
type idleState struct {
	last    time.Time     // last request, or inbound traffic
	busy    int           // requests holding it awake
	after   time.Duration // its idle time; 0: never frozen
	pid     proc.Identity
	slot    int // network slot, -1 for none
	inbound uint64
	// counted is the wake owed for traffic read on the counter of a
	// frozen sandbox that has no watch (countInbound).
	counted countedWake
	// watch, while it is frozen, wakes it on the first packet for it
	// (nil: none could be made, and the idle watch reads its counter).
	watch *netns.InboundWatch
	// cpu is the VMM's CPU time at cpuAt (zero: not read since the
	// sandbox joined the watch or was frozen).
	cpu    time.Duration
	cpuAt  time.Time
	frozen bool
	// frozenAt is when it was frozen, gen counts its freezes; tried is
	// set once a page-out of its VMM started during this freeze, and
	// reclaimed once one moved memory to swap. swapped is set once any
	// page-out of it moved memory to swap.
	frozenAt                  time.Time
	gen                       uint64
	tried, reclaimed, swapped bool
	// hot is what the page-out during this freeze found resident, when
	// it was not the first page-out of the sandbox, for the wake to
	// read back (nil: nothing). readBack is set when the last page-out
	// left pages for the wake after it to read back: what is resident
	// at the next one then includes all it read, used or not. learned
	// is what was resident at the last page-out after a wake that did
	// not read back its own set (the pages the guest touched, and after
	// a first wake that read a sibling's, those of the sibling's it did
	// not use), in bytes.
	// pagingIn is set while a wake's read-back runs: no page-out starts
	// before it ends.
	hot      []proc.Span
	readBack bool
	learned  uint64
	pagingIn bool
	// snap names the sandbox's siblings (its snapshot, and whether it
	// has a disk: another VMM layout), for idler.siblings. firstOut is
	// set when the page-out during this freeze was the sandbox's first:
	// nothing is known of what its wake will want but what a sibling's
	// did. learn is set by a wake from a first page-out that found no
	// sibling's notes: once the request ends, what it faulted back is
	// noted for its siblings.
	snap            string
	firstOut, learn bool
	// code is the layout of the VMM's code buffer, read at its first
	// page-out (the whole buffer resident then), until the wake after it
	// has read back a sibling's pages by it or noted its own for them.
	code proc.CodeLayout
	// resync is set by a thaw: the next client of the sandbox tells the
	// guest the time first (takeClock). setting is open while a client
	// does; the clients after it wait for it to close.
	resync  bool
	setting chan struct{}
}

// idler holds the idle state of the daemon's sandboxes.
type idler struct {
	mu    sync.Mutex            // guards m, stats
	m     map[string]*idleState // by sandbox id
	stats FreezeStats
	locks keyedLocks // serialise freeze and thaw of a sandbox
	// reclaiming is set while page-outs run (one at a time); noSwap
	// when the last one found the host's swap full or absent, at
	// swapChecked; cannot once the kernel refused page-outs for good
	// (too old, or not permitted). Guarded by mu.
	reclaiming, noSwap, cannot bool
	swapChecked                time.Time
	// reclaimAfter is Config.IdleReclaim, or what SetIdleReclaim set.
	// Guarded by mu.
	reclaimAfter time.Duration
	// unwatched is set by SetTrafficWatch(false): a freeze makes no
	// watch and the idle tick reads the counter; setClock by
	// SetClockAfterWake(true). Guarded by mu.
	unwatched, setClock bool
	// compactDue is when a paged-out sandbox woke or went with no zram
	// compaction since (zero: none due); compacting is set while one
	// runs, compacted is when the last one started, and noCompact once
	// one failed (zram too old, or not there). Guarded by mu.
	compactDue, compacted time.Time
	compacting, noCompact bool
	// siblings holds, by idleState.snap, what the first wake from a
	// first page-out among sandboxes of that snapshot faulted back
	// (read once its request ended), for the others' first wakes to
	// read back; noting holds the snapshots whose notes are being taken.
	// Kept while sandboxes of the snapshot run. Guarded by mu.
	siblings map[string]proc.Notes
	noting   map[string]bool
	// pageOut, resident, pageIn, swapFree, swapsToZram and compact are
	// proc.PageOut, proc.ResidentAnon, proc.PageIn, the host's free
	// swap, proc.SwapsToZram and proc.CompactZramSwap; noteResident,
	// place and codeLayout are proc.NoteResident, proc.Place and
	// proc.ReadCodeLayout; inbound is the network manager's Inbound.
	// Unit tests replace them.
	pageOut      func(proc.Identity, func() bool) (int64, error)
	resident     func(proc.Identity, uint64, int) ([]proc.Span, error)
	pageIn       func(proc.Identity, []proc.Span) (int64, error)
	swapFree     func() (uint64, error)
	swapsToZram  func() (bool, error)
	compact      func() (int, int64, error)
	noteResident func(proc.Identity, uint64, int) (proc.Notes, error)
	place        func(proc.Identity, proc.Notes, proc.CodeLayout) ([]proc.Span, error)
	codeLayout   func(proc.Identity) (proc.CodeLayout, error)
	inbound      func(slot int) (uint64, error)
}

// compactLater notes that pages left zram's pool, now: a compaction is
// due. Called with mu held.
func (d *idler) compactLater(now time.Time) {
	if d.compactDue.IsZero() {
		d.compactDue = now
	}
}

// hostSwapFree returns the host's free swap.
func hostSwapFree() (uint64, error) {
	_, free, err := proc.Swap()
	return free, err
}

// canFreeze reports whether the engine freezes idle sandboxes.
func (e *Engine) canFreeze() bool {
	return e.cfg.Daemon && e.cfg.IdleFreeze > 0 && e.cfg.Cgroups != nil && e.cfg.Cgroups.CanFreeze()
}

// idleTime is sb's idle time before a freeze; 0 for never.
func (e *Engine) idleTime(sb *state.Sandbox) time.Duration {
	switch {
	case sb.IdleFreezeSecs < 0:
		return 0
	case sb.IdleFreezeSecs > 0:
		return time.Duration(sb.IdleFreezeSecs) * time.Second
	}
	return e.cfg.IdleFreeze
}

// FreezeStats returns the idle watch's counters.
func (e *Engine) FreezeStats() FreezeStats {
	e.idle.mu.Lock()
	defer e.idle.mu.Unlock()
	s := e.idle.stats
	for _, st := range e.idle.m {
		if st.frozen {
			s.Frozen++
			if st.watch != nil {
				s.Watched++
			}
			if st.reclaimed {
				s.Reclaimed++
			}
		}
	}
	return s
}

// isFrozen reports whether the daemon froze sandbox id.
func (e *Engine) isFrozen(id string) bool {
	e.idle.mu.Lock()
	defer e.idle.mu.Unlock()
	st := e.idle.m[id]
	return st != nil && st.frozen
}

// showFrozen makes a running sandbox the daemon froze show as frozen.
func (e *Engine) showFrozen(sb *state.Sandbox) {
	if sb.Status == state.StatusRunning && e.isFrozen(sb.ID) {
		sb.Status = state.StatusFrozen
	}
}

// hold keeps sandbox id awake until the returned release: it thaws it if
// it was frozen and counts it busy, so that the idle watch leaves it
// alone. clock is what it owes the guest's clock: the guest was frozen
// since a client last told it the time (clock.set), or another client is
// telling it (clock.wait). request says that the hold is a client's request to
// the guest, which ends with the release: only such a wake is noted for
// the sandbox's siblings (a wake by inbound traffic ends before the guest
// has handled it, and a branch reads all the guest's memory).
func (e *Engine) hold(id string, request bool) (release func(), clock wakeClock, err error) {
	if !e.canFreeze() {
		return func() {}, clock, nil
	}
	unlock := e.idle.locks.lock(id)
	defer unlock()
	e.idle.mu.Lock()
	st := e.idle.m[id]
	if st == nil {
		st = &idleState{slot: -1}
		e.idle.m[id] = st
	}
	st.busy++
	st.last = time.Now()
	frozen := st.frozen
	e.idle.mu.Unlock()
	release = func() {
		e.idle.mu.Lock()
		learn := false
		var code proc.CodeLayout
		if st.busy--; st.busy == 0 {
			st.last = time.Now()
			learn, st.learn = st.learn, false
			if learn {
				code, st.code = st.code, proc.CodeLayout{}
			}
		}
		e.idle.mu.Unlock()
		if learn {
			go e.noteSiblings(id, st, code)
		}
	}
	if frozen {
		if err := e.thaw(id, st, request); err != nil {
			release()
			return nil, clock, err
		}
	}
	e.idle.mu.Lock()
	clock = st.takeClock()
	e.idle.mu.Unlock()
	return release, clock, nil
}

// thaw thaws sandbox id's VMM, and starts reading back the pages its
// last page-out found resident, if this freeze paged it out, or after a
// first page-out those a sibling's first wake used (idler.siblings).
// request is hold's. Called with id's lock in e.idle.locks held.
func (e *Engine) thaw(id string, st *idleState, request bool) error {
	if err := e.cfg.Cgroups.Thaw(id); err != nil {
		return fmt.Errorf("wake sandbox %s: %w", id, err)
	}
	e.idle.mu.Lock()
	st.frozen, st.resync = false, true
	e.idle.stats.Wakes++
	w := st.takeWatch()
	if st.reclaimed {
		e.idle.compactLater(time.Now())
	}
	// After a first page-out nothing is known of what this guest will
	// want but what a sibling's first wake faulted back, if one did; if
	// none did yet, this wake is noted for them if it is a request's.
	var notes proc.Notes
	if st.hot == nil && st.firstOut && st.snap != "" {
		n, ok := e.idle.siblings[st.snap]
		switch {
		case ok:
			// The next page-out learns what is resident then as this
			// wake's set, what it read back and did not use with it.
			notes = n
		case request && !e.idle.noting[st.snap]:
			st.learn = true
		}
	}
	st.firstOut = false
	code := st.code
	if !st.learn {
		st.code = proc.CodeLayout{}
	}
	pageIn := st.hot != nil || notes.Bytes() > 0
	if pageIn {
		st.pagingIn = true
	}
	e.idle.mu.Unlock()
	w.Close()
	if pageIn {
		go func() {
			e.pageInHot(id, st, notes, code)
			e.idle.mu.Lock()
			st.pagingIn = false
			e.idle.mu.Unlock()
		}()
	}
	return nil
}

// WaitPageIns waits until no watched sandbox's read-back runs
// (FreezeStats counts one once it has ended), polling: for the bench and
// tests.
func (e *Engine) WaitPageIns() {
	for e.pagingIn() {
		time.Sleep(5 * time.Millisecond)
	}
}

// pagingIn reports whether a watched sandbox's read-back runs.
func (e *Engine) pagingIn() bool {
	e.idle.mu.Lock()
	defer e.idle.mu.Unlock()
	for _, st := range e.idle.m {
		if st.pagingIn {
			return true
		}
	}
	return false
}

// forgetIdle drops sandbox id from the idle watch, thawing its VMM first
// if it was frozen (a task frozen by cgroup v1 ignores SIGKILL). One
// whose thaw fails stays in the watch, frozen, for a later request or
// kill to thaw.
func (e *Engine) forgetIdle(id string) error {
	if e.cfg.Cgroups == nil || !e.cfg.Cgroups.CanFreeze() {
		return nil
	}
	defer e.idle.locks.lock(id)()
	if err := e.cfg.Cgroups.Thaw(id); err != nil {
		return err
	}
	e.idle.mu.Lock()
	st := e.idle.m[id]
	if st != nil && st.swapped {
		e.idle.compactLater(time.Now())
	}
	var w *netns.InboundWatch
	if st != nil {
		w = st.takeWatch()
	}
	delete(e.idle.m, id)
	e.idle.mu.Unlock()
	w.Close()
	return nil
}

// RunIdle freezes idle sandboxes and wakes frozen ones that get inbound
// traffic, until ctx ends; then it thaws every sandbox it froze, so that
// commands without the daemon find them running. Without a freezer (no
// root, no cgroup freezer) or with Config.IdleFreeze 0 it returns at once.
func (e *Engine) RunIdle(ctx context.Context) {
	if !e.canFreeze() {
		if e.cfg.Daemon && e.cfg.IdleFreeze > 0 {
			e.log.Warn("idle sandboxes are not frozen: this host has no cgroup freezer forkd can use (root and cgroup v1 freezer or v2)")
		}
		return
	}
	defer e.thawAll()
	var reclaims sync.WaitGroup
	defer reclaims.Wait()
	tick := time.NewTicker(IdlePoll)
	defer tick.Stop()
	var scanned time.Time
	for {
		if time.Since(scanned) >= idleRescan {
			e.rescanIdle()
			scanned = time.Now()
		}
		e.idleTick(ctx, &reclaims)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// rescanIdle brings the idle watch's list in line with the state store:
// running sandboxes join it, gone ones leave it.
func (e *Engine) rescanIdle() {
	list, err := e.state.List()
	if err != nil {
		e.log.Warn("idle watch: list sandboxes", "err", err)
		return
	}
	now := time.Now()
	seen := map[string]bool{}
	var gone []*netns.InboundWatch // closed once mu is released
	defer func() {
		for _, w := range gone {
			w.Close()
		}
	}()
	e.idle.mu.Lock()
	defer e.idle.mu.Unlock()
	for _, sb := range list {
		if sb.Status != state.StatusRunning {
			continue
		}
		seen[sb.ID] = true
		st := e.idle.m[sb.ID]
		if st == nil {
			st = &idleState{last: now, slot: -1}
			e.idle.m[sb.ID] = st
		}
		st.after, st.pid, st.snap = e.idleTime(sb), sb.Handle.Process, siblingsOf(sb)
		if sb.Net != nil && e.cfg.Net != nil {
			st.slot = sb.Net.Slot
		}
	}
	for id, st := range e.idle.m {
		switch {
		case seen[id] || st.busy > 0:
			// A sandbox held by a request may not be recorded yet.
		case !st.frozen:
			delete(e.idle.m, id)
		case !proc.Alive(st.pid):
			// Its VMM died frozen (cgroup v2 lets SIGKILL through):
			// nothing is left to wake, and its kill finds no entry.
			gone = append(gone, st.takeWatch())
			delete(e.idle.m, id)
		}
	}
	snaps := map[string]bool{}
	for _, st := range e.idle.m {
		snaps[st.snap] = true
	}
	for snap := range e.idle.siblings {
		if !snaps[snap] {
			delete(e.idle.siblings, snap)
		}
	}
}

// siblingsOf returns the key of sb's siblings in idler.siblings: VMMs
// restored from the same snapshot with the same devices.
func siblingsOf(sb *state.Sandbox) string {
	if sb.Disk != nil {
		return sb.Snapshot + "+disk"
	}
	return sb.Snapshot
}

// idleTick wakes frozen sandboxes with new inbound traffic, freezes the
// running ones idle for their time and starts paging out the ones frozen
// for their reclaim time (in reclaims).
func (e *Engine) idleTick(ctx context.Context, reclaims *sync.WaitGroup) {
	now := time.Now()
	var freeze, wake []string
	var reclaim []reclaimJob
	e.idle.mu.Lock()
	pick := e.idle.reclaimAfter > 0 && !e.idle.reclaiming && !e.idle.cannot && (!e.idle.noSwap || now.Sub(e.idle.swapChecked) >= reclaimRetry)
	for id, st := range e.idle.m {
		if st.slot >= 0 && st.watch == nil {
			if n, err := e.idle.inbound(st.slot); err == nil && n != st.inbound {
				st.last = now
				if st.countInbound(n, now) {
					wake = append(wake, id)
				}
				continue
			}
		}
		if pick && e.reclaimable(st, now) {
			reclaim = append(reclaim, reclaimJob{id, st.pid, st.gen})
		}
		if st.frozen || st.busy > 0 || st.after <= 0 || st.pid.PID == 0 || now.Sub(st.cpuAt) < cpuWindow {
			continue
		}
		switch working, known := e.working(st, now); {
		case working:
			st.last = now
		case known && now.Sub(st.last) >= st.after:
			freeze = append(freeze, id)
		}
	}
	if len(reclaim) > 0 {
		e.idle.reclaiming = true
		reclaims.Go(func() { e.reclaim(ctx, reclaim) })
	}
	if d := &e.idle; !d.compactDue.IsZero() && !d.compacting && !d.noCompact &&
		now.Sub(d.compactDue) >= zramCompactDelay && now.Sub(d.compacted) >= zramCompactEvery {
		d.compactDue, d.compacting, d.compacted = time.Time{}, true, now
		reclaims.Go(e.compactZram)
	}
	e.idle.mu.Unlock()
	for _, id := range wake {
		go e.wakeCounted(id)
	}
	for _, id := range freeze {
		if err := e.freeze(id); err != nil {
			e.log.Warn("idle watch: freeze", "sandbox", id, "err", err)
		}
	}
}

// working reads st's VMM's CPU time and reports whether it used more than
// BusyCPU since the last reading; known is false when there was no
// reading to compare with (or the VMM is gone). Called with e.idle.mu
// held.
func (e *Engine) working(st *idleState, now time.Time) (working, known bool) {
	cpu, err := proc.CPUTime(st.pid)
	prev, prevAt := st.cpu, st.cpuAt
	st.cpu, st.cpuAt = cpu, now
	if err != nil || prevAt.IsZero() {
		return false, false
	}
	return float64(cpu-prev) > BusyCPU*float64(now.Sub(prevAt)), true
}

// freeze freezes sandbox id if it is still idle.
func (e *Engine) freeze(id string) error {
	defer e.idle.locks.lock(id)()
	e.idle.mu.Lock()
	st := e.idle.m[id]
	if st == nil || st.frozen || st.busy > 0 || time.Since(st.last) < st.after {
		e.idle.mu.Unlock()
		return nil
	}
	pid, slot, seen := st.pid, st.slot, st.inbound
	e.idle.mu.Unlock()
	// A calling client would wait on a frozen guest: freeze only a
	// sandbox whose daemon client has nothing pending.
	if c := e.cachedClient(id); c != nil && c.Pending() > 0 {
		return nil
	}
	// The pid is the VMM's only while its start time matches, before and
	// after it moves into the freezer.
	if !proc.Alive(pid) {
		return nil
	}
	w, busy := e.watchInbound(id, slot, seen)
	if busy {
		return nil
	}
	if err := e.cfg.Cgroups.Freeze(id, pid.PID); err != nil {
		w.Close()
		return err
	}
	if !proc.Alive(pid) {
		w.Close()
		return errors.Join(errdefs.NotFound("sandbox %s: its VMM went away while it was frozen", id), e.cfg.Cgroups.Thaw(id))
	}
	e.idle.mu.Lock()
	st.watch = w
	st.frozen, st.cpuAt, st.frozenAt = true, time.Time{}, time.Now()
	st.gen++
	st.tried, st.reclaimed, st.hot, st.firstOut, st.learn = false, false, nil, false, false
	st.code = proc.CodeLayout{}
	st.counted.failedAt = time.Time{}
	e.idle.stats.Freezes++
	e.idle.mu.Unlock()
	e.log.Debug("sandbox frozen", "sandbox", id, "watched", w != nil)
	if w != nil {
		go e.watchTraffic(id, st, w)
	}
	return nil
}

// thawAll thaws every sandbox the idle watch froze.
func (e *Engine) thawAll() {
	e.idle.mu.Lock()
	var ids []string
	for id, st := range e.idle.m {
		if st.frozen {
			ids = append(ids, id)
		}
	}
	e.idle.mu.Unlock()
	for _, id := range ids {
		unlock := e.idle.locks.lock(id)
		if err := e.cfg.Cgroups.Thaw(id); err != nil {
			e.log.Warn("thaw at shutdown", "sandbox", id, "err", err)
		}
		e.idle.mu.Lock()
		var w *netns.InboundWatch
		if st := e.idle.m[id]; st != nil {
			st.frozen, st.hot = false, nil
			w = st.takeWatch()
		}
		e.idle.mu.Unlock()
		w.Close()
		unlock()
	}
}
