package e2e

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/forkd/forkd/internal/testutil"
)

// layer builds an image layer from name -> content ("" content with a
// trailing "/" name is a directory; "->target" is a symlink).
func layer(t *testing.T, files [][2]string) v1.Layer {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, f := range files {
		h := &tar.Header{Name: f[0], Mode: 0o755, Size: int64(len(f[1])), Typeflag: tar.TypeReg}
		switch {
		case strings.HasSuffix(f[0], "/"):
			h.Typeflag, h.Size = tar.TypeDir, 0
		case strings.HasPrefix(f[1], "->"):
			h.Typeflag, h.Linkname, h.Size = tar.TypeSymlink, f[1][2:], 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			testutil.Write(t, h.Name, tw, []byte(f[1]))
		}
	}
	testutil.Close(t, "tar writer", tw)
	data := b.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func ociImage(t *testing.T, layers ...v1.Layer) v1.Image {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// TestFromImage imports a busybox image from a real local registry and
// from a docker save tarball through the CLI, forks it and runs in it;
// broken images fail clearly and leave nothing behind.
func TestFromImage(t *testing.T) {
	c := newCLI(t)
	testutil.RequireRoot(t)
	// A cache of its own, so that "nothing left behind" is about this test.
	cache := t.TempDir()
	c.env = append(c.env, "FORKD_CACHE="+cache)
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Fatal(err)
	}
	img := ociImage(t,
		layer(t, [][2]string{{"bin/", ""}, {"bin/busybox", string(bb)}, {"bin/sh", "->busybox"}, {"bin/cat", "->busybox"},
			{"etc/", ""}, {"etc/os-release", "ID=forkdtest\n"}, {"etc/motd", "old"}}),
		layer(t, [][2]string{{"etc/.wh.motd", ""}, {"etc/greeting", "hello from the image\n"}}))

	addr := testutil.StartRegistry(t)
	ref := addr + "/forkd/bb:1"
	r, _ := name.ParseReference(ref, name.Insecure)
	if err := remote.Write(r, img); err != nil {
		t.Fatal(err)
	}
	tarPath := filepath.Join(t.TempDir(), "bb.tar")
	tag, _ := name.NewTag("forkd.test/bb:1")
	if err := tarball.WriteToFile(tarPath, tag, img); err != nil {
		t.Fatal(err)
	}
	for _, src := range []struct{ snap, ref string }{{"reg", ref}, {"tar", tarPath}} {
		t.Run(src.snap, func(t *testing.T) {
			c := c.in(t)
			c.ok("from-image", src.ref, "--tag", src.snap, "--insecure")
			id := strings.Fields(c.ok("fork", "--tag", src.snap))[0]
			if out := c.ok("exec", id, "--", "cat", "/etc/greeting"); out != "hello from the image\n" {
				t.Fatalf("greeting %q", out)
			}
			if _, _, code := c.run("exec", id, "--", "cat", "/etc/motd"); code == 0 {
				t.Fatal("whiteout ignored, /etc/motd present")
			}
		})
	}

	entries := func() []string {
		var out []string
		for _, d := range []string{filepath.Join(c.data, "snapshots"), filepath.Join(cache, "images"), filepath.Join(cache, "rootfs")} {
			ents, _ := os.ReadDir(d)
			for _, e := range ents {
				out = append(out, d+"/"+e.Name())
			}
		}
		return out
	}
	before := strings.Join(entries(), ",")
	evil := ociImage(t, layer(t, [][2]string{{"../../escape", "x"}}))
	evilTar := filepath.Join(t.TempDir(), "evil.tar")
	if err := tarball.WriteToFile(evilTar, tag, evil); err != nil {
		t.Fatal(err)
	}
	junk := filepath.Join(t.TempDir(), "junk.tar")
	testutil.WriteFile(t, junk, []byte("this is not an image"), 0o644)
	for _, bad := range []struct{ name, ref string }{
		{"escaping layer", evilTar},
		{"junk", junk},
		{"missing tag", addr + "/forkd/missing:1"},
		{"missing file", "/nonexistent/image.tar"},
	} {
		t.Run(bad.name, func(t *testing.T) {
			_, errs, code := c.in(t).run("from-image", bad.ref, "--tag", "bad", "--insecure")
			if code == 0 || strings.TrimSpace(errs) == "" {
				t.Errorf("from-image %s: exit %d, %q", bad.ref, code, errs)
			}
		})
	}
	if after := strings.Join(entries(), ","); after != before {
		t.Errorf("failed imports left something:\nbefore %s\nafter  %s", before, after)
	}
	if _, err := os.Stat("/escape"); err == nil {
		t.Fatal("a ../ entry escaped the image root")
	}
}
