package snapshot

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
)

// MaxDepth bounds a chain of branches.
const MaxDepth = 32

// CreateBranch starts snapshot tag as a branch, its staging metadata
// saying so (md's Kind, Branch, Parent, ParentHash, Ephemeral and Writer
// are kept), so that a crash while it is written leaves a failed snapshot
// (see Reclaim) rather than nothing.
func (s *Store) CreateBranch(tag string, md Metadata) (*Writer, error) {
	w, err := s.Create(tag)
	if err != nil {
		return nil, err
	}
	md.FormatVersion, md.Tag, md.Status, md.Kind = FormatVersion, tag, StatusWriting, KindBranch
	if md.Created.IsZero() {
		md.Created = time.Now().UTC()
	}
	if err := fsutil.WriteJSON(filepath.Join(w.dir, MetadataFile), md, 0o600); err != nil {
		return nil, w.abort(err)
	}
	return w, nil
}

// LayerPath is where a branch's layer file goes.
func (w *Writer) LayerPath() string { return filepath.Join(w.dir, LayerFile) }

// Dependents returns the tags of the snapshots made from tag as it stands
// (their parent is tag, with tag's content), sorted.
func (s *Store) Dependents(tag string) ([]string, error) {
	all, err := s.List()
	if err != nil {
		return nil, err
	}
	hash := ""
	for _, sn := range all {
		if sn.Tag == tag {
			hash = sn.ContentHash
		}
	}
	var out []string
	for _, sn := range all {
		if sn.Parent == tag && (sn.ParentHash == "" || sn.ParentHash == hash) {
			out = append(out, sn.Tag)
		}
	}
	sort.Strings(out)
	return out, nil
}

// Ancestors returns the chain above snapshot sn, parent first. A parent
// that is missing, or whose content is not what the child was made from,
// ends the chain with a FailedPrecondition-class error naming it; so does a
// cycle or a chain over MaxDepth.
func (s *Store) Ancestors(sn *Snapshot) ([]*Snapshot, error) {
	var out []*Snapshot
	seen := map[string]bool{sn.Tag: true}
	for cur := sn; cur.Parent != ""; {
		if len(out) >= MaxDepth {
			return out, errdefs.FailedPrecondition("snapshot %q: chain deeper than %d", sn.Tag, MaxDepth)
		}
		if seen[cur.Parent] {
			return out, errdefs.FailedPrecondition("snapshot %q: its chain has a cycle at %q", sn.Tag, cur.Parent)
		}
		seen[cur.Parent] = true
		p, err := s.Get(cur.Parent)
		if errdefs.IsNotFound(err) {
			return out, errdefs.FailedPrecondition("snapshot %q: parent %q of %q is missing", sn.Tag, cur.Parent, cur.Tag)
		}
		if err != nil {
			return out, err
		}
		if cur.ParentHash != "" && p.ContentHash != cur.ParentHash {
			return out, errdefs.FailedPrecondition("snapshot %q: parent %q of %q was altered (made again since)", sn.Tag, p.Tag, cur.Tag)
		}
		out = append(out, p)
		cur = p
	}
	return out, nil
}

// Info describes a snapshot's place in its chain and what it holds.
type Info struct {
	Snapshot *Snapshot
	// LogicalBytes is the guest RAM size; PhysicalBytes what the
	// snapshot's files take on disk; LayerBytes what its layer takes (a
	// diff or live branch's own pages).
	LogicalBytes, PhysicalBytes, LayerBytes int64
	// Ancestors are the tags above it, parent first; ChainError says why
	// the chain could not be followed further (a parent missing or altered).
	Ancestors  []string
	ChainError string
	// Dependents are the tags made from it (its direct children).
	Dependents []string
}

// Info returns tag's Info.
func (s *Store) Info(tag string) (*Info, error) {
	sn, err := s.Get(tag)
	if err != nil {
		return nil, err
	}
	in := &Info{Snapshot: sn, LogicalBytes: int64(sn.MemoryMiB) << 20, PhysicalBytes: sn.SizeBytes()}
	in.LayerBytes = allocated(sn.LayerPath())
	anc, err := s.Ancestors(sn)
	for _, a := range anc {
		in.Ancestors = append(in.Ancestors, a.Tag)
	}
	if err != nil {
		in.ChainError = err.Error()
	}
	if in.Dependents, err = s.Dependents(tag); err != nil {
		return nil, err
	}
	return in, nil
}

// allocated is the disk space path takes (0 when it does not exist).
func allocated(path string) int64 {
	var st unix.Stat_t
	if unix.Stat(path, &st) != nil {
		return 0
	}
	return st.Blocks * 512
}

// RemoveOptions say what Remove does with a snapshot's dependents.
type RemoveOptions struct {
	// Cascade removes the dependents first, recursively (each refused while
	// sandboxes use it).
	Cascade bool
	// Force removes the snapshot and leaves its dependents (each has its
	// own complete memory, so they still fork; their chain is broken).
	Force bool
}

// RemoveTree removes tag as Remove does, refusing while it has dependents
// unless opts say what to do with them. It returns the tags removed.
func (s *Store) RemoveTree(tag string, opts RemoveOptions) ([]string, error) {
	deps, err := s.Dependents(tag)
	if err != nil {
		return nil, err
	}
	var removed []string
	switch {
	case len(deps) == 0 || opts.Force:
	case opts.Cascade:
		for _, d := range deps {
			r, err := s.RemoveTree(d, opts)
			removed = append(removed, r...)
			if err != nil {
				return removed, fmt.Errorf("cascade to %s: %w", d, err)
			}
		}
	default:
		return nil, errdefs.FailedPrecondition("snapshot %q has %d dependent snapshot(s) (%s): remove them first, or use --cascade (remove them too) or --force (keep them, unchained)",
			tag, len(deps), strings.Join(deps, ", "))
	}
	if err := s.Remove(tag); err != nil {
		return removed, err
	}
	return append(removed, tag), nil
}

// writingEntries returns a snapshot of status writing for each live
// staging directory (its writer still works on it), for List.
func (s *Store) writingEntries(entries []os.DirEntry, have map[string]bool) []*Snapshot {
	var out []*Snapshot
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), ".staging-") {
			continue
		}
		dir := filepath.Join(s.root, e.Name())
		md, err := readStagingMetadata(dir)
		if err != nil || have[md.Tag] || !stagingLive(dir) {
			continue
		}
		have[md.Tag] = true
		md.Status = StatusWriting
		out = append(out, &Snapshot{Metadata: *md, Dir: dir})
	}
	return out
}

// readStagingMetadata reads a staging directory's metadata.
func readStagingMetadata(dir string) (*Metadata, error) {
	name := filepath.Base(dir)
	rest := strings.TrimPrefix(name, ".staging-")
	i := strings.LastIndexByte(rest, '-')
	if i <= 0 {
		return nil, fmt.Errorf("staging dir %s: no tag", name)
	}
	return readMetadata(dir, rest[:i])
}

// failStaging turns the staging directory of a branch whose writer died
// into a failed snapshot of its tag (its big files removed), which rmi
// removes; it reports false when dir is not such a branch, or its tag was
// taken meanwhile.
func (s *Store) failStaging(dir string) (bool, error) {
	md, err := readStagingMetadata(dir)
	if err != nil {
		return false, nil //nolint:nilerr // unreadable staging is no branch: Reclaim removes it
	}
	if md.Kind != KindBranch {
		return false, nil
	}
	final := filepath.Join(s.root, md.Tag)
	if _, err := os.Lstat(final); err == nil {
		return false, nil
	}
	var errs []error
	for _, f := range []string{MemoryFile, LayerFile, StateFile} {
		if err := os.Remove(filepath.Join(dir, f)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	md.Status, md.Writer = StatusFailed, nil
	md.Error = "interrupted: the forkd process writing it stopped before it was complete; remove it (forkd rmi " + md.Tag + ")"
	if err := fsutil.WriteJSON(filepath.Join(dir, MetadataFile), md, 0o600); err != nil {
		return false, errors.Join(append(errs, err)...)
	}
	if err := unix.Renameat2(unix.AT_FDCWD, dir, unix.AT_FDCWD, final, unix.RENAME_NOREPLACE); err != nil {
		return false, errors.Join(append(errs, err)...)
	}
	return true, errors.Join(errs...)
}
