package oci

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image/rootfs"
	"github.com/forkd/forkd/internal/testutil"
)

// ent is one tar entry for a test layer.
type ent struct {
	name, link, data string
	typ              byte
	mode             int64
	uid, gid         int
}

func layerTar(t *testing.T, ents ...ent) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, e := range ents {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: e.mode, Uid: e.uid, Gid: e.gid,
			ModTime: time.Unix(1600000000, 0), Format: tar.FormatPAX}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
			if h.Typeflag == tar.TypeDir {
				h.Mode = 0o755
			}
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.data))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Size > 0 {
			testutil.Write(t, h.Name, tw, []byte(e.data))
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// newTree returns a tree in a fresh directory, and a sibling directory
// standing for "outside".
func newTree(t *testing.T) (*rootfs.Tree, string, string) {
	t.Helper()
	base := t.TempDir()
	root := filepath.Join(base, "root")
	outside := filepath.Join(base, "outside")
	for _, d := range []string{root, outside} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	tr, err := rootfs.OpenTree(root)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr, root, outside
}

func apply(t *testing.T, tr *rootfs.Tree, layer []byte) error {
	t.Helper()
	return ApplyLayer(context.Background(), tr, bytes.NewReader(layer), ApplyOptions{Ownership: os.Geteuid() == 0})
}

// listTree returns every path under dir, relative, sorted.
func listTree(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			t.Fatal(err)
		}
		if rel, _ := filepath.Rel(dir, p); rel != "." {
			out = append(out, rel)
		}
		return nil
	})
	sort.Strings(out)
	return out
}

func TestTraversalRefused(t *testing.T) {
	for name, layer := range map[string][]ent{
		"dotdot":           {{name: "../escape", data: "x"}},
		"dotdot inside":    {{name: "a/../../escape", data: "x"}},
		"absolute":         {{name: "/etc/passwd", data: "x"}},
		"absolute dir":     {{name: "/tmp", typ: tar.TypeDir}},
		"hardlink dotdot":  {{name: "a", data: "x"}, {name: "l", typ: tar.TypeLink, link: "../../etc/passwd"}},
		"hardlink abs":     {{name: "l", typ: tar.TypeLink, link: "/etc/passwd"}},
		"whiteout dotdot":  {{name: "d/.wh..", data: ""}},
		"whiteout in ..":   {{name: "../.wh.outside", data: ""}},
		"dotdot after ok":  {{name: "ok", data: "fine"}, {name: "x/../../../escape", data: "x"}},
		"hardlink to root": {{name: "l", typ: tar.TypeLink, link: "."}},
	} {
		t.Run(name, func(t *testing.T) {
			tr, root, outside := newTree(t)
			err := apply(t, tr, layerTar(t, layer...))
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("got %v, want InvalidArgument", err)
			}
			if got := listTree(t, outside); len(got) != 0 {
				t.Errorf("written outside: %v", got)
			}
			if got := listTree(t, filepath.Dir(root)); !slices.Equal(got, filterOK(listTree(t, filepath.Dir(root)))) {
				t.Errorf("unexpected files: %v", got)
			}
		})
	}
}

func filterOK(paths []string) []string {
	var out []string
	for _, p := range paths {
		if p == "root" || p == "outside" || strings.HasPrefix(p, "root/") {
			out = append(out, p)
		}
	}
	return out
}

// TestSymlinksConfined plants symlinks that point out of the tree and then
// writes through them: every write must stay inside.
func TestSymlinksConfined(t *testing.T) {
	tr, root, outside := newTree(t)
	victim := filepath.Join(outside, "victim")
	if err := os.WriteFile(victim, []byte("original"), 0o644); err != nil {
		t.Fatal(err)
	}
	layer1 := layerTar(t,
		ent{name: "abs", typ: tar.TypeSymlink, link: outside},             // absolute host path
		ent{name: "rel", typ: tar.TypeSymlink, link: "../../../../../.."}, // climbs past the root
		ent{name: "rootlink", typ: tar.TypeSymlink, link: "/"},
		ent{name: "file", typ: tar.TypeSymlink, link: victim},
	)
	if err := apply(t, tr, layer1); err != nil {
		t.Fatal(err)
	}
	// Writes through each symlink, one layer each: each either fails or
	// lands inside the tree.
	for _, e := range []ent{
		{name: "abs/pwned", data: "x"},
		{name: "rel/pwned-rel", data: "x"},
		{name: "rootlink/etc/through-root", data: "x"},
		{name: "file", data: "replaced"}, // replaces the symlink, not its target
		{name: "rel/sub", typ: tar.TypeDir},
		{name: "rel/hl", typ: tar.TypeLink, link: "file"},
	} {
		_ = apply(t, tr, layerTar(t, e))
	}
	if got := listTree(t, outside); !slices.Equal(got, []string{"victim"}) {
		t.Errorf("outside holds %v", got)
	}
	if b, _ := os.ReadFile(victim); string(b) != "original" {
		t.Errorf("victim rewritten: %q", b)
	}
	if b, err := os.ReadFile(filepath.Join(root, "file")); err != nil || string(b) != "replaced" {
		t.Errorf("file: %q, %v", b, err)
	}
	for _, p := range []string{"pwned-rel", "etc/through-root", "sub", "hl"} {
		if _, err := os.Lstat(filepath.Join(root, p)); err != nil {
			t.Errorf("%s not written inside the tree: %v", p, err)
		}
	}
	// A whiteout through a symlink removes nothing outside either.
	if err := apply(t, tr, layerTar(t, ent{name: "abs/.wh.victim"}, ent{name: "rel/.wh..wh..opq"})); err != nil {
		t.Logf("whiteouts through symlinks: %v", err)
	}
	if _, err := os.Stat(victim); err != nil {
		t.Errorf("victim removed through a whiteout: %v", err)
	}
}

func TestWhiteouts(t *testing.T) {
	tr, root, _ := newTree(t)
	l1 := layerTar(t,
		ent{name: "a/", typ: tar.TypeDir}, ent{name: "a/1", data: "1"}, ent{name: "a/2", data: "2"},
		ent{name: "b/", typ: tar.TypeDir}, ent{name: "b/old", data: "o"}, ent{name: "b/sub/deep", data: "d"},
		ent{name: "c/", typ: tar.TypeDir}, ent{name: "c/y", data: "y"},
		ent{name: "d/", typ: tar.TypeDir}, ent{name: "d/keep", data: "k"},
	)
	l2 := layerTar(t,
		ent{name: "a/.wh.1"},
		ent{name: "b/", typ: tar.TypeDir}, ent{name: "b/new", data: "n"}, ent{name: "b/.wh..wh..opq"},
		ent{name: ".wh.c"},
		ent{name: "d/.wh.nonexistent"},
		ent{name: "e/.wh..wh..opq"}, // opaque dir with nothing below: created empty
	)
	for _, l := range [][]byte{l1, l2} {
		if err := apply(t, tr, l); err != nil {
			t.Fatal(err)
		}
	}
	want := []string{"a", "a/2", "b", "b/new", "d", "d/keep", "e"}
	if got := listTree(t, root); !slices.Equal(got, want) {
		t.Errorf("tree %v, want %v", got, want)
	}
}

func TestMetadata(t *testing.T) {
	tr, root, _ := newTree(t)
	l1 := layerTar(t,
		ent{name: "usr/bin/tool", data: "#!/bin/sh\n", mode: 0o4755, uid: 1000, gid: 1001},
		ent{name: "usr/bin/alias", typ: tar.TypeSymlink, link: "tool"},
		ent{name: "usr/bin/hard", typ: tar.TypeLink, link: "usr/bin/tool"},
		ent{name: "tmp/", typ: tar.TypeDir, mode: 0o1777},
		ent{name: "dev/fifo", typ: tar.TypeFifo, mode: 0o600},
		ent{name: "dev/null", typ: tar.TypeChar, mode: 0o666},
	)
	if err := apply(t, tr, l1); err != nil {
		t.Fatal(err)
	}
	var st, hl unix.Stat_t
	unix.Lstat(filepath.Join(root, "usr/bin/tool"), &st)
	unix.Lstat(filepath.Join(root, "usr/bin/hard"), &hl)
	if st.Mode&0o7777 != 0o4755 {
		t.Errorf("tool mode %o", st.Mode&0o7777)
	}
	if st.Ino != hl.Ino || st.Nlink != 2 {
		t.Errorf("hard link: inodes %d/%d nlink %d", st.Ino, hl.Ino, st.Nlink)
	}
	if st.Mtim.Sec != 1600000000 {
		t.Errorf("mtime %d", st.Mtim.Sec)
	}
	if l, _ := os.Readlink(filepath.Join(root, "usr/bin/alias")); l != "tool" {
		t.Errorf("symlink -> %q", l)
	}
	var tmp unix.Stat_t
	unix.Lstat(filepath.Join(root, "tmp"), &tmp)
	if tmp.Mode&0o7777 != 0o1777 {
		t.Errorf("tmp mode %o", tmp.Mode&0o7777)
	}
	var fifo unix.Stat_t
	if err := unix.Lstat(filepath.Join(root, "dev/fifo"), &fifo); err != nil || fifo.Mode&unix.S_IFMT != unix.S_IFIFO {
		t.Errorf("fifo: %v %o", err, fifo.Mode)
	}
	if os.Geteuid() == 0 {
		if st.Uid != 1000 || st.Gid != 1001 {
			t.Errorf("owner %d:%d", st.Uid, st.Gid)
		}
		var null unix.Stat_t
		if err := unix.Lstat(filepath.Join(root, "dev/null"), &null); err != nil || null.Mode&unix.S_IFMT != unix.S_IFCHR {
			t.Errorf("char device: %v %o", err, null.Mode)
		}
	}
	// A later layer replaces a directory by a file and a file by a directory.
	l2 := layerTar(t, ent{name: "tmp", data: "now a file"}, ent{name: "usr/bin/tool/", typ: tar.TypeDir})
	if err := apply(t, tr, l2); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(filepath.Join(root, "tmp")); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("tmp: %v %v", fi, err)
	}
	if fi, err := os.Lstat(filepath.Join(root, "usr/bin/tool")); err != nil || !fi.IsDir() {
		t.Errorf("tool: %v %v", fi, err)
	}
	if b, _ := os.ReadFile(filepath.Join(root, "usr/bin/hard")); string(b) != "#!/bin/sh\n" {
		t.Errorf("hard link lost its content: %q", b)
	}
}

func TestMalformedLayer(t *testing.T) {
	good := layerTar(t, ent{name: "a", data: strings.Repeat("x", 5000)})
	for name, b := range map[string][]byte{
		"garbage":   []byte(strings.Repeat("not a tar archive ", 64)),
		"truncated": good[:1200],
	} {
		t.Run(name, func(t *testing.T) {
			tr, _, _ := newTree(t)
			if err := apply(t, tr, b); !errdefs.IsInvalidArgument(err) {
				t.Errorf("%v, want InvalidArgument", err)
			}
		})
	}
}

// TestOpaqueKeepsImplicitParents: entries of a layer without their parent
// directories' own entries survive an opaque whiteout of an ancestor later
// in the same layer.
func TestOpaqueKeepsImplicitParents(t *testing.T) {
	tr, root, _ := newTree(t)
	if err := apply(t, tr, layerTar(t, ent{name: "a/old", data: "lower"}, ent{name: "a/b/lower", data: "lower"})); err != nil {
		t.Fatal(err)
	}
	if err := apply(t, tr, layerTar(t, ent{name: "a/b/c/new", data: "upper"}, ent{name: "a/.wh..wh..opq"})); err != nil {
		t.Fatal(err)
	}
	// a/b is both lower and (implicitly) this layer's: kept, but not the
	// lower file in it; a/old goes.
	if got := listTree(t, root); !slices.Equal(got, []string{"a", "a/b", "a/b/c", "a/b/c/new"}) {
		t.Errorf("tree %v", got)
	}
}
