// Package oci reads container images (from a registry, a `docker save`
// tarball or an OCI layout directory) and flattens their layers into a
// directory tree, honouring whiteouts, modes, ownership, symlinks and hard
// links, and refusing any entry that would land outside the tree.
package oci

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/forkd/forkd/internal/errdefs"
)

// DefaultPlatform is the platform of forkd guests.
var DefaultPlatform = v1.Platform{OS: "linux", Architecture: "amd64"}

// OpenOptions tune Open.
type OpenOptions struct {
	// Insecure allows plain HTTP and unverified TLS for any registry.
	// Without it, plain HTTP is used only for localhost, loopback and
	// private addresses (go-containerregistry's rule).
	Insecure bool
	// Platform selects the image of a multi-platform index; zero means
	// DefaultPlatform.
	Platform v1.Platform
	// Keychain authenticates to registries; nil means the Docker config
	// (~/.docker/config.json, credential helpers).
	Keychain authn.Keychain
}

// Kind says where an image came from.
type Kind string

// The kinds of source Open accepts.
const (
	KindRegistry Kind = "registry"
	KindTarball  Kind = "docker-archive"
	KindLayout   Kind = "oci-layout"
)

// Source is an opened image and where it came from.
type Source struct {
	Image  v1.Image
	Kind   Kind
	Ref    string  // the reference as given
	Digest v1.Hash // manifest digest: a content key of the image
}

// Open resolves ref to one image:
//
//   - "oci:PATH", or a directory holding an oci-layout file: an OCI layout;
//   - "docker-archive:PATH", or a regular file: a `docker save` tarball;
//   - anything else: a registry reference ("localhost:5000/foo:tag"); a
//     reference that looks like a path (starts with "/", "./", "../", ends
//     in ".tar") and names no file is errdefs.ErrNotFound.
//
// A reference to nothing is errdefs.ErrNotFound; a malformed reference,
// tarball or layout, or an image for another platform, is
// errdefs.ErrInvalidArgument; an unreachable registry is
// errdefs.ErrUnavailable.
func Open(ctx context.Context, ref string, o OpenOptions) (*Source, error) {
	if o.Platform.OS == "" {
		o.Platform = DefaultPlatform
	}
	var (
		src *Source
		err error
	)
	switch {
	case strings.HasPrefix(ref, "oci:"):
		src, err = openLayout(strings.TrimPrefix(ref, "oci:"), o.Platform)
	case strings.HasPrefix(ref, "docker-archive:"):
		src, err = openTarball(strings.TrimPrefix(ref, "docker-archive:"))
	default:
		fi, serr := os.Stat(ref)
		switch {
		case serr == nil && fi.IsDir():
			if _, err := os.Stat(filepath.Join(ref, "oci-layout")); err != nil {
				return nil, errdefs.InvalidArgument("image %s: a directory without an oci-layout file", ref)
			}
			src, err = openLayout(ref, o.Platform)
		case serr == nil:
			src, err = openTarball(ref)
		case strings.HasPrefix(ref, "/") || strings.HasPrefix(ref, "./") || strings.HasPrefix(ref, "../") ||
			strings.HasSuffix(ref, ".tar") || strings.HasSuffix(ref, ".tar.gz"):
			return nil, errdefs.NotFound("image %s: no such file", ref)
		default:
			src, err = openRemote(ctx, ref, o)
		}
	}
	if err != nil {
		return nil, err
	}
	src.Ref = ref
	if src.Digest, err = src.Image.Digest(); err != nil {
		return nil, classify(ref, err, src.Kind)
	}
	cf, err := src.Image.ConfigFile()
	if err != nil {
		return nil, classify(ref, err, src.Kind)
	}
	if (cf.OS != "" && cf.OS != o.Platform.OS) || (cf.Architecture != "" && cf.Architecture != o.Platform.Architecture) {
		return nil, errdefs.InvalidArgument("image %s is for %s/%s, not %s/%s", ref, cf.OS, cf.Architecture,
			o.Platform.OS, o.Platform.Architecture)
	}
	return src, nil
}

func openRemote(ctx context.Context, ref string, o OpenOptions) (*Source, error) {
	var nopts []name.Option
	if o.Insecure {
		nopts = append(nopts, name.Insecure)
	}
	r, err := name.ParseReference(ref, nopts...)
	if err != nil {
		return nil, errdefs.InvalidArgument("image reference %q: %v", ref, err)
	}
	kc := o.Keychain
	if kc == nil {
		kc = authn.DefaultKeychain
	}
	ropts := []remote.Option{remote.WithContext(ctx), remote.WithPlatform(o.Platform), remote.WithAuthFromKeychain(kc)}
	if o.Insecure {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = &tls.Config{InsecureSkipVerify: true} //nolint:gosec // asked for with Insecure
		ropts = append(ropts, remote.WithTransport(tr))
	}
	img, err := remote.Image(r, ropts...)
	if err != nil {
		return nil, classify(ref, err, KindRegistry)
	}
	return &Source{Image: img, Kind: KindRegistry}, nil
}

func openTarball(path string) (*Source, error) {
	if _, err := os.Stat(path); err != nil {
		return nil, errdefs.NotFound("image tarball %s: %v", path, err)
	}
	img, err := tarball.ImageFromPath(path, nil)
	if err != nil {
		return nil, errdefs.InvalidArgument("image tarball %s: %v", path, err)
	}
	return &Source{Image: img, Kind: KindTarball}, nil
}

func openLayout(path string, p v1.Platform) (*Source, error) {
	if _, err := os.Stat(filepath.Join(path, "oci-layout")); err != nil {
		if _, derr := os.Stat(path); derr != nil {
			return nil, errdefs.NotFound("OCI layout %s: %v", path, derr)
		}
		return nil, errdefs.InvalidArgument("OCI layout %s: no oci-layout file", path)
	}
	idx, err := layout.ImageIndexFromPath(path)
	if err != nil {
		return nil, errdefs.InvalidArgument("OCI layout %s: %v", path, err)
	}
	img, err := pickImage(idx, p, 0)
	if err != nil {
		return nil, fmt.Errorf("OCI layout %s: %w", path, err)
	}
	return &Source{Image: img, Kind: KindLayout}, nil
}

// pickImage returns the one image of idx (and nested indexes) for p: the
// only image, or the only one whose platform matches.
func pickImage(idx v1.ImageIndex, p v1.Platform, depth int) (v1.Image, error) {
	if depth > 4 {
		return nil, errdefs.InvalidArgument("indexes nested too deep")
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, errdefs.InvalidArgument("index: %v", err)
	}
	var all, matching []v1.Image
	for _, d := range im.Manifests {
		switch {
		case d.MediaType.IsImage():
			img, err := idx.Image(d.Digest)
			if err != nil {
				return nil, errdefs.InvalidArgument("image %s: %v", d.Digest, err)
			}
			all = append(all, img)
			if d.Platform != nil && d.Platform.OS == p.OS && d.Platform.Architecture == p.Architecture {
				matching = append(matching, img)
			}
		case d.MediaType.IsIndex():
			child, err := idx.ImageIndex(d.Digest)
			if err != nil {
				return nil, errdefs.InvalidArgument("index %s: %v", d.Digest, err)
			}
			img, err := pickImage(child, p, depth+1)
			if err != nil {
				return nil, err
			}
			all = append(all, img)
			matching = append(matching, img)
		}
	}
	switch {
	case len(matching) == 1:
		return matching[0], nil
	case len(all) == 1:
		return all[0], nil
	case len(all) == 0:
		return nil, errdefs.NotFound("no image in the index")
	}
	return nil, errdefs.InvalidArgument("%d images and no single one for %s/%s", len(all), p.OS, p.Architecture)
}

// classify gives err from go-containerregistry a class.
func classify(ref string, err error, kind Kind) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	var terr *transport.Error
	if errors.As(err, &terr) {
		for _, d := range terr.Errors {
			switch d.Code {
			case transport.ManifestUnknownErrorCode, transport.NameUnknownErrorCode, transport.BlobUnknownErrorCode:
				return errdefs.NotFound("image %s: %v", ref, err)
			case transport.UnauthorizedErrorCode, transport.DeniedErrorCode:
				return errdefs.Unauthenticated("image %s: %v", ref, err)
			}
		}
		switch terr.StatusCode {
		case http.StatusNotFound:
			return errdefs.NotFound("image %s: %v", ref, err)
		case http.StatusUnauthorized, http.StatusForbidden:
			return errdefs.Unauthenticated("image %s: %v", ref, err)
		}
		return errdefs.Unavailable("image %s: %v", ref, err)
	}
	var nerr net.Error
	if errors.As(err, &nerr) || errors.Is(err, os.ErrDeadlineExceeded) {
		return errdefs.Unavailable("image %s: %v", ref, err)
	}
	if kind == KindRegistry {
		return errdefs.Unavailable("image %s: %v", ref, err)
	}
	return errdefs.InvalidArgument("image %s: %v", ref, err)
}
