package hub

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
)

// blobCache keeps the blobs a pull fetched, each verified against its
// digest before it is named by it, so that a pull cut short resumes
// without fetching them again. A pull removes the blobs it used once its
// snapshots are committed.
type blobCache struct {
	dir string // <hub>/blobs/sha256
}

func (c *blobCache) path(digest string) string {
	return filepath.Join(c.dir, strings.TrimPrefix(digest, "sha256:"))
}

// has reports whether the cache holds blob digest of size bytes.
func (c *blobCache) has(digest string, size int64) bool {
	st, err := os.Stat(c.path(digest))
	return err == nil && st.Mode().IsRegular() && st.Size() == size
}

// fetch stores blob digest of size bytes from src, verified. A blob that
// does not hash to its digest is refused (InvalidArgument) and nothing of
// it is kept.
func (c *blobCache) fetch(ctx context.Context, src source, digest string, size int64) error {
	if err := os.MkdirAll(c.dir, 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(c.dir, fsutil.TempPrefix(strings.TrimPrefix(digest, "sha256:")[:12]))
	if err != nil {
		return writeErr(err)
	}
	keep := false
	defer func() {
		if !keep {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	h := sha256.New()
	if err := src.blob(ctx, digest, size, io.MultiWriter(f, h)); err != nil {
		return err
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != digest {
		return errdefs.InvalidArgument("blob %s from %s does not match its digest (it hashes to %s): refused", digest, src.name(), got)
	}
	if err := f.Sync(); err != nil {
		return writeErr(err)
	}
	if err := f.Close(); err != nil {
		return writeErr(err)
	}
	if err := os.Rename(f.Name(), c.path(digest)); err != nil {
		return err
	}
	keep = true
	return nil
}

// read returns blob digest of size bytes, verified again (the cache is
// a file like any other).
func (c *blobCache) read(digest string, size int64) ([]byte, error) {
	f, err := os.Open(c.path(digest))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b := make([]byte, size)
	if _, err := io.ReadFull(f, b); err != nil {
		return nil, fmt.Errorf("cached blob %s: %w", digest, err)
	}
	if got := fmt.Sprintf("sha256:%x", sha256.Sum256(b)); got != digest {
		os.Remove(c.path(digest))
		return nil, errdefs.InvalidArgument("cached blob %s changed on disk (it hashes to %s); removed, pull again", digest, got)
	}
	return b, nil
}

// copyTo writes blob digest to w, verified, and returns the sha256 of
// what it wrote.
func (c *blobCache) copyTo(digest string, w io.Writer) error {
	f, err := os.Open(c.path(digest))
	if err != nil {
		return err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(io.MultiWriter(w, h), f); err != nil {
		return writeErr(err)
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != digest {
		os.Remove(c.path(digest))
		return errdefs.InvalidArgument("cached blob %s changed on disk (it hashes to %s); removed, pull again", digest, got)
	}
	return nil
}

// remove drops blobs from the cache.
func (c *blobCache) remove(digests []string) {
	for _, d := range digests {
		os.Remove(c.path(d))
	}
}

// contentStore holds pulled boot files by the sha256 of their content:
// <dir>/sha256/<hex>, read-only once in place. A pull holds the store
// (a shared flock on <dir>/lock) from its first file to its commit; a
// sweep takes it exclusively, so it never removes what a pull is about to
// use.
type contentStore struct {
	dir string
}

func (s *contentStore) path(sum string) string { return filepath.Join(s.dir, "sha256", sum) }

// has reports whether the store holds a file of sha256 sum and size bytes.
func (s *contentStore) has(sum string, size int64) bool {
	st, err := os.Stat(s.path(sum))
	return err == nil && st.Mode().IsRegular() && st.Size() == size
}

// hold takes the store for a pull; the returned func releases it.
func (s *contentStore) hold() (func(), error) {
	f, err := s.lockFile()
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH); err != nil {
		f.Close()
		return nil, err
	}
	return func() { f.Close() }, nil
}

func (s *contentStore) lockFile() (*os.File, error) {
	if err := os.MkdirAll(filepath.Join(s.dir, "sha256"), 0o755); err != nil {
		return nil, err
	}
	return os.OpenFile(filepath.Join(s.dir, "lock"), os.O_CREATE|os.O_RDWR, 0o600)
}

// create starts a file to be put in the store as sum.
func (s *contentStore) create(sum string) (*os.File, error) {
	if err := os.MkdirAll(filepath.Join(s.dir, "sha256"), 0o755); err != nil {
		return nil, err
	}
	f, err := os.CreateTemp(filepath.Join(s.dir, "sha256"), fsutil.TempPrefix(sum[:12]))
	if err != nil {
		return nil, writeErr(err)
	}
	return f, nil
}

// commit checks that f (from create) has sha256 sum, by reading it back
// whole, and puts it in place, read-only. f is closed, and removed on
// error.
func (s *contentStore) commit(f *os.File, sum string) (err error) {
	defer func() {
		f.Close()
		if err != nil {
			os.Remove(f.Name())
		}
	}()
	if err := f.Sync(); err != nil {
		return writeErr(err)
	}
	h := sha256.New()
	if err := hashFile(f, h); err != nil {
		return err
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != sum {
		return errdefs.InvalidArgument("assembled file hashes to %s, not the %s its config names: refused", got, sum)
	}
	if err := f.Chmod(0o444); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), s.path(sum)); err != nil {
		return err
	}
	return fsutil.SyncDir(filepath.Join(s.dir, "sha256"))
}

// hashFile hashes f from its start.
func hashFile(f *os.File, h hash.Hash) error {
	buf := make([]byte, 1<<20)
	_, err := io.CopyBuffer(h, io.NewSectionReader(f, 0, 1<<62), buf)
	return err
}

// sweep removes every file not in used (clean paths), unless a pull holds
// the store; temporary files of pulls that died go too.
func (s *contentStore) sweep(used map[string]bool) ([]string, error) {
	f, err := s.lockFile()
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return nil, nil // a pull runs: the next sweep does it
	}
	dir := filepath.Join(s.dir, "sha256")
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var removed []string
	var errs []error
	for _, e := range entries {
		p := filepath.Join(dir, e.Name())
		if used[p] {
			continue
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, p)
	}
	return removed, errors.Join(errs...)
}

// index records the artifacts this host pulled or pushed: manifest
// digest to the snapshot that has its content, checked against the
// snapshot's content hash before it is trusted.
type index struct {
	path string
}

// indexEntry is one artifact.
type indexEntry struct {
	Tag         string    `json:"tag"`
	ContentHash string    `json:"content_hash"`
	Ref         string    `json:"ref,omitempty"`
	Time        time.Time `json:"time"`
}

// maxIndexEntries bounds the index; the oldest entries go first.
const maxIndexEntries = 4096

func (x *index) load() map[string]indexEntry {
	m := map[string]indexEntry{}
	b, err := os.ReadFile(x.path)
	if err != nil || len(b) > 16<<20 {
		return m
	}
	if json.Unmarshal(b, &m) != nil {
		return map[string]indexEntry{}
	}
	return m
}

// add records entries (by digest), under the index's lock.
func (x *index) add(entries map[string]indexEntry) error {
	lock, err := os.OpenFile(x.path+".lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return err
	}
	m := x.load()
	for d, e := range entries {
		m[d] = e
	}
	if len(m) > maxIndexEntries {
		type kv struct {
			d string
			t time.Time
		}
		all := make([]kv, 0, len(m))
		for d, e := range m {
			all = append(all, kv{d, e.Time})
		}
		sort.Slice(all, func(i, j int) bool { return all[i].t.Before(all[j].t) })
		for _, e := range all[:len(m)-maxIndexEntries] {
			delete(m, e.d)
		}
	}
	return fsutil.WriteJSON(x.path, m, 0o600)
}

// StaleBlobAge is how long a blob stays in the pull cache unused: a pull
// cut short and never tried again leaves its blobs that long.
const StaleBlobAge = 7 * 24 * time.Hour

// Prune removes the pull cache's blobs (and temporary files) not
// modified for maxAge.
func (h *Hub) Prune(maxAge time.Duration) error {
	ents, err := os.ReadDir(h.cache.dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		fi, err := e.Info()
		if err != nil || time.Since(fi.ModTime()) < maxAge {
			continue
		}
		if err := os.Remove(filepath.Join(h.cache.dir, e.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
