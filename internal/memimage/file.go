package memimage

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
)

// SparseCopy copies the file src to dst, a new file (mode 0600), keeping
// src's holes: dst gets src's size and content, and blocks only where src
// has data. It tries a reflink (FICLONE: O(1), sharing blocks on XFS and
// btrfs) and otherwise copies src's data extents (SEEK_DATA/SEEK_HOLE) with
// copy_file_range, preallocating nothing. dst is neither synced nor written
// atomically (see fsutil.SyncFile); on error it is removed.
//
// dst must not exist (AlreadyExists otherwise): an image may be mapped by
// running children, which rewriting it in place would corrupt. A missing
// src is NotFound; a full filesystem ResourceExhausted.
func SparseCopy(src, dst string) (err error) {
	in, err := os.Open(src)
	if err != nil {
		return fileError("sparse copy", err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fileError("sparse copy", err)
	}
	defer func() {
		if err != nil {
			out.Close()
			os.Remove(dst)
		}
	}()
	if err := sparseCopy(in, out); err != nil {
		return fmt.Errorf("sparse copy %s: %w", src, err)
	}
	return out.Close()
}

// sparseCopy makes out, an empty file, a sparse copy of in.
func sparseCopy(in, out *os.File) error {
	st, err := in.Stat()
	if err != nil {
		return err
	}
	if unix.IoctlFileClone(int(out.Fd()), int(in.Fd())) == nil {
		return nil
	}
	// No reflink here (EOPNOTSUPP on ext4 and tmpfs, EXDEV across
	// filesystems): a failed clone may have left out in any state.
	if err := out.Truncate(0); err != nil {
		return writeError(err)
	}
	if err := out.Truncate(st.Size()); err != nil {
		return writeError(err)
	}
	return dataExtents(in, st.Size(), func(off, n int64) error { return copyRange(in, out, off, n) })
}

// Materialize writes out: the image base with every data extent of the
// layer written over it, at the same offsets (Flatten of base and layer).
func Materialize(base, layer, out string) error {
	return Flatten([]string{base, layer}, out)
}

// Flatten writes out: the image chain[0] (the base) with the data extents
// of each later file (its layers, in order) written over it at the same
// offsets, so that a hole in a layer reads through to the layers and base
// below it and a data extent, zeros included, replaces them. All must have
// the base's size (InvalidArgument otherwise).
//
// out is written atomically: a temporary file next to it, fsynced and
// renamed over out (an image mapped by running children keeps its content).
// The base is copied as SparseCopy does, a reflink where possible; the
// layers' extents with copy_file_range (reflinked, too, on XFS and btrfs).
//
// A layer must sit on a filesystem that reports holes at page granularity
// or finer (ext4, XFS, btrfs, tmpfs without huge pages): where a data
// extent may cover more than the pages written into it, the rest would
// read as zeros and replace base pages. A layer whose file reports a block
// size over the page size is refused (FailedPrecondition).
func Flatten(chain []string, out string) (err error) {
	if len(chain) == 0 {
		return errdefs.InvalidArgument("flatten %s: empty chain", out)
	}
	files := make([]*os.File, 0, len(chain))
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	var size int64
	for i, p := range chain {
		f, err := os.Open(p)
		if err != nil {
			return fileError("flatten", err)
		}
		files = append(files, f)
		var st unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &st); err != nil {
			return fmt.Errorf("flatten: stat %s: %w", p, err)
		}
		switch {
		case i == 0:
			size = st.Size
		case st.Size != size:
			return errdefs.InvalidArgument("flatten: layer %s has %d bytes, its base %d", p, st.Size, size)
		case int(st.Blksize) > os.Getpagesize():
			return errdefs.FailedPrecondition("flatten: layer %s: its filesystem allocates %d-byte blocks, more than a page: holes cannot be told from written zeros", p, st.Blksize)
		}
	}

	f, err := createTemp(out)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if err := sparseCopy(files[0], f); err != nil {
		return fmt.Errorf("flatten %s: base %s: %w", out, chain[0], err)
	}
	for i, layer := range files[1:] {
		err := dataExtents(layer, size, func(off, n int64) error { return copyRange(layer, f, off, n) })
		if err != nil {
			return fmt.Errorf("flatten %s: layer %s: %w", out, chain[i+1], err)
		}
	}
	return commit(f, out)
}

// Allocated returns the bytes of storage the file at path holds
// (st_blocks * 512): for a sparse image, about its data extents.
func Allocated(path string) (int64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, fileError("allocated", &fs.PathError{Op: "stat", Path: path, Err: err})
	}
	return st.Blocks * 512, nil
}

// dataExtents calls fn for each data extent of f within [0, size), in
// order, as SEEK_DATA and SEEK_HOLE report them.
func dataExtents(f *os.File, size int64, fn func(off, n int64) error) error {
	fd := int(f.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) { // no data past off
			return nil
		}
		if err != nil {
			return fmt.Errorf("seek data in %s: %w", f.Name(), err)
		}
		if data >= size {
			return nil
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("seek hole in %s: %w", f.Name(), err)
		}
		hole = min(hole, size)
		if err := fn(data, hole-data); err != nil {
			return err
		}
		off = hole
	}
	return nil
}

// copyRange copies the n bytes at off in in to the same offset in out,
// with copy_file_range where the kernel can (same filesystem), else
// through a buffer.
func copyRange(in, out *os.File, off, n int64) error {
	for n > 0 {
		roff, woff := off, off
		k, err := unix.CopyFileRange(int(in.Fd()), &roff, int(out.Fd()), &woff, int(min(n, 1<<30)), 0)
		switch {
		case errors.Is(err, unix.EXDEV), errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.ENOSYS), errors.Is(err, unix.EINVAL):
			return copyRangeBuffered(in, out, off, n)
		case err != nil:
			return writeError(err)
		case k == 0:
			return fmt.Errorf("copy %s: %w at offset %d", in.Name(), io.ErrUnexpectedEOF, off)
		}
		off, n = off+int64(k), n-int64(k)
	}
	return nil
}

// copyRangeBuffered is copyRange with pread and pwrite.
func copyRangeBuffered(in, out *os.File, off, n int64) error {
	buf := copyBufs.Get().(*[maxCopyChunk]byte)
	defer copyBufs.Put(buf)
	for n > 0 {
		b := buf[:min(n, int64(len(buf)))]
		if _, err := in.ReadAt(b, off); err != nil {
			return fmt.Errorf("read %s: %w", in.Name(), err)
		}
		if _, err := out.WriteAt(b, off); err != nil {
			return writeError(err)
		}
		off, n = off+int64(len(b)), n-int64(len(b))
	}
	return nil
}

// createTemp creates the temporary file (mode 0600) through which path is
// written, next to it and named as fsutil names its own.
func createTemp(path string) (*os.File, error) {
	f, err := os.CreateTemp(filepath.Dir(path), fsutil.TempPrefix(filepath.Base(path)))
	if err != nil {
		return nil, fileError("create", err)
	}
	return f, nil
}

// commit fsyncs and closes f, renames it to path and fsyncs the directory.
// On error f is closed and left for the caller to remove.
func commit(f *os.File, path string) error {
	if err := f.Sync(); err != nil {
		f.Close()
		return writeError(err)
	}
	if err := f.Close(); err != nil {
		return writeError(err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fileError("commit", err)
	}
	return fsutil.SyncDir(filepath.Dir(path))
}

// DataHash returns a SHA-256 over the data extents of the file at path
// (each extent's offset and length, then its bytes) and the file's size,
// without reading its holes: two images with the same data at the same
// places hash alike, however their holes were made.
func DataHash(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, errdefs.NotFound("%s: %w", path, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	h := sha256.New()
	buf := make([]byte, 1<<20)
	var hdr [16]byte
	err = dataExtents(f, st.Size(), func(off, n int64) error {
		binary.BigEndian.PutUint64(hdr[:8], uint64(off))
		binary.BigEndian.PutUint64(hdr[8:], uint64(n))
		h.Write(hdr[:])
		_, err := io.CopyBuffer(h, io.NewSectionReader(f, off, n), buf)
		return err
	})
	if err != nil {
		return nil, err
	}
	binary.BigEndian.PutUint64(hdr[:8], uint64(st.Size()))
	h.Write(hdr[:8])
	return h.Sum(nil), nil
}
