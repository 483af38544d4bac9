package oci

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image/oci/ocitest"
	"github.com/forkd/forkd/internal/testutil"
)

func TestLocateConfinesToRoot(t *testing.T) {
	base := t.TempDir()
	root := filepath.Join(base, "imports")
	outside := filepath.Join(base, "secret")
	for _, d := range []string{filepath.Join(root, "layout"), filepath.Join(outside, "layout")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		testutil.WriteFile(t, filepath.Join(d, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644)
	}
	testutil.WriteFile(t, filepath.Join(root, "img.tar"), []byte("x"), 0o644)
	testutil.WriteFile(t, filepath.Join(outside, "img.tar"), []byte("x"), 0o644)
	testutil.Symlink(t, filepath.Join(outside, "img.tar"), filepath.Join(root, "link.tar"))
	testutil.Symlink(t, outside, filepath.Join(root, "linkdir"))
	// A root reached through a symlink still confines.
	rootLink := filepath.Join(base, "root-link")
	testutil.Symlink(t, root, rootLink)

	for _, c := range []struct {
		name      string
		ref, root string
		kind      Kind
		path      string // want, for success
		is        func(error) bool
		want      string
	}{
		{name: "tarball", ref: "img.tar", root: root, kind: KindTarball, path: filepath.Join(root, "img.tar")},
		{name: "tarball absolute", ref: filepath.Join(root, "img.tar"), root: root, kind: KindTarball, path: filepath.Join(root, "img.tar")},
		{name: "docker-archive", ref: "docker-archive:img.tar", root: root, kind: KindTarball, path: filepath.Join(root, "img.tar")},
		{name: "oci layout", ref: "oci:layout", root: root, kind: KindLayout, path: filepath.Join(root, "layout")},
		{name: "layout dir", ref: "layout", root: root, kind: KindLayout, path: filepath.Join(root, "layout")},
		{name: "root via symlink", ref: "img.tar", root: rootLink, kind: KindTarball, path: filepath.Join(root, "img.tar")},
		{name: "registry", ref: "ubuntu:24.04", root: root, kind: KindRegistry, path: "ubuntu:24.04"},
		// A relative name that exists in the working directory (this test
		// file) but not in root is never looked up there.
		{name: "cwd not looked up", ref: "locate_test.go", root: root, kind: KindRegistry, path: "locate_test.go"},
		{name: "registry digest", ref: "localhost:5000/a/b@sha256:" + strings.Repeat("a", 64), root: root, kind: KindRegistry},
		{name: "absolute outside", ref: filepath.Join(outside, "img.tar"), root: root, is: errdefs.IsInvalidArgument, want: "outside the import directory"},
		{name: "etc passwd", ref: "/etc/passwd", root: root, is: errdefs.IsInvalidArgument, want: "outside"},
		{name: "absolute missing", ref: "/nonexistent/x.tar", root: root, is: errdefs.IsInvalidArgument, want: "outside"},
		{name: "dotdot", ref: "../secret/img.tar", root: root, is: errdefs.IsInvalidArgument, want: "outside"},
		{name: "oci outside", ref: "oci:" + filepath.Join(outside, "layout"), root: root, is: errdefs.IsInvalidArgument, want: "outside"},
		{name: "docker-archive outside", ref: "docker-archive:/etc/shadow", root: root, is: errdefs.IsInvalidArgument, want: "outside"},
		{name: "oci dotdot", ref: "oci:../secret/layout", root: root, is: errdefs.IsInvalidArgument, want: "outside"},
		{name: "symlink file", ref: "link.tar", root: root, is: errdefs.IsInvalidArgument, want: "outside"},
		{name: "symlink dir", ref: "linkdir/layout", root: root, is: errdefs.IsInvalidArgument, want: "outside"},
		{name: "docker-archive symlink dir", ref: "docker-archive:linkdir/img.tar", root: root, is: errdefs.IsInvalidArgument, want: "outside"},
		{name: "missing", ref: "./missing.tar", root: root, is: errdefs.IsNotFound},
		{name: "bad reference", ref: "UPPER/case::x", root: root, is: errdefs.IsInvalidArgument, want: "image reference"},
		{name: "empty", ref: "", root: root, is: errdefs.IsInvalidArgument, want: "empty"},
		// Without a root any path goes (the local CLI).
		{name: "no root tarball", ref: filepath.Join(outside, "img.tar"), kind: KindTarball, path: filepath.Join(outside, "img.tar")},
		{name: "no root layout", ref: "oci:" + filepath.Join(outside, "layout"), kind: KindLayout, path: filepath.Join(outside, "layout")},
	} {
		t.Run(c.name, func(t *testing.T) {
			kind, path, err := Locate(c.ref, c.root)
			if c.is != nil {
				if !c.is(err) || !strings.Contains(err.Error(), c.want) {
					t.Errorf("Locate(%q, %q) = %s %s, %v; want %q", c.ref, c.root, kind, path, err, c.want)
				}
				return
			}
			if err != nil || kind != c.kind || c.path != "" && path != c.path {
				t.Errorf("Locate(%q, %q) = %s %s, %v; want %s %s", c.ref, c.root, kind, path, err, c.kind, c.path)
			}
		})
	}
}

func TestLayoutSymlinksRefused(t *testing.T) {
	img := ocitest.Image(t, ocitest.Layer(t, layerTar(t, ent{name: "a", data: "a"})))
	m, _ := img.Manifest()
	// Each case moves one part of a good layout outside (a sibling
	// directory) and leaves a symlink to it in its place.
	for _, c := range []struct{ name, part string }{
		{"index", "index.json"},
		{"oci-layout", "oci-layout"},
		{"blobs", "blobs"},
		{"sha256", "blobs/sha256"},
		{"config", "blobs/sha256/" + m.Config.Digest.Hex},
		{"layer", "blobs/sha256/" + m.Layers[0].Digest.Hex},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := ocitest.Layout(t, img)
			if _, err := Open(context.Background(), "oci:"+dir, OpenOptions{Root: filepath.Dir(dir)}); err != nil {
				t.Fatalf("the untouched layout: %v", err)
			}
			outside := filepath.Join(t.TempDir(), "outside")
			testutil.Rename(t, filepath.Join(dir, c.part), outside)
			testutil.Symlink(t, outside, filepath.Join(dir, c.part))
			_, err := Open(context.Background(), "oci:"+dir, OpenOptions{Root: filepath.Dir(dir)})
			if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "symlink") {
				t.Errorf("%s a symlink: got %v, want it refused", c.part, err)
			}
		})
	}
}

// A layout exported for one platform may list other platforms' manifests
// without their blobs: the image for ours still opens; only the manifest
// picked must be there.
func TestLayoutWithOtherPlatformsMissing(t *testing.T) {
	img := ocitest.Image(t, ocitest.Layer(t, layerTar(t, ent{name: "a", data: "a"})))
	dir := ocitest.Layout(t, img)
	p := filepath.Join(dir, "index.json")
	var idx map[string]any
	b, err := os.ReadFile(p)
	if err != nil || json.Unmarshal(b, &idx) != nil {
		t.Fatalf("index.json: %v", err)
	}
	other := map[string]any{
		"mediaType": "application/vnd.oci.image.manifest.v1+json",
		"digest":    "sha256:" + strings.Repeat("b", 64), "size": 500,
		"platform": map[string]any{"os": "linux", "architecture": "riscv64"},
	}
	idx["manifests"] = append(idx["manifests"].([]any), other)
	b, _ = json.Marshal(idx)
	testutil.WriteFile(t, p, b, 0o644)
	src, err := Open(context.Background(), "oci:"+dir, OpenOptions{})
	if err != nil {
		t.Fatalf("layout listing a missing riscv64 manifest: %v", err)
	}
	want, _ := img.Digest()
	if src.Digest != want {
		t.Fatalf("picked %s, want %s", src.Digest, want)
	}
}
