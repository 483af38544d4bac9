package sandbox

import (
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/snapshot"
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
