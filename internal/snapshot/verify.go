package snapshot

import (
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
)

// FileID is a cheap identity of a file: enough to tell, without reading
// it, that the file at a path was replaced (new inode) or rewritten (new
// size or modification time) since the identity was taken. The device
// number is left out on purpose: it is not stable across reboots on
// LVM or btrfs, and would refuse snapshots whose files never changed.
type FileID struct {
	Size    int64  `json:"size"`
	MtimeNS int64  `json:"mtime_ns"`
	Ino     uint64 `json:"ino"`
}

// Identify returns the identity of the file at path (following symlinks).
func Identify(path string) (*FileID, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return nil, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	return &FileID{Size: st.Size, MtimeNS: st.Mtim.Nano(), Ino: st.Ino}, nil
}

// diff describes how id differs from want; "" if it does not.
func (id *FileID) diff(want *FileID) string {
	switch {
	case id.Ino != want.Ino:
		return fmt.Sprintf("replaced: inode %d, was %d", id.Ino, want.Ino)
	case id.Size != want.Size:
		return fmt.Sprintf("size %d bytes, was %d", id.Size, want.Size)
	case id.MtimeNS != want.MtimeNS:
		return fmt.Sprintf("modified %s, was %s", mtime(id.MtimeNS), mtime(want.MtimeNS))
	}
	return ""
}

func mtime(ns int64) string { return time.Unix(0, ns).UTC().Format(time.RFC3339Nano) }

// Verify checks that the snapshot's files are still those it was made
// with: its memory and state files exist with their recorded sizes, and its
// root filesystem image has its recorded identity (a child restored onto
// another disk than the one in its saved memory corrupts that disk's
// filesystem as it sees it). What older metadata did not record is not
// checked. Failures are FailedPrecondition-class. Verify only stats files,
// so it is cheap enough to run before every restore.
func (s *Snapshot) Verify() error {
	for _, f := range []struct {
		what, path string
		size       int64
	}{
		{"memory file", s.MemoryPath(), s.MemoryBytes},
		{"device state file", s.StatePath(), s.StateBytes},
	} {
		fi, err := os.Stat(f.path)
		if errors.Is(err, os.ErrNotExist) {
			return errdefs.FailedPrecondition("snapshot %q: its %s %s is missing; %s", s.Tag, f.what, f.path, s.rebuild())
		}
		if err != nil {
			return fmt.Errorf("snapshot %q: %w", s.Tag, err)
		}
		if f.size != 0 && fi.Size() != f.size {
			return errdefs.FailedPrecondition("snapshot %q: its %s %s is %d bytes, was %d when it was made; %s",
				s.Tag, f.what, f.path, fi.Size(), f.size, s.rebuild())
		}
	}
	if s.Rootfs.Path == "" || s.Rootfs.ID == nil {
		return nil
	}
	id, err := Identify(s.Rootfs.Path)
	if errors.Is(err, os.ErrNotExist) {
		return errdefs.FailedPrecondition("snapshot %q: its root filesystem image %s is gone; %s", s.Tag, s.Rootfs.Path, s.rebuild())
	}
	if err != nil {
		return fmt.Errorf("snapshot %q: root filesystem image: %w", s.Tag, err)
	}
	if d := id.diff(s.Rootfs.ID); d != "" {
		return errdefs.FailedPrecondition("snapshot %q: its root filesystem image changed since it was made (%s: %s); %s",
			s.Tag, s.Rootfs.Path, d, s.rebuild())
	}
	return nil
}

// rebuild is the advice closing a Verify error.
func (s *Snapshot) rebuild() string {
	return fmt.Sprintf("rebuild the snapshot (forkd rmi %s, then create it again)", s.Tag)
}

// identifyInputs records in md the sizes of the memory and state files in
// dir and the identity of the root filesystem image. A rootfs identity the
// caller already set (taken before the parent VM booted) must still match:
// otherwise the image was replaced while the snapshot was made.
func identifyInputs(md *Metadata, memory, state string) error {
	for _, f := range []struct {
		path string
		size *int64
	}{{memory, &md.MemoryBytes}, {state, &md.StateBytes}} {
		fi, err := os.Stat(f.path)
		if err != nil {
			return err
		}
		*f.size = fi.Size()
	}
	if md.Rootfs.Path == "" {
		return nil
	}
	id, err := Identify(md.Rootfs.Path)
	if err != nil {
		return fmt.Errorf("root filesystem image: %w", err)
	}
	if md.Rootfs.ID != nil {
		if d := id.diff(md.Rootfs.ID); d != "" {
			return errdefs.FailedPrecondition("root filesystem image changed while the snapshot was made (%s: %s)", md.Rootfs.Path, d)
		}
	}
	md.Rootfs.ID = id
	return nil
}
