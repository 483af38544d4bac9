package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/disk"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/vmm"
)

// A snapshot with a disk slot (snapshot.Metadata.DiskSlot) has a second
// disk after its root file system. Its parent wrote nothing there (a
// private 1 MiB file); a child without a disk gets the image cache's
// placeholder, read-only; a child with one gets a qcow2 overlay in its
// run dir, over an empty ext4 image of its size or, for a child of a
// branch of a sandbox with a disk, over the branch's disk layer. After
// the restore the disk is resized to its size (the guest remembers the
// parent's 1 MiB) and the agent moves the root's writable layer onto it.
const (
	// scratchIndex is the slot's disk index: after the root file system.
	scratchIndex = 1
	// scratchSerial is how the guest finds the slot's disk.
	scratchSerial = "forkd-scratch"
	// parentScratch is the parent's slot image, in its run dir.
	parentScratch = "scratch.raw"
)

// childDisk says what disk a child of snap forked with diskMiB gets: the
// disk layer it is made over ("" for an empty disk) and its size (0: no
// disk). A child of a branch of a sandbox with a disk always gets that
// disk.
func childDisk(snap *snapshot.Snapshot, diskMiB int) (layer string, mib int, err error) {
	if err := disk.ValidateMiB("disk_mib", diskMiB); err != nil {
		return "", 0, err
	}
	if layer, mib := snap.DiskLayer(); layer != "" {
		if diskMiB != 0 && diskMiB != mib {
			return "", 0, errdefs.InvalidArgument("snapshot %q carries a disk of %d MiB that every child gets: disk_mib must be 0 or %d, not %d", snap.Tag, mib, mib, diskMiB)
		}
		return layer, mib, nil
	}
	if diskMiB > 0 && !snap.DiskSlot {
		why := "it was made by a forkd without disk support"
		if snap.Rootfs.Path == "" {
			why = "its image has no root file system"
		}
		return "", 0, errdefs.FailedPrecondition("snapshot %q has no slot for a disk (%s): rebuild the snapshot from an image with a root file system (forkd rmi %s, then forkd snapshot) to fork it with --disk-mib", snap.Tag, why, snap.Tag)
	}
	return "", diskMiB, nil
}

// parentDisk makes the parent's slot image: writable, so that the guest's
// driver does not take the disk for read-only (a feature it negotiates
// once, which its children inherit), and empty.
func parentDisk(runDir string) (vmm.Disk, error) {
	if err := os.MkdirAll(runDir, 0o700); err != nil {
		return vmm.Disk{}, err
	}
	p := filepath.Join(runDir, parentScratch)
	f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return vmm.Disk{}, err
	}
	err = f.Truncate(image.PlaceholderBytes)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return vmm.Disk{Path: p, Format: vmm.FormatRaw, Serial: scratchSerial}, err
}

// scratchDisk returns the image of sb's disk slot: the placeholder when it
// has no disk, else a new overlay at sb.Disk.Image over snap's disk layer
// or an empty disk base. The caller holds a reference on snap, which
// keeps its layer; what scratchDisk makes is in sb's run dir.
func (e *Engine) scratchDisk(ctx context.Context, snap *snapshot.Snapshot, sb *state.Sandbox) (vmm.Disk, error) {
	if sb.Disk == nil {
		ph, err := e.images.DiskPlaceholder(ctx)
		if err != nil {
			return vmm.Disk{}, fmt.Errorf("disk placeholder: %w", err)
		}
		return vmm.Disk{Path: ph, ReadOnly: true, Format: vmm.FormatRaw, Serial: scratchSerial}, nil
	}
	backing, format := "", "qcow2"
	if layer, _ := snap.DiskLayer(); layer != "" {
		backing = e.disks.Path(layer)
		if _, err := os.Stat(backing); err != nil {
			return vmm.Disk{}, errdefs.FailedPrecondition("snapshot %q: its disk layer %s: %w", snap.Tag, layer, err)
		}
	} else {
		var err error
		if backing, err = e.images.DiskBase(ctx, sb.Disk.MiB); err != nil {
			return vmm.Disk{}, fmt.Errorf("disk base: %w", err)
		}
		format = "raw"
	}
	if err := os.MkdirAll(filepath.Dir(sb.Disk.Image), 0o700); err != nil {
		return vmm.Disk{}, err
	}
	if err := e.disks.Overlay(ctx, sb.Disk.Image, backing, format, int64(sb.Disk.MiB)<<20); err != nil {
		return vmm.Disk{}, err
	}
	return vmm.Disk{Path: sb.Disk.Image, Format: vmm.FormatQCOW2, Serial: scratchSerial, SharedBacking: true}, nil
}

// resizeDisk tells a restored child's guest its disk's size: the guest
// knows the size of its snapshot's slot image until then.
func resizeDisk(ctx context.Context, m vmm.Machine, sb *state.Sandbox) error {
	if sb.Disk == nil {
		return nil
	}
	ds, ok := m.(vmm.DiskSnapshotter)
	if !ok {
		return errdefs.NotImplemented("this backend cannot give sandboxes a disk")
	}
	return ds.ResizeDisk(ctx, scratchIndex, int64(sb.Disk.MiB)<<20)
}

// diskRequest is what the agent of sb is told of its disk (nil: none),
// once its features are checked.
func diskRequest(c *agent.Client, sb *state.Sandbox, tag string) (*proto.Disk, error) {
	if sb.Disk == nil {
		return nil, nil
	}
	if !slices.Contains(c.Features(), proto.FeatureDisk) {
		return nil, errdefs.FailedPrecondition("disk: the agent of snapshot %s cannot attach one (made with an older agent; snapshot it again)", tag)
	}
	return &proto.Disk{Serial: scratchSerial, MiB: sb.Disk.MiB}, nil
}

// diskBranch is a branch's part of a source's disk: the layer the source's
// current image becomes, and the overlay the source goes on writing to.
type diskBranch struct {
	layer   string
	mib     int
	oldTop  string // the source's current image
	overlay string // its next one, over the layer
}

// prepareDiskBranch makes the layer and the new overlay of sb's disk
// (whose image is known) before the source is paused: the layer is a
// second name of the current image, which the switch (at the pause)
// freezes. The branch's staging metadata names the layer already, so GC
// keeps it. Undone by abort.
func (e *Engine) prepareDiskBranch(ctx context.Context, sb *state.Sandbox, layer string) (*diskBranch, error) {
	db := &diskBranch{layer: layer, mib: sb.Disk.MiB, oldTop: sb.Disk.Image,
		overlay: filepath.Join(filepath.Dir(sb.Disk.Image), overlayName(layer))}
	if err := e.disks.Add(layer, db.oldTop); err != nil {
		return nil, err
	}
	if err := e.disks.Overlay(ctx, db.overlay, e.disks.Path(layer), "qcow2", int64(db.mib)<<20); err != nil {
		return nil, errors.Join(err, e.disks.Remove(layer))
	}
	// Recorded before the switch: a crash past this point leaves the
	// image the VMM writes to unknown, and the record says so.
	if err := db.record(e, sb.ID, db.oldTop, db.overlay); err != nil {
		return nil, errors.Join(err, db.abort(e))
	}
	return db, nil
}

// overlayName is the file name of the overlay a branch of disk layer
// layer gives its source, next to the source's image.
func overlayName(layer string) string { return "disk-" + layer + disk.Ext }

// record sets the source's disk image and next image in its record.
func (db *diskBranch) record(e *Engine, id, image, next string) error {
	_, err := e.state.Update(id, func(r *state.Sandbox) error {
		if r.Disk != nil {
			r.Disk.Image, r.Disk.Next = image, next
		}
		return nil
	})
	return err
}

// abort undoes prepareDiskBranch when the switch was not made.
func (db *diskBranch) abort(e *Engine) error {
	return errors.Join(os.Remove(db.overlay), e.disks.Remove(db.layer))
}

// notSwitched records that the source still writes to its image, and
// undoes prepareDiskBranch. Should the record fail, its next image stays
// set (the disk counts as unknown) and so do the files.
func (db *diskBranch) notSwitched(e *Engine, id string) error {
	if err := db.record(e, id, db.oldTop, ""); err != nil {
		return err
	}
	return db.abort(e)
}

// switched records that the source now writes to the new overlay: its
// record names it, and the old image keeps only its name as a layer.
func (db *diskBranch) switched(e *Engine, id string) error {
	if err := db.record(e, id, db.overlay, ""); err != nil {
		return err
	}
	if err := os.Remove(db.oldTop); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// unknown records that a failed switch left the source's image unknown:
// its record keeps both images, as a crash during the switch leaves it,
// and so do its files, until resolveDisk asks the VMM which it writes to.
func (db *diskBranch) unknown(e *Engine, id string) error {
	return db.record(e, id, db.oldTop, db.overlay)
}

// resolveDisk settles the disk of sb, a running sandbox whose record
// leaves its image unknown (Disk.Next set by a branch that failed without
// knowing whether it switched the disk, or that a crash cut short), by
// asking m which of the two images its disk writes to, and records that
// as the branch would have (switched or notSwitched), in the record and
// in sb. The caller holds sb against kills and branches. Without an
// answer it is FailedPrecondition with the reason, and nothing changes:
// the next branch asks again. A record whose image an older forkd
// blanked cannot be settled.
func (e *Engine) resolveDisk(ctx context.Context, m vmm.Machine, sb *state.Sandbox) error {
	unknown := fmt.Sprintf("sandbox %s: the state of its disk is unknown since a branch of it failed", sb.ID)
	if sb.Disk.Image == "" {
		return errdefs.FailedPrecondition("%s; it cannot be branched again", unknown)
	}
	db, err := e.pendingDiskBranch(sb)
	if err != nil {
		return errdefs.FailedPrecondition("%s, and its record is not one forkd makes (%w); it cannot be branched again", unknown, err)
	}
	ds, ok := m.(vmm.DiskSwitchChecker)
	if !ok {
		return errdefs.FailedPrecondition("%s, and backend %s cannot tell which image it writes to; it cannot be branched again", unknown, e.cfg.Backend.Name())
	}
	switched, err := ds.DiskSwitched(ctx, scratchIndex, db.overlay)
	if err != nil {
		return errdefs.FailedPrecondition("%s, and its VMM did not tell which image it writes to (%w); retry to ask again", unknown, err)
	}
	if switched {
		err = db.switched(e, sb.ID)
	} else {
		err = db.notSwitched(e, sb.ID)
	}
	if err != nil {
		return fmt.Errorf("sandbox %s: settle its disk (switched: %t): %w", sb.ID, switched, err)
	}
	if switched {
		sb.Disk.Image = db.overlay
	}
	sb.Disk.Next = ""
	e.log.Info("settled the disk of a failed branch", "sandbox", sb.ID, "switched", switched, "image", sb.Disk.Image)
	return nil
}

// pendingDiskBranch is the branch of sb's disk its record says is in
// progress: the overlay next to its image, named by prepareDiskBranch
// after the layer. Both are in one of the engine's run dirs.
func (e *Engine) pendingDiskBranch(sb *state.Sandbox) (*diskBranch, error) {
	d := sb.Disk
	dir := filepath.Dir(d.Image)
	if filepath.Dir(dir) != e.runDir || filepath.Dir(d.Next) != dir || d.Next == d.Image {
		return nil, errdefs.InvalidArgument("disk images %s and %s: not side by side in a run dir", errdefs.Quote(d.Image), errdefs.Quote(d.Next))
	}
	name := filepath.Base(d.Next)
	layer := strings.TrimSuffix(strings.TrimPrefix(name, "disk-"), disk.Ext)
	if name != overlayName(layer) || disk.ValidateID(layer) != nil {
		return nil, errdefs.InvalidArgument("disk image %s: not named after a disk layer", errdefs.Quote(d.Next))
	}
	return &diskBranch{layer: layer, mib: d.MiB, oldTop: d.Image, overlay: d.Next}, nil
}

// gcDisks removes the disk layers nothing uses any more: no snapshot
// (being written, ready or failed) names one, no other layer backs onto
// it, and no image in a run dir (a sandbox's disk, whatever its state)
// reaches it. Errors are logged: a layer left is removed by the next GC.
func (e *Engine) gcDisks() {
	removed, err := e.disks.GC(func() (disk.Refs, error) {
		var r disk.Refs
		snaps, err := e.snaps.List()
		if err != nil {
			return r, err
		}
		for _, sn := range snaps {
			if layer, _ := sn.DiskLayer(); layer != "" {
				r.Layers = append(r.Layers, layer)
			}
		}
		r.Images, err = filepath.Glob(filepath.Join(e.runDir, "*", "*.qcow2"))
		return r, err
	})
	if len(removed) > 0 {
		e.log.Info("removed disk layers", "layers", removed)
	}
	if err != nil {
		e.log.Warn("collect disk layers", "err", err)
	}
}
