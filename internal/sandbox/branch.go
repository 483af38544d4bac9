package sandbox

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/disk"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/memimage"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/vmm"
)

// Branch modes (BranchSpec.Mode): what the user gets.
const (
	// BranchFull is a self-contained snapshot: no parent.
	BranchFull = "full"
	// BranchDiff is a layer of the pages that differ from the snapshot the
	// source came from, pinned to it by content hash; the source's pause
	// grows with the pages it wrote, not with its RAM.
	BranchDiff = "diff"
	// BranchLive pauses the source only to switch over: pages are copied
	// while it runs; the snapshot is its state at the switch-over.
	BranchLive = "live"
)

// DefaultMaxBranches bounds the branches being taken at once.
const DefaultMaxBranches = 2

// ValidateBranchMode checks a branch mode ("" is diff).
func ValidateBranchMode(mode string) error {
	switch mode {
	case "", BranchFull, BranchDiff, BranchLive:
		return nil
	}
	return errdefs.InvalidArgument("branch mode %q: want full, diff or live", mode)
}

// BranchSpec describes a branch of a running sandbox.
type BranchSpec struct {
	// ID is the source sandbox.
	ID string
	// Tag names the new snapshot; "" makes one up (branch-<id>-<time>).
	Tag string
	// Mode is BranchFull, BranchDiff (the default) or BranchLive.
	Mode string
	// Ephemeral makes the snapshot belong to its children: it is removed
	// once the last of them is gone (fork --from).
	Ephemeral bool
}

// BranchTag returns the tag Branch would make up for sandbox id now.
func BranchTag(id string) string {
	return fmt.Sprintf("branch-%s-%d", strings.TrimPrefix(id, "sb-"), time.Now().UnixMilli())
}

// Branch snapshots the running sandbox spec.ID into a new snapshot that
// more children can be forked from: all its guest RAM, its vCPU and
// device state (and, for a sandbox with a disk layer, that layer, copy on
// write). The source keeps running, its id and deadline unchanged; what it
// does after the branch never reaches the branch. A sandbox that is
// starting, dead, unresponsive, or being killed or branched is refused
// (FailedPrecondition); more than Config.MaxBranches at once are refused
// with ResourceExhausted. The new snapshot is written under its tag with
// status writing; a crash leaves it failed (snapshot.Store.Reclaim), never
// ready with wrong contents.
func (e *Engine) Branch(ctx context.Context, spec BranchSpec) (*snapshot.Snapshot, error) {
	start := time.Now()
	if err := ValidateID(spec.ID); err != nil {
		return nil, err
	}
	if err := ValidateBranchMode(spec.Mode); err != nil {
		return nil, err
	}
	if spec.Mode == "" {
		spec.Mode = BranchDiff
	}
	if spec.Tag == "" {
		spec.Tag = BranchTag(spec.ID)
	}
	if err := snapshot.ValidateTag(spec.Tag); err != nil {
		return nil, err
	}
	if _, err := e.snaps.Get(spec.Tag); err == nil {
		return nil, errdefs.AlreadyExists("snapshot %q already exists", spec.Tag)
	} else if !errdefs.IsNotFound(err) {
		return nil, err
	}
	select {
	case e.branches <- struct{}{}:
		defer func() { <-e.branches }()
	default:
		return nil, errdefs.ResourceExhausted("%d branches are being taken (at most %d at once); retry shortly", cap(e.branches), cap(e.branches))
	}
	// The source is held against kills and other branches while it is
	// captured; a kill waits for the capture (never a half snapshot).
	unlock, ok := e.ends.tryLock(spec.ID)
	if !ok {
		return nil, errdefs.FailedPrecondition("sandbox %s is being killed or branched; retry once that is done", spec.ID)
	}
	held := true
	release := func() {
		if held {
			held = false
			unlock()
		}
	}
	defer release()
	// Awake while it is branched: a frozen VMM answers no QMP. Its
	// clock is left to its next client (children set theirs anyway).
	awake, clock, err := e.hold(spec.ID, false)
	if err != nil {
		return nil, err
	}
	e.clockDone(spec.ID, clock, false)
	defer awake()
	sb, err := e.Get(ctx, spec.ID)
	if err != nil {
		return nil, err
	}
	if sb.Status != state.StatusRunning {
		return nil, errdefs.FailedPrecondition("sandbox %s is %s: only a running sandbox can be branched", spec.ID, sb.Status)
	}
	src, err := e.snaps.Get(sb.Snapshot)
	if err != nil {
		return nil, fmt.Errorf("the snapshot of sandbox %s: %w", spec.ID, err)
	}
	depth := 0
	if spec.Mode != BranchFull {
		depth = 1
		if src.Branch != nil && src.Parent != "" {
			depth = src.Branch.Depth + 1
		}
		if depth > snapshot.MaxDepth {
			return nil, errdefs.FailedPrecondition("sandbox %s: a %s branch would make a chain of depth %d (at most %d); branch it in full mode, or compact %s first",
				spec.ID, spec.Mode, depth, snapshot.MaxDepth, src.Tag)
		}
	}
	m, err := e.cfg.Backend.Attach(ctx, sb.Handle)
	if err != nil {
		return nil, err
	}
	md := branchMetadata(src, sb, spec, depth)
	if sb.Disk != nil {
		if sb.Disk.Image == "" || sb.Disk.Next != "" {
			// A branch switching it failed not knowing whether it
			// did, or was cut short: its VMM knows.
			if err := e.resolveDisk(ctx, m, sb); err != nil {
				return nil, err
			}
		}
		// Named in the staging metadata before it exists, so that GC
		// keeps it from the start.
		md.Branch.Disk, md.Branch.DiskMiB = disk.NewID(), sb.Disk.MiB
	}
	w, err := e.snaps.CreateBranch(spec.Tag, md)
	if err != nil {
		return nil, err
	}
	defer func() { _ = w.Abort() }() // no-op after Commit; the branch failed otherwise
	var db *diskBranch
	if sb.Disk != nil {
		if db, err = e.prepareDiskBranch(ctx, sb, md.Branch.Disk); err != nil {
			return nil, fmt.Errorf("branch %s of %s: %w", spec.Tag, spec.ID, err)
		}
	}
	got, err := e.capture(ctx, m, src, spec.Mode, w, db)
	if err == nil && got.switched {
		err = e.fault("disk-switched")
	}
	if db != nil {
		err = e.settleDisk(sb.ID, db, got.switched, err)
	}
	if err != nil {
		return nil, fmt.Errorf("branch %s of %s: %w", spec.Tag, spec.ID, err)
	}
	release() // the source is free: what follows reads snapshot files only
	if err := memimage.Materialize(src.MemoryPath(), w.LayerPath(), w.MemoryPath()); err != nil {
		return nil, fmt.Errorf("branch %s: materialise its memory: %w", spec.Tag, err)
	}
	if md.ContentHash, err = branchHash(src.ContentHash, w.StatePath(), w.LayerPath()); err != nil {
		return nil, err
	}
	if spec.Mode == BranchFull {
		// Stands alone: no layer, no parent.
		if err := os.Remove(w.LayerPath()); err != nil {
			return nil, err
		}
	}
	md.Branch.PauseMS, md.Branch.DirtyBytes = got.pauseMS, got.dirty
	md.Branch.DiskSwitchMS = got.diskMS
	md.Branch.TotalMS = msSince(start)
	snap, err := w.Commit(md)
	if err != nil {
		return nil, err
	}
	e.log.Info("sandbox branched", "sandbox", spec.ID, "snapshot", spec.Tag, "mode", spec.Mode,
		"pause_ms", got.pauseMS, "dirty_mib", got.dirty>>20, "disk_layer", md.Branch.Disk,
		"disk_switch_ms", got.diskMS, "total_ms", md.Branch.TotalMS)
	return snap, nil
}

// branchMetadata is a branch's metadata: the machine of its source's
// snapshot (a branch restores like it), its own identity and chain.
func branchMetadata(src *snapshot.Snapshot, sb *state.Sandbox, spec BranchSpec, depth int) snapshot.Metadata {
	md := src.Metadata
	md.Tag, md.Status, md.Error = spec.Tag, snapshot.StatusWriting, ""
	md.Created = time.Time{}
	md.MemoryBytes, md.StateBytes, md.ContentHash = 0, 0, ""
	md.Kind = snapshot.KindBranch
	md.Ephemeral = spec.Ephemeral
	md.Writer = starter()
	md.Warmup = nil
	md.Parent, md.ParentHash = "", ""
	if spec.Mode != BranchFull {
		md.Parent, md.ParentHash = src.Tag, src.ContentHash
	}
	md.Branch = &snapshot.BranchInfo{Mode: spec.Mode, Source: sb.ID, Depth: depth}
	return md
}

// captured is what a capture measured.
type captured struct {
	pauseMS float64
	dirty   int64
	// diskMS is the part of the pause the disk switch took (paused
	// modes; a live save's switch is inside its downtime).
	diskMS float64
	// switched: the source's disk was switched to the new overlay, even
	// if the capture failed afterwards.
	switched bool
}

// capture writes the source's device state to w's state file and the
// pages that differ from src's memory to w's layer file (holes elsewhere),
// and, with db, switches the source's disk to db's overlay at the same
// pause (see settleDisk for the outcome). Whatever happens, the source is
// running when it returns.
func (e *Engine) capture(ctx context.Context, m vmm.Machine, src *snapshot.Snapshot, mode string, w *snapshot.Writer, db *diskBranch) (captured, error) {
	var ds vmm.DiskSnapshotter
	if db != nil {
		var ok bool
		if ds, ok = m.(vmm.DiskSnapshotter); !ok {
			return captured{}, errdefs.NotImplemented("backend %s cannot branch a sandbox's disk", e.cfg.Backend.Name())
		}
	}
	layer, err := os.OpenFile(w.LayerPath(), os.O_CREATE|os.O_RDWR|os.O_TRUNC, 0o600)
	if err != nil {
		return captured{}, err
	}
	defer layer.Close()
	if err := layer.Truncate(int64(src.MemoryMiB) << 20); err != nil {
		return captured{}, err
	}
	if mode == BranchLive {
		return captureLive(ctx, m, src, w, layer, db)
	}
	saver, ok := m.(vmm.DeviceSaver)
	if !ok {
		return captured{}, errdefs.NotImplemented("backend %s cannot branch a running machine", e.cfg.Backend.Name())
	}
	mm, err := m.Memory(ctx)
	if err != nil {
		return captured{}, err
	}
	// Copy what is private already while the guest runs, so that the
	// pause mostly rewrites pages in place.
	pre, err := memimage.Private(mm)
	if err != nil {
		return captured{}, err
	}
	if _, err := memimage.Copy(mm, pre, layer); err != nil {
		return captured{}, err
	}
	t0 := time.Now()
	if err := m.Pause(ctx); err != nil {
		return captured{}, fmt.Errorf("pause: %w", err)
	}
	var pages memimage.Pages
	err = saver.SaveDevices(ctx, vmm.DeviceSaveSpec{BaseState: src.StatePath(), StateFile: w.StatePath()})
	if err == nil {
		pages, err = memimage.Private(mm)
	}
	if err == nil {
		_, err = memimage.Copy(mm, pages, layer)
	}
	var got captured
	if err == nil && db != nil {
		t := time.Now()
		err = ds.SnapshotDisk(ctx, scratchIndex, db.overlay)
		got.diskMS, got.switched = msSince(t), err == nil
	}
	rerr := m.Resume(context.WithoutCancel(ctx))
	got.pauseMS, got.dirty = msSince(t0), pages.Bytes()
	if err = errors.Join(err, rerr); err != nil {
		return got, err
	}
	return got, layer.Sync()
}

// settleDisk records the outcome of a branch's disk switch, given
// whether the capture switched it and its error, and returns the error:
// the source writes to the new overlay (its record says so; the old image
// is only the layer now), or it still writes to its image (the layer and
// the overlay go), or it is unknown which (both stay, recorded, until the
// next branch asks the VMM: resolveDisk).
func (e *Engine) settleDisk(id string, db *diskBranch, switched bool, err error) error {
	switch {
	case switched:
		if serr := db.switched(e, id); serr != nil {
			return errors.Join(err, serr, db.unknown(e, id))
		}
		return err
	case err == nil:
		return errors.New("disk switch: the capture neither switched the disk nor failed")
	case errors.Is(err, vmm.ErrDiskSwitch):
		return errors.Join(err, db.unknown(e, id))
	default:
		return errors.Join(err, db.notSwitched(e, id))
	}
}

// captureLive is capture by the backend's live save: each page it sends
// that differs from src's memory goes to the layer; one equal to it leaves
// a hole (punched after the save when an earlier copy had been written:
// the final pause waits for Page, which must stay fast).
func captureLive(ctx context.Context, m vmm.Machine, src *snapshot.Snapshot, w *snapshot.Writer, layer *os.File, db *diskBranch) (captured, error) {
	saver, ok := m.(vmm.LiveSaver)
	if !ok {
		return captured{}, errdefs.NotImplemented("this backend cannot branch a running machine live")
	}
	base, err := os.Open(src.MemoryPath())
	if err != nil {
		return captured{}, err
	}
	defer base.Close()
	size := int64(src.MemoryMiB) << 20
	mem, err := unix.Mmap(int(base.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return captured{}, fmt.Errorf("map the base memory: %w", err)
	}
	defer func() { _ = unix.Munmap(mem) }()
	const (
		untouched = iota
		written
		stale // written, then found equal to the base again
	)
	pages := make([]byte, size/pageSize)
	zero := make([]byte, pageSize)
	var disks []vmm.DiskSnapshot
	if db != nil {
		disks = []vmm.DiskSnapshot{{Index: scratchIndex, Overlay: db.overlay}}
	}
	stats, err := saver.SaveLive(ctx, vmm.LiveSaveSpec{
		StateFile: w.StatePath(),
		Disks:     disks,
		Page: func(off uint64, data []byte) error {
			i := off / pageSize
			if off%pageSize != 0 || i >= uint64(len(pages)) {
				return errdefs.InvalidArgument("page at %#x is outside guest RAM", off)
			}
			if data == nil {
				data = zero
			}
			if string(mem[off:off+pageSize]) == string(data) {
				if pages[i] == written {
					pages[i] = stale
				}
				return nil
			}
			pages[i] = written
			_, err := layer.WriteAt(data, int64(off))
			return err
		},
	})
	if err != nil {
		return captured{}, err
	}
	got := captured{pauseMS: float64(stats.Downtime.Microseconds()) / 1000, switched: db != nil}
	for i := 0; i < len(pages); {
		if pages[i] == written {
			got.dirty += pageSize
		}
		j := i
		for j < len(pages) && pages[j] == stale {
			j++
		}
		if j > i {
			if err := unix.Fallocate(int(layer.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(i)*pageSize, int64(j-i)*pageSize); err != nil {
				return got, err
			}
			i = j
			continue
		}
		i++
	}
	return got, layer.Sync()
}

// pageSize is the guest page size.
const pageSize = 4096

// branchHash is a branch's content hash: its parent's, its device state's
// and its layer's data, without reading the holes of the layer.
func branchHash(parentHash, statePath, layerPath string) (string, error) {
	h := sha256.New()
	fmt.Fprintf(h, "forkd-branch-v1\nparent %s\n", parentHash)
	for _, p := range []string{statePath, layerPath} {
		sum, err := memimage.DataHash(p)
		if err != nil {
			return "", err
		}
		h.Write(sum)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// ForkFrom branches the running sandbox id into a snapshot of its own
// (mode, "" for diff) and forks spec.N children of it: children of the
// source's current state. The snapshot belongs to them: it is removed once
// the last of them is gone (and at once if none came up). spec.Tag is
// ignored.
func (e *Engine) ForkFrom(ctx context.Context, id, mode string, spec ForkSpec) (*ForkResult, error) {
	snap, err := e.Branch(ctx, BranchSpec{ID: id, Mode: mode, Ephemeral: true})
	if err != nil {
		return nil, err
	}
	spec.Tag = snap.Tag
	res, err := e.Fork(ctx, spec)
	if res == nil || len(res.Children) == 0 {
		e.dropEphemeral(snap.Tag)
	}
	return res, err
}

// dropEphemeral removes snapshot tag if it belongs to its children
// (Ephemeral) and none of them is left. Called when a sandbox ends.
func (e *Engine) dropEphemeral(tag string) {
	snap, err := e.snaps.Get(tag)
	if err != nil || !snap.Ephemeral {
		return
	}
	if users, err := e.Users(tag); err != nil || len(users) > 0 {
		return
	}
	if deps, err := e.snaps.Dependents(tag); err != nil || len(deps) > 0 {
		return // branched again: kept for its dependents
	}
	if err := e.RemoveSnapshot(tag); err != nil && !errdefs.IsNotFound(err) && !errdefs.IsFailedPrecondition(err) {
		e.log.Warn("remove ephemeral snapshot", "snapshot", tag, "err", err)
	}
}

// Compact makes snapshot to, standing alone (no parent), from snapshot
// from: the same machine, memory and state, and its disk (if any)
// flattened into one layer of its own, so that its children and branches
// need nothing of from's chain. from is left as it is.
func (e *Engine) Compact(ctx context.Context, from, to string) (*snapshot.Snapshot, error) {
	if err := snapshot.ValidateTag(from); err != nil {
		return nil, err
	}
	if err := snapshot.ValidateTag(to); err != nil {
		return nil, err
	}
	src, ref, err := e.snaps.Acquire(from)
	if err != nil {
		return nil, err
	}
	defer ref.Close() // from cannot be removed while it is copied
	md := src.Metadata
	md.Tag, md.Created = to, time.Time{}
	md.MemoryBytes, md.StateBytes = 0, 0
	md.Parent, md.ParentHash, md.Ephemeral = "", "", false
	layer, _ := src.DiskLayer()
	if md.Branch != nil {
		b := *md.Branch
		b.Mode, b.Depth = BranchFull, 0
		if layer != "" {
			// Named in the staging metadata before it exists, as in
			// Branch.
			b.Disk = disk.NewID()
		}
		md.Branch = &b
	}
	w, err := e.snaps.CreateBranch(to, md)
	if err != nil {
		return nil, err
	}
	defer func() { _ = w.Abort() }()
	if layer != "" {
		// Its disk stands alone too: one layer, no backing chain.
		if err := e.disks.Flatten(ctx, md.Branch.Disk, layer, w.Dir()); err != nil {
			return nil, fmt.Errorf("compact %s: disk: %w", from, errors.Join(err, e.disks.Remove(md.Branch.Disk)))
		}
	}
	if err := memimage.SparseCopy(src.MemoryPath(), w.MemoryPath()); err != nil {
		return nil, fmt.Errorf("compact %s: memory: %w", from, err)
	}
	if err := memimage.SparseCopy(src.StatePath(), w.StatePath()); err != nil {
		return nil, fmt.Errorf("compact %s: state: %w", from, err)
	}
	h := sha256.Sum256([]byte("forkd-compact-v1\n" + src.ContentHash))
	md.ContentHash = hex.EncodeToString(h[:])
	md.Writer = nil
	if md.Kind == "" {
		md.Kind = snapshot.KindBoot
	}
	return w.Commit(md)
}
