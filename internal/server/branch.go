package server

import (
	"net/http"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
)

// statusValue is a value a handler answers with a status of its own (a route
// whose success status depends on the request).
type statusValue struct {
	code int
	v    any
}

// branchSandbox branches a running sandbox: 201 with the snapshot once it
// is ready, or, with wait false, 202 at once with the snapshot writing (the
// branch then belongs to the daemon, not to the request).
func (s *Server) branchSandbox(r *http.Request, req *apiv1.BranchRequest) (any, error) {
	spec, wait, err := request.Branch(r.PathValue("id"), req)
	if err != nil {
		return nil, err
	}
	if spec.Tag == "" {
		spec.Tag = sandbox.BranchTag(spec.ID)
	}
	if wait {
		snap, err := s.e.Branch(r.Context(), spec)
		if err != nil {
			return nil, err
		}
		return statusValue{http.StatusCreated, request.ViewSnapshot(snap, 0, nil)}, nil
	}
	// Checked now, so that a refusal is the answer, not a failed snapshot.
	if _, err := s.e.Get(r.Context(), spec.ID); err != nil {
		return nil, err
	}
	if _, err := s.e.Snapshots().Get(spec.Tag); err == nil {
		return nil, errdefs.AlreadyExists("snapshot %s already exists", errdefs.Quote(spec.Tag))
	}
	s.work.Add(1)
	go func() {
		defer s.work.Done()
		if _, err := s.e.Branch(s.base, spec); err != nil {
			s.log.Warn("branch failed", "sandbox", spec.ID, "snapshot", spec.Tag, "err", err)
		}
	}()
	return statusValue{http.StatusAccepted, apiv1.Snapshot{Tag: spec.Tag, Status: apiv1.SnapshotWriting, Kind: snapshot.KindBranch,
		Mode: modeOr(spec.Mode), Source: spec.ID}}, nil
}

func modeOr(m string) string {
	if m == "" {
		return sandbox.BranchDiff
	}
	return m
}

// forkSandbox forks new sandboxes from a running sandbox's current state.
func (s *Server) forkSandbox(r *http.Request, req *apiv1.ForkRequest) (any, error) {
	mode, spec, err := request.ForkFrom(req, s.e.Config().MaxChildren)
	if err != nil {
		return nil, err
	}
	id := r.PathValue("id")
	return s.fork(r, spec, func(spec sandbox.ForkSpec) (*sandbox.ForkResult, error) {
		return s.cfg.Admitter.ForkFrom(r.Context(), id, mode, spec)
	})
}

func (s *Server) snapshotInfo(r *http.Request) (any, error) {
	tag := r.PathValue("tag")
	if err := snapshot.ValidateTag(tag); err != nil {
		return nil, err
	}
	in, err := s.e.Snapshots().Info(tag)
	if err != nil {
		return nil, err
	}
	users, _ := s.e.Users(tag)
	return request.ViewInfo(in, len(users), s.e.Restorable(in.Snapshot)), nil
}

func (s *Server) compactSnapshot(r *http.Request, req *apiv1.CompactRequest) (any, error) {
	snap, err := s.e.Compact(r.Context(), r.PathValue("tag"), req.To)
	if err != nil {
		return nil, err
	}
	return statusValue{http.StatusCreated, request.ViewSnapshot(snap, 0, nil)}, nil
}
