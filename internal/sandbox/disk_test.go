package sandbox

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/disk"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/vmm"
)

func TestChildDisk(t *testing.T) {
	old := &snapshot.Snapshot{Metadata: snapshot.Metadata{Tag: "old", Rootfs: snapshot.FileRef{Path: "/r"}}}
	minimal := &snapshot.Snapshot{Metadata: snapshot.Metadata{Tag: "min"}}
	slot := &snapshot.Snapshot{Metadata: snapshot.Metadata{Tag: "py", DiskSlot: true, Rootfs: snapshot.FileRef{Path: "/r"}}}
	branch := &snapshot.Snapshot{Metadata: snapshot.Metadata{Tag: "b", DiskSlot: true, Rootfs: snapshot.FileRef{Path: "/r"},
		Branch: &snapshot.BranchInfo{Mode: BranchDiff, Disk: "dl-0123456789abcdef", DiskMiB: 512}}}
	for _, c := range []struct {
		snap      *snapshot.Snapshot
		ask       int
		layer     string
		mib       int
		class     func(error) bool
		errSubstr string
	}{
		{snap: old, ask: 0},
		{snap: slot, ask: 0},
		{snap: slot, ask: 64, mib: 64},
		{snap: slot, ask: 1 << 20, mib: 1 << 20},
		{snap: slot, ask: 32, class: errdefs.IsInvalidArgument, errSubstr: "disk_mib = 32"},
		{snap: old, ask: 256, class: errdefs.IsFailedPrecondition, errSubstr: "rebuild the snapshot"},
		{snap: minimal, ask: 256, class: errdefs.IsFailedPrecondition, errSubstr: "no root file system"},
		// A branch with a disk gives it to every child.
		{snap: branch, ask: 0, layer: "dl-0123456789abcdef", mib: 512},
		{snap: branch, ask: 512, layer: "dl-0123456789abcdef", mib: 512},
		{snap: branch, ask: 1024, class: errdefs.IsInvalidArgument, errSubstr: "must be 0 or 512"},
	} {
		layer, mib, err := childDisk(c.snap, c.ask)
		if c.class != nil {
			if !c.class(err) || !strings.Contains(err.Error(), c.errSubstr) {
				t.Errorf("%s with %d MiB: %v, want %q", c.snap.Tag, c.ask, err, c.errSubstr)
			}
			continue
		}
		if err != nil || layer != c.layer || mib != c.mib {
			t.Errorf("%s with %d MiB = %q, %d, %v; want %q, %d", c.snap.Tag, c.ask, layer, mib, err, c.layer, c.mib)
		}
	}
}

// switchAsker is a machine that only answers DiskSwitched.
type switchAsker struct {
	vmm.Machine
	switched bool
	err      error
	asked    []string
}

func (m *switchAsker) DiskSwitched(_ context.Context, index int, overlay string) (bool, error) {
	m.asked = append(m.asked, fmt.Sprintf("%d %s", index, overlay))
	return m.switched, m.err
}

// overlayOver writes at path the start of a qcow2 image whose backing
// file is backing: as much as GC reads of it.
func overlayOver(t *testing.T, path, backing string) {
	t.Helper()
	b := make([]byte, 32+len(backing))
	copy(b, "QFI\xfb")
	binary.BigEndian.PutUint32(b[4:], 3)
	binary.BigEndian.PutUint64(b[8:], 32)
	binary.BigEndian.PutUint32(b[16:], uint32(len(backing)))
	copy(b[32:], backing)
	testutil.WriteFile(t, path, b, 0o600)
}

// unknownDisk makes what a branch of a running sandbox with a disk leaves
// when its switch got no answer: the layer (a second name of the disk's
// image), the overlay over it, and a record that names both images.
func unknownDisk(t *testing.T, e *Engine) (sb *state.Sandbox, top, layer, overlay string) {
	t.Helper()
	id := "sb-aaaaaaaaaa"
	dir := filepath.Join(e.runDir, id)
	testutil.MkdirAll(t, dir, 0o700)
	top = filepath.Join(dir, "disk.qcow2")
	overlayOver(t, top, "/images/empty.raw")
	testutil.Check(t, e.state.Put(&state.Sandbox{ID: id, Status: state.StatusRunning,
		Handle: vmm.Handle{Backend: "fake", RunDir: dir}, Disk: &state.Disk{MiB: 64, Image: top}}))
	layer = disk.NewID()
	db := &diskBranch{layer: layer, mib: 64, oldTop: top, overlay: filepath.Join(dir, "disk-"+layer+disk.Ext)}
	testutil.Check(t, e.disks.Add(layer, top))
	overlayOver(t, db.overlay, e.disks.Path(layer))
	testutil.Check(t, db.record(e, id, top, db.overlay)) // as prepareDiskBranch does
	cause := fmt.Errorf("qmp blockdev-snapshot: EOF (%w)", vmm.ErrDiskSwitch)
	if err := e.settleDisk(id, db, false, cause); !errors.Is(err, vmm.ErrDiskSwitch) {
		t.Fatalf("settleDisk = %v, want the capture's error", err)
	}
	sb, err := e.state.Get(id)
	testutil.Check(t, err)
	if *sb.Disk != (state.Disk{MiB: 64, Image: top, Next: db.overlay}) {
		t.Fatalf("after an unknown switch the record says %+v, want both images", *sb.Disk)
	}
	return sb, top, layer, db.overlay
}

// checkDisk checks the record of sandbox id's disk, and which of files
// exist.
func checkDisk(t *testing.T, e *Engine, id string, want state.Disk, files map[string]bool) {
	t.Helper()
	sb, err := e.state.Get(id)
	testutil.Check(t, err)
	if *sb.Disk != want {
		t.Errorf("record %+v, want %+v", *sb.Disk, want)
	}
	for p, exists := range files {
		if _, err := os.Stat(p); (err == nil) != exists {
			t.Errorf("%s: exists %t, want %t (%v)", filepath.Base(p), err == nil, exists, err)
		}
	}
}

// TestResolveDisk settles a disk whose switch's outcome was unknown by
// asking the machine: switched, not switched, or no answer.
func TestResolveDisk(t *testing.T) {
	ctx := context.Background()
	t.Run("switched", func(t *testing.T) {
		e := fakeEngine(t)
		sb, top, layer, overlay := unknownDisk(t, e)
		m := &switchAsker{switched: true}
		testutil.Check(t, e.resolveDisk(ctx, m, sb))
		if want := []string{"1 " + overlay}; !slices.Equal(m.asked, want) {
			t.Errorf("asked %q, want %q", m.asked, want)
		}
		want := state.Disk{MiB: 64, Image: overlay}
		if *sb.Disk != want {
			t.Errorf("sandbox given back with %+v, want %+v", *sb.Disk, want)
		}
		// The old image keeps only its name as the layer, which the
		// overlay backs onto: GC keeps it.
		e.gcDisks()
		checkDisk(t, e, sb.ID, want, map[string]bool{top: false, e.disks.Path(layer): true, overlay: true})
	})
	t.Run("not switched", func(t *testing.T) {
		e := fakeEngine(t)
		sb, top, layer, overlay := unknownDisk(t, e)
		testutil.Check(t, e.resolveDisk(ctx, &switchAsker{}, sb))
		want := state.Disk{MiB: 64, Image: top}
		if *sb.Disk != want {
			t.Errorf("sandbox given back with %+v, want %+v", *sb.Disk, want)
		}
		checkDisk(t, e, sb.ID, want, map[string]bool{top: true, e.disks.Path(layer): false, overlay: false})
	})
	t.Run("no answer", func(t *testing.T) {
		e := fakeEngine(t)
		sb, top, layer, overlay := unknownDisk(t, e)
		err := e.resolveDisk(ctx, &switchAsker{err: errdefs.Unavailable("qemu exited")}, sb)
		if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "qemu exited") {
			t.Errorf("resolveDisk = %v, want FailedPrecondition with the reason", err)
		}
		// Nothing changes: the next branch asks again.
		e.gcDisks()
		checkDisk(t, e, sb.ID, state.Disk{MiB: 64, Image: top, Next: overlay},
			map[string]bool{top: true, e.disks.Path(layer): true, overlay: true})
	})
	t.Run("refused", func(t *testing.T) {
		e := fakeEngine(t)
		sb, _, _, overlay := unknownDisk(t, e)
		for _, c := range []struct {
			name   string
			disk   state.Disk
			m      vmm.Machine
			substr string
		}{
			// Blanked by an older forkd: not known which it was.
			{name: "blanked", disk: state.Disk{MiB: 64}, m: &switchAsker{}, substr: "cannot be branched again"},
			{name: "no checker", disk: *sb.Disk, m: fakeMachine{}, substr: "cannot tell"},
			{name: "outside its run dir", disk: state.Disk{MiB: 64, Image: sb.Disk.Image, Next: filepath.Join(e.runDir, filepath.Base(overlay))},
				m: &switchAsker{}, substr: "not side by side"},
			{name: "not a layer's overlay", disk: state.Disk{MiB: 64, Image: sb.Disk.Image, Next: filepath.Join(sb.Handle.RunDir, "disk-x.qcow2")},
				m: &switchAsker{}, substr: "not named after a disk layer"},
		} {
			s := *sb
			s.Disk = &c.disk
			err := e.resolveDisk(ctx, c.m, &s)
			if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), c.substr) {
				t.Errorf("%s: resolveDisk = %v, want FailedPrecondition saying %q", c.name, err, c.substr)
			}
			if a, ok := c.m.(*switchAsker); ok && len(a.asked) > 0 {
				t.Errorf("%s: the machine was asked", c.name)
			}
		}
	})
}

// fakeMachine is a machine that cannot tell where its disk writes.
type fakeMachine struct{ vmm.Machine }
