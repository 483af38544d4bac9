package sandbox

import (
	"context"
	"errors"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
)

// Idle reclaim: once a sandbox has stayed frozen for IdleReclaim, the
// idle watch pages its VMM's private memory out (proc.PageOut), to the
// host's swap: compressed in RAM with zram (scripts/zram-swap.sh). The
// next wake faults back what the guest touches; the rest stays out. A
// fault costs a trap per page (~22 µs on a 2-core TCG host, ~4,600 of
// them for an exec), so from its second page-out on, the idle watch first
// notes which pages of the VMM are resident: those its guest touched
// since the page-out before. The next wake reads them back (proc.PageIn,
// about 5 µs a page) beside the thawed guest. What a read-back brought in
// is resident at the next page-out whether the guest used it or not, and
// nothing here tells which it used; so once the set has grown by more
// than a quarter over the last one learned from a wake that faulted on
// demand, the idle watch notes nothing for one wake, which faults on
// demand again, and the page-out after it learns afresh.
// A first page-out knows nothing of what the wake after it will want:
// the whole VMM is resident then. Sandboxes of one snapshot want much the
// same pages of their VMMs, though (on a 2-core TCG host 16.8-17.1 of
// the 18.5-19.2 MiB one exec faulted back, at the same offsets of the
// same mappings): the first of them to wake from its first page-out
// faults on demand (so does any other woken before it is noted), and
// once its request has ended the idle watch notes what it
// has resident, by mapping and offset (proc.NoteResident); the first wakes of
// the others read those pages of theirs back (proc.Place), beside the
// guest. Translated code is the exception: each VMM's code buffer holds
// the same blocks in another order, so the notes name the blocks on the
// noted pages (Notes.WithCode), and a sibling reads back the pages its
// own buffer has them on, by the layout of that buffer the idle watch
// read before its first page-out (proc.ReadCodeLayout). Their next
// page-outs learn what is resident then, the pages of the sibling's they
// did not use with it, as their own.
// Pages faulted back (and those of a paged-out sandbox that goes) leave
// holes in zram's pool, which takes RAM until compacted: the idle watch
// asks zram to compact its pools a while after such a wake or kill
// (zramCompactDelay), at most once every zramCompactEvery.

// DefaultIdleReclaim is forkd serve's --idle-reclaim default: an agent
// idle this long does not notice the next wake's page-ins (about 0.1 s).
const DefaultIdleReclaim = time.Minute

// reclaimSwapFree is the free swap below which the idle watch pages
// nothing out: a VMM holds some tens of MiB.
const reclaimSwapFree = 256 << 20

// zramCompactDelay is how long after a paged-out sandbox woke (or went)
// the idle watch compacts zram's pools: its guest has faulted back what
// its request touched by then. zramCompactEvery bounds how often: a
// compaction walks the whole pool.
const (
	zramCompactDelay = 5 * time.Second
	zramCompactEvery = 30 * time.Second
)

// wakePageInMax and wakePageInRuns bound what a wake reads back (and
// what the idle watch keeps for it: 16 bytes a run): a sandbox that
// touched more since its last page-out faults its pages in as it needs
// them.
const (
	wakePageInMax  = 64 << 20
	wakePageInRuns = 4096
)

// reclaimJob names a frozen sandbox to page out, during its gen'th
// freeze.
type reclaimJob struct {
	id  string
	pid proc.Identity
	gen uint64
}

// reclaimable reports whether st has been frozen for its reclaim time,
// nothing is waking it or still reading its pages back, and no page-out
// was tried during this freeze. Called with e.idle.mu held.
func (e *Engine) reclaimable(st *idleState, now time.Time) bool {
	return st.frozen && !st.tried && st.busy == 0 && !st.pagingIn && st.pid.PID != 0 && e.idle.reclaimAfter > 0 && now.Sub(st.frozenAt) >= e.idle.reclaimAfter
}

// stillFrozen reports whether j's sandbox is still in j's freeze, with
// nothing waking it. Called with e.idle.mu held.
func (e *Engine) stillFrozen(j reclaimJob) bool {
	st := e.idle.m[j.id]
	return st != nil && st.frozen && st.gen == j.gen && st.pid == j.pid && st.busy == 0 && e.idle.reclaimAfter > 0
}

// SetIdleReclaim changes how long the idle watch leaves a sandbox frozen
// before it pages it out (Config.IdleReclaim; 0 never), for sandboxes
// frozen now too. For benchmarks, which measure without it first.
func (e *Engine) SetIdleReclaim(d time.Duration) {
	e.idle.mu.Lock()
	defer e.idle.mu.Unlock()
	e.idle.reclaimAfter = d
}

// reclaimRetry is how long the idle watch waits to look for swap again
// after finding none free.
const reclaimRetry = 10 * time.Second

// reclaim pages out the VMMs of jobs one after the other, each only while
// its sandbox stays in the freeze it was picked in, and only while the
// host has swap free, until ctx ends. A page-out stops as soon as its
// sandbox is being woken, so a request never waits on it; it is tried
// once a freeze.
func (e *Engine) reclaim(ctx context.Context, jobs []reclaimJob) {
	defer func() {
		e.idle.mu.Lock()
		e.idle.reclaiming = false
		e.idle.mu.Unlock()
	}()
	for _, j := range jobs {
		if ctx.Err() != nil {
			return
		}
		free, err := e.idle.swapFree()
		e.idle.mu.Lock()
		warn := free < reclaimSwapFree && !e.idle.noSwap
		e.idle.noSwap, e.idle.swapChecked = free < reclaimSwapFree, time.Now()
		st := e.idle.m[j.id]
		still := !e.idle.noSwap && st != nil && e.stillFrozen(j) && e.reclaimable(st, time.Now())
		again, readBack, learned := false, false, uint64(0)
		if still {
			st.tried, again, readBack, learned = true, st.swapped, st.readBack, st.learned
		}
		e.idle.mu.Unlock()
		if warn {
			e.log.Warn("idle sandboxes' memory is not reclaimed while the host's swap is full or absent (scripts/zram-swap.sh gives it compressed swap in RAM)", "swap_free_mib", free>>20, "err", err)
		}
		if free < reclaimSwapFree {
			return
		}
		if !still {
			continue
		}
		// What the last wake brought back, and the guest touched since:
		// what the next wake will want. A first page-out finds the whole
		// VMM resident, which tells nothing.
		var hot []proc.Span
		var code proc.CodeLayout
		if again {
			hot, learned = e.hotSet(j, readBack, learned)
		} else {
			code = e.readCodeLayout(j)
		}
		moved, err := e.idle.pageOut(j.pid, func() bool {
			e.idle.mu.Lock()
			defer e.idle.mu.Unlock()
			return ctx.Err() == nil && e.stillFrozen(j)
		})
		switch {
		case errors.Is(err, unix.ENOSYS), errors.Is(err, unix.EPERM), errors.Is(err, unix.EACCES):
			e.idle.mu.Lock()
			e.idle.cannot = true
			e.idle.mu.Unlock()
			e.log.Warn("idle sandboxes' memory is not reclaimed: the kernel refuses process_madvise (Linux 5.10 or later, and CAP_SYS_NICE, needed)", "err", err)
			return
		case errors.Is(err, proc.ErrStopped), errdefs.IsNotFound(err):
			continue
		case err != nil:
			e.log.Warn("idle watch: page out", "sandbox", j.id, "err", err)
			continue
		}
		e.idle.mu.Lock()
		// Nothing moved: a cgroup that allows it no swap (cgroup v2 with
		// a memory limit sets memory.swap.max 0), or nothing left to go.
		if moved > 0 {
			if e.idle.m[j.id] == st && e.stillFrozen(j) {
				st.reclaimed, st.hot, st.learned = true, hot, learned
				st.readBack, st.firstOut, st.code = hot != nil, !again, code
			}
			st.swapped = true
			e.idle.stats.Reclaims++
			e.idle.stats.SwappedBytes += moved
		}
		e.idle.mu.Unlock()
		e.log.Debug("sandbox paged out", "sandbox", j.id, "moved_mib", moved>>20)
	}
}

// compactZram compacts the pools of the zram devices the host swaps to
// (none: nothing to count), and counts the RAM that freed. The first
// failure turns it off, with a warning.
func (e *Engine) compactZram() {
	n, freed, err := e.idle.compact()
	e.idle.mu.Lock()
	e.idle.compacting = false
	e.idle.noCompact = err != nil
	if err == nil && n > 0 {
		e.idle.stats.ZramCompactions++
		e.idle.stats.ZramCompactedBytes += freed
	}
	e.idle.mu.Unlock()
	if err != nil {
		e.log.Warn("zram's pools are not compacted: the RAM pages swapped back in took stays taken until the kernel compacts them", "err", err)
		return
	}
	e.log.Debug("compacted zram", "freed_mib", freed>>20)
}

// hotSet returns the runs of j's VMM's resident anonymous pages, for its
// next wake to read back, and what is learned of its working set (in
// bytes): all of them after a wake that did not read back (readBack
// false); nil, to learn afresh, once they have grown by more than a
// quarter over learned since.
func (e *Engine) hotSet(j reclaimJob, readBack bool, learned uint64) ([]proc.Span, uint64) {
	spans, err := e.idle.resident(j.pid, wakePageInMax, wakePageInRuns)
	if err != nil {
		if !errdefs.IsNotFound(err) {
			e.log.Warn("idle watch: read a VMM's resident pages", "sandbox", j.id, "err", err)
		}
		return nil, learned
	}
	var size uint64
	for _, s := range spans {
		size += s.Len
	}
	switch {
	case spans == nil:
		return nil, learned
	case !readBack:
		return spans, size
	case size > learned+learned/4:
		return nil, learned
	}
	return spans, learned
}

// readCodeLayout reads the layout of the code buffer of j's VMM, before
// its first page-out: a sibling's notes find their translated code in it
// at its first wake (proc.CodeLayout). Without one (a KVM guest has no
// code buffer) they find it by offset.
func (e *Engine) readCodeLayout(j reclaimJob) proc.CodeLayout {
	code, err := e.idle.codeLayout(j.pid)
	switch {
	case errors.Is(err, proc.ErrNoCodeBuffer), errdefs.IsNotFound(err):
	case err != nil:
		e.log.Warn("idle watch: read the layout of a VMM's translated code", "sandbox", j.id, "err", err)
	}
	return code
}

// pageInHot reads back the pages st's last page-out found resident, if
// the freeze just ended paged it out, or else those sibling names (a
// sibling's, placed in st's VMM by proc.Place, its translated code by
// code, the layout of its code buffer): its guest then faults on fewer
// of them. It runs beside the woken guest (thaw starts it), which
// takes a fault on a page it wants before the read-back gets there; on a
// 2-core TCG host the first exec after a later page-out took 1-19 % less
// at the p50 than with all read back before the thaw
// (docs/benchmarks.md). A failure only costs the wake those faults.
func (e *Engine) pageInHot(id string, st *idleState, sibling proc.Notes, code proc.CodeLayout) {
	e.idle.mu.Lock()
	hot, pid := st.hot, st.pid
	st.hot = nil
	e.idle.mu.Unlock()
	start := time.Now()
	var err error
	fromSibling := hot == nil && sibling.Bytes() > 0
	if fromSibling {
		hot, err = e.idle.place(pid, sibling, code)
	}
	if hot == nil {
		if err != nil && !errdefs.IsNotFound(err) {
			e.log.Warn("wake: find a sibling's pages in a paged-out sandbox", "sandbox", id, "err", err)
		}
		return
	}
	read, err := e.idle.pageIn(pid, hot)
	took := time.Since(start)
	switch {
	case errdefs.IsNotFound(err):
		return
	case err != nil:
		e.log.Warn("wake: read back a paged-out sandbox's pages", "sandbox", id, "err", err)
		return
	}
	e.idle.mu.Lock()
	e.idle.stats.PageIns++
	e.idle.stats.PageInBytes += read
	e.idle.stats.PageInSeconds += took.Seconds()
	if fromSibling {
		e.idle.stats.SiblingPageIns++
		if sibling.CodeBlocks() > 0 && code.Blocks() > 0 {
			e.idle.stats.SiblingCodePageIns++
		}
	}
	e.idle.mu.Unlock()
	e.log.Debug("sandbox paged in", "sandbox", id, "mib", read>>20, "ms", took.Milliseconds(), "sibling", fromSibling)
}

// noteSiblings notes what sandbox id's VMM has resident, for the first
// wakes of its siblings (idler.siblings), unless one of them has been
// noted already. Its last wake was from its first page-out and read
// nothing back, and its request has just ended: what is resident is what
// that wake and request faulted back. code is the layout of its code
// buffer before that page-out: the notes name the translated code by it.
func (e *Engine) noteSiblings(id string, st *idleState, code proc.CodeLayout) {
	e.idle.mu.Lock()
	snap, pid := st.snap, st.pid
	if _, ok := e.idle.siblings[snap]; ok || e.idle.noting[snap] {
		e.idle.mu.Unlock()
		return
	}
	e.idle.noting[snap] = true
	e.idle.mu.Unlock()
	notes, err := e.idle.noteResident(pid, wakePageInMax, wakePageInRuns)
	e.idle.mu.Lock()
	delete(e.idle.noting, snap)
	if err == nil && notes.Bytes() > 0 {
		e.idle.siblings[snap] = notes.WithCode(code)
	}
	e.idle.mu.Unlock()
	switch {
	case err != nil && !errdefs.IsNotFound(err):
		e.log.Warn("idle watch: note a woken sandbox's pages for its siblings", "sandbox", id, "err", err)
	case err == nil:
		e.log.Debug("noted a woken sandbox's pages for its siblings", "sandbox", id, "snapshot", snap, "mib", notes.Bytes()>>20)
	}
}
