package sandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/cleanup"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/vmm"
)

// ForkSpec describes a batch of children.
type ForkSpec struct {
	Tag      string
	N        int
	Metadata map[string]string
	// ReadyTimeout bounds each child's restore until its agent answers.
	ReadyTimeout time.Duration
	// KeepPartial keeps the children that came up when others failed;
	// by default a batch is all or nothing.
	KeepPartial bool
	// OnDone, if set, is called as each child is ready or has failed
	// (from several goroutines at once).
	OnDone func(Child)
	// IDs, when set, are the children's ids (len N, each valid and
	// unused), so a caller can reserve them before the batch starts.
	IDs []string
	// Timeout, when positive, sets each child's ExpiresAt that long after
	// it became ready (an Expirer kills it then).
	Timeout time.Duration
	// Extra is recorded with each child (state.Sandbox.Extra).
	Extra map[string]json.RawMessage
	// Net is the children's network, for a snapshot made with a NIC
	// (nil: the default egress policy, no published port).
	Net *NetSpec
	// Limits, if set, caps each child's resources (a cgroup per child).
	Limits *state.Limits
	// OnUnresponsive overrides Config.Unresponsive for these children.
	OnUnresponsive string
	// IdleFreezeSecs overrides Config.IdleFreeze for these children: 0
	// follows it, -1 never freezes them.
	IdleFreezeSecs int
	// GuestPIDsLimit, when positive, caps the tasks inside each child's
	// guest (proto.InitRequest.PIDsLimit); 0 is the agent's default.
	GuestPIDsLimit int
	// DiskMiB, when positive, gives each child a writable disk of that
	// many MiB (disk.MinMiB to disk.MaxMiB) that takes the root file
	// system's writes instead of guest RAM; the snapshot needs a disk
	// slot. Children of a branch of a sandbox with a disk get that disk
	// whatever DiskMiB says (0, or its size).
	DiskMiB int

	batch string // set by Fork: the open batch the children belong to
}

// Child is the fate of one child of a batch.
type Child struct {
	ID      string         `json:"id"`
	ReadyMS float64        `json:"ready_ms"`
	Err     error          `json:"-"`
	Sandbox *state.Sandbox `json:"-"`
}

// ForkResult is a finished batch.
type ForkResult struct {
	Children []Child `json:"children"`
	WallMS   float64 `json:"wall_ms"`
}

// Fork restores spec.N children of snapshot spec.Tag in parallel (at most
// MaxParallel at once) and returns when every child's agent has answered.
// Children are recorded in the state store before their VMM starts, so a
// crash mid-batch leaves records the next start reconciles.
func (e *Engine) Fork(ctx context.Context, spec ForkSpec) (*ForkResult, error) {
	if err := snapshot.ValidateTag(spec.Tag); err != nil {
		return nil, err
	}
	if spec.N < 1 || spec.N > e.cfg.MaxChildren {
		return nil, errdefs.InvalidArgument("n = %d: want 1 to %d", spec.N, e.cfg.MaxChildren)
	}
	if err := validateMetadata(spec.Metadata); err != nil {
		return nil, err
	}
	if err := ValidateUnresponsive(spec.OnUnresponsive); err != nil {
		return nil, err
	}
	if err := ValidateIdleFreezeSecs(spec.IdleFreezeSecs); err != nil {
		return nil, err
	}
	if spec.IDs != nil && len(spec.IDs) != spec.N {
		return nil, errdefs.InvalidArgument("%d ids for %d children", len(spec.IDs), spec.N)
	}
	for _, id := range spec.IDs {
		if err := ValidateID(id); err != nil {
			return nil, err
		}
	}
	if spec.ReadyTimeout == 0 {
		spec.ReadyTimeout = 2 * time.Minute
	}
	snap, err := e.snaps.Get(spec.Tag)
	if err != nil {
		return nil, err
	}
	if err := e.Restorable(snap); err != nil {
		return nil, err
	}
	if _, spec.DiskMiB, err = childDisk(snap, spec.DiskMiB); err != nil {
		return nil, err
	}
	if !snap.Network && spec.Net != nil {
		return nil, errdefs.FailedPrecondition("snapshot %q was made without a NIC, so its children have no network to configure (snapshot with --per-child-netns)", spec.Tag)
	}
	if spec.Net == nil {
		spec.Net = &NetSpec{}
	}
	if err := spec.Net.validate(); err != nil {
		return nil, err
	}
	if err := validateLimits(spec.Limits); err != nil {
		return nil, err
	}
	if spec.Limits != nil && e.cfg.Cgroups == nil {
		return nil, errdefs.FailedPrecondition("resource limits need cgroups, which need root")
	}
	start := time.Now()
	// The batch is open until its answer is given: a crash before then
	// leaves members nobody was told of, which reconcile aborts.
	batch := &state.Batch{ID: "fb-" + newID()[3:], Starter: starter(), Created: start.UTC()}
	if err := e.state.PutBatch(batch); err != nil {
		return nil, err
	}
	spec.batch = batch.ID
	res := &ForkResult{Children: make([]Child, spec.N)}
	var wg sync.WaitGroup
	for i := range res.Children {
		id := newID()
		if spec.IDs != nil {
			id = spec.IDs[i]
		}
		wg.Add(1)
		go func(c *Child) {
			defer wg.Done()
			// A pool entry, restored already, still counts as a restore
			// while it wakes: a hundred guests woken at once each get so
			// little CPU that their timers eat most of it.
			pk := e.pool.take(snap, spec)
			select {
			case e.restores <- struct{}{}:
			case <-ctx.Done():
				c.ID, c.Err = id, ctx.Err()
				if pk != nil {
					e.pool.discardLater(pk)
				}
				return
			}
			defer func() { <-e.restores }()
			*c = e.forkOne(ctx, snap, spec, id, pk)
			if spec.OnDone != nil {
				spec.OnDone(*c)
			}
		}(&res.Children[i])
	}
	wg.Wait()
	res.WallMS = msSince(start)
	e.pool.refill(snap, spec.N)
	var errs []error
	for _, c := range res.Children {
		if c.Err != nil {
			errs = append(errs, c.Err)
		}
	}
	if len(errs) == 0 {
		// Answered: the members are ordinary sandboxes from now on (a
		// member's Batch names a closed batch).
		return res, e.state.DeleteBatch(batch.ID)
	}
	err = &BatchError{Failed: len(errs), N: spec.N, First: errs[0]}
	if spec.KeepPartial {
		return res, errors.Join(err, e.state.DeleteBatch(batch.ID))
	}
	kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	var kerrs []error
	for _, c := range res.Children {
		if c.Err == nil {
			if kerr := e.Kill(kctx, c.ID); kerr != nil {
				kerrs = append(kerrs, kerr)
			}
		}
	}
	if len(kerrs) == 0 { // else the batch stays open: reconcile finishes it
		kerrs = append(kerrs, e.state.DeleteBatch(batch.ID))
	}
	return nil, errors.Join(append([]error{err}, kerrs...)...)
}

// Restorable says why children of snap cannot be restored by this engine
// (a FailedPrecondition-class error), or nil when they can: it is ready,
// its files are intact, its backend and accelerator are this engine's,
// and its NIC, if any, can be given a namespace.
func (e *Engine) Restorable(snap *snapshot.Snapshot) error {
	if snap.Status != snapshot.StatusReady {
		return errdefs.FailedPrecondition("snapshot %q is %s, not ready", snap.Tag, snap.Status)
	}
	if err := snap.Verify(); err != nil {
		return err
	}
	if snap.Backend != e.cfg.Backend.Name() {
		return errdefs.FailedPrecondition("snapshot %q was made by backend %s; this forkd uses %s", snap.Tag, snap.Backend, e.cfg.Backend.Name())
	}
	if acc := e.cfg.Backend.Capabilities().Accelerator; snap.Accelerator != "" && snap.Accelerator != acc {
		return errdefs.FailedPrecondition("snapshot %q was made under %s; this forkd runs %s", snap.Tag, snap.Accelerator, acc)
	}
	if snap.Network && e.cfg.Net == nil {
		return errdefs.FailedPrecondition("snapshot %q has a NIC: its children need per-child network namespaces, which need root", snap.Tag)
	}
	if layer, _ := snap.DiskLayer(); layer != "" {
		if _, err := os.Stat(e.disks.Path(layer)); err != nil {
			return errdefs.FailedPrecondition("snapshot %q: its disk layer %s: %w", snap.Tag, layer, err)
		}
	}
	return nil
}

// forkOne restores one child, or wakes pool entry pk as it when not nil,
// and waits for its agent.
func (e *Engine) forkOne(ctx context.Context, snap *snapshot.Snapshot, spec ForkSpec, id string, pk *parkedVMM) (c Child) {
	start := time.Now()
	c.ID = id
	sb := &state.Sandbox{
		ID:       id,
		Snapshot: snap.Tag,
		Status:   state.StatusStarting,
		Starter:  starter(),
		Handle:   vmm.Handle{Backend: e.cfg.Backend.Name(), RunDir: filepath.Join(e.runDir, id)},
		Created:  time.Now().UTC(),
		Metadata: spec.Metadata,
		Extra:    spec.Extra,

		OnUnresponsive: spec.OnUnresponsive,
		IdleFreezeSecs: spec.IdleFreezeSecs,
		GuestPIDsLimit: spec.GuestPIDsLimit,
		Batch:          spec.batch,
	}
	if spec.Limits != nil {
		l := *spec.Limits
		sb.Limits = &l
	}
	if spec.DiskMiB > 0 {
		sb.Disk = &state.Disk{MiB: spec.DiskMiB, Image: filepath.Join(sb.Handle.RunDir, "disk.qcow2")}
	}
	// What the child holds, undone by fail last first: its record, what
	// restoreFresh or restoreParked made for it (released), its VMM. The
	// undos share one deadline, set when they run.
	var undo cleanup.Stack
	var undoCtx context.Context
	undo.Add(func() error { return e.state.Delete(id) })
	undo.Add(func() error { return e.release(undoCtx, sb) })
	fail := func(err error) Child {
		var cancel context.CancelFunc
		undoCtx, cancel = context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if uerr := undo.Run(); uerr != nil {
			e.log.Warn("roll back failed child", "sandbox", id, "err", uerr)
		}
		c.Err = fmt.Errorf("child %s: %w", id, err)
		return c
	}
	rctx, cancel := context.WithTimeout(ctx, spec.ReadyTimeout)
	defer cancel()
	var m vmm.Machine
	var err error
	if pk != nil {
		m, err = e.restoreParked(rctx, spec, sb, pk)
	} else {
		m, err = e.restoreFresh(rctx, snap, spec, sb)
	}
	restored := time.Now()
	if m != nil {
		undo.Add(func() error { return m.Stop(undoCtx) })
	}
	if err == nil {
		err = e.fault("restored")
	}
	if err != nil {
		return fail(err)
	}
	// The VMM's identity is durable before anything else can fail: a crash
	// from here on leaves a record that names the process to kill.
	sb.Handle = m.Handle()
	if err := e.stillStarting(id, func(r *state.Sandbox) { r.Handle = sb.Handle }); err != nil {
		return fail(err)
	}
	if err := resizeDisk(rctx, m, sb); err != nil {
		return fail(err)
	}
	client, err := DialAgent(rctx, m, e.agentOptions(id))
	if err != nil {
		return fail(err)
	}
	dialed := time.Now()
	if spec.GuestPIDsLimit > 0 && !slices.Contains(client.Features(), proto.FeatureLimits) {
		client.Close()
		return fail(errdefs.FailedPrecondition("guest pids limit: the agent of snapshot %s cannot apply it (made with an older agent; snapshot it again)", spec.Tag))
	}
	init := initRequest(id, spec.GuestPIDsLimit)
	if init.Disk, err = diskRequest(client, sb, spec.Tag); err != nil {
		client.Close()
		return fail(err)
	}
	if err := client.Init(rctx, init); err != nil {
		client.Close()
		return fail(fmt.Errorf("init: %w", err))
	}
	if sb.Net != nil && len(spec.Net.Publish) > 0 {
		err := e.publish(rctx, sb, spec.Net.Publish)
		if err == nil {
			err = e.fault("published")
		}
		if err != nil {
			client.Close()
			return fail(err)
		}
	}
	c.ReadyMS = msSince(start)
	e.log.Debug("child ready", "sandbox", id, "pooled", pk != nil, "restore_ms", restored.Sub(start).Milliseconds(),
		"dial_ms", dialed.Sub(restored).Milliseconds(), "init_ms", time.Since(dialed).Milliseconds())
	sb.Status = state.StatusRunning
	sb.ReadyMS = int64(c.ReadyMS)
	if spec.Timeout > 0 {
		sb.ExpiresAt = time.Now().Add(spec.Timeout).UTC()
	}
	sb.Starter = nil // running: the sandbox no longer belongs to this process
	if err := e.stillStarting(id, func(r *state.Sandbox) {
		if sb.ExpiresAt.IsZero() {
			sb.ExpiresAt = r.ExpiresAt // set through the API while it started
		}
		*r = *sb
	}); err != nil {
		client.Close()
		return fail(err)
	}
	if err := e.fault("ready"); err != nil {
		client.Close()
		return fail(err)
	}
	e.keepClient(id, client)
	c.Sandbox = sb
	return c
}

// restoreFresh records sb, gives it its network and cgroup, and starts a
// VMM restored from snap. What it made is released by the caller on error.
func (e *Engine) restoreFresh(ctx context.Context, snap *snapshot.Snapshot, spec ForkSpec, sb *state.Sandbox) (vmm.Machine, error) {
	if err := e.record(sb, snap); err != nil {
		return nil, err
	}
	if err := e.fault("recorded"); err != nil {
		return nil, err
	}
	ps, done, err := e.prepareVMM(ctx, snap, sb, spec.Net)
	if err != nil {
		return nil, err
	}
	defer done()
	return e.cfg.Backend.Restore(ctx, vmm.RestoreSpec{
		Name: ps.Name, RunDir: ps.RunDir, Config: ps.Config, MemoryFile: ps.MemoryFile,
		StateFile: snap.StatePath(), Disks: ps.Disks, NICs: ps.NICs, Hold: ps.Hold, Launch: ps.Launch,
	})
}

// record stores sb, with a network slot when snap has a NIC.
func (e *Engine) record(sb *state.Sandbox, snap *snapshot.Snapshot) error {
	if snap.Network {
		return e.state.PutWithSlot(sb, e.cfg.Net.MaxSlots())
	}
	return e.state.Put(sb)
}

// prepareVMM isolates the recorded sb (network with ns's policy, cgroup
// with its limits) and takes a reference on snap; it returns how to start
// sb's VMM, and done, which the caller calls once the VMM has started (or
// failed to): the VMM holds the reference from then on.
func (e *Engine) prepareVMM(ctx context.Context, snap *snapshot.Snapshot, sb *state.Sandbox, ns *NetSpec) (vmm.ParkSpec, func(), error) {
	launch, nics, isolated, err := e.isolate(ctx, sb, ns)
	if err == nil {
		err = e.fault("isolated")
	}
	if err != nil {
		isolated()
		return vmm.ParkSpec{}, nil, err
	}
	cur, ref, err := e.snaps.Acquire(snap.Tag)
	if err == nil && !sameSnapshot(cur, snap) {
		// Removed and made again since this fork read it: its files are
		// the new snapshot's, its machine, disk and network the old one's.
		ref.Close()
		err = errdefs.FailedPrecondition("snapshot %q was replaced while this fork waited; fork again", snap.Tag)
	}
	if err != nil {
		isolated()
		return vmm.ParkSpec{}, nil, err
	}
	ps := vmm.ParkSpec{
		Name: sb.ID, RunDir: sb.Handle.RunDir, Config: snap.Machine, MemoryFile: snap.MemoryPath(),
		NICs: nics, Hold: []*os.File{ref.File}, Launch: launch,
	}
	if snap.Rootfs.Path != "" {
		ps.Disks = []vmm.Disk{{Path: snap.Rootfs.Path, ReadOnly: true}}
	}
	if snap.DiskSlot {
		// Made under the reference, which keeps the snapshot's disk
		// layer; what is made goes with the run dir.
		d, err := e.scratchDisk(ctx, cur, sb)
		if err != nil {
			ref.Close()
			isolated()
			return vmm.ParkSpec{}, nil, err
		}
		ps.Disks = append(ps.Disks, d)
	}
	return ps, func() { ref.Close(); isolated() }, nil
}

func msSince(t time.Time) float64 {
	return float64(time.Since(t).Microseconds()) / 1000
}

// Metadata limits.
const (
	maxMetadataKeys  = 64
	maxMetadataKey   = 128
	maxMetadataValue = 1024
)

func validateMetadata(md map[string]string) error {
	if len(md) > maxMetadataKeys {
		return errdefs.InvalidArgument("metadata has %d keys; the limit is %d", len(md), maxMetadataKeys)
	}
	for k, v := range md {
		if k == "" || len(k) > maxMetadataKey {
			return errdefs.InvalidArgument("metadata key %q: want 1 to %d bytes", k, maxMetadataKey)
		}
		if len(v) > maxMetadataValue {
			return errdefs.InvalidArgument("metadata value of %q: over %d bytes", k, maxMetadataValue)
		}
	}
	return nil
}

// BatchError is a fork in which some children failed to come up; it
// carries the first child's error (and its class).
type BatchError struct {
	Failed, N int
	First     error
}

func (b *BatchError) Error() string {
	return fmt.Sprintf("%d of %d children failed: %v", b.Failed, b.N, b.First)
}

func (b *BatchError) Unwrap() error { return b.First }

// sameSnapshot reports whether a and b are one snapshot, not two made
// under one tag at different times.
func sameSnapshot(a, b *snapshot.Snapshot) bool {
	return a.Tag == b.Tag && a.Created.Equal(b.Created) && a.ContentHash == b.ContentHash
}
