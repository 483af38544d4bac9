package image

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image/oci/ocitest"
	"github.com/forkd/forkd/internal/image/rootfs"
	"github.com/forkd/forkd/internal/testutil"
)

// tarEntry is one entry of a test layer.
type tarEntry struct {
	name, link string
	data       []byte
	typ        byte
	mode       int64
	uid, gid   int
}

func tarBytes(t *testing.T, ents []tarEntry) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, e := range ents {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: e.mode, Uid: e.uid, Gid: e.gid,
			Size: int64(len(e.data)), ModTime: time.Unix(1700000000, 0)}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
			if h.Typeflag == tar.TypeDir {
				h.Mode = 0o755
			}
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		testutil.Write(t, h.Name, tw, e.data)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// busyboxImage is a two-layer image: a busybox root, then a layer with
// whiteouts, an opaque directory and a (fake) python3.
func busyboxImage(t *testing.T) v1.Image {
	t.Helper()
	bb, err := os.ReadFile(testutil.RequireCommand(t, "busybox"))
	if err != nil {
		t.Fatal(err)
	}
	l1 := []tarEntry{
		{name: "bin/", typ: tar.TypeDir},
		{name: "bin/busybox", data: bb, mode: 0o755},
		{name: "bin/sh", typ: tar.TypeSymlink, link: "busybox"},
		{name: "bin/ls", typ: tar.TypeLink, link: "bin/busybox"},
		{name: "etc/", typ: tar.TypeDir},
		{name: "etc/os-release", data: []byte("ID=forkdtest\nNAME=\"forkd test\"\n")},
		{name: "etc/passwd", data: []byte("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")},
		{name: "home/user/", typ: tar.TypeDir, uid: 1000, gid: 1000, mode: 0o700},
		{name: "home/user/notes", data: []byte("mine"), uid: 1000, gid: 1000, mode: 0o600},
		{name: "old/", typ: tar.TypeDir},
		{name: "old/gone", data: []byte("gone")},
		{name: "old/keep", data: []byte("keep")},
		{name: "opaque/", typ: tar.TypeDir},
		{name: "opaque/lower", data: []byte("lower")},
		{name: "run/", typ: tar.TypeDir},
		{name: "var/run", typ: tar.TypeSymlink, link: "/run"},
	}
	l2 := []tarEntry{
		{name: "old/.wh.gone"},
		{name: "opaque/", typ: tar.TypeDir},
		{name: "opaque/.wh..wh..opq"},
		{name: "opaque/upper", data: []byte("upper")},
		{name: "usr/bin/python3", data: []byte("#!/bin/sh\necho fake python\n"), mode: 0o755},
		{name: "var/run/through-abs-symlink", data: []byte("in /run")},
	}
	return ocitest.Image(t, ocitest.Layer(t, tarBytes(t, l1)), ocitest.Layer(t, tarBytes(t, l2)))
}

func push(t *testing.T, img v1.Image, ref string) {
	t.Helper()
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
}

func writeTarball(t *testing.T, img v1.Image) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "image.tar")
	tag, _ := name.NewTag("forkd.test/busybox:latest")
	if err := tarball.WriteToFile(p, tag, img); err != nil {
		t.Fatal(err)
	}
	return p
}

func requireImport(t *testing.T) {
	t.Helper()
	testutil.RequireRoot(t)
	requireAptHost(t)
	testutil.RequireCommand(t, "mkfs.ext4", "debugfs", "unshare")
}

// snapshotCache lists the cache's rootfs and image entries, to compare
// before and after a failed import.
func snapshotCache(t *testing.T, cache string) []string {
	var out []string
	for _, e := range listCache(t, cache) {
		if strings.HasPrefix(e, "rootfs/") || strings.HasPrefix(e, "images/") {
			out = append(out, e)
		}
	}
	return out
}

// assertNoMounts fails t if anything is mounted under dir.
func assertNoMounts(t *testing.T, dir string) {
	t.Helper()
	m, err := mountsBelow(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(m) > 0 {
		t.Errorf("mounts left under %s: %v", dir, m)
	}
}

func TestFromOCI(t *testing.T) {
	requireImport(t)
	addr := testutil.StartRegistry(t)
	cache := t.TempDir() // imports are cheap: a fresh cache, but the kernel comes from apt
	if d := os.Getenv("FORKD_TEST_CACHE"); d != "" {
		// Share the kernel download with the other tests.
		cache = testCacheDir(t)
	}
	b := newBuilder(t, cache)
	ctx := context.Background()
	// One image per kind of source (a marker layer tells them apart), so
	// each import really flattens its layers.
	marked := func(kind string) v1.Image {
		img, err := mutate.AppendLayers(busyboxImage(t), ocitest.Layer(t, tarBytes(t, []tarEntry{{name: "source", data: []byte(kind)}})))
		if err != nil {
			t.Fatal(err)
		}
		return img
	}
	push(t, marked("registry"), addr+"/forkd/busybox:v1")
	layoutDir := ocitest.Layout(t, marked("layout"))
	sources := map[string]string{
		"registry": addr + "/forkd/busybox:v1",
		"tarball":  writeTarball(t, marked("tarball")),
		"archive":  "docker-archive:" + writeTarball(t, marked("archive")),
		"layout":   layoutDir,
	}
	for _, kind := range []string{"registry", "tarball", "archive", "layout"} {
		t.Run(kind, func(t *testing.T) {
			tag := "bb-" + kind
			start := time.Now()
			got, err := b.FromOCI(ctx, sources[kind], OCIOptions{Tag: tag, Preload: []string{"json"}})
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("import from %s: %s", kind, time.Since(start).Round(time.Millisecond))
			if got.Name != tag || got.Python != "/usr/bin/python3" || got.Rootfs == "" || !slices.Equal(got.Preload, []string{"json"}) {
				t.Errorf("image %+v", got)
			}
			want := []string{"forkd.root=/dev/vda", "forkd.rootfstype=ext4", "forkd.python=/usr/bin/python3", "forkd.preload=json"}
			if !slices.Equal(got.Cmdline, want) {
				t.Errorf("cmdline %v", got.Cmdline)
			}
			checkSHA(t, got.Rootfs, got.RootfsSHA256)
			checkBusyboxRootfs(t, got.Rootfs)
			if out := debugfs(t, got.Rootfs, "cat /source"); !strings.Contains(out, kind) {
				t.Errorf("/source is %q", out)
			}
			// Build finds the imported image by its tag.
			again, err := b.Build(ctx, tag)
			if err != nil || !reflect.DeepEqual(again, got) {
				t.Errorf("Build(%s) = %+v, %v; want %+v", tag, again, err, got)
			}
		})
	}
	// The same layout again ("oci:" form, another tag): same digest, so the
	// root filesystem is the cached one.
	start := time.Now()
	same, err := b.FromOCI(ctx, "oci:"+layoutDir, OCIOptions{Tag: "bb-oci"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("import of a cached digest: %s", time.Since(start).Round(time.Millisecond))
	lay, _ := b.Build(ctx, "bb-layout")
	if same.Rootfs != lay.Rootfs {
		t.Errorf("same digest, two root filesystems: %s %s", same.Rootfs, lay.Rootfs)
	}
	if len(same.Preload) != 0 || slices.ContainsFunc(same.Cmdline, func(s string) bool { return strings.HasPrefix(s, "forkd.preload") }) {
		t.Errorf("preload of another tag leaked: %+v", same)
	}
	// Re-importing under a tag replaces the image.
	if _, err := b.FromOCI(ctx, layoutDir, OCIOptions{Tag: "bb-registry"}); err != nil {
		t.Fatal(err)
	}
	if re, _ := b.Build(ctx, "bb-registry"); re.Rootfs != lay.Rootfs {
		t.Errorf("re-import under bb-registry kept %s", re.Rootfs)
	}
	assertNoLeftovers(t, cache)
	assertNoMounts(t, cache)
}

// checkBusyboxRootfs checks the flattened busybox image in an ext4 image.
func checkBusyboxRootfs(t *testing.T, image string) {
	t.Helper()
	ls := func(dir string) string { return debugfs(t, image, "ls -l "+dir) }
	if out := ls("/old"); !strings.Contains(out, "keep") || strings.Contains(out, "gone") {
		t.Errorf("/old after whiteout:\n%s", out)
	}
	if out := ls("/opaque"); !strings.Contains(out, "upper") || strings.Contains(out, "lower") {
		t.Errorf("/opaque after opaque whiteout:\n%s", out)
	}
	if out := debugfs(t, image, "stat /home/user/notes"); !strings.Contains(out, "User:  1000   Group:  1000") || !strings.Contains(out, "Mode:  0600") {
		t.Errorf("ownership or mode lost:\n%s", out)
	}
	if out := debugfs(t, image, "stat /bin/ls"); !strings.Contains(out, "Links: 2") {
		t.Errorf("hard link lost:\n%s", out)
	}
	if out := debugfs(t, image, "stat /bin/sh"); !strings.Contains(out, "Type: symlink") || !strings.Contains(out, `Fast link dest: "busybox"`) {
		t.Errorf("symlink lost:\n%s", out)
	}
	if out := ls("/run"); !strings.Contains(out, "through-abs-symlink") {
		t.Errorf("write through the absolute symlink /var/run -> /run did not land in the image's /run:\n%s", out)
	}
	for _, mp := range []string{"/proc", "/sys", "/dev", "/tmp", "/mnt"} {
		if out := debugfs(t, image, "stat "+mp); !strings.Contains(out, "Type: directory") {
			t.Errorf("mount point %s missing:\n%s", mp, out)
		}
	}
}

func TestFromOCIErrors(t *testing.T) {
	requireImport(t)
	addr := testutil.StartRegistry(t)
	cache := testCacheDir(t)
	b := newBuilder(t, cache)
	ctx := context.Background()
	before := snapshotCache(t, cache)

	garbage := filepath.Join(t.TempDir(), "garbage.tar")
	testutil.WriteFile(t, garbage, bytes.Repeat([]byte("not a docker save tarball "), 100), 0o644)
	evilDir := ocitest.Layout(t, ocitest.Image(t, ocitest.Layer(t, tarBytes(t, []tarEntry{
		{name: "ok", data: []byte("fine")},
		{name: "../../../../tmp/forkd-evil", data: []byte("escaped")},
	}))))
	absDir := ocitest.Layout(t, ocitest.Image(t, ocitest.Layer(t, tarBytes(t, []tarEntry{{name: "/etc/forkd-evil", data: []byte("x")}}))))
	noLayout := t.TempDir()
	arm, err := mutate.ConfigFile(busyboxImage(t), &v1.ConfigFile{OS: "linux", Architecture: "arm64"})
	if err != nil {
		t.Fatal(err)
	}
	armDir := ocitest.Layout(t, arm)
	// A layout whose layer blob was swapped for another well-formed layer,
	// the manifest unchanged.
	tampered := ocitest.Image(t, ocitest.Layer(t, tarBytes(t, []tarEntry{{name: "etc/motd", data: []byte("good")}})))
	tamperedDir := ocitest.Layout(t, tampered)
	tl, _ := tampered.Layers()
	td, _ := tl[0].Digest()
	evil, err := ocitest.Layer(t, tarBytes(t, []tarEntry{{name: "etc/motd", data: []byte("evil")}})).Compressed()
	if err != nil {
		t.Fatal(err)
	}
	evilBlob, _ := io.ReadAll(evil)
	if err := os.WriteFile(filepath.Join(tamperedDir, "blobs", td.Algorithm, td.Hex), evilBlob, 0o644); err != nil {
		t.Fatal(err)
	}

	for _, c := range []struct {
		name, ref string
		opts      OCIOptions
		is        func(error) bool
	}{
		{"unknown tag", addr + "/forkd/nothing:v1", OCIOptions{Tag: "e1"}, errdefs.IsNotFound},
		{"missing file", "/nonexistent/image.tar", OCIOptions{Tag: "e2"}, errdefs.IsNotFound},
		{"missing layout", "oci:/nonexistent/layout", OCIOptions{Tag: "e3"}, errdefs.IsNotFound},
		{"garbage tarball", garbage, OCIOptions{Tag: "e4"}, errdefs.IsInvalidArgument},
		{"dir without oci-layout", noLayout, OCIOptions{Tag: "e5"}, errdefs.IsInvalidArgument},
		{"traversal layer", evilDir, OCIOptions{Tag: "e6"}, errdefs.IsInvalidArgument},
		{"absolute layer", absDir, OCIOptions{Tag: "e7"}, errdefs.IsInvalidArgument},
		{"other platform", armDir, OCIOptions{Tag: "e8"}, errdefs.IsInvalidArgument},
		{"bad reference", "UPPER/case::x", OCIOptions{Tag: "e9"}, errdefs.IsInvalidArgument},
		{"unreachable registry", "127.0.0.1:1/x/y:z", OCIOptions{Tag: "e10"}, errdefs.IsUnavailable},
		{"bad tag", evilDir, OCIOptions{Tag: "../x"}, errdefs.IsInvalidArgument},
		{"builtin tag", evilDir, OCIOptions{Tag: "python"}, errdefs.IsAlreadyExists},
		{"bad extra", evilDir, OCIOptions{Tag: "e11", Extra: []string{"--force-yes"}}, errdefs.IsInvalidArgument},
		{"tampered layer", tamperedDir, OCIOptions{Tag: "e13"}, errdefs.IsInvalidArgument},
		{"extra on non-Debian", ocitest.Layout(t, busyboxImage(t)), OCIOptions{Tag: "e12", Extra: []string{"file"}}, errdefs.IsFailedPrecondition},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := b.FromOCI(ctx, c.ref, c.opts)
			if !c.is(err) {
				t.Errorf("got %v (class %s)", err, errdefs.Code(err))
			} else {
				t.Log(err)
			}
			if _, err := os.Stat("/tmp/forkd-evil"); err == nil {
				os.Remove("/tmp/forkd-evil")
				t.Error("a layer wrote outside its root")
			}
			if after := snapshotCache(t, cache); !slices.Equal(after, before) {
				t.Errorf("cache changed:\nbefore %v\nafter  %v", before, after)
			}
			assertNoLeftovers(t, cache)
			assertNoMounts(t, cache)
		})
	}
	if _, err := os.Stat("/etc/forkd-evil"); err == nil {
		t.Error("a layer wrote /etc/forkd-evil on the host")
	}
}

// debianTar returns a tarball of a debootstrap --variant=minbase tree of
// the host's suite, made once and kept in the shared test cache.
func debianTar(t *testing.T) string {
	t.Helper()
	testutil.RequireCommand(t, "debootstrap")
	base := os.Getenv("FORKD_TEST_CACHE")
	if base == "" {
		base = t.TempDir()
	}
	d := (&Builder{}).hostDistro()
	out := filepath.Join(base, "oci", "debian-"+d.suite+"-minbase.tar")
	if _, err := os.Stat(out); err == nil {
		return out
	}
	testutil.MkdirAll(t, filepath.Dir(out), 0o755)
	tree := filepath.Join(t.TempDir(), "tree")
	testutil.Mkdir(t, tree, 0o755)
	start := time.Now()
	err := rootfs.Tools{}.Bootstrap(context.Background(), rootfs.Bootstrap{
		Suite: d.suite, Mirror: d.mirror, Variant: "minbase", Components: d.components}, tree, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("debootstrap minbase: %s", time.Since(start).Round(time.Second))
	tmp := out + ".tmp"
	if err := tarTree(tree, tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, out); err != nil {
		t.Fatal(err)
	}
	return out
}

// tarTree writes the tree at dir to a tar file, keeping owners, modes,
// symlinks, hard links and device nodes.
func tarTree(dir, out string) error {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	links := map[[2]uint64]string{}
	err = filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if rel == "." {
			return nil
		}
		target := ""
		if fi.Mode()&os.ModeSymlink != 0 {
			if target, err = os.Readlink(p); err != nil {
				return err
			}
		}
		h, err := tar.FileInfoHeader(fi, target)
		if err != nil {
			return err
		}
		h.Name = rel
		if fi.IsDir() {
			h.Name += "/"
		}
		st := fi.Sys().(*syscall.Stat_t)
		h.Uid, h.Gid, h.Uname, h.Gname = int(st.Uid), int(st.Gid), "", ""
		if fi.Mode().IsRegular() && st.Nlink > 1 {
			k := [2]uint64{st.Dev, st.Ino}
			if first, ok := links[k]; ok {
				h.Typeflag, h.Linkname, h.Size = tar.TypeLink, first, 0
			} else {
				links[k] = rel
			}
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if h.Typeflag == tar.TypeReg {
			src, err := os.Open(p)
			if err != nil {
				return err
			}
			defer src.Close()
			if _, err := io.Copy(tw, src); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// TestFromOCIExtra imports a Debian image and installs a package into it
// from a chroot.
func TestFromOCIExtra(t *testing.T) {
	requireImport(t)
	testutil.RequireCommand(t, "debootstrap")
	cache := testCacheDir(t)
	b := newBuilder(t, cache)
	ctx := context.Background()
	debTar := debianTar(t)
	layer, err := tarball.LayerFromFile(debTar)
	if err != nil {
		t.Fatal(err)
	}
	dir := ocitest.Layout(t, ocitest.Image(t, layer))

	// A package that does not exist: NotFound, nothing left, nothing mounted.
	before := snapshotCache(t, cache)
	if _, err := b.FromOCI(ctx, dir, OCIOptions{Tag: "deb-bad", Extra: []string{"no-such-package-forkd"}}); !errdefs.IsNotFound(err) {
		t.Errorf("unknown package: %v", err)
	}
	if after := snapshotCache(t, cache); !slices.Equal(after, before) {
		t.Errorf("cache changed: %v -> %v", before, after)
	}
	assertNoLeftovers(t, cache)
	assertNoMounts(t, cache)

	start := time.Now()
	img, err := b.FromOCI(ctx, "oci:"+dir, OCIOptions{Tag: "deb-file", Extra: []string{"file"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("import with --extra file: %s", time.Since(start).Round(time.Millisecond))
	assertNoMounts(t, cache)
	assertNoLeftovers(t, cache)
	if out := debugfs(t, img.Rootfs, "stat /usr/bin/file"); !strings.Contains(out, "Type: regular") {
		t.Errorf("/usr/bin/file not installed:\n%s", out)
	}
	if out := debugfs(t, img.Rootfs, "stat /usr/sbin/policy-rc.d"); !strings.Contains(out, "File not found") {
		t.Errorf("policy-rc.d left in the image:\n%s", out)
	}
	if out := debugfs(t, img.Rootfs, "ls /var/lib/apt/lists"); strings.Contains(out, "Packages") {
		t.Errorf("apt lists left in the image:\n%s", out)
	}
	if img.Python != "" {
		t.Errorf("minbase has no python3, image says %q", img.Python)
	}
	// Importing again is a cache hit.
	start = time.Now()
	again, err := b.FromOCI(ctx, "oci:"+dir, OCIOptions{Tag: "deb-file", Extra: []string{"file"}})
	if err != nil || again.Rootfs != img.Rootfs {
		t.Errorf("re-import: %+v, %v", again, err)
	}
	t.Logf("re-import, cached: %s", time.Since(start).Round(time.Millisecond))
}
