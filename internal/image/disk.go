package image

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/image/deb"
)

// Cache entries of sandboxes' writable disks, under <cache>/disk/:
//
//	placeholder-1m.raw   1 MiB of zeros: the disk slot of children without a disk
//	ext4-v1-<N>m.img     an empty ext4 file system of N MiB (sparse), the base
//	                     every disk of that size starts from
const (
	kindDisk        = "disk"
	placeholderName = "placeholder-1m.raw"
	// PlaceholderBytes is the placeholder's size.
	PlaceholderBytes = 1 << 20
)

// DiskPlaceholder returns the placeholder image: 1 MiB of zeros, attached
// read-only where a machine's disk slot holds no disk.
func (b *Builder) DiskPlaceholder(ctx context.Context) (string, error) {
	if b.CacheDir == "" || !filepath.IsAbs(b.CacheDir) {
		return "", errdefs.InvalidArgument("image builder: cache directory %q is not an absolute path", b.CacheDir)
	}
	return b.ensureFile(ctx, kindDisk, placeholderName, func(w io.Writer) error {
		_, err := w.Write(make([]byte, PlaceholderBytes))
		return err
	})
}

// DiskBase returns an empty ext4 file system of mib MiB in a sparse file,
// made once per size with mkfs.ext4 (inode tables and journal left
// unwritten: the file reads as zeros there already). Sandboxes' disks are
// qcow2 overlays over it; it is never written once made.
func (b *Builder) DiskBase(ctx context.Context, mib int) (string, error) {
	if b.CacheDir == "" || !filepath.IsAbs(b.CacheDir) {
		return "", errdefs.InvalidArgument("image builder: cache directory %q is not an absolute path", b.CacheDir)
	}
	if mib < 16 || mib > 1<<20 {
		return "", errdefs.InvalidArgument("disk base of %d MiB", mib)
	}
	name := "ext4-v1-" + strconv.Itoa(mib) + "m.img"
	parent := filepath.Join(b.CacheDir, kindDisk)
	final := filepath.Join(parent, name)
	if fi, err := os.Stat(final); err == nil && fi.Mode().IsRegular() {
		return final, nil
	}
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return "", err
	}
	unlock, err := b.lock(ctx, kindDisk, name)
	if err != nil {
		return "", err
	}
	defer unlock()
	if fi, err := os.Stat(final); err == nil && fi.Mode().IsRegular() {
		return final, nil // made meanwhile
	}
	if err := removeStale(parent, fsutil.TempPrefix(name)); err != nil {
		return "", err
	}
	mkfs := b.Tools.MkfsExt4
	if mkfs == "" {
		mkfs = "mkfs.ext4"
	}
	if mkfs, err = deb.LookPath(mkfs); err != nil {
		return "", errdefs.FailedPrecondition("mkfs.ext4 not found (install e2fsprogs): %w", err)
	}
	tmp := filepath.Join(parent, fsutil.TempPrefix(name)+randomSuffix())
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return "", err
	}
	err = f.Truncate(int64(mib) << 20)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		// -m 0: no blocks kept for root, the guest's whole disk is its.
		cmd := exec.CommandContext(ctx, mkfs, "-F", "-q", "-m", "0", "-L", "forkd-disk",
			"-E", "lazy_itable_init=1,lazy_journal_init=1", tmp)
		cmd.Env = append(os.Environ(), "LC_ALL=C")
		if out, rerr := cmd.CombinedOutput(); rerr != nil {
			err = fmt.Errorf("mkfs.ext4 (%d MiB): %w: %s", mib, rerr, strings.TrimSpace(string(out)))
		}
	}
	if err == nil {
		err = syncFile(tmp)
	}
	if err == nil {
		err = os.Rename(tmp, final)
	}
	if err != nil {
		os.Remove(tmp)
		return "", err
	}
	return final, fsutil.SyncDir(parent)
}

func syncFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}
