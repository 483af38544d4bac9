// Package disk keeps sandboxes' writable disk layers.
//
// A sandbox forked with a disk writes to a qcow2 overlay in its run dir,
// backed by an empty ext4 image from the image cache. A branch freezes
// that overlay as a layer: it is hard-linked into the store, under a
// stable absolute path, and the sandbox goes on writing to a new overlay
// backed by it. Children of the branch get overlays backed by the layer,
// and a branch of one of them adds a layer over it: a chain of qcow2
// files, each naming the next by its backing file name.
//
// Layout: <dir>/<id>.qcow2, one file per layer, and <dir>/lock. A layer
// lives while a snapshot names it, another layer of the store backs onto
// it, or an overlay still in use (a sandbox's, in its run dir) does; GC
// removes the others. GC holds the lock exclusively; Add, which makes a
// layer, holds it shared, so a layer is never seen between its making
// and the reference its maker records first.
package disk

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
)

// Sizes of a sandbox's disk, in MiB.
const (
	MinMiB = 64
	MaxMiB = 1 << 20 // 1 TiB
)

// ValidateMiB checks a disk size: 0 (no disk) or MinMiB to MaxMiB.
func ValidateMiB(field string, mib int) error {
	if mib != 0 && (mib < MinMiB || mib > MaxMiB) {
		return errdefs.InvalidArgument("%s = %d: want 0 (no disk) or %d to %d MiB", field, mib, MinMiB, MaxMiB)
	}
	return nil
}

// Ext is a layer's file name extension.
const Ext = ".qcow2"

const lockFile = "lock"

// NewID returns a fresh layer id: "dl-" and 16 lowercase hex digits.
func NewID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("dl-%x", b)
}

// ValidateID checks a layer id's shape before it names a file.
func ValidateID(id string) error {
	rest, ok := strings.CutPrefix(id, "dl-")
	if !ok || len(rest) != 16 || strings.Trim(rest, "0123456789abcdef") != "" {
		return errdefs.InvalidArgument("disk layer id %s: want dl- and 16 hex digits", errdefs.Quote(id))
	}
	return nil
}

// Store is a directory of disk layers.
type Store struct {
	dir string
	// QemuImg is the qemu-img binary Overlay runs ("" finds it in PATH).
	QemuImg string
}

// Open returns the store in dir, creating it if needed.
func Open(dir string) (*Store, error) {
	if !filepath.IsAbs(dir) {
		return nil, errdefs.InvalidArgument("disk store %q: not an absolute path", dir)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("disk store: %w", err)
	}
	return &Store{dir: dir}, nil
}

// Dir is the store's directory.
func (s *Store) Dir() string { return s.dir }

// Path is where layer id lives (whether or not it exists).
func (s *Store) Path(id string) string { return filepath.Join(s.dir, id+Ext) }

// lock takes the store's lock (unix.LOCK_SH or LOCK_EX), waiting for it.
func (s *Store) lock(how int) (unlock func(), err error) {
	f, err := os.OpenFile(filepath.Join(s.dir, lockFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	for {
		err = unix.Flock(int(f.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("lock disk store: %w", err)
	}
	return func() { f.Close() }, nil
}

// Add makes the image at from (a sandbox's current overlay) layer id by
// hard-linking it: the same file, under the store's stable name, which
// the overlays made over it name as their backing file. The caller has
// recorded its reference to id first (a branch's staging metadata), so
// that a GC running meanwhile keeps it. from must be on the store's file
// system.
func (s *Store) Add(id, from string) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	unlock, err := s.lock(unix.LOCK_SH)
	if err != nil {
		return err
	}
	defer unlock()
	if err := os.Link(from, s.Path(id)); err != nil {
		return fmt.Errorf("add disk layer %s: %w", id, err)
	}
	return nil
}

// Remove removes layer id, whatever refers to it (a caller undoing its
// own Add). A missing layer is not an error.
func (s *Store) Remove(id string) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	if err := os.Remove(s.Path(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// Refs are what keeps layers alive: the layers snapshots name, and the
// images in use outside the store (sandboxes' overlays), whose backing
// chains are followed into it.
type Refs struct {
	Layers []string
	Images []string
}

// GC removes the layers that refs (asked for with the store's lock held,
// so that no layer is added meanwhile) do not reach through backing
// chains, and returns their ids. A chain that cannot be read keeps what
// it reached so far; a layer whose header cannot be read keeps nothing
// alive below it but is kept itself while referenced.
func (s *Store) GC(refs func() (Refs, error)) ([]string, error) {
	unlock, err := s.lock(unix.LOCK_EX)
	if err != nil {
		return nil, err
	}
	defer unlock()
	r, err := refs()
	if err != nil {
		return nil, err
	}
	live := map[string]bool{}
	var errs []error
	mark := func(top string) {
		chain, err := Chain(top)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
		for _, p := range chain {
			if id, ok := s.idOf(p); ok {
				live[id] = true
			}
		}
	}
	for _, id := range r.Layers {
		if ValidateID(id) == nil {
			live[id] = true
			mark(s.Path(id))
		}
	}
	for _, img := range r.Images {
		mark(img)
	}
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, err
	}
	var removed []string
	for _, e := range entries {
		id, ok := strings.CutSuffix(e.Name(), Ext)
		if !ok || ValidateID(id) != nil || live[id] {
			continue
		}
		if err := os.Remove(s.Path(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, id)
	}
	sort.Strings(removed)
	// A chain that could not be read is reported, but does not stop the
	// collection of what is plainly unreferenced.
	return removed, errors.Join(errs...)
}

// idOf returns the layer id of path when it is a layer of this store.
func (s *Store) idOf(path string) (string, bool) {
	if filepath.Dir(path) != s.dir {
		return "", false
	}
	id, ok := strings.CutSuffix(filepath.Base(path), Ext)
	return id, ok && ValidateID(id) == nil
}

// Overlay creates an empty qcow2 image at path of size bytes whose
// backing file is backing (an absolute path, in backingFormat: "raw" or
// "qcow2"), without opening the backing file. The file is created anew
// (an existing one is an error) with mode 0600.
func (s *Store) Overlay(ctx context.Context, path, backing, backingFormat string, size int64) error {
	if !filepath.IsAbs(backing) {
		return errdefs.InvalidArgument("overlay of %q: the backing file must be an absolute path", backing)
	}
	if backingFormat != "raw" && backingFormat != "qcow2" {
		return errdefs.InvalidArgument("overlay: backing format %q", backingFormat)
	}
	if size <= 0 || size%512 != 0 {
		return errdefs.InvalidArgument("overlay: size %d", size)
	}
	if _, err := os.Lstat(path); err == nil {
		return errdefs.AlreadyExists("overlay %s exists", path)
	}
	bin, err := s.qemuImg()
	if err != nil {
		return err
	}
	// -u: the backing file is not opened; its size does not matter.
	cmd := exec.CommandContext(ctx, bin, "create", "-q", "-f", "qcow2", "-F", backingFormat, "-b", backing, "-u",
		"-o", "compat=1.1", path, strconv.FormatInt(size, 10))
	if out, err := cmd.CombinedOutput(); err != nil {
		os.Remove(path)
		return fmt.Errorf("qemu-img create %s: %w: %s", path, err, strings.TrimSpace(string(out)))
	}
	if err := os.Chmod(path, 0o600); err != nil {
		os.Remove(path)
		return err
	}
	// The name in the header is the contract: check it reads back.
	if got, err := BackingFile(path); err != nil || got != backing {
		os.Remove(path)
		return fmt.Errorf("overlay %s: backing file %q, want %q (%v)", path, got, backing, err)
	}
	return nil
}

// Flatten makes layer id a copy of layer from that stands alone: one
// qcow2 file with what from's chain reads, and no backing file. It is
// written in dir (on the store's file system) and then added like Add;
// the caller has recorded id first, and removes it on failure.
func (s *Store) Flatten(ctx context.Context, id, from, dir string) error {
	if err := ValidateID(from); err != nil {
		return err
	}
	bin, err := s.qemuImg()
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, id+Ext)
	defer os.Remove(tmp)
	cmd := exec.CommandContext(ctx, bin, "convert", "-q", "-O", "qcow2", "-o", "compat=1.1", s.Path(from), tmp)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("qemu-img convert %s: %w: %s", from, err, strings.TrimSpace(string(out)))
	}
	if err := os.Chmod(tmp, 0o600); err != nil {
		return err
	}
	// On disk before a snapshot that names it can be committed.
	if err := fsutil.SyncFile(tmp); err != nil {
		return err
	}
	return s.Add(id, tmp)
}

// qemuImg finds the qemu-img binary.
func (s *Store) qemuImg() (string, error) {
	bin := s.QemuImg
	if bin == "" {
		bin = "qemu-img"
	}
	bin, err := exec.LookPath(bin)
	if err != nil {
		return "", errdefs.FailedPrecondition("qemu-img not found (install qemu-utils): %w", err)
	}
	return bin, nil
}

// qcow2 header fields (all big-endian): magic at 0, version at 4,
// backing_file_offset (u64) at 8, backing_file_size (u32) at 16.
const (
	qcowMagic       = 0x514649fb // "QFI\xfb"
	qcowHeaderLen   = 20
	maxBackingName  = 1023 // QEMU's own limit
	maxChainLen     = 64
	maxHeaderOffset = 1 << 20
)

// BackingFile returns the backing file name in the header of the qcow2
// image at path ("" when it has none).
func BackingFile(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	return readBacking(f)
}

var errNotQCOW2 = errors.New("not a qcow2 image")

// readBacking reads the backing file name of the qcow2 image r.
func readBacking(r io.ReaderAt) (string, error) {
	var h [qcowHeaderLen]byte
	if _, err := r.ReadAt(h[:], 0); err != nil {
		return "", fmt.Errorf("qcow2 header: %w", err)
	}
	if binary.BigEndian.Uint32(h[0:4]) != qcowMagic {
		return "", errNotQCOW2
	}
	if v := binary.BigEndian.Uint32(h[4:8]); v != 2 && v != 3 {
		return "", fmt.Errorf("qcow2 version %d", v)
	}
	off := binary.BigEndian.Uint64(h[8:16])
	size := binary.BigEndian.Uint32(h[16:20])
	if off == 0 {
		return "", nil
	}
	if size == 0 || size > maxBackingName || off < qcowHeaderLen || off > maxHeaderOffset {
		return "", fmt.Errorf("qcow2 backing file name of %d bytes at %d", size, off)
	}
	name := make([]byte, size)
	if _, err := r.ReadAt(name, int64(off)); err != nil {
		return "", fmt.Errorf("qcow2 backing file name: %w", err)
	}
	if strings.IndexByte(string(name), 0) >= 0 {
		return "", errors.New("qcow2 backing file name holds a NUL")
	}
	return string(name), nil
}

// Chain returns the image at path and its backing files, top first, as
// long as each is a qcow2 image with a backing file; the last is the
// first image without one (or that is not qcow2: a raw base). Relative
// backing names are resolved against their image's directory, as QEMU
// does. An image that cannot be read ends the chain with its error; a
// cycle or a chain over 64 images is an error.
func Chain(path string) ([]string, error) {
	out := []string{path}
	seen := map[string]bool{path: true}
	for cur := path; ; {
		f, err := os.Open(cur)
		if err != nil {
			return out, err
		}
		backing, err := readBacking(f)
		f.Close()
		if errors.Is(err, errNotQCOW2) && len(out) > 1 {
			return out, nil // a raw base
		}
		if err != nil {
			return out, fmt.Errorf("%s: %w", cur, err)
		}
		if backing == "" {
			return out, nil
		}
		if !filepath.IsAbs(backing) {
			backing = filepath.Join(filepath.Dir(cur), backing)
		}
		if seen[backing] || len(out) >= maxChainLen {
			return out, fmt.Errorf("%s: backing chain loops or is over %d images", path, maxChainLen)
		}
		seen[backing] = true
		out = append(out, backing)
		cur = backing
	}
}
