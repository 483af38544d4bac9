package server

import (
	"context"
	"errors"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/hub"
	"github.com/forkd/forkd/internal/progress"
	"github.com/forkd/forkd/internal/request"
)

// Operation kinds of the hub.
const (
	opPush   = "push"
	opPull   = "pull"
	opPack   = "pack"
	opUnpack = "unpack"
)

// transfer runs a hub transfer in the background as operation op: its
// progress goes to the operation as it runs, its summary when it ends.
// It belongs to the daemon, not to the request.
func (s *Server) transfer(op apiv1.Operation, run func(ctx context.Context, onProgress func(hub.Progress)) (*hub.Result, error)) {
	s.work.Add(1)
	go func() {
		defer s.work.Done()
		select {
		case s.transfers <- struct{}{}:
		case <-s.base.Done():
			s.ops.finish(op.ID, s.base.Err())
			return
		}
		defer func() { <-s.transfers }()
		ctx := progress.With(s.base, s.ops.progress(op.ID))
		res, err := run(ctx, func(p hub.Progress) { s.ops.setTransfer(op.ID, request.ViewTransfer(op.Kind, p, nil)) })
		if res != nil {
			s.ops.setTransfer(op.ID, request.ViewTransfer(op.Kind, hub.Progress{}, res))
			if res.Tag != "" {
				s.ops.setSnapshot(op.ID, res.Tag)
			}
		}
		if err != nil {
			s.log.Warn("transfer failed", "op", op.Kind, "operation", op.ID, "err", err)
		}
		s.ops.finish(op.ID, err)
	}()
}

// pushSnapshot pushes a snapshot to a registry: 202 with the operation.
func (s *Server) pushSnapshot(r *http.Request, req *apiv1.PushRequest) (any, error) {
	spec, err := request.Push(r.PathValue("tag"), req)
	if err != nil {
		return nil, err
	}
	if _, err := s.e.Snapshots().Get(spec.Tag); err != nil {
		return nil, err
	}
	op, err := s.ops.start(opPush, spec.Tag)
	if err != nil {
		return nil, err
	}
	s.transfer(op, func(ctx context.Context, onProgress func(hub.Progress)) (*hub.Result, error) {
		spec.OnProgress = onProgress
		return s.e.Push(ctx, spec)
	})
	return op, nil
}

// pullSnapshot pulls a snapshot from a registry: 202 with the operation.
func (s *Server) pullSnapshot(r *http.Request, req *apiv1.PullRequest) (any, error) {
	spec, err := request.Pull(req)
	if err != nil {
		return nil, err
	}
	if spec.Tag != "" {
		if _, err := s.e.Snapshots().Get(spec.Tag); err == nil {
			return nil, errdefs.AlreadyExists("snapshot %q already exists; pull with another tag", spec.Tag)
		}
	}
	op, err := s.ops.start(opPull, spec.Tag)
	if err != nil {
		return nil, err
	}
	s.transfer(op, func(ctx context.Context, onProgress func(hub.Progress)) (*hub.Result, error) {
		spec.OnProgress = onProgress
		return s.e.Pull(ctx, spec)
	})
	return op, nil
}

// packSnapshot writes a snapshot into a layout tar file: 202 with the
// operation.
func (s *Server) packSnapshot(r *http.Request, req *apiv1.PackRequest) (any, error) {
	spec, err := request.Pack(r.PathValue("tag"), req)
	if err != nil {
		return nil, err
	}
	if spec.Path, err = s.confine(spec.Path, s.cfg.ExportDir, "export", false); err != nil {
		return nil, err
	}
	if _, err := s.e.Snapshots().Get(spec.Tag); err != nil {
		return nil, err
	}
	op, err := s.ops.start(opPack, spec.Tag)
	if err != nil {
		return nil, err
	}
	s.transfer(op, func(ctx context.Context, onProgress func(hub.Progress)) (*hub.Result, error) {
		spec.OnProgress = onProgress
		return s.e.Pack(ctx, spec)
	})
	return op, nil
}

// unpackSnapshot reads a snapshot from a layout tar file: 202 with the
// operation.
func (s *Server) unpackSnapshot(r *http.Request, req *apiv1.UnpackRequest) (any, error) {
	spec, err := request.Unpack(req)
	if err != nil {
		return nil, err
	}
	if spec.Path, err = s.confine(spec.Path, s.cfg.ImportDir, "import", true); err != nil {
		return nil, err
	}
	if spec.Tag != "" {
		if _, err := s.e.Snapshots().Get(spec.Tag); err == nil {
			return nil, errdefs.AlreadyExists("snapshot %q already exists; unpack with another tag", spec.Tag)
		}
	}
	op, err := s.ops.start(opUnpack, spec.Tag)
	if err != nil {
		return nil, err
	}
	s.transfer(op, func(ctx context.Context, onProgress func(hub.Progress)) (*hub.Result, error) {
		spec.OnProgress = onProgress
		return s.e.Unpack(ctx, spec)
	})
	return op, nil
}

// confine resolves a file path of a pack (exists false: a new file) or an
// unpack (an existing file). A local server takes any path, relative to
// its working directory (the CLI's own). A daemon takes relative paths
// inside dir and absolute ones only inside it, symlinks resolved, so
// that API callers read and write nothing else of its host.
func (s *Server) confine(path, dir, what string, exists bool) (string, error) {
	if s.cfg.Local {
		return filepath.Abs(path)
	}
	root, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return "", errdefs.FailedPrecondition("%s directory %s: %w (create it, or start forkd serve with --%s-dir)", what, dir, err, what)
	}
	if !filepath.IsAbs(path) {
		path = filepath.Join(root, path)
	}
	path = filepath.Clean(path)
	outside := errdefs.InvalidArgument("%s is outside the daemon's %s directory %s: only files inside it can be used", errdefs.Quote(path), what, dir)
	check := path
	if !exists {
		check = filepath.Dir(path)
	}
	resolved, err := filepath.EvalSymlinks(check)
	if errors.Is(err, fs.ErrNotExist) {
		if !inside(path, root) && !inside(path, dir) {
			return "", outside
		}
		return "", errdefs.NotFound("%s: no such file or directory", errdefs.Quote(check))
	}
	if err != nil {
		return "", err
	}
	if !inside(resolved, root) {
		return "", outside
	}
	if !exists {
		resolved = filepath.Join(resolved, filepath.Base(path))
		if fi, err := os.Lstat(resolved); err == nil && fi.Mode()&fs.ModeSymlink != 0 {
			return "", outside
		} else if err == nil {
			return "", errdefs.AlreadyExists("%s exists; pack writes a new file", errdefs.Quote(path))
		}
	}
	return resolved, nil
}

// inside reports whether path is dir or below it (both clean).
func inside(path, dir string) bool {
	rel, err := filepath.Rel(filepath.Clean(dir), path)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}
