package sandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/cleanup"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/vmm"
)

// pool keeps VMMs ready for the snapshots forked most recently, so that a
// fork skips starting its VMM and restoring into it. A pool entry is a VMM
// that restored the snapshot, whose agent answered and ran one command
// (so that under TCG the guest's exec path is translated already), and
// that was then stopped (SIGSTOP: no CPU, no wake-ups). For a snapshot
// with a NIC it sits in its own network namespace with the default egress
// policy. A fork that takes one gives it the child's id and policy, lets
// it run again and tells its agent the time, fresh entropy and who it is,
// as after any restore. Children with resource limits never use the pool
// (their cgroup must be in place when the VMM starts).
//
// A snapshot's pool is Config.Pool entries, or as many as its largest fork
// in the last poolDemandWindow asked for, up to Config.PoolMax entries
// over all snapshots; it is refilled after each fork, in the background,
// with the CPU nothing else wants (SCHED_IDLE, as root), and never while the host has less than
// a fifth of its memory available. Entries beyond what the recent demand
// asks for are discarded by a trim every poolTrimEvery.
//
// Entries are recorded (status parked) so that their run dirs and network
// slots are owned; they belong to this process: a daemon that stops
// discards them, and reconcile removes those a crash left.
type pool struct {
	e    *Engine
	size int // entries kept per snapshot without demand
	max  int // entries over all snapshots, at most
	// background: entries wait in SCHED_IDLE (as root only, since only
	// root may give a taken entry the normal class back).
	background bool

	slots chan struct{}  // one token per park in progress
	bg    sync.WaitGroup // discards, drops and the trimmer
	stop  chan struct{}  // closed by close: the trimmer ends

	mu      sync.Mutex // guards the fields below
	entries map[string][]*parkedVMM
	filling map[string]chan struct{} // closed when tag's filler ends
	recent  []string                 // tags, most recently forked last; at most maxPoolTags
	demand  map[string]poolDemand    // largest recent fork per tag
	hits    int
	closed  bool // set by close: nothing is parked any more
}

// poolDemand is the largest fork of a snapshot since at.
type poolDemand struct {
	n  int
	at time.Time
}

// maxPoolTags bounds how many snapshots have parked VMMs at once.
const maxPoolTags = 4

// poolDemandWindow is how long a fork's size sets its snapshot's pool.
const poolDemandWindow = 10 * time.Minute

// poolTrimEvery is how often entries beyond the demand are discarded.
const poolTrimEvery = time.Minute

// poolSettleQuiet and poolSettleMax bound how long a pool entry settles
// after its warm-up (see settle).
const (
	poolSettleQuiet = 200 * time.Millisecond
	poolSettleMax   = 3 * time.Second
)

// poolMinFreeMemory is the share of the host's memory that must stay
// available for the pool to park one more VMM.
const poolMinFreeMemory = 0.2

// parkedVMM is one pool entry: a restored VMM, stopped.
type parkedVMM struct {
	p    vmm.Parked
	m    vmm.Machine
	sb   *state.Sandbox
	snap *snapshot.Snapshot // what it was restored from
	// background: the VMM runs in SCHED_IDLE until it is taken.
	background bool
}

// newPool returns a pool of size entries per snapshot, growing with demand
// up to max over all (at least size × maxPoolTags), or nil for a size of 0
// or a backend that cannot park.
func newPool(e *Engine, size, limit int) *pool {
	if size <= 0 {
		return nil
	}
	if _, ok := e.cfg.Backend.(vmm.Parker); !ok {
		return nil
	}
	p := &pool{e: e, size: size, max: max(limit, size*maxPoolTags), slots: make(chan struct{}, 2*cap(e.restores)),
		stop: make(chan struct{}), entries: map[string][]*parkedVMM{}, filling: map[string]chan struct{}{},
		demand: map[string]poolDemand{}, background: os.Geteuid() == 0}
	p.bg.Go(p.trimLoop)
	return p
}

// take returns a pool entry for a child of snap, or nil (always for a
// child with limits or a disk, and for a nil pool). An entry of an earlier
// snapshot of the same tag, or one that died meanwhile, is never handed
// out (it is discarded, and the child restores from scratch).
func (p *pool) take(snap *snapshot.Snapshot, spec ForkSpec) *parkedVMM {
	if p == nil || spec.Limits != nil || spec.DiskMiB > 0 {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for es := p.entries[snap.Tag]; len(es) > 0; es = p.entries[snap.Tag] {
		pk := es[len(es)-1]
		p.entries[snap.Tag] = es[:len(es)-1]
		if sameSnapshot(pk.snap, snap) && proc.Alive(pk.sb.Handle.Process) {
			p.hits++
			return pk
		}
		p.discardLater(pk)
	}
	return nil
}

// discardLater discards pk in the background.
func (p *pool) discardLater(pk *parkedVMM) {
	p.bg.Go(func() { p.discardLogged(pk) })
}

// dropLater drops the pools of tags in the background: a fork's answer
// must not wait for another snapshot's VMMs to be discarded.
func (p *pool) dropLater(tags []string) {
	if len(tags) > 0 {
		p.bg.Go(func() {
			if err := p.dropTags(tags); err != nil {
				p.e.log.Warn("discard parked VMMs", "snapshots", tags, "err", err)
			}
		})
	}
}

// restoreParked turns pk into the child sb: its record takes the child's
// id, its network takes the child's policy, and its VMM runs again. On
// failure the VMM is discarded; a record renamed to sb is the caller's to
// release.
func (e *Engine) restoreParked(ctx context.Context, spec ForkSpec, sb *state.Sandbox, pk *parkedVMM) (_ vmm.Machine, err error) {
	sb.Handle, sb.Net = pk.sb.Handle, pk.sb.Net
	if err := e.state.Rename(pk.sb.ID, sb); err != nil {
		// The record keeps the parked id, so nothing is the caller's: the
		// VMM, the record's network and the record go here.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		sb.Net = nil
		return nil, errors.Join(err, pk.p.Discard(dctx), e.release(dctx, pk.sb), e.state.Delete(pk.sb.ID))
	}
	var undo cleanup.Stack
	defer func() {
		if err != nil {
			err = errors.Join(err, undo.Run())
		}
	}()
	undo.Add(func() error { return pk.p.Discard(context.WithoutCancel(ctx)) })
	if sb.Net != nil {
		if err := e.cfg.Net.SetPolicy(ctx, sb.Net.Slot, spec.Net.Policy); err != nil {
			return nil, err
		}
		pol, _ := json.Marshal(spec.Net.Policy)
		sb.Net.Policy = pol
	}
	id := sb.Handle.Process
	if pk.background {
		if err := proc.SetSched(id, proc.Normal); err != nil {
			return nil, err
		}
	}
	if err := proc.Signal(id, syscall.SIGCONT); err != nil {
		return nil, fmt.Errorf("wake parked VMM: %w", err)
	}
	undo.Release()
	return pk.m, nil
}

// refill tops tag's pool up to its size, in the background, after a fork
// of n children. It makes tag the most recent and drops the pools of older
// tags beyond maxPoolTags.
func (p *pool) refill(snap *snapshot.Snapshot, n int) {
	if layer, _ := snap.DiskLayer(); p == nil || layer != "" {
		// Every child of a snapshot with a disk layer has a disk of its
		// own, made when it forks.
		return
	}
	p.mu.Lock()
	if p.closed {
		// A fork that ends while the engine closes (its request outlived
		// the daemon's grace) parks nothing that nobody would discard.
		p.mu.Unlock()
		return
	}
	p.noteDemandLocked(snap.Tag, n, time.Now())
	var evict []string
	recent := []string{}
	for _, t := range p.recent {
		if t != snap.Tag {
			recent = append(recent, t)
		}
	}
	recent = append(recent, snap.Tag)
	for len(recent) > maxPoolTags {
		evict = append(evict, recent[0])
		delete(p.demand, recent[0])
		recent = recent[1:]
	}
	p.recent = recent
	if p.filling[snap.Tag] != nil {
		p.mu.Unlock()
		p.dropLater(evict)
		return
	}
	done := make(chan struct{})
	p.filling[snap.Tag] = done
	p.mu.Unlock()
	p.dropLater(evict)
	go func() {
		defer func() {
			p.mu.Lock()
			delete(p.filling, snap.Tag)
			p.mu.Unlock()
			close(done)
		}()
		for p.wantsOneMore(snap.Tag) {
			pk, err := p.park(snap)
			if err != nil {
				p.e.log.Warn("park VMM", "snapshot", snap.Tag, "err", err)
				return
			}
			p.mu.Lock()
			if p.wantedLocked(snap.Tag) {
				p.entries[snap.Tag] = append(p.entries[snap.Tag], pk)
				pk = nil
			}
			p.mu.Unlock()
			if pk != nil { // the tag was dropped meanwhile
				p.discardLogged(pk)
				return
			}
		}
	}()
}

// noteDemandLocked records a fork of n children of tag at now: it sets
// tag's demand unless a larger fork set it within poolDemandWindow.
func (p *pool) noteDemandLocked(tag string, n int, now time.Time) {
	if d := p.demand[tag]; n >= d.n || now.Sub(d.at) >= poolDemandWindow {
		p.demand[tag] = poolDemand{n: n, at: now}
	}
}

// targetLocked is how many entries tag's pool should hold now.
func (p *pool) targetLocked(tag string, now time.Time) int {
	n := p.size
	if d, ok := p.demand[tag]; ok && now.Sub(d.at) < poolDemandWindow {
		n = max(n, d.n)
	}
	return min(n, p.max)
}

// wantsOneMore reports whether tag's pool is below its target, the pool
// as a whole below its bound, and the host's available memory above
// poolMinFreeMemory.
func (p *pool) wantsOneMore(tag string) bool {
	p.mu.Lock()
	total := 0
	for _, es := range p.entries {
		total += len(es)
	}
	ok := p.wantedLocked(tag) && len(p.entries[tag]) < p.targetLocked(tag, time.Now()) && total < p.max
	p.mu.Unlock()
	if !ok {
		return false
	}
	avail, memTotal, err := proc.Memory()
	if err != nil {
		p.e.log.Warn("pool: host memory", "err", err)
		return false
	}
	if float64(avail) < poolMinFreeMemory*float64(memTotal) {
		p.e.log.Info("pool: not refilled, host memory low", "snapshot", tag, "available_mib", avail>>20)
		return false
	}
	return true
}

// trimLoop discards, every poolTrimEvery until close, the entries beyond
// each snapshot's target (those its demand asked for, once that demand is
// older than poolDemandWindow).
func (p *pool) trimLoop() {
	t := time.NewTicker(poolTrimEvery)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
		}
		p.trim(time.Now())
	}
}

// trim discards the entries beyond each snapshot's target at now.
func (p *pool) trim(now time.Time) {
	var gone []*parkedVMM
	p.mu.Lock()
	for tag, es := range p.entries {
		if n := p.targetLocked(tag, now); len(es) > n {
			gone = append(gone, es[n:]...)
			p.entries[tag] = es[:n]
		}
	}
	p.mu.Unlock()
	for _, pk := range gone {
		p.discardLogged(pk)
	}
}

func (p *pool) wantedLocked(tag string) bool {
	for _, t := range p.recent {
		if t == tag {
			return true
		}
	}
	return false
}

// park restores one VMM of snap into the pool, recorded and isolated like
// a child (without limits), at most two per restore slot at once (it
// runs as SCHED_IDLE), and stops it.
func (p *pool) park(snap *snapshot.Snapshot) (_ *parkedVMM, err error) {
	e := p.e
	p.slots <- struct{}{}
	defer func() { <-p.slots }()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	id := newID()
	sb := &state.Sandbox{ID: id, Snapshot: snap.Tag, Status: state.StatusParked, Created: time.Now().UTC(), Starter: starter(),
		Handle: vmm.Handle{Backend: e.cfg.Backend.Name(), RunDir: filepath.Join(e.runDir, id)}}
	var undo cleanup.Stack
	defer func() {
		if err != nil {
			err = errors.Join(err, undo.Run())
		}
	}()
	if err := e.record(sb, snap); err != nil {
		return nil, err
	}
	undo.Add(func() error { return e.state.Delete(id) })
	// The network and run dir prepareVMM makes for the record.
	undo.Add(func() error { return e.release(context.Background(), sb) })
	ns := &NetSpec{}
	if err := ns.validate(); err != nil {
		return nil, err
	}
	spec, done, err := e.prepareVMM(ctx, snap, sb, ns)
	if err != nil {
		return nil, err
	}
	defer done()
	if p.background {
		// The VMM runs only on CPU nothing else wants until a fork
		// takes it.
		spec.Launch.Enter = append(spec.Launch.Enter, func() (func() error, error) { return proc.SchedThread(proc.Background) })
	}
	pk, err := e.cfg.Backend.(vmm.Parker).Park(ctx, spec)
	if err != nil {
		return nil, err
	}
	undo.Add(func() error { return pk.Discard(ctx) })
	sb.Handle = pk.Handle()
	if err := e.state.Put(sb); err != nil {
		return nil, err
	}
	m, err := pk.Restore(ctx, vmm.RestoreSpec{StateFile: snap.StatePath()})
	if err != nil {
		return nil, err
	}
	init := initRequest(id, 0)
	if err := warm(ctx, m, &init); err != nil {
		return nil, err
	}
	if err := settle(ctx, sb.Handle.Process); err != nil {
		return nil, err
	}
	if err := e.trimParked(ctx, id, m, sb.Handle.Process, p.background); err != nil {
		return nil, err
	}
	if err := proc.Signal(sb.Handle.Process, syscall.SIGSTOP); err != nil {
		return nil, err
	}
	undo.Release()
	return &parkedVMM{p: pk, m: m, sb: sb, snap: snap, background: p.background}, nil
}

// settle waits, up to poolSettleMax, until the VMM named by id used no
// CPU over poolSettleQuiet (at its SCHED_IDLE class, a busy host may
// delay that): what the guest still does after the warm-up (~90 ms of CPU
// here: the command's exit, the agent's garbage) is then done before the
// stop, not when a fork wakes it.
func settle(ctx context.Context, id proc.Identity) error {
	last, err := proc.CPUTime(id)
	if err != nil {
		return err
	}
	quietSince := time.Now()
	for deadline := time.Now().Add(poolSettleMax); time.Now().Before(deadline); {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(poolSettleQuiet / 4):
		}
		cpu, err := proc.CPUTime(id)
		if err != nil {
			return err
		}
		if cpu != last {
			last, quietSince = cpu, time.Now()
		} else if time.Since(quietSince) >= poolSettleQuiet {
			return nil
		}
	}
	return nil
}

// trimParked leaves a pool entry's VMM holding little more than what a
// request uses: it pages all of the VMM's private memory out, has the
// guest run true once more, which faults back what an exec touches (its
// translated code, the blocks' hash table, the vCPU's TLB tables, the
// pages of the guest, the agent and QEMU that it reaches), and lets the
// guest settle again. What stays out is what the restore and the first
// warm-up used once: the incoming migration's buffers, the code
// translated for the resume and the agent's init, the pages the loader
// relocated. On a 2-core TCG host that took a child from the pool from
// 23.3–23.9 to 19.0–19.6 MiB after its fork (docs/benchmarks.md). Pages go
// out only where swap is zram with some free: what a fork's later
// requests fault back then comes from RAM, not a disk. A failed page-out
// leaves the entry as it is; a failed exec or settle discards it. With
// background, the page-out (the compression into zram, on the caller's
// CPU) runs in SCHED_IDLE, as the entry does: behind a fork's restores.
func (e *Engine) trimParked(ctx context.Context, id string, m vmm.Machine, pid proc.Identity, background bool) error {
	if !e.zramFree() {
		return nil
	}
	moved, err := pageOut(ctx, pid, background)
	if err != nil {
		e.log.Debug("pool: page out a parked VMM", "sandbox", id, "err", err)
		return nil
	}
	if err := warm(ctx, m, nil); err != nil {
		return err
	}
	if err := settle(ctx, pid); err != nil {
		return err
	}
	e.log.Debug("pool: paged out a parked VMM but for what an exec uses", "sandbox", id, "mib", moved>>20)
	return nil
}

// pageOut is proc.PageOut of the process named by id until ctx ends,
// with background on an OS thread of the SCHED_IDLE class.
func pageOut(ctx context.Context, id proc.Identity, background bool) (int64, error) {
	keep := func() bool { return ctx.Err() == nil }
	if !background {
		return proc.PageOut(id, keep)
	}
	type result struct {
		moved int64
		err   error
	}
	done := make(chan result, 1)
	go func() {
		// Never unlocked: the thread ends with the goroutine, and its
		// class with it.
		runtime.LockOSThread()
		if _, err := proc.SchedThread(proc.Background); err != nil {
			done <- result{err: err}
			return
		}
		moved, err := proc.PageOut(id, keep)
		done <- result{moved, err}
	}()
	r := <-done
	return r.moved, r.err
}

// zramFree reports whether the host swaps to zram first, with at least
// reclaimSwapFree of its swap free.
func (e *Engine) zramFree() bool {
	zram, err := e.idle.swapsToZram()
	if err != nil || !zram {
		return false
	}
	free, err := e.idle.swapFree()
	return err == nil && free >= reclaimSwapFree
}

// warm waits for the agent of m, a pool entry, sends it init if that is
// not nil, and has it run true: under TCG the guest's first exec after a
// restore costs a translation of its whole exec path (~150–250 ms of CPU
// here), which the child that takes the entry then does not pay.
func warm(ctx context.Context, m vmm.Machine, init *proto.InitRequest) error {
	c, err := DialAgent(ctx, m, agent.Options{})
	if err != nil {
		return err
	}
	defer c.Close()
	if init != nil {
		if err := c.Init(ctx, *init); err != nil {
			return fmt.Errorf("init: %w", err)
		}
	}
	res, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"true"}})
	if err == nil && res.ExitCode != 0 {
		err = fmt.Errorf("true exited %d", res.ExitCode)
	}
	if err != nil {
		return fmt.Errorf("warm-up exec: %w", err)
	}
	return nil
}

// discard stops a pool entry's VMM (SIGKILL ends a stopped process too)
// and releases what it holds.
func (p *pool) discard(pk *parkedVMM) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := errors.Join(pk.p.Discard(ctx), p.e.release(ctx, pk.sb), p.e.state.Delete(pk.sb.ID))
	if err != nil {
		return fmt.Errorf("discard parked VMM %s: %w", pk.sb.ID, err)
	}
	return nil
}

// discardLogged is discard where nobody waits for the error: it logs it.
func (p *pool) discardLogged(pk *parkedVMM) {
	if err := p.discard(pk); err != nil {
		p.e.log.Warn("discard parked VMM", "snapshot", pk.snap.Tag, "err", err)
	}
}

// drop discards tag's parked VMMs and stops refilling them (before the
// snapshot is removed: parked VMMs hold references on it).
func (p *pool) drop(tag string) error {
	if p == nil {
		return nil
	}
	return p.dropTags([]string{tag})
}

func (p *pool) dropTags(tags []string) error {
	var fillers []chan struct{}
	p.mu.Lock()
	for _, tag := range tags {
		var recent []string
		for _, t := range p.recent {
			if t != tag {
				recent = append(recent, t)
			}
		}
		p.recent = recent
		if ch := p.filling[tag]; ch != nil {
			fillers = append(fillers, ch)
		}
	}
	p.mu.Unlock()
	// A filler stops once its tag is no longer wanted; what it was parking
	// it discards itself.
	for _, ch := range fillers {
		<-ch
	}
	var gone []*parkedVMM
	p.mu.Lock()
	for _, tag := range tags {
		gone = append(gone, p.entries[tag]...)
		delete(p.entries, tag)
	}
	p.mu.Unlock()
	var errs []error
	for _, pk := range gone {
		errs = append(errs, p.discard(pk))
	}
	return errors.Join(errs...)
}

// close discards every pool entry; refill parks none after it.
func (p *pool) close() error {
	if p == nil {
		return nil
	}
	p.mu.Lock()
	if !p.closed {
		close(p.stop)
	}
	p.closed = true
	tags := append([]string(nil), p.recent...)
	for t := range p.entries {
		tags = append(tags, t)
	}
	p.mu.Unlock()
	err := p.dropTags(tags)
	p.bg.Wait()
	return err
}

// PrimePool fills snapshot tag's pool as a fork of size children would
// (up to the pool's bound) and waits (until ctx ends) until it is full. It gives an engine without
// Config.Pool a pool; the benchmark uses it to time forks from parked VMMs.
// Call it before forking from other goroutines: it may set the pool.
func (e *Engine) PrimePool(ctx context.Context, tag string, size int) error {
	snap, err := e.snaps.Get(tag)
	if err != nil {
		return err
	}
	if e.pool == nil {
		if e.pool = newPool(e, size, size); e.pool == nil {
			return fmt.Errorf("backend %s cannot park VMMs", e.cfg.Backend.Name())
		}
	}
	e.pool.refill(snap, size)
	want := min(max(size, e.pool.size), e.pool.max)
	for {
		parked, _ := e.PoolStats()
		if parked[tag] >= want {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// PoolStats says how many VMMs wait parked per snapshot, and how many
// forks took one.
func (e *Engine) PoolStats() (parked map[string]int, hits int) {
	parked = map[string]int{}
	if e.pool == nil {
		return parked, 0
	}
	e.pool.mu.Lock()
	defer e.pool.mu.Unlock()
	for t, es := range e.pool.entries {
		parked[t] = len(es)
	}
	return parked, e.pool.hits
}
