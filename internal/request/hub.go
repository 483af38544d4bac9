package request

import (
	"strings"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/hub"
	"github.com/forkd/forkd/internal/snapshot"
)

// Bounds of hub request fields.
const (
	maxRefBytes        = 1024
	maxCAPEMBytes      = 1 << 20
	maxCredentialBytes = 4096
	maxPathBytes       = 4096
)

// remote validates a registry request's reference and connection fields.
func remote(ref string, tagged bool, auth *apiv1.RegistryAuth, caPEM string, insecure bool) (hub.Remote, error) {
	var r hub.Remote
	switch {
	case ref == "":
		return r, errdefs.InvalidArgument("ref is required: a registry reference (registry/repo:tag)")
	case len(ref) > maxRefBytes:
		return r, errdefs.InvalidArgument("ref is %d bytes; the limit is %d", len(ref), maxRefBytes)
	case len(caPEM) > maxCAPEMBytes:
		return r, errdefs.InvalidArgument("ca_pem is %d bytes; the limit is %d", len(caPEM), maxCAPEMBytes)
	case caPEM != "" && !strings.Contains(caPEM, "-----BEGIN CERTIFICATE-----"):
		return r, errdefs.InvalidArgument("ca_pem holds no PEM certificate")
	}
	if err := hub.CheckRef(ref, tagged, insecure); err != nil {
		return r, err
	}
	if auth != nil {
		if auth.Username == "" || len(auth.Username) > maxCredentialBytes || len(auth.Password) > maxCredentialBytes {
			return r, errdefs.InvalidArgument("auth: a username (and a password) of at most %d bytes each", maxCredentialBytes)
		}
		r.Username, r.Password = auth.Username, auth.Password
	}
	r.CAPEM, r.Insecure = []byte(caPEM), insecure
	return r, nil
}

// Push validates a push request for snapshot tag.
func Push(tag string, req *apiv1.PushRequest) (hub.PushSpec, error) {
	if err := snapshot.ValidateTag(tag); err != nil {
		return hub.PushSpec{}, err
	}
	r, err := remote(req.Ref, true, req.Auth, req.CAPEM, req.Insecure)
	return hub.PushSpec{Tag: tag, Ref: req.Ref, Remote: r}, err
}

// Pull validates a pull request.
func Pull(req *apiv1.PullRequest) (hub.PullSpec, error) {
	if req.Tag != "" {
		if err := snapshot.ValidateTag(req.Tag); err != nil {
			return hub.PullSpec{}, err
		}
	}
	r, err := remote(req.Ref, false, req.Auth, req.CAPEM, req.Insecure)
	return hub.PullSpec{Ref: req.Ref, Tag: req.Tag, Remote: r}, err
}

// Pack validates a pack request for snapshot tag (the path is the
// server's to confine).
func Pack(tag string, req *apiv1.PackRequest) (hub.PackSpec, error) {
	if err := snapshot.ValidateTag(tag); err != nil {
		return hub.PackSpec{}, err
	}
	if err := checkPath(req.Path); err != nil {
		return hub.PackSpec{}, err
	}
	return hub.PackSpec{Tag: tag, Path: req.Path}, nil
}

// Unpack validates an unpack request.
func Unpack(req *apiv1.UnpackRequest) (hub.UnpackSpec, error) {
	if req.Tag != "" {
		if err := snapshot.ValidateTag(req.Tag); err != nil {
			return hub.UnpackSpec{}, err
		}
	}
	if err := checkPath(req.Path); err != nil {
		return hub.UnpackSpec{}, err
	}
	return hub.UnpackSpec{Path: req.Path, Tag: req.Tag}, nil
}

func checkPath(p string) error {
	switch {
	case p == "":
		return errdefs.InvalidArgument("path is required")
	case len(p) > maxPathBytes || strings.ContainsRune(p, 0):
		return errdefs.InvalidArgument("path %s is not a usable file name", errdefs.Quote(p))
	}
	return nil
}

// ViewTransfer is a transfer's progress (res nil) or summary, as the API
// shows it.
func ViewTransfer(op string, p hub.Progress, res *hub.Result) *apiv1.Transfer {
	v := &apiv1.Transfer{Op: op, Phase: p.Phase, Files: viewFiles(p.Files)}
	if res == nil {
		for _, f := range p.Files {
			v.BlobBytes += f.Total
			v.MovedBytes += f.Done
			v.SkippedBytes += f.Skipped
			v.Blobs += f.Blobs
			v.BlobsMoved += f.BlobsMoved
		}
		return v
	}
	v.Phase = "done"
	v.Tag, v.Ref, v.Digest = res.Tag, res.Ref, res.Digest
	v.Files = viewFiles(res.Files)
	for _, l := range res.Links {
		v.Links = append(v.Links, apiv1.TransferLink{Tag: l.Tag, Digest: l.Digest, New: l.New})
	}
	v.BlobBytes, v.MovedBytes, v.SkippedBytes, v.CachedBytes = res.BlobBytes, res.Moved, res.Skipped, res.Cached
	v.Blobs, v.BlobsMoved = res.Blobs, res.BlobsMoved
	v.NetSentBytes, v.NetReceivedBytes = res.NetSent, res.NetReceived
	v.MemoryBytes, v.MemoryDataBytes, v.MemoryBlobBytes = res.MemoryBytes, res.MemoryData, res.MemoryBlobs
	v.Seconds = res.Seconds
	return v
}

func viewFiles(fs []hub.FileProgress) []apiv1.TransferFile {
	out := make([]apiv1.TransferFile, len(fs))
	for i, f := range fs {
		out[i] = apiv1.TransferFile{Name: f.Name, TotalBytes: f.Total, DoneBytes: f.Done, SkippedBytes: f.Skipped,
			Blobs: f.Blobs, BlobsDone: f.BlobsDone, WorkBytes: f.Work, WorkDoneBytes: f.WorkDone}
	}
	return out
}
