package oci

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/forkd/forkd/internal/errdefs"
)

// checkManifest bounds and verifies what Open reads of img before its
// layers: at most MaxLayers layers, a config of at most MaxMetadata bytes
// whose content matches the manifest's digest of it (go-containerregistry
// does not check it for layouts). The manifest itself needs no check: the
// image digest is computed from its bytes.
func checkManifest(img v1.Image) error {
	m, err := img.Manifest()
	if err != nil {
		return errdefs.InvalidArgument("manifest: %w", err)
	}
	if len(m.Layers) > MaxLayers {
		return errdefs.InvalidArgument("image has %d layers; the limit is %d", len(m.Layers), MaxLayers)
	}
	if m.Config.Size > MaxMetadata {
		return errdefs.InvalidArgument("image config is %d bytes; the limit is %d", m.Config.Size, MaxMetadata)
	}
	raw, err := img.RawConfigFile()
	if err != nil {
		return errdefs.InvalidArgument("config: %w", err)
	}
	got, _, err := v1.SHA256(bytes.NewReader(raw))
	if err != nil {
		return err
	}
	if got != m.Config.Digest {
		return errdefs.InvalidArgument("config %s content does not match its digest (%s)", m.Config.Digest, got)
	}
	return nil
}

// checkLayoutFile refuses a file of an OCI layout that is not a regular
// file (a symlink could lead outside the import directory) or is larger
// than max bytes (max < 0: any size).
func checkLayoutFile(path string, max int64) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return errdefs.NotFound("%s: no such file", path)
	}
	if err != nil {
		return errdefs.InvalidArgument("%w", err)
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		return errdefs.InvalidArgument("%s is a symlink; the files of a layout must be regular files", path)
	}
	if !fi.Mode().IsRegular() {
		return errdefs.InvalidArgument("%s is not a regular file (a %s)", path, fi.Mode().Type())
	}
	if max >= 0 && fi.Size() > max {
		return errdefs.InvalidArgument("%s is %d bytes; the limit is %d", path, fi.Size(), max)
	}
	return nil
}

// layoutBlob is the path of blob h in the layout at dir, checked with
// checkLayoutFile.
func layoutBlob(dir string, h v1.Hash, max int64) error {
	if h.Algorithm == "" || h.Hex == "" || filepath.Base(h.Hex) != h.Hex || filepath.Base(h.Algorithm) != h.Algorithm {
		return errdefs.InvalidArgument("blob digest %q is not valid", h)
	}
	return checkLayoutFile(filepath.Join(dir, "blobs", h.Algorithm, h.Hex), max)
}

// checkLayoutImage checks the blobs of img, from the layout at dir, before
// go-containerregistry reads them: manifest and config regular files of at
// most MaxMetadata bytes, layers regular files.
func checkLayoutImage(dir string, img v1.Image) error {
	d, err := img.Digest()
	if err != nil {
		return errdefs.InvalidArgument("manifest: %w", err)
	}
	m, err := img.Manifest()
	if err != nil {
		return errdefs.InvalidArgument("manifest %s: %w", d, err)
	}
	if err := layoutBlob(dir, m.Config.Digest, MaxMetadata); err != nil {
		return err
	}
	for _, l := range m.Layers {
		if err := layoutBlob(dir, l.Digest, -1); err != nil {
			return err
		}
	}
	return nil
}

// checkTarball bounds what go-containerregistry reads whole of a `docker
// save` tarball: manifest.json and the configs it names, at most
// MaxMetadata bytes each.
func checkTarball(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return errdefs.NotFound("image tarball %s: %w", path, err)
	}
	defer f.Close()
	sizes := map[string]int64{}
	var manifest []byte
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return errdefs.InvalidArgument("image tarball %s: %w", path, err)
		}
		name := filepath.Clean(hdr.Name)
		sizes[name] = hdr.Size
		if name == "manifest.json" {
			if hdr.Size > MaxMetadata {
				return errdefs.InvalidArgument("image tarball %s: manifest.json is %d bytes; the limit is %d", path, hdr.Size, MaxMetadata)
			}
			if manifest, err = io.ReadAll(tr); err != nil {
				return errdefs.InvalidArgument("image tarball %s: %w", path, err)
			}
		}
	}
	var entries []struct{ Config string }
	if err := json.Unmarshal(manifest, &entries); err != nil {
		return errdefs.InvalidArgument("image tarball %s: manifest.json: %w", path, err)
	}
	for _, e := range entries {
		if n := sizes[filepath.Clean(e.Config)]; n > MaxMetadata {
			return errdefs.InvalidArgument("image tarball %s: config %s is %d bytes; the limit is %d", path, e.Config, n, MaxMetadata)
		}
	}
	return nil
}
