package server

import (
	"net/http"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/progress"
	"github.com/forkd/forkd/internal/request"
	"github.com/forkd/forkd/internal/snapshot"
)

func (s *Server) listSnapshots(r *http.Request) (any, error) {
	snaps, err := s.e.Snapshots().List()
	if err != nil {
		return nil, err
	}
	out := apiv1.SnapshotList{Snapshots: []apiv1.Snapshot{}}
	refs, _ := s.e.Refcounts()
	for _, sn := range snaps {
		out.Snapshots = append(out.Snapshots, request.ViewSnapshot(sn, refs[sn.Tag], s.e.Restorable(sn)))
	}
	for tag := range s.ops.writing() {
		out.Snapshots = append(out.Snapshots, apiv1.Snapshot{Tag: tag, Status: apiv1.SnapshotWriting})
	}
	return out, nil
}

func (s *Server) getSnapshot(r *http.Request) (any, error) {
	tag := r.PathValue("tag")
	if err := snapshot.ValidateTag(tag); err != nil {
		return nil, err
	}
	sn, err := s.e.Snapshots().Get(tag)
	if errdefs.IsNotFound(err) && s.ops.writing()[tag] {
		return apiv1.Snapshot{Tag: tag, Status: apiv1.SnapshotWriting}, nil
	}
	if err != nil {
		return nil, err
	}
	users, _ := s.e.Users(sn.Tag)
	return request.ViewSnapshot(sn, len(users), s.e.Restorable(sn)), nil
}

func (s *Server) deleteSnapshot(r *http.Request) (any, error) {
	tag := r.PathValue("tag")
	if err := snapshot.ValidateTag(tag); err != nil {
		return nil, err
	}
	if s.ops.writing()[tag] {
		return nil, errdefs.FailedPrecondition("snapshot %q is still being written", tag)
	}
	q := r.URL.Query()
	opts := snapshot.RemoveOptions{Cascade: q.Get("cascade") == "true", Force: q.Get("force") == "true"}
	for _, k := range []string{"cascade", "force"} {
		if v := q.Get(k); v != "" && v != "true" && v != "false" {
			return nil, errdefs.InvalidArgument("%s=%s: want true or false", k, errdefs.Quote(v))
		}
	}
	if opts.Cascade && opts.Force {
		return nil, errdefs.InvalidArgument("cascade and force: give one")
	}
	_, err := s.e.RemoveSnapshotWith(tag, opts)
	return nil, err
}

// createSnapshot starts building a snapshot in the background and answers
// 202 with the operation to poll. The build belongs to the daemon, not to
// the request: it goes on when the caller leaves.
func (s *Server) createSnapshot(r *http.Request, req *apiv1.CreateSnapshotRequest) (any, error) {
	spec, oci, err := request.SnapshotSpec(req, s.cfg.ImportDir)
	if err != nil {
		return nil, err
	}
	if oci != nil && len(oci.Extra) > 0 && !s.cfg.AllowImageScripts {
		return nil, errdefs.InvalidArgument("oci.extra runs the image's own package scripts as root on the host; " +
			"this daemon refuses it unless started with forkd serve --allow-image-scripts")
	}
	spec.Network = s.e.Config().Net != nil
	if req.Network != nil {
		spec.Network = *req.Network
	}
	if spec.Network && s.e.Config().Net == nil {
		return nil, errdefs.FailedPrecondition("network: this daemon cannot give children their own network namespaces (it does not run as root)")
	}
	if _, err := s.e.Snapshots().Get(spec.Tag); err == nil {
		return nil, errdefs.AlreadyExists("snapshot %q already exists", spec.Tag)
	} else if !errdefs.IsNotFound(err) {
		return nil, err
	}
	op, err := s.ops.start("create_snapshot", spec.Tag)
	if err != nil {
		return nil, err
	}
	s.work.Add(1)
	go func() {
		defer s.work.Done()
		select {
		case s.builds <- struct{}{}:
		case <-s.base.Done():
			s.ops.finish(op.ID, s.base.Err())
			return
		}
		defer func() { <-s.builds }()
		_, err := s.e.CreateSnapshot(progress.With(s.base, s.ops.progress(op.ID)), spec)
		if err != nil {
			s.log.Warn("snapshot build failed", "snapshot", spec.Tag, "operation", op.ID, "err", err)
		}
		s.ops.finish(op.ID, err)
	}()
	return op, nil
}

func (s *Server) listOperations(r *http.Request) (any, error) {
	return apiv1.OperationList{Operations: s.ops.list()}, nil
}

func (s *Server) getOperation(r *http.Request) (any, error) {
	return s.ops.get(r.PathValue("id"))
}
