// Package ocitest makes small container images for tests: layers from tar
// bytes, images of linux/amd64, OCI layouts on disk.
package ocitest

import (
	"bytes"
	"io"
	"path/filepath"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// Platform is the platform of the images made here.
var Platform = v1.Platform{OS: "linux", Architecture: "amd64"}

// Layer is a gzip-compressed layer of the (uncompressed) tar bytes data.
func Layer(t testing.TB, data []byte) v1.Layer {
	t.Helper()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// Image is an image of layers for Platform, running /bin/sh.
func Image(t testing.TB, layers ...v1.Layer) v1.Image {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = Platform.OS, Platform.Architecture
	cf.Config.Cmd = []string{"/bin/sh"}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	return img
}

// Layout writes img as an OCI layout in a new temporary directory and
// returns the layout's directory.
func Layout(t testing.TB, img v1.Image) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "layout")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img, layout.WithPlatform(Platform)); err != nil {
		t.Fatal(err)
	}
	return dir
}

// Blob is the path of blob h in the layout at dir.
func Blob(dir string, h v1.Hash) string {
	return filepath.Join(dir, "blobs", h.Algorithm, h.Hex)
}
