package memimage

import (
	"errors"
	"io/fs"
	"os"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/vmm"
)

// Layer is an image file being written. Until Commit it is a temporary
// file next to its path (named as fsutil names its temporary files), so a
// crash leaves the path as it was. A Layer is not safe for concurrent use.
type Layer struct {
	path string
	f    *os.File // nil once committed or discarded
}

// CreateLayer starts a layer of size bytes to be committed at path, all
// holes: it will hold only the pages copied into it, the rest reading
// through to its base (Materialize).
func CreateLayer(path string, size int64) (*Layer, error) {
	if size < 0 {
		return nil, errdefs.InvalidArgument("layer %s: size %d", path, size)
	}
	f, err := createTemp(path)
	if err != nil {
		return nil, err
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		os.Remove(f.Name())
		return nil, writeError(err)
	}
	return &Layer{path: path, f: f}, nil
}

// CreateLayerFrom starts an image to be committed at path whose content
// begins as a sparse copy of base (as SparseCopy makes it): a full image,
// to copy a child's private pages over. Made before a guest's pause, it
// keeps the copy of the base out of it.
func CreateLayerFrom(path, base string) (*Layer, error) {
	in, err := os.Open(base)
	if err != nil {
		return nil, fileError("layer from base", err)
	}
	defer in.Close()
	f, err := createTemp(path)
	if err != nil {
		return nil, err
	}
	if err := sparseCopy(in, f); err != nil {
		f.Close()
		os.Remove(f.Name())
		return nil, err
	}
	return &Layer{path: path, f: f}, nil
}

// Copy copies pages of mm's image into the layer, as the package-level
// Copy does. Copying a page twice (a pre-copy, then the pause) leaves the
// later content.
func (l *Layer) Copy(mm vmm.MemoryMap, pages Pages) (int64, error) {
	if l.f == nil {
		return 0, errdefs.FailedPrecondition("layer %s: already committed or discarded", l.path)
	}
	return Copy(mm, pages, l.f)
}

// Commit makes the layer durable at its path: fsync, rename over whatever
// is there, fsync of the directory. The fsync costs what writing back the
// layer's new pages costs, so run it after the guest resumes. After Commit,
// successful or not, the Layer is spent: Discard is a no-op and Copy and
// Commit fail.
func (l *Layer) Commit() error {
	if l.f == nil {
		return errdefs.FailedPrecondition("layer %s: already committed or discarded", l.path)
	}
	f := l.f
	l.f = nil
	if err := commit(f, l.path); err != nil {
		os.Remove(f.Name())
		return err
	}
	return nil
}

// Discard removes the layer's temporary file. Idempotent; a no-op after
// Commit.
func (l *Layer) Discard() error {
	if l.f == nil {
		return nil
	}
	f := l.f
	l.f = nil
	f.Close()
	if err := os.Remove(f.Name()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}
