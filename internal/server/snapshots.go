package server

import (
	"fmt"
	"net/http"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
)

// Bounds of snapshot requests.
const (
	maxWarmups     = 32
	maxWarmupBytes = 4096
)

// viewSnapshot is a snapshot as the API shows it; refs is its number of
// live sandboxes.
func viewSnapshot(sn *snapshot.Snapshot, refs int) apiv1.Snapshot {
	return apiv1.Snapshot{
		Tag: sn.Tag, Status: string(sn.Status), Image: sn.Image, Backend: sn.Backend,
		Accelerator: sn.Accelerator, MemoryMiB: sn.MemoryMiB, VCPUs: sn.VCPUs,
		SizeBytes: sn.SizeBytes(), Refcount: refs, Created: sn.Created, Parent: sn.Parent, Error: sn.Error,
		Network: sn.Network, Python: sn.Python,
	}
}

func (s *Server) listSnapshots(r *http.Request) (any, error) {
	snaps, err := s.e.Snapshots().List()
	if err != nil {
		return nil, err
	}
	out := apiv1.SnapshotList{Snapshots: []apiv1.Snapshot{}}
	refs, _ := s.e.Refcounts()
	for _, sn := range snaps {
		out.Snapshots = append(out.Snapshots, viewSnapshot(sn, refs[sn.Tag]))
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
	return viewSnapshot(sn, len(users)), nil
}

func (s *Server) deleteSnapshot(r *http.Request) (any, error) {
	tag := r.PathValue("tag")
	if err := snapshot.ValidateTag(tag); err != nil {
		return nil, err
	}
	if s.ops.writing()[tag] {
		return nil, errdefs.FailedPrecondition("snapshot %q is still being written", tag)
	}
	return nil, s.e.RemoveSnapshot(tag)
}

// SnapshotSpec validates a create request into a snapshot spec and, when
// it imports an OCI image, the import's options. importDir confines local
// image paths (image.OCIOptions.ImportDir; empty: anywhere, for the local
// CLI only). Nothing is built or started.
func SnapshotSpec(req *apiv1.CreateSnapshotRequest, importDir string) (sandbox.SnapshotSpec, *image.OCIOptions, error) {
	spec, err := snapshotSpec(req)
	if err != nil || req.OCI == nil {
		return spec, nil, err
	}
	oci := &image.OCIOptions{Tag: spec.Tag, Extra: req.OCI.Extra, Preload: req.OCI.Preload, Insecure: req.OCI.Insecure,
		ImportDir: importDir}
	if err := image.ValidateOCIOptions(req.OCI.Ref, *oci); err != nil {
		return spec, nil, fmt.Errorf("oci: %w", err)
	}
	return spec, oci, nil
}

// snapshotSpec validates a create request but its OCI source.
func snapshotSpec(req *apiv1.CreateSnapshotRequest) (sandbox.SnapshotSpec, error) {
	spec := sandbox.SnapshotSpec{Tag: req.Tag, Image: req.Image, MemoryMiB: req.MemoryMiB, VCPUs: req.VCPUs, Warmup: req.Warmup}
	if err := snapshot.ValidateTag(spec.Tag); err != nil {
		return spec, err
	}
	if spec.Image == "" {
		spec.Image = "minimal"
	}
	if err := image.ValidateName(spec.Image); err != nil {
		return spec, err
	}
	if m := spec.MemoryMiB; m != 0 && (m < sandbox.MinMemoryMiB || m > sandbox.MaxMemoryMiB) {
		return spec, errdefs.InvalidArgument("memory_mib = %d: want %d to %d", m, sandbox.MinMemoryMiB, sandbox.MaxMemoryMiB)
	}
	if v := spec.VCPUs; v < 0 || v > sandbox.MaxVCPUs {
		return spec, errdefs.InvalidArgument("vcpus = %d: want 1 to %d", v, sandbox.MaxVCPUs)
	}
	if len(spec.Warmup) > maxWarmups {
		return spec, errdefs.InvalidArgument("%d warmup commands; the limit is %d", len(spec.Warmup), maxWarmups)
	}
	for _, w := range spec.Warmup {
		if w == "" || len(w) > maxWarmupBytes {
			return spec, errdefs.InvalidArgument("warmup commands are 1 to %d bytes", maxWarmupBytes)
		}
	}
	return spec, nil
}

// createSnapshot starts building a snapshot in the background and answers
// 202 with the operation to poll. The build belongs to the daemon, not to
// the request: it goes on when the caller leaves.
func (s *Server) createSnapshot(r *http.Request, req *apiv1.CreateSnapshotRequest) (any, error) {
	spec, oci, err := SnapshotSpec(req, s.cfg.ImportDir)
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
		var err error
		if oci != nil {
			spec.Built, err = s.e.Images().FromOCI(s.base, req.OCI.Ref, *oci)
		}
		if err == nil {
			_, err = s.e.CreateSnapshot(s.base, spec)
		}
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
