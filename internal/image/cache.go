package image

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/cleanup"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/mountinfo"
)

// Cache layout under Builder.CacheDir (every name below is validated as a
// single path component before use):
//
//	kernel/<package>_<version>/     vmlinuz, config, modules/, kernel.json
//	busybox/<package>_<version>/    busybox, applets
//	initramfs/<key>.cpio.gz         key = sha256 of everything that goes in
//	rootfs/<key>/                   rootfs.ext4, rootfs.json; key = sha256 of the recipe
//	images/<name>.json              images imported with FromOCI
//	disk/<name>                     sandboxes' disk bases and placeholder (disk.go)
//	locks/<kind>-<key>.lock         flock(2) files serialising builders of one entry
//
// Entries are built in ".staging-<key>-*" (directories) or ".tmp-<key>-*"
// (files) next to their final place and renamed into it once complete and
// synced, so an entry either exists whole or not at all. Staging leftovers
// of a crashed builder are removed by the next builder of the same key,
// under the lock, or by Reclaim.
const (
	kindKernel    = "kernel"
	kindBusybox   = "busybox"
	kindInitramfs = "initramfs"
	kindRootfs    = "rootfs"
	kindImages    = "images"
	kindLocks     = "locks"
)

var keyRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._+~-]{0,200}$`)

// checkKey refuses a cache key that is not one safe path component.
func checkKey(key string) error {
	if !keyRE.MatchString(key) || strings.Contains(key, "..") {
		return errdefs.InvalidArgument("cache key %q is not a safe file name", key)
	}
	return nil
}

// lock takes the exclusive flock of one cache entry, waiting until ctx is
// done. The returned function releases it.
func (b *Builder) lock(ctx context.Context, kind, key string) (func(), error) {
	waited := false
	for {
		unlock, ok, err := b.tryLock(kind, key)
		if err != nil || ok {
			return unlock, err
		}
		if !waited {
			waited = true
			b.progressf(ctx, "waiting for another builder of %s/%s", kind, key)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// tryLock is lock without waiting: ok is false when another builder holds
// the entry.
func (b *Builder) tryLock(kind, key string) (unlock func(), ok bool, err error) {
	dir := filepath.Join(b.CacheDir, kindLocks)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, false, err
	}
	f, err := os.OpenFile(filepath.Join(dir, kind+"-"+key+".lock"), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, false, err
	}
	switch err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err {
	case nil:
		return func() { f.Close() }, true, nil
	case unix.EWOULDBLOCK, unix.EINTR:
		f.Close()
		return nil, false, nil
	default:
		f.Close()
		return nil, false, fmt.Errorf("lock %s/%s: %w", kind, key, err)
	}
}

// StaleTempAge is how old a ".tmp-" file of the cache must be for Reclaim
// to take it for a crashed writer's.
const StaleTempAge = 10 * time.Minute

// Reclaim removes what crashed builders left in the cache: staging
// directories of entries no builder holds the lock of (mounts below them
// detached first, as a failed build does), and ".tmp-" files not modified
// for StaleTempAge. It is safe while other builders run: a staging
// directory being built is under its entry's lock, a file being written
// is fresh. Call it when a daemon starts. Errors are joined; what could
// not be removed is left for the next call.
func (b *Builder) Reclaim() error {
	kinds, err := os.ReadDir(b.CacheDir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, k := range kinds {
		if !k.IsDir() || k.Name() == kindLocks {
			continue
		}
		errs = append(errs, b.reclaimKind(k.Name()))
	}
	return errors.Join(errs...)
}

func (b *Builder) reclaimKind(kind string) error {
	parent := filepath.Join(b.CacheDir, kind)
	entries, err := os.ReadDir(parent)
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		p := filepath.Join(parent, e.Name())
		if rest, ok := strings.CutPrefix(e.Name(), ".tmp-"); ok && rest != "" {
			if fi, err := e.Info(); err == nil && fi.Mode().IsRegular() && time.Since(fi.ModTime()) > StaleTempAge {
				if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
					errs = append(errs, err)
				}
			}
			continue
		}
		rest, ok := strings.CutPrefix(e.Name(), ".staging-")
		i := strings.LastIndexByte(rest, '-')
		if !ok || !e.IsDir() || i <= 0 {
			continue
		}
		// .staging-<key>-<random>, or .staging-<key>-old-<random> for an
		// entry being replaced.
		key := strings.TrimSuffix(rest[:i], "-old")
		if checkKey(key) != nil {
			continue
		}
		unlock, free, err := b.tryLock(kind, key)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if !free {
			continue // being built
		}
		if err := removeTree(p); err != nil {
			errs = append(errs, err)
		} else {
			b.log().Info("removed a crashed build's leftover", "dir", p)
		}
		unlock()
	}
	return errors.Join(errs...)
}

// ensureDir returns <cache>/<kind>/<key>, building it first unless valid
// accepts what is there. build fills an empty staging directory; on success
// it is renamed into place (replacing an invalid entry), on failure it is
// removed and nothing is left behind.
func (b *Builder) ensureDir(ctx context.Context, kind, key string, valid func(dir string) error,
	build func(ctx context.Context, staging string) error) (dir string, err error) {
	if err := checkKey(key); err != nil {
		return "", err
	}
	parent := filepath.Join(b.CacheDir, kind)
	final := filepath.Join(parent, key)
	if valid(final) == nil {
		return final, nil
	}
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return "", err
	}
	unlock, err := b.lock(ctx, kind, key)
	if err != nil {
		return "", err
	}
	defer unlock()
	if valid(final) == nil {
		return final, nil // another builder made it while we waited
	}
	if err := removeStale(parent, ".staging-"+key+"-"); err != nil {
		return "", err
	}
	staging, err := os.MkdirTemp(parent, ".staging-"+key+"-")
	if err != nil {
		return "", err
	}
	var cl cleanup.Stack
	cl.Add(func() error { return removeTree(staging) })
	defer func() {
		if err != nil {
			err = errors.Join(err, cl.Run())
		}
	}()
	// The staging directory stays 0700 while it is built: an image's
	// device nodes and setuid files must not be reachable by other users.
	if err := build(ctx, staging); err != nil {
		return "", err
	}
	if err := fsutil.SyncDir(staging); err != nil {
		return "", err
	}
	if err := os.Chmod(staging, 0o755); err != nil {
		return "", err
	}
	if _, err := os.Lstat(final); err == nil {
		trash := filepath.Join(parent, ".staging-"+key+"-old-"+randomSuffix())
		if err := os.Rename(final, trash); err != nil {
			return "", err
		}
		defer removeTree(trash) //nolint:errcheck // a leftover is removed by the next builder
	}
	if err := os.Rename(staging, final); err != nil {
		return "", err
	}
	cl.Release()
	return final, fsutil.SyncDir(parent)
}

// ensureFile returns <cache>/<kind>/<name>, writing it with write first if
// it does not exist. The file is written to a temporary name, synced and
// renamed, so it exists whole or not at all.
func (b *Builder) ensureFile(ctx context.Context, kind, name string, write func(w io.Writer) error) (path string, err error) {
	if err := checkKey(name); err != nil {
		return "", err
	}
	parent := filepath.Join(b.CacheDir, kind)
	final := filepath.Join(parent, name)
	if fi, err := os.Stat(final); err == nil && fi.Mode().IsRegular() {
		return final, nil
	}
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return "", err
	}
	unlock, err := b.lock(ctx, kind, name)
	if err != nil {
		return "", err
	}
	defer unlock()
	if fi, err := os.Stat(final); err == nil && fi.Mode().IsRegular() {
		return final, nil
	}
	if err := removeStale(parent, fsutil.TempPrefix(name)); err != nil {
		return "", err
	}
	return final, fsutil.WriteWith(final, 0o644, write)
}

// removeStale removes the entries of dir whose names start with prefix.
// Callers hold the lock that makes them stale.
func removeStale(dir, prefix string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix) {
			errs = append(errs, removeTree(filepath.Join(dir, e.Name())))
		}
	}
	return errors.Join(errs...)
}

// removeTree removes dir and everything below it without crossing into a
// mount: mounts found below dir (there should be none; everything that
// mounts runs in a private namespace) are detached first, and if one
// cannot be, nothing is removed.
func removeTree(dir string) error {
	mounts, err := mountsBelow(dir)
	if err != nil {
		return err
	}
	for _, m := range mounts {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("refusing to remove %s: %s is mounted and cannot be unmounted: %w", dir, m, err)
		}
	}
	return os.RemoveAll(dir)
}

// mountsBelow lists the mount points at or below dir, deepest first.
func mountsBelow(dir string) ([]string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	if real, err := filepath.EvalSymlinks(abs); err == nil {
		abs = real
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, nil // no procfs: nothing to check against
	}
	defer f.Close()
	mounts, err := mountinfo.Parse(f)
	var out []string
	for _, m := range mounts {
		if mp := m.MountPoint; mp == abs || strings.HasPrefix(mp, abs+"/") {
			out = append(out, mp)
		}
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out, err
}

func randomSuffix() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// sha256File returns the hex sha256 of the file at path.
func sha256File(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// hashKey returns the hex sha256 of parts, each length-prefixed so no two
// lists collide.
func hashKey(parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		fmt.Fprintf(h, "%d:%s;", len(p), p)
	}
	return hex.EncodeToString(h.Sum(nil))
}
