package sandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/cleanup"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/vmm"
)

// pool keeps VMM processes parked (waiting for a snapshot's device state)
// for the snapshots forked most recently, so that a fork skips starting
// its VMM. A parked VMM already maps the snapshot's memory and, for a
// snapshot with a NIC, sits in its own network namespace with the default
// egress policy; children with resource limits never use the pool (their
// cgroup must be in place when the VMM starts).
//
// Parked VMMs are recorded (status parked) so that their run dirs and
// network slots are owned; they belong to this process: a daemon that
// stops discards them, and reconcile removes those a crash left.
type pool struct {
	e    *Engine
	size int // parked VMMs kept per snapshot

	bg sync.WaitGroup // discards and drops running in the background

	mu      sync.Mutex // guards the fields below
	entries map[string][]*parkedVMM
	filling map[string]chan struct{} // closed when tag's filler ends
	recent  []string                 // tags, most recently forked last; at most maxPoolTags
	hits    int
	closed  bool // set by close: nothing is parked any more
}

// maxPoolTags bounds how many snapshots have parked VMMs at once.
const maxPoolTags = 4

// parkedVMM is one pool entry.
type parkedVMM struct {
	p    vmm.Parked
	sb   *state.Sandbox
	snap *snapshot.Snapshot // what it was parked for
}

func newPool(e *Engine, size int) *pool {
	if size <= 0 {
		return nil
	}
	if _, ok := e.cfg.Backend.(vmm.Parker); !ok {
		return nil
	}
	return &pool{e: e, size: size, entries: map[string][]*parkedVMM{}, filling: map[string]chan struct{}{}}
}

// take returns a parked VMM for a child of snap, or nil (always for a
// child with limits or a disk, and for a nil pool). A VMM parked for an earlier
// snapshot of the same tag, or one that died while parked, is never
// handed out (it is discarded, and the child restores from scratch).
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
		p.bg.Go(func() { p.discardLogged(pk) })
	}
	return nil
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
// id, its network takes the child's policy, and the VMM loads snap. On
// failure the VMM is discarded; a record renamed to sb is the caller's to
// release.
func (e *Engine) restoreParked(ctx context.Context, snap *snapshot.Snapshot, spec ForkSpec, sb *state.Sandbox, pk *parkedVMM) (_ vmm.Machine, err error) {
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
	m, err := pk.p.Restore(ctx, vmm.RestoreSpec{StateFile: snap.StatePath()})
	if err != nil {
		return nil, err
	}
	undo.Release()
	return m, nil
}

// refill tops tag's parked VMMs up to the pool size, in the background.
// It makes tag the most recent and drops the pools of older tags beyond
// maxPoolTags.
func (p *pool) refill(snap *snapshot.Snapshot) {
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
		for {
			p.mu.Lock()
			n, wanted := len(p.entries[snap.Tag]), p.wantedLocked(snap.Tag)
			p.mu.Unlock()
			if !wanted || n >= p.size {
				return
			}
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

func (p *pool) wantedLocked(tag string) bool {
	for _, t := range p.recent {
		if t == tag {
			return true
		}
	}
	return false
}

// park starts one VMM for snap, recorded and isolated like a child
// (without limits), within the engine's bound on concurrent restores.
func (p *pool) park(snap *snapshot.Snapshot) (_ *parkedVMM, err error) {
	e := p.e
	e.restores <- struct{}{}
	defer func() { <-e.restores }()
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
	pk, err := e.cfg.Backend.(vmm.Parker).Park(ctx, spec)
	if err != nil {
		return nil, err
	}
	undo.Add(func() error { return pk.Discard(ctx) })
	sb.Handle = pk.Handle()
	if err := e.state.Put(sb); err != nil {
		return nil, err
	}
	undo.Release()
	return &parkedVMM{p: pk, sb: sb, snap: snap}, nil
}

// discard stops a parked VMM and releases what it holds.
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

// close discards every parked VMM; refill parks none after it.
func (p *pool) close() error {
	if p == nil {
		return nil
	}
	p.mu.Lock()
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

// PrimePool parks up to size VMMs for snapshot tag and waits (until ctx
// ends) until they are all parked. It gives an engine without
// Config.Pool a pool; the benchmark uses it to time forks from parked VMMs.
// Call it before forking from other goroutines: it may set the pool.
func (e *Engine) PrimePool(ctx context.Context, tag string, size int) error {
	snap, err := e.snaps.Get(tag)
	if err != nil {
		return err
	}
	if e.pool == nil {
		if e.pool = newPool(e, size); e.pool == nil {
			return fmt.Errorf("backend %s cannot park VMMs", e.cfg.Backend.Name())
		}
	}
	e.pool.refill(snap)
	for {
		parked, _ := e.PoolStats()
		if parked[tag] >= e.pool.size {
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
