package hub

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/snapshot"
)

// PackSpec says what Pack writes where.
type PackSpec struct {
	// Tag is the snapshot; Path the tar file to write (it must not
	// exist).
	Tag, Path  string
	OnProgress func(Progress)
}

// Pack writes snapshot spec.Tag, with its chain, as an OCI image layout
// in a tar file: the same artifacts a push sends, for a machine no
// registry reaches. The file appears only once complete.
func (h *Hub) Pack(ctx context.Context, spec PackSpec) (*Result, error) {
	start := time.Now()
	if err := snapshot.ValidateTag(spec.Tag); err != nil {
		return nil, err
	}
	if _, err := os.Lstat(spec.Path); err == nil {
		return nil, errdefs.AlreadyExists("%s exists; give a new file", spec.Path)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	sn, err := h.cfg.Store.Get(spec.Tag)
	if err != nil {
		return nil, err
	}
	f, err := os.CreateTemp(filepath.Dir(spec.Path), fsutil.TempPrefix(filepath.Base(spec.Path)))
	if err != nil {
		return nil, writeErr(err)
	}
	done := false
	defer func() {
		if !done {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	s, err := newTarSink(f, sn.Created)
	if err != nil {
		return nil, err
	}
	res, err := h.push(ctx, s, spec.Tag, spec.Tag, spec.OnProgress, start)
	if res != nil {
		res.Op, res.Ref = "pack", spec.Path
	}
	if err != nil {
		return res, err
	}
	if err := s.close(); err != nil {
		return res, err
	}
	if err := f.Sync(); err != nil {
		return res, writeErr(err)
	}
	if err := f.Close(); err != nil {
		return res, writeErr(err)
	}
	if err := os.Chmod(f.Name(), 0o644); err != nil {
		return res, err
	}
	if err := os.Link(f.Name(), spec.Path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return res, errdefs.AlreadyExists("%s appeared while it was written", spec.Path)
		}
		return res, fmt.Errorf("pack: %w", err)
	}
	done = true
	os.Remove(f.Name())
	if err := fsutil.SyncDir(filepath.Dir(spec.Path)); err != nil {
		return res, err
	}
	st, _ := os.Stat(spec.Path)
	if st != nil {
		say(ctx, "packed %s into %s (%s)", spec.Tag, spec.Path, mib(st.Size()))
	}
	return res, nil
}

// UnpackSpec says what Unpack reads.
type UnpackSpec struct {
	// Path is a tar file Pack wrote (an OCI image layout).
	Path string
	// Tag names the snapshot here ("": the tag it was packed under).
	Tag        string
	OnProgress func(Progress)
}

// Unpack reads a snapshot (and the links of its chain this host lacks)
// from a layout tar, as Pull does from a registry, with the same checks.
func (h *Hub) Unpack(ctx context.Context, spec UnpackSpec) (*Result, error) {
	start := time.Now()
	if spec.Tag != "" {
		if err := snapshot.ValidateTag(spec.Tag); err != nil {
			return nil, err
		}
	}
	src, err := openTar(spec.Path, h.cfg.Limits)
	if err != nil {
		return nil, err
	}
	defer src.close()
	res, err := h.pull(ctx, src, "", spec.Path, spec.Tag, spec.OnProgress, start)
	if res != nil {
		res.Op = "unpack"
	}
	return res, err
}
