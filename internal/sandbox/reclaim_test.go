package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/cgroup"
	"github.com/forkd/forkd/internal/proc"
)

// The idle watch pages out a sandbox frozen for its reclaim time, once a
// freeze, never one being woken or read back; a wake stops a page-out
// under way; full swap pauses it and a kernel that refuses it turns it
// off. The page-out and the host's swap are fakes here (TestIdleFreezeVM
// pages out real VMMs).
func TestIdleReclaim(t *testing.T) {
	e := fakeEngine(t)
	var mu sync.Mutex
	var calls []int
	result := func(proc.Identity, func() bool) (int64, error) { return 30 << 20, nil }
	e.idle.pageOut = func(id proc.Identity, keep func() bool) (int64, error) {
		mu.Lock()
		calls = append(calls, id.PID)
		f := result
		mu.Unlock()
		return f(id, keep)
	}
	free := uint64(1 << 30)
	e.idle.swapFree = func() (uint64, error) { return free, nil }
	e.SetIdleReclaim(time.Minute)
	long := time.Now().Add(-2 * time.Minute)
	frozen := func(pid int, since time.Time) *idleState {
		return &idleState{frozen: true, frozenAt: since, gen: 1, slot: -1, pid: proc.Identity{PID: pid, StartTime: 1}}
	}
	e.idle.m["a"] = frozen(1, long)
	e.idle.m["busy"] = frozen(2, long)
	e.idle.m["busy"].busy = 1
	e.idle.m["recent"] = frozen(3, time.Now())
	e.idle.m["reading"] = frozen(4, long)
	e.idle.m["reading"].pagingIn = true // its last wake's read-back runs
	tick := func() []int {
		t.Helper()
		mu.Lock()
		calls = nil
		mu.Unlock()
		var wg sync.WaitGroup
		e.idleTick(context.Background(), &wg)
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		return append([]int(nil), calls...)
	}
	want := func(got []int, pids ...int) {
		t.Helper()
		if fmt.Sprint(got) != fmt.Sprint(pids) {
			t.Fatalf("paged out %v, want %v", got, pids)
		}
	}

	want(tick(), 1)
	if st := e.FreezeStats(); st.Reclaimed != 1 || st.Reclaims != 1 || st.SwappedBytes != 30<<20 {
		t.Fatalf("stats %+v after one page-out", st)
	}
	want(tick()) // once a freeze

	// A new freeze of the same sandbox is paged out again, once its
	// reclaim time has passed.
	e.idle.m["a"].gen, e.idle.m["a"].frozenAt, e.idle.m["a"].tried, e.idle.m["a"].reclaimed = 2, long, false, false
	// A wake that starts during the page-out stops it: not counted.
	result = func(_ proc.Identity, keep func() bool) (int64, error) {
		e.idle.mu.Lock()
		e.idle.m["a"].busy = 1
		e.idle.mu.Unlock()
		if keep() {
			t.Error("keep() true for a sandbox being woken")
		}
		return 0, proc.ErrStopped
	}
	want(tick(), 1)
	if st := e.FreezeStats(); st.Reclaimed != 0 || st.Reclaims != 1 {
		t.Fatalf("stats %+v after a page-out a wake stopped", st)
	}

	// Nothing moved (a cgroup with no swap allowed): tried, not counted.
	e.idle.m["a"].busy, e.idle.m["a"].gen, e.idle.m["a"].tried = 0, 3, false
	result = func(proc.Identity, func() bool) (int64, error) { return 0, nil }
	want(tick(), 1)
	if st := e.FreezeStats(); st.Reclaimed != 0 || st.Reclaims != 1 {
		t.Fatalf("stats %+v after a page-out that moved nothing", st)
	}

	// Full swap: nothing is paged out, and nothing is tried for 10 s.
	e.idle.m["recent"].frozenAt = long
	free = 100 << 20
	want(tick())
	free = 1 << 30
	want(tick())
	e.idle.swapChecked = time.Now().Add(-reclaimRetry)
	result = func(proc.Identity, func() bool) (int64, error) { return 1 << 20, nil }
	want(tick(), 3)

	// Once its read-back has ended, the other is paged out too.
	e.idle.m["reading"].pagingIn = false
	want(tick(), 4)

	// A kernel that refuses process_madvise turns page-outs off.
	e.idle.m["a"].gen, e.idle.m["a"].tried = 4, false
	result = func(proc.Identity, func() bool) (int64, error) {
		return 0, fmt.Errorf("page out: %w", unix.ENOSYS)
	}
	want(tick(), 1)
	e.idle.m["a"].gen, e.idle.m["a"].tried = 5, false
	want(tick())
}

// The idle watch compacts zram's pools zramCompactDelay after a paged-out
// sandbox woke or went, at most once every zramCompactEvery, counts what
// that freed (not when no zram is swap), and stops after a failure. The
// compaction is a fake here (TestIdleFreezeVM asks the host's zram).
func TestIdleZramCompact(t *testing.T) {
	e := fakeEngine(t)
	var calls int
	devices, freed, fail := 1, int64(3<<20), error(nil)
	e.idle.compact = func() (int, int64, error) {
		calls++
		return devices, freed, fail
	}
	tick := func(want int) {
		t.Helper()
		calls = 0
		var wg sync.WaitGroup
		e.idleTick(context.Background(), &wg)
		wg.Wait()
		if calls != want {
			t.Fatalf("%d compactions, want %d", calls, want)
		}
	}
	tick(0) // none due
	now := time.Now()
	e.idle.compactLater(now)
	tick(0) // due, but pages may still be coming back
	e.idle.compactLater(now.Add(time.Second))
	if !e.idle.compactDue.Equal(now) {
		t.Fatalf("due at %v after a second wake, want the first's %v", e.idle.compactDue, now)
	}
	e.idle.compactDue = now.Add(-zramCompactDelay)
	tick(1)
	if st := e.FreezeStats(); st.ZramCompactions != 1 || st.ZramCompactedBytes != 3<<20 {
		t.Fatalf("stats %+v after one compaction", st)
	}
	tick(0) // done: none due

	// Due again soon after: it waits for zramCompactEvery.
	e.idle.compactLater(now.Add(-zramCompactDelay))
	tick(0)
	e.idle.compacted = now.Add(-zramCompactEvery)
	devices = 0 // no zram swap now: not counted
	tick(1)
	if st := e.FreezeStats(); st.ZramCompactions != 1 {
		t.Fatalf("stats %+v after a compaction of no device", st)
	}

	// A failure turns it off.
	devices, fail = 1, errors.New("write /sys/block/zram0/compact: permission denied")
	e.idle.compactLater(now.Add(-zramCompactDelay))
	e.idle.compacted = time.Time{}
	tick(1)
	e.idle.compactLater(now.Add(-zramCompactDelay))
	tick(0)
	if st := e.FreezeStats(); st.ZramCompactions != 1 {
		t.Fatalf("stats %+v after a failed compaction", st)
	}
}

// From a sandbox's second page-out on, the idle watch notes its VMM's
// resident pages first, and the wake after that page-out reads them back,
// once; once the set has grown by more than a quarter over the last one
// learned from a wake that faulted on demand, one wake faults on demand
// again; a page-out a wake stopped keeps nothing for it. The page-outs
// and the reads are fakes here (TestIdleFreezeVM wakes a real VMM from
// its second and third page-outs; proc's tests read a real process back).
func TestIdleWakePageIn(t *testing.T) {
	e := fakeEngine(t)
	mib := func(n uint64) []proc.Span { return []proc.Span{{Start: 0x10000, Len: n << 20}} }
	spans := mib(8)
	var resident, pagedIn int
	var residentErr, pageInErr error
	e.idle.swapFree = func() (uint64, error) { return 1 << 30, nil }
	pageOut := func(proc.Identity, func() bool) (int64, error) { return 30 << 20, nil }
	e.idle.pageOut = func(id proc.Identity, keep func() bool) (int64, error) { return pageOut(id, keep) }
	e.idle.resident = func(_ proc.Identity, maxBytes uint64, maxRuns int) ([]proc.Span, error) {
		resident++
		if maxBytes != wakePageInMax || maxRuns != wakePageInRuns {
			t.Errorf("resident pages read with bounds %d bytes, %d runs; want %d, %d", maxBytes, maxRuns, wakePageInMax, wakePageInRuns)
		}
		return spans, residentErr
	}
	var got []proc.Span
	e.idle.pageIn = func(_ proc.Identity, hot []proc.Span) (int64, error) {
		pagedIn++
		got = hot
		return int64(hot[0].Len), pageInErr
	}
	e.SetIdleReclaim(time.Minute)
	st := &idleState{frozen: true, frozenAt: time.Now().Add(-2 * time.Minute), gen: 1, slot: -1, pid: proc.Identity{PID: 1, StartTime: 1}}
	e.idle.m["a"] = st
	// cycle freezes st anew (the gen'th freeze), ticks the idle watch
	// once and wakes it twice (the second wake reads nothing): it checks
	// how often the resident pages were read and how often read back.
	cycle := func(gen uint64, wantResident, wantPagedIn int) {
		t.Helper()
		resident, pagedIn, got = 0, 0, nil
		st.frozen, st.gen, st.tried, st.reclaimed, st.hot = true, gen, false, false, nil
		var wg sync.WaitGroup
		e.idleTick(context.Background(), &wg)
		wg.Wait()
		e.pageInHot("a", st, proc.Notes{}, proc.CodeLayout{})
		e.pageInHot("a", st, proc.Notes{}, proc.CodeLayout{})
		if resident != wantResident || pagedIn != wantPagedIn {
			t.Fatalf("page-out %d: resident pages read %d times, read back %d; want %d and %d", gen, resident, pagedIn, wantResident, wantPagedIn)
		}
		if pagedIn > 0 && fmt.Sprint(got) != fmt.Sprint(spans) {
			t.Fatalf("page-out %d: read back %v, want %v", gen, got, spans)
		}
	}
	cycle(1, 0, 0) // the first: nothing known
	cycle(2, 1, 1) // learns 8 MiB
	if s := e.FreezeStats(); s.PageIns != 1 || s.PageInBytes != 8<<20 || s.PageInSeconds <= 0 {
		t.Fatalf("stats %+v after one wake that read back", s)
	}
	spans = mib(10) // what it read, and a little more: kept
	cycle(3, 1, 1)
	spans = mib(11) // more than a quarter over 8 MiB: learn afresh
	cycle(4, 1, 0)
	cycle(5, 1, 1) // learned 11 MiB
	spans = mib(13)
	cycle(6, 1, 1)
	// A page-out a wake stopped keeps nothing.
	pageOut = func(proc.Identity, func() bool) (int64, error) { return 0, proc.ErrStopped }
	cycle(7, 1, 0)
	pageOut = func(proc.Identity, func() bool) (int64, error) { return 30 << 20, nil }
	// A read-back that fails is not counted.
	pageInErr = errors.New("process_vm_readv: boom")
	before := e.FreezeStats().PageIns
	cycle(8, 1, 1)
	if s := e.FreezeStats(); s.PageIns != before {
		t.Fatalf("stats %+v after a failed read-back, want %d page-ins", s, before)
	}
	// Resident pages that cannot be read: paged out all the same.
	pageInErr, residentErr, spans = nil, errors.New("read pagemap: boom"), nil
	cycle(9, 1, 0)
	if !st.reclaimed {
		t.Fatal("not paged out when its resident pages could not be read")
	}
}

// A wake from a page-out that noted pages thaws first and reads them back
// beside the guest: the idle watch pages the sandbox out again only once
// that read-back has ended, and WaitPageIns waits for it. The read-back
// is a fake here, and so is the thaw (a manager without a freezer).
func TestThawReadsBackBeside(t *testing.T) {
	e := fakeEngine(t)
	e.cfg.Cgroups = &cgroup.Manager{}
	release := make(chan struct{})
	started := make(chan []proc.Span, 1)
	e.idle.pageIn = func(_ proc.Identity, hot []proc.Span) (int64, error) {
		started <- hot
		<-release
		return int64(hot[0].Len), nil
	}
	e.idle.pageOut = func(proc.Identity, func() bool) (int64, error) {
		t.Error("paged out while its read-back ran")
		return 0, nil
	}
	e.idle.swapFree = func() (uint64, error) { return 1 << 30, nil }
	e.SetIdleReclaim(time.Minute)
	hot := []proc.Span{{Start: 0x10000, Len: 4 << 20}}
	st := &idleState{frozen: true, reclaimed: true, hot: hot, gen: 1, slot: -1, pid: proc.Identity{PID: 1, StartTime: 1}}
	e.idle.m["a"] = st
	if err := e.thaw("a", st, true); err != nil {
		t.Fatal(err)
	}
	if got := <-started; fmt.Sprint(got) != fmt.Sprint(hot) {
		t.Fatalf("read back %v, want %v", got, hot)
	}
	// Frozen again and past its reclaim time while the read-back runs.
	e.idle.mu.Lock()
	if st.frozen || !st.pagingIn || st.hot != nil {
		t.Errorf("during the read-back: frozen %v, pagingIn %v, hot %v", st.frozen, st.pagingIn, st.hot)
	}
	st.frozen, st.frozenAt, st.gen, st.tried = true, time.Now().Add(-2*time.Minute), 2, false
	e.idle.mu.Unlock()
	var wg sync.WaitGroup
	e.idleTick(context.Background(), &wg)
	wg.Wait()
	done := make(chan struct{})
	go func() { e.WaitPageIns(); close(done) }()
	select {
	case <-done:
		t.Fatal("WaitPageIns returned while a read-back ran")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	<-done
	e.idle.mu.Lock()
	paging := st.pagingIn
	e.idle.mu.Unlock()
	if s := e.FreezeStats(); paging || s.PageIns != 1 || s.PageInBytes != 4<<20 || s.Wakes != 1 {
		t.Fatalf("after the read-back: pagingIn %v, stats %+v", paging, s)
	}
	// Now it may be paged out.
	var paged bool
	e.idle.pageOut = func(proc.Identity, func() bool) (int64, error) { paged = true; return 1 << 20, nil }
	e.idleTick(context.Background(), &wg)
	wg.Wait()
	if !paged {
		t.Fatal("not paged out once its read-back had ended")
	}
}

// After a first page-out, nothing is known of what a wake will want: the
// first sandbox of a snapshot to wake from one faults on demand, and is
// noted once its request ends; its siblings' first wakes read back the
// same pages of their VMMs, and their next page-outs learn what is
// resident as their own set; a sandbox of another snapshot does not. Page-outs and read-backs are fakes here;
// the notes are taken of this test's own process, and placed in it
// (TestIdleFreezeVM wakes a real VMM with a sibling's notes).
func TestSiblingPageIn(t *testing.T) {
	e := fakeEngine(t)
	e.cfg.Cgroups = &cgroup.Manager{}
	self, err := proc.Self(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	page := os.Getpagesize()
	m, err := unix.Mmap(-1, 0, 8*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	used := []proc.Span{{Start: uint64(uintptr(unsafe.Pointer(&m[0]))), Len: uint64(4 * page)}}
	e.idle.resident = func(proc.Identity, uint64, int) ([]proc.Span, error) { return used, nil }
	e.idle.noteResident = func(id proc.Identity, _ uint64, _ int) (proc.Notes, error) { return proc.Note(id, used) }
	var mu sync.Mutex
	var read [][]proc.Span
	e.idle.pageIn = func(_ proc.Identity, spans []proc.Span) (int64, error) {
		mu.Lock()
		defer mu.Unlock()
		read = append(read, spans)
		return int64(spans[0].Len), nil
	}
	e.idle.pageOut = func(proc.Identity, func() bool) (int64, error) { return 30 << 20, nil }
	e.idle.swapFree = func() (uint64, error) { return 1 << 30, nil }
	e.SetIdleReclaim(time.Minute)
	long := time.Now().Add(-2 * time.Minute)
	sandbox := func(snap string) *idleState {
		return &idleState{frozen: true, frozenAt: long, gen: 1, slot: -1, pid: self, snap: snap}
	}
	a, b, c, d := sandbox("s"), sandbox("s"), sandbox("other"), sandbox("s")
	e.idle.m["a"], e.idle.m["b"], e.idle.m["c"], e.idle.m["d"] = a, b, c, d
	var wg sync.WaitGroup
	e.idleTick(context.Background(), &wg)
	wg.Wait()
	if !a.firstOut || !b.firstOut || !c.firstOut || !d.firstOut {
		t.Fatalf("first page-outs not marked: %v %v %v %v", a.firstOut, b.firstOut, c.firstOut, d.firstOut)
	}
	wakeFor := func(id string, st *idleState, request bool) {
		t.Helper()
		if err := e.thaw(id, st, request); err != nil {
			t.Fatal(err)
		}
		e.WaitPageIns()
	}
	wake := func(id string, st *idleState) { t.Helper(); wakeFor(id, st, true) }

	// A wake that is no request's (inbound traffic, a branch) is not
	// noted: its hold ends before the guest has done the work.
	wakeFor("d", d, false)
	if d.learn || len(read) != 0 || e.idle.noting["s"] {
		t.Fatalf("a wake for traffic: learn %v, read back %v, noting %v", d.learn, read, e.idle.noting["s"])
	}

	wake("a", a)
	if !a.learn || len(read) != 0 {
		t.Fatalf("first wake of the snapshot: learn %v, read back %v", a.learn, read)
	}
	e.noteSiblings("a", a, proc.CodeLayout{}) // what its request's release starts
	if n := e.idle.siblings["s"]; n.Bytes() != uint64(4*page) {
		t.Fatalf("noted %d bytes for the siblings, want %d", n.Bytes(), 4*page)
	}

	wake("b", b)
	if fmt.Sprint(read) != fmt.Sprint([][]proc.Span{used}) {
		t.Fatalf("sibling's wake read back %v, want %v", read, used)
	}
	if s := e.FreezeStats(); s.SiblingPageIns != 1 || s.PageIns != 1 {
		t.Fatalf("stats %+v after a sibling's wake", s)
	}
	if b.learn || b.readBack {
		t.Fatalf("after a sibling's wake: learn %v, readBack %v", b.learn, b.readBack)
	}

	// Another snapshot's sandbox learns for its own siblings.
	wake("c", c)
	if len(read) != 1 || !c.learn {
		t.Fatalf("another snapshot's wake: read back %v, learn %v", read, c.learn)
	}

	// A sandbox's second page-out is no first: it learns what is
	// resident then as its own set, the sibling's pages with it.
	b.frozen, b.frozenAt, b.gen, b.tried = true, long, 2, false
	e.idleTick(context.Background(), &wg)
	wg.Wait()
	if b.firstOut || fmt.Sprint(b.hot) != fmt.Sprint(used) || b.learned != uint64(4*page) {
		t.Fatalf("second page-out: firstOut %v, hot %v, learned %d", b.firstOut, b.hot, b.learned)
	}

	// Notes stay while a sandbox of their snapshot is watched, and go
	// once none is (these are in no state store: they leave the watch
	// once awake).
	e.rescanIdle()
	if _, ok := e.idle.siblings["s"]; !ok {
		t.Fatal("siblings' notes dropped while a sibling is frozen")
	}
	wake("b", b)
	e.rescanIdle()
	if len(e.idle.siblings) != 0 {
		t.Fatalf("siblings' notes kept with no sandbox left: %v", e.idle.siblings)
	}
}

// The idle watch drops a frozen sandbox that is no longer recorded
// running once its VMM is gone (one killed while frozen: cgroup v2 lets
// SIGKILL through), and keeps one whose VMM still runs (being killed, or
// its record not written yet).
func TestRescanDropsFrozenDead(t *testing.T) {
	e := fakeEngine(t)
	self, err := proc.Self(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	e.idle.m["dead"] = &idleState{frozen: true, slot: -1, pid: proc.Identity{PID: self.PID, StartTime: self.StartTime + 1}}
	e.idle.m["alive"] = &idleState{frozen: true, slot: -1, pid: self}
	e.idle.m["idle"] = &idleState{slot: -1, pid: self}
	e.rescanIdle()
	_, dead := e.idle.m["dead"]
	_, alive := e.idle.m["alive"]
	_, idle := e.idle.m["idle"]
	if dead || !alive || idle {
		t.Fatalf("after a rescan: dead kept %v, alive kept %v, unfrozen unrecorded kept %v; want false, true, false", dead, alive, idle)
	}
}
