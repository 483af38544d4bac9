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
	// Root, when set, confines local sources to this directory (Locate).
	Root string
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
// With o.Root set, local paths are confined to it (Locate). A reference to
// nothing is errdefs.ErrNotFound; a malformed reference, tarball or layout,
// a path outside o.Root, or an image for another platform, is
// errdefs.ErrInvalidArgument; an unreachable registry is
// errdefs.ErrUnavailable.
func Open(ctx context.Context, ref string, o OpenOptions) (*Source, error) {
	if o.Platform.OS == "" {
		o.Platform = DefaultPlatform
	}
	kind, path, err := Locate(ref, o.Root)
	if err != nil {
		return nil, err
	}
	var src *Source
	switch kind {
	case KindLayout:
		src, err = openLayout(path, o.Platform)
	case KindTarball:
		src, err = openTarball(path)
	default:
		src, err = openRemote(ctx, ref, o)
	}
	if err != nil {
		return nil, err
	}
	if err := checkManifest(src.Image); err != nil {
		return nil, fmt.Errorf("image %s: %w", ref, err)
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

// Locate says what ref names, without opening it: its kind and, for a
// tarball or layout, its path (see Open for the forms). A malformed
// registry reference is errdefs.ErrInvalidArgument.
//
// With root empty, a path may be anywhere, relative to the working
// directory. With root set, relative paths are taken inside root, and a
// path that is outside root once cleaned and its symlinks resolved is
// errdefs.ErrInvalidArgument, whether or not it exists; the path returned
// is the resolved one. A reference that is not path-like and names nothing
// in root is a registry reference.
func Locate(ref, root string) (Kind, string, error) {
	if ref == "" {
		return "", "", errdefs.InvalidArgument("empty image reference")
	}
	var kind Kind
	path, local := ref, false
	switch {
	case strings.HasPrefix(ref, "oci:"):
		kind, path, local = KindLayout, strings.TrimPrefix(ref, "oci:"), true
	case strings.HasPrefix(ref, "docker-archive:"):
		kind, path, local = KindTarball, strings.TrimPrefix(ref, "docker-archive:"), true
	case strings.HasPrefix(ref, "/") || strings.HasPrefix(ref, "./") || strings.HasPrefix(ref, "../") ||
		strings.HasSuffix(ref, ".tar") || strings.HasSuffix(ref, ".tar.gz"):
		local = true
	}
	if root != "" && (local || exists(filepath.Join(root, ref))) {
		var err error
		if path, err = confine(path, root); err != nil {
			return "", "", err
		}
		local = true
	}
	if kind != "" {
		return kind, path, nil
	}
	if root != "" && !local {
		// Confined, and not in root: never looked up against the working
		// directory (that would reach, and tell of, any file on the host).
		if _, err := name.ParseReference(ref); err != nil {
			return "", "", badRef(ref, err)
		}
		return KindRegistry, ref, nil
	}
	fi, err := os.Stat(path)
	switch {
	case err == nil && fi.IsDir():
		if !exists(filepath.Join(path, "oci-layout")) {
			return "", "", errdefs.InvalidArgument("image %s: a directory without an oci-layout file", errdefs.Quote(ref))
		}
		return KindLayout, path, nil
	case err == nil:
		return KindTarball, path, nil
	case local:
		return "", "", errdefs.NotFound("image %s: no such file", errdefs.Quote(ref))
	}
	if _, err := name.ParseReference(ref); err != nil {
		return "", "", badRef(ref, err)
	}
	return KindRegistry, ref, nil
}

// confine resolves path (relative paths inside root) and checks that it
// lies inside root. A path lexically outside root is refused before it is
// looked at, so that the answer says nothing of what exists there.
func confine(path, root string) (string, error) {
	rroot, err := filepath.EvalSymlinks(root)
	if err != nil {
		return "", errdefs.FailedPrecondition("import directory %s: %w", root, err)
	}
	if !filepath.IsAbs(path) {
		path = filepath.Join(root, path)
	}
	outside := errdefs.InvalidArgument("image path %s is outside the import directory %s: only paths inside it can be imported", errdefs.Quote(path), root)
	path = filepath.Clean(path)
	if !within(path, root) && !within(path, rroot) {
		return "", outside
	}
	resolved, err := filepath.EvalSymlinks(path)
	if err != nil {
		return "", errdefs.NotFound("image %s: no such file", errdefs.Quote(path))
	}
	if !within(resolved, rroot) {
		return "", outside
	}
	return resolved, nil
}

// badRef is the error for a reference the parser refused. The parser's
// complaint repeats the reference, so it is left out for a long one.
func badRef(ref string, err error) error {
	if len(ref) > errdefs.QuoteMax {
		return errdefs.InvalidArgument("image reference %s is not valid", errdefs.Quote(ref))
	}
	return errdefs.InvalidArgument("image reference %q: %w", ref, err)
}

// within reports whether path is dir or inside it (both clean).
func within(path, dir string) bool {
	rel, err := filepath.Rel(filepath.Clean(dir), path)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

func openRemote(ctx context.Context, ref string, o OpenOptions) (*Source, error) {
	var nopts []name.Option
	if o.Insecure {
		nopts = append(nopts, name.Insecure)
	}
	r, err := name.ParseReference(ref, nopts...)
	if err != nil {
		return nil, badRef(ref, err)
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
		return nil, errdefs.NotFound("image tarball %s: %w", path, err)
	}
	if err := checkTarball(path); err != nil {
		return nil, err
	}
	img, err := tarball.ImageFromPath(path, nil)
	if err != nil {
		return nil, errdefs.InvalidArgument("image tarball %s: %w", path, err)
	}
	return &Source{Image: img, Kind: KindTarball}, nil
}

func openLayout(path string, p v1.Platform) (*Source, error) {
	if _, err := os.Stat(filepath.Join(path, "oci-layout")); err != nil {
		if _, derr := os.Stat(path); derr != nil {
			return nil, errdefs.NotFound("OCI layout %s: %w", path, derr)
		}
		return nil, errdefs.InvalidArgument("OCI layout %s: no oci-layout file", path)
	}
	// Nothing of the layout may be a symlink (one could lead outside the
	// import directory), and what is read whole is bounded.
	for _, f := range []string{"oci-layout", "index.json"} {
		if err := checkLayoutFile(filepath.Join(path, f), MaxMetadata); err != nil {
			return nil, fmt.Errorf("OCI layout: %w", err)
		}
	}
	for _, d := range []string{"blobs", filepath.Join("blobs", "sha256")} {
		if fi, err := os.Lstat(filepath.Join(path, d)); err == nil && !fi.IsDir() {
			return nil, errdefs.InvalidArgument("OCI layout %s: %s is not a directory (a symlink is refused)", path, d)
		}
	}
	idx, err := layout.ImageIndexFromPath(path)
	if err != nil {
		return nil, errdefs.InvalidArgument("OCI layout %s: %w", path, err)
	}
	blob := func(h v1.Hash) error { return layoutBlob(path, h, MaxMetadata) }
	img, err := pickImage(idx, p, blob, 0)
	if err != nil {
		return nil, fmt.Errorf("OCI layout %s: %w", path, err)
	}
	if err := checkLayoutImage(path, img); err != nil {
		return nil, fmt.Errorf("OCI layout: %w", err)
	}
	return &Source{Image: img, Kind: KindLayout}, nil
}

// pickImage returns the one image of idx (and nested indexes) for p: the
// only image, or the only one whose platform matches. A nested index is
// checked with blob before it is read; an image manifest only once it is
// the one picked (a layout may lack the manifests of other platforms).
func pickImage(idx v1.ImageIndex, p v1.Platform, blob func(v1.Hash) error, depth int) (v1.Image, error) {
	if depth > 4 {
		return nil, errdefs.InvalidArgument("indexes nested too deep")
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, errdefs.InvalidArgument("index: %w", err)
	}
	// A candidate is an image manifest of idx (load is nil) or the image a
	// nested index picked.
	type candidate struct {
		digest v1.Hash
		img    v1.Image
	}
	var all, matching []candidate
	for _, d := range im.Manifests {
		if (d.MediaType.IsImage() || d.MediaType.IsIndex()) && d.Size > MaxMetadata {
			return nil, errdefs.InvalidArgument("manifest %s is %d bytes; the limit is %d", d.Digest, d.Size, MaxMetadata)
		}
		switch {
		case d.MediaType.IsImage():
			c := candidate{digest: d.Digest}
			all = append(all, c)
			if d.Platform != nil && d.Platform.OS == p.OS && d.Platform.Architecture == p.Architecture {
				matching = append(matching, c)
			}
		case d.MediaType.IsIndex():
			if err := blob(d.Digest); err != nil {
				return nil, err
			}
			child, err := idx.ImageIndex(d.Digest)
			if err != nil {
				return nil, errdefs.InvalidArgument("index %s: %w", d.Digest, err)
			}
			img, err := pickImage(child, p, blob, depth+1)
			if err != nil {
				return nil, err
			}
			all = append(all, candidate{img: img})
			matching = append(matching, candidate{img: img})
		}
	}
	var pick candidate
	switch {
	case len(matching) == 1:
		pick = matching[0]
	case len(all) == 1:
		pick = all[0]
	case len(all) == 0:
		return nil, errdefs.NotFound("no image in the index")
	default:
		return nil, errdefs.InvalidArgument("%d images and no single one for %s/%s", len(all), p.OS, p.Architecture)
	}
	if pick.img != nil {
		return pick.img, nil
	}
	if err := blob(pick.digest); err != nil {
		return nil, err
	}
	img, err := idx.Image(pick.digest)
	if err != nil {
		return nil, errdefs.InvalidArgument("image %s: %w", pick.digest, err)
	}
	return img, nil
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
				return errdefs.NotFound("image %s: %w", ref, err)
			case transport.UnauthorizedErrorCode, transport.DeniedErrorCode:
				return errdefs.Unauthenticated("image %s: %w", ref, err)
			}
		}
		switch terr.StatusCode {
		case http.StatusNotFound:
			return errdefs.NotFound("image %s: %w", ref, err)
		case http.StatusUnauthorized, http.StatusForbidden:
			return errdefs.Unauthenticated("image %s: %w", ref, err)
		}
		return errdefs.Unavailable("image %s: %w", ref, err)
	}
	var nerr net.Error
	if errors.As(err, &nerr) || errors.Is(err, os.ErrDeadlineExceeded) {
		return errdefs.Unavailable("image %s: %w", ref, err)
	}
	if kind == KindRegistry {
		return errdefs.Unavailable("image %s: %w", ref, err)
	}
	return errdefs.InvalidArgument("image %s: %w", ref, err)
}
