package snapshot

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
)

// Writer builds one snapshot in a staging directory. Exactly one of Commit
// or Abort must be called.
type Writer struct {
	store *Store
	tag   string
	dir   string
	lock  *os.File // exclusive flock: the staging dir is live
	done  bool
}

// Create starts a new snapshot named tag. It fails with an
// AlreadyExists-class error if the tag is taken.
func (s *Store) Create(tag string) (*Writer, error) {
	final, err := s.path(tag)
	if err != nil {
		return nil, err
	}
	if _, err := os.Lstat(final); err == nil {
		if _, err := readMetadata(final, tag); err != nil {
			return nil, errdefs.AlreadyExists("snapshot %q already exists, unusable (%w); remove it first (forkd rmi %s)", tag, err, tag)
		}
		return nil, errdefs.AlreadyExists("snapshot %q already exists", tag)
	}
	dir, err := os.MkdirTemp(s.root, ".staging-"+tag+"-")
	if err != nil {
		return nil, err
	}
	lock, err := os.OpenFile(filepath.Join(dir, LockFile), os.O_CREATE|os.O_RDWR, 0o600)
	if err == nil {
		err = unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	}
	if err != nil {
		if lock != nil {
			lock.Close()
		}
		os.RemoveAll(dir)
		return nil, fmt.Errorf("staging snapshot %q: %w", tag, err)
	}
	w := &Writer{store: s, tag: tag, dir: dir, lock: lock}
	md := Metadata{FormatVersion: FormatVersion, Tag: tag, Status: StatusWriting, Created: time.Now().UTC()}
	if err := fsutil.WriteJSON(filepath.Join(dir, MetadataFile), md, 0o600); err != nil {
		return nil, w.abort(err)
	}
	return w, nil
}

// Dir is the staging directory.
func (w *Writer) Dir() string { return w.dir }

// MemoryPath is where the memory file goes.
func (w *Writer) MemoryPath() string { return filepath.Join(w.dir, MemoryFile) }

// StatePath is where the device state goes.
func (w *Writer) StatePath() string { return filepath.Join(w.dir, StateFile) }

// Commit writes md (status ready) and moves the snapshot into place. It
// records the sizes of the memory and state files and the identity of
// md.Rootfs (see Snapshot.Verify); a caller that set md.Rootfs.ID (with
// Identify, before the parent booted) has it checked instead, so that an
// image replaced while the snapshot was made fails the commit. It
// fails with an AlreadyExists-class error if another writer committed the
// same tag first; the staging dir is then removed.
func (w *Writer) Commit(md Metadata) (*Snapshot, error) {
	if w.done {
		return nil, errors.New("snapshot writer already finished")
	}
	md.FormatVersion = FormatVersion
	md.Tag = w.tag
	md.Status = StatusReady
	if md.Created.IsZero() {
		md.Created = time.Now().UTC()
	}
	for _, name := range []string{MemoryFile, StateFile} {
		if err := fsutil.SyncFile(filepath.Join(w.dir, name)); err != nil {
			return nil, w.abort(fmt.Errorf("snapshot %q: %w", w.tag, err))
		}
	}
	if err := identifyInputs(&md, w.MemoryPath(), w.StatePath()); err != nil {
		return nil, w.abort(fmt.Errorf("snapshot %q: %w", w.tag, err))
	}
	if err := fsutil.WriteJSON(filepath.Join(w.dir, MetadataFile), md, 0o600); err != nil {
		return nil, w.abort(err)
	}
	final := filepath.Join(w.store.root, w.tag)
	if err := unix.Renameat2(unix.AT_FDCWD, w.dir, unix.AT_FDCWD, final, unix.RENAME_NOREPLACE); err != nil {
		if errors.Is(err, unix.EEXIST) || errors.Is(err, unix.ENOTEMPTY) {
			return nil, w.abort(errdefs.AlreadyExists("snapshot %q already exists", w.tag))
		}
		return nil, w.abort(fmt.Errorf("commit snapshot %q: %w", w.tag, err))
	}
	w.done = true
	w.lock.Close()
	if err := fsutil.SyncDir(w.store.root); err != nil {
		return nil, err
	}
	return &Snapshot{Metadata: md, Dir: final}, nil
}

// Abort discards the staging directory. Safe to call after Commit (no-op).
func (w *Writer) Abort() error {
	if w.done {
		return nil
	}
	w.done = true
	err := os.RemoveAll(w.dir)
	w.lock.Close()
	return err
}

// abort is Abort after a failure err, which it returns, joined with
// Abort's own error when the staging directory could not be removed.
func (w *Writer) abort(err error) error {
	if aerr := w.Abort(); aerr != nil {
		return errors.Join(err, fmt.Errorf("discard staging snapshot %q: %w", w.tag, aerr))
	}
	return err
}
