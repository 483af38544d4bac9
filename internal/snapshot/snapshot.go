// Package snapshot is the on-disk store of warm snapshots.
//
// Layout, one directory per tag under the store root:
//
//	<root>/<tag>/metadata.json   Metadata, written last
//	<root>/<tag>/memory          guest RAM (sparse); children map it MAP_PRIVATE
//	<root>/<tag>/state           device state
//	<root>/<tag>/lock            reference lock (see below)
//
// A snapshot is built in <root>/.staging-<tag>-<random>/ and renamed into
// place only when complete, so a crash never leaves a half-written tag.
// Staging dirs are held by an exclusive flock on their lock file while their
// writer lives; Reclaim removes the ones whose writer died.
//
// References: every VMM restored from a snapshot keeps a shared flock on the
// snapshot's lock file for its whole life (the fd is inherited by the VMM
// process). Remove takes the lock exclusively and fails while any child
// lives, whatever process started it, with no counter to drift after a
// crash.
package snapshot

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
)

// FormatVersion is the version of the layout and metadata this code writes
// and reads.
const FormatVersion = 1

// Status of a snapshot.
type Status string

// Snapshot statuses.
const (
	StatusWriting Status = "writing"
	StatusReady   Status = "ready"
	StatusFailed  Status = "failed"
	// StatusCorrupt: a tag this forkd cannot use (its metadata is missing,
	// unreadable, invalid or of another format version; Error says which).
	// Only List reports it; Remove deletes it.
	StatusCorrupt Status = "corrupt"
)

// File names inside a snapshot directory.
const (
	MetadataFile = "metadata.json"
	MemoryFile   = "memory"
	StateFile    = "state"
	LockFile     = "lock"
	// LayerFile is a diff or live branch's own pages (see BranchInfo).
	LayerFile = "layer"
)

// FileRef names an input file and its content hash. ID is its identity
// when the snapshot was made; Commit records it for Rootfs only, the one
// input a restore reads (kernel and initrd are in the saved memory), and
// Snapshot.Verify checks it. Metadata from older forkd has none.
type FileRef struct {
	Path   string  `json:"path,omitempty"`
	SHA256 string  `json:"sha256,omitempty"`
	ID     *FileID `json:"id,omitempty"`
}

// Metadata is metadata.json.
type Metadata struct {
	FormatVersion  int             `json:"format_version"`
	Tag            string          `json:"tag"`
	Status         Status          `json:"status"`
	Error          string          `json:"error,omitempty"`
	Backend        string          `json:"backend"`
	BackendVersion string          `json:"backend_version"`
	Accelerator    string          `json:"accelerator"`
	Machine        json.RawMessage `json:"machine"`
	Image          string          `json:"image"`
	Kernel         FileRef         `json:"kernel"`
	Initrd         FileRef         `json:"initrd"`
	Rootfs         FileRef         `json:"rootfs,omitempty"`
	MemoryMiB      int             `json:"memory_mib"`
	VCPUs          int             `json:"vcpus"`
	// MemoryBytes and StateBytes are the sizes of the memory and state
	// files, set by Commit (0: not recorded, by an older forkd).
	MemoryBytes int64 `json:"memory_bytes,omitempty"`
	StateBytes  int64 `json:"state_bytes,omitempty"`
	// Network: the machine has a NIC (configured as netns.GuestAddr), so
	// every child gets its own network namespace.
	Network bool `json:"network,omitempty"`
	// DiskSlot: the machine has a disk after its root file system whose
	// image each child chooses: a writable disk of its own, or a
	// placeholder. Snapshots made by an older forkd, or of an image
	// without a root file system, have none, and their children no disk.
	DiskSlot    bool      `json:"disk_slot,omitempty"`
	Python      string    `json:"python,omitempty"`
	Preload     []string  `json:"preload,omitempty"`
	Warmup      []string  `json:"warmup,omitempty"`
	Parent      string    `json:"parent,omitempty"`
	ParentHash  string    `json:"parent_hash,omitempty"`
	ContentHash string    `json:"content_hash,omitempty"`
	Created     time.Time `json:"created"`

	// Kind is how the snapshot was made: KindBoot ("" in older
	// metadata: a parent VM booted from an image) or KindBranch (the state
	// of a running sandbox).
	Kind string `json:"kind,omitempty"`
	// Branch is what a branch records of its making (nil otherwise).
	Branch *BranchInfo `json:"branch,omitempty"`
	// Ephemeral snapshots belong to their children (fork --from): removed
	// once the last of them is gone.
	Ephemeral bool `json:"ephemeral,omitempty"`
	// Writer is the forkd process writing the snapshot, while it is
	// written (staging metadata only): a staging branch whose writer died
	// becomes a failed snapshot.
	Writer *proc.Identity `json:"writer,omitempty"`
	// Origin says where a snapshot pulled from a registry (or unpacked
	// from a layout file) came from; nil for one made here.
	Origin *Origin `json:"origin,omitempty"`
}

// Origin is where a snapshot made elsewhere came from.
type Origin struct {
	// Ref is the registry reference pulled, or the layout file unpacked.
	Ref string `json:"ref"`
	// Digest is the manifest digest of the snapshot's artifact.
	Digest string    `json:"digest"`
	Pulled time.Time `json:"pulled"`
	// CPU is the CPU of the host the snapshot was made on.
	CPU *CPU `json:"cpu,omitempty"`
}

// CPU describes a host CPU.
type CPU struct {
	Vendor string   `json:"vendor,omitempty"`
	Model  string   `json:"model,omitempty"`
	Flags  []string `json:"flags,omitempty"`
}

// Kinds of snapshot.
const (
	KindBoot   = "boot"
	KindBranch = "branch"
)

// BranchInfo is what a branch records of its making. Its memory file is
// always complete (materialised), so children need no other snapshot; its
// layer file, for diff and live branches, holds only the pages that
// differ from its parent's memory (holes elsewhere), the unit that a chain
// is made of.
type BranchInfo struct {
	// Mode is full (no parent), diff or live.
	Mode string `json:"mode"`
	// Source is the sandbox the branch was taken from.
	Source string `json:"source"`
	// Depth is the number of layers down to a snapshot that stands alone
	// (1 for a diff or live branch of a boot or full snapshot).
	Depth int `json:"depth,omitempty"`
	// PauseMS is how long the source was paused; DirtyBytes how much of
	// its memory differed from its snapshot's.
	PauseMS    float64 `json:"pause_ms"`
	DirtyBytes int64   `json:"dirty_bytes"`
	// TotalMS is the whole branch, materialisation included.
	TotalMS float64 `json:"total_ms"`
	// Disk is the branch's writable disk layer, the source's disk as it
	// was at the branch (a layer id of package disk: a qcow2 file of the
	// data dir's disk store, "" when the source had no disk), and DiskMiB
	// its size. Every child of the branch gets a disk over it.
	Disk    string `json:"disk,omitempty"`
	DiskMiB int    `json:"disk_mib,omitempty"`
	// DiskSwitchMS is the part of PauseMS the switch of the source's
	// disk to a new overlay took (paused modes only).
	DiskSwitchMS float64 `json:"disk_switch_ms,omitempty"`
}

// Snapshot is a snapshot found in the store.
type Snapshot struct {
	Metadata
	Dir string `json:"dir"`
}

// MemoryPath is the snapshot's memory file.
func (s *Snapshot) MemoryPath() string { return filepath.Join(s.Dir, MemoryFile) }

// StatePath is the snapshot's device state file.
func (s *Snapshot) StatePath() string { return filepath.Join(s.Dir, StateFile) }

// LayerPath is a branch's layer file.
func (s *Snapshot) LayerPath() string { return filepath.Join(s.Dir, LayerFile) }

// DiskLayer returns the disk layer every child of the snapshot gets and
// its size ("", 0 when it has none).
func (s *Snapshot) DiskLayer() (string, int) {
	if s.Branch == nil || s.Branch.Disk == "" {
		return "", 0
	}
	return s.Branch.Disk, s.Branch.DiskMiB
}

// LockPath is the snapshot's reference lock file.
func (s *Snapshot) LockPath() string { return filepath.Join(s.Dir, LockFile) }

// SizeBytes is the disk space the snapshot's files use.
func (s *Snapshot) SizeBytes() int64 {
	var total int64
	entries, _ := os.ReadDir(s.Dir)
	for _, e := range entries {
		var st unix.Stat_t
		if unix.Stat(filepath.Join(s.Dir, e.Name()), &st) == nil {
			total += st.Blocks * 512
		}
	}
	return total
}

// ErrInUse is in the chain of Remove's error for a snapshot that VMMs
// still hold references on.
var ErrInUse = errors.New("in use")

// Store is a snapshot directory tree.
type Store struct {
	root string
}

// Open returns the store rooted at dir, creating it if needed.
func Open(dir string) (*Store, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("snapshot store: %w", err)
	}
	return &Store{root: dir}, nil
}

// Root is the store's directory.
func (s *Store) Root() string { return s.root }

// path returns the directory of tag after validating it.
func (s *Store) path(tag string) (string, error) {
	if err := ValidateTag(tag); err != nil {
		return "", err
	}
	return filepath.Join(s.root, tag), nil
}

// Get returns the snapshot named tag.
func (s *Store) Get(tag string) (*Snapshot, error) {
	dir, err := s.path(tag)
	if err != nil {
		return nil, err
	}
	return load(dir, tag)
}

func load(dir, tag string) (*Snapshot, error) {
	md, err := readMetadata(dir, tag)
	if errors.Is(err, os.ErrNotExist) {
		if _, serr := os.Lstat(dir); errors.Is(serr, os.ErrNotExist) {
			return nil, errdefs.NotFound("snapshot %q not found", tag)
		}
	}
	var fe *formatError
	switch {
	case errors.As(err, &fe):
		return nil, errdefs.FailedPrecondition("snapshot %q has %w", tag, fe)
	case err != nil:
		return nil, errdefs.FailedPrecondition("snapshot %q is corrupt: %w; remove it (forkd rmi %s)", tag, err, tag)
	}
	return &Snapshot{Metadata: *md, Dir: dir}, nil
}

// formatError is metadata of a format version this forkd does not read.
type formatError struct{ version int }

func (e *formatError) Error() string {
	return fmt.Sprintf("format version %d; this forkd reads %d", e.version, FormatVersion)
}

// readMetadata reads and checks dir's metadata.json; its errors say what is
// wrong with it, without naming the tag.
func readMetadata(dir, tag string) (*Metadata, error) {
	b, err := os.ReadFile(filepath.Join(dir, MetadataFile))
	if err != nil {
		return nil, err
	}
	var md Metadata
	if err := json.Unmarshal(b, &md); err != nil {
		return nil, fmt.Errorf("corrupt %s: %w", MetadataFile, err)
	}
	if md.FormatVersion != FormatVersion {
		return nil, &formatError{md.FormatVersion}
	}
	if md.Tag != tag {
		return nil, fmt.Errorf("%s names tag %q", MetadataFile, md.Tag)
	}
	return &md, nil
}

// List returns every snapshot in the store, sorted by tag. A tag whose
// metadata cannot be used is listed with StatusCorrupt, Error saying why,
// so that it can be found and removed. A snapshot still being written
// (a live staging directory) is listed with StatusWriting.
func (s *Store) List() ([]*Snapshot, error) {
	entries, err := os.ReadDir(s.root)
	if err != nil {
		return nil, err
	}
	var out []*Snapshot
	for _, e := range entries {
		if ValidateTag(e.Name()) != nil {
			continue
		}
		dir := filepath.Join(s.root, e.Name())
		var md *Metadata
		if e.IsDir() {
			md, err = readMetadata(dir, e.Name())
		} else {
			err = errors.New("not a directory")
		}
		if errors.Is(err, os.ErrNotExist) {
			if _, serr := os.Lstat(dir); errors.Is(serr, os.ErrNotExist) {
				continue // removed since ReadDir
			}
		}
		if err != nil {
			md = &Metadata{Tag: e.Name(), Status: StatusCorrupt, Error: err.Error()}
		}
		out = append(out, &Snapshot{Metadata: *md, Dir: dir})
	}
	have := map[string]bool{}
	for _, sn := range out {
		have[sn.Tag] = true
	}
	out = append(out, s.writingEntries(entries, have)...)
	sort.Slice(out, func(i, j int) bool { return out[i].Tag < out[j].Tag })
	return out, nil
}

// Ref is a held reference on a snapshot: a shared flock on its lock file.
// Pass File to the VMM (vmm.RestoreSpec.Hold) so the reference lives as long
// as the VMM process, then Close it.
type Ref struct {
	File *os.File
}

// Close releases this process's copy of the reference.
func (r *Ref) Close() error { return r.File.Close() }

// Acquire takes a reference on a ready snapshot whose files pass
// Snapshot.Verify. It fails while the snapshot is being removed.
func (s *Store) Acquire(tag string) (*Snapshot, *Ref, error) {
	snap, err := s.Get(tag)
	if err != nil {
		return nil, nil, err
	}
	if snap.Status != StatusReady {
		return nil, nil, errdefs.FailedPrecondition("snapshot %q is %s, not ready", tag, snap.Status)
	}
	f, err := os.Open(snap.LockPath())
	if err != nil {
		return nil, nil, fmt.Errorf("snapshot %q: %w", tag, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err != nil {
		f.Close()
		return nil, nil, errdefs.FailedPrecondition("snapshot %q is being removed", tag)
	}
	// Removal renames the directory before deleting it; a lock taken on a
	// renamed directory's file is worthless.
	if _, err := os.Stat(snap.LockPath()); err != nil {
		f.Close()
		return nil, nil, errdefs.NotFound("snapshot %q was removed", tag)
	}
	if err := snap.Verify(); err != nil {
		f.Close()
		return nil, nil, err
	}
	return snap, &Ref{File: f}, nil
}

// InUse reports whether any process holds a reference on tag.
func (s *Store) InUse(tag string) (bool, error) {
	dir, err := s.path(tag)
	if err != nil {
		return false, err
	}
	f, err := os.Open(filepath.Join(dir, LockFile))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return false, errdefs.NotFound("snapshot %q not found", tag)
		}
		return false, err
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return true, nil
	}
	return false, nil
}

// Remove deletes the snapshot named tag, corrupt ones included (a
// directory without metadata or lock file, or with unusable metadata). It
// fails with a FailedPrecondition-class error while any VMM holds a
// reference; without a lock file no reference can be checked.
func (s *Store) Remove(tag string) error {
	dir, err := s.path(tag)
	if err != nil {
		return err
	}
	if _, err := os.Lstat(dir); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return errdefs.NotFound("snapshot %q not found", tag)
		}
		return fmt.Errorf("snapshot %q: %w", tag, err)
	}
	f, err := os.Open(filepath.Join(dir, LockFile))
	switch {
	case err == nil:
		defer f.Close()
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			return errdefs.FailedPrecondition("snapshot %q is %w by running sandboxes", tag, ErrInUse)
		}
	case errors.Is(err, os.ErrNotExist), errors.Is(err, unix.ENOTDIR):
		// No lock file: a corrupt tag no restore could have referenced.
	default:
		return fmt.Errorf("snapshot %q: %w", tag, err)
	}
	trash, err := os.MkdirTemp(s.root, ".trash-"+tag+"-")
	if err != nil {
		return err
	}
	if err := os.Rename(dir, filepath.Join(trash, tag)); err != nil {
		os.Remove(trash)
		if errors.Is(err, os.ErrNotExist) {
			return errdefs.NotFound("snapshot %q not found", tag)
		}
		return fmt.Errorf("remove snapshot %q: %w", tag, err)
	}
	return os.RemoveAll(trash)
}

// Reclaim removes staging and trash directories whose owner died, but for
// a branch's staging directory, which becomes a failed snapshot of its tag
// (removable with Remove). It is safe to run while other processes write
// snapshots.
func (s *Store) Reclaim() error {
	entries, err := os.ReadDir(s.root)
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		name := e.Name()
		if !strings.HasPrefix(name, ".staging-") && !strings.HasPrefix(name, ".trash-") {
			continue
		}
		dir := filepath.Join(s.root, name)
		if strings.HasPrefix(name, ".staging-") {
			if stagingLive(dir) {
				continue
			}
			// A branch interrupted by a crash stays, failed, to be seen.
			if failed, err := s.failStaging(dir); failed || err != nil {
				if err != nil {
					errs = append(errs, err)
				}
				continue
			}
		}
		if err := os.RemoveAll(dir); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// stagingLive reports whether a staging dir's writer still holds it.
func stagingLive(dir string) bool {
	f, err := os.Open(filepath.Join(dir, LockFile))
	if err != nil {
		return false
	}
	defer f.Close()
	return unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil
}
