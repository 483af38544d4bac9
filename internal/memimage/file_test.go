package memimage

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
)

// writeAt writes data into the file at path at off.
func writeAt(t testing.TB, path string, data []byte, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(data, off); err != nil {
		t.Fatal(err)
	}
}

// readFile returns the content of the file at path.
func readFile(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// noTemps fails unless dir holds exactly the names given.
func noTemps(t *testing.T, dir string, names ...string) {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range es {
		got = append(got, e.Name())
	}
	if strings.Join(got, " ") != strings.Join(names, " ") {
		t.Fatalf("%s holds %v, want %v", dir, got, names)
	}
}

func TestSparseCopy(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	newImageFile(t, src, 5<<20+123) // ends in a hole, not page-aligned
	writeAt(t, src, bytes.Repeat([]byte{1}, ps), 0)
	writeAt(t, src, bytes.Repeat([]byte{2}, 2*ps), 1<<20)
	writeAt(t, src, []byte("tail"), 5<<20+100)

	dst := filepath.Join(dir, "dst")
	if err := SparseCopy(src, dst); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readFile(t, src), readFile(t, dst)) {
		t.Fatal("content differs")
	}
	if s, d := extentsOf(t, src), extentsOf(t, dst); !reflect.DeepEqual(s, d) || len(s) != 3 {
		t.Fatalf("extents %v, want %v", d, s)
	}
	if a, err := Allocated(dst); err != nil || a > 64<<10 {
		t.Fatalf("Allocated = %d, %v: holes not kept", a, err)
	}
	st, err := os.Stat(dst)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("dst mode %v, %v", st.Mode(), err)
	}

	if err := SparseCopy(src, dst); !errdefs.IsAlreadyExists(err) {
		t.Errorf("dst exists: SparseCopy = %v, want AlreadyExists", err)
	}
	if err := SparseCopy(filepath.Join(dir, "nope"), filepath.Join(dir, "x")); !errdefs.IsNotFound(err) {
		t.Errorf("no src: SparseCopy = %v, want NotFound", err)
	}
	noTemps(t, dir, "dst", "src")
}

func TestCopyRangeBuffered(t *testing.T) {
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	data := bytes.Repeat([]byte("0123456789abcdef"), (3*maxCopyChunk)/16+5)
	testWrite(t, src, data)
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out := newImageFile(t, dst, int64(len(data)))
	if err := copyRangeBuffered(in, out, 100, int64(len(data)-200)); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, len(data))
	copy(want[100:len(data)-100], data[100:])
	if !bytes.Equal(readFile(t, dst), want) {
		t.Fatal("content differs")
	}
}

func testWrite(t testing.TB, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestMaterialize builds a layer from a child's written pages, as a branch
// does, and checks that base + layer is the child's memory byte for byte.
func TestMaterialize(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base")
	writeImage(t, base, 64, map[int]bool{40: true, 41: true, 50: true})
	mem := mapPrivate(t, base)
	touch(mem, []int{3, 4, 5, 40, 63}, []int{10}, []int{0, 41})
	clear(mem[20*ps : 21*ps]) // a page the guest zeroed must read as zeros
	mm := selfMap(mem)
	pages, err := Private(mm)
	if err != nil {
		t.Fatal(err)
	}

	layer := filepath.Join(dir, "layer")
	l, err := CreateLayer(layer, ImageSize(mm))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.Copy(mm, pages); err != nil {
		t.Fatal(err)
	}
	if err := l.Commit(); err != nil {
		t.Fatal(err)
	}
	if ext := extentsOf(t, layer); !reflect.DeepEqual(ext, runExtents(pages)) {
		t.Fatalf("layer extents %v, want %v", ext, runExtents(pages))
	}

	out := filepath.Join(dir, "out")
	if err := Materialize(base, layer, out); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readFile(t, out), mem) {
		t.Fatal("base + layer differs from the child's memory")
	}
	// The base's holes that no page was written over (41, 50) stay holes.
	want := [][2]int64{{0, 41 * int64(ps)}, {42 * int64(ps), 8 * int64(ps)}, {51 * int64(ps), 13 * int64(ps)}}
	if ext := extentsOf(t, out); !reflect.DeepEqual(ext, want) {
		t.Fatalf("out extents %v, want %v", ext, want)
	}
	noTemps(t, dir, "base", "layer", "out")

	// out may replace an image in place: the new one arrives whole.
	if err := Materialize(base, layer, base); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readFile(t, base), readFile(t, out)) {
		t.Fatal("in place: base + layer differs")
	}
}

func TestFlatten(t *testing.T) {
	dir := t.TempDir()
	base, l1, l2, out := filepath.Join(dir, "base"), filepath.Join(dir, "l1"), filepath.Join(dir, "l2"), filepath.Join(dir, "out")
	writeImage(t, base, 16, map[int]bool{12: true})
	size := int64(16 * ps)
	newImageFile(t, l1, size)
	newImageFile(t, l2, size)
	page := func(b byte) []byte { return bytes.Repeat([]byte{b}, ps) }
	for _, i := range []int64{1, 2, 3, 12} {
		writeAt(t, l1, page(0x11), i*int64(ps))
	}
	for _, i := range []int64{2, 5} {
		writeAt(t, l2, page(0x22), i*int64(ps))
	}
	writeAt(t, l2, page(0), 6*int64(ps))

	if err := Flatten([]string{base, l1, l2}, out); err != nil {
		t.Fatal(err)
	}
	want := readFile(t, base)
	for i, b := range map[int]byte{1: 0x11, 2: 0x22, 3: 0x11, 5: 0x22, 6: 0, 12: 0x11} {
		copy(want[i*ps:], page(b))
	}
	if !bytes.Equal(readFile(t, out), want) {
		t.Fatal("flattened image differs")
	}

	// A chain of one is a copy.
	one := filepath.Join(dir, "one")
	if err := Flatten([]string{base}, one); err != nil || !bytes.Equal(readFile(t, one), readFile(t, base)) {
		t.Fatalf("chain of one: %v", err)
	}
}

func TestFlattenErrors(t *testing.T) {
	dir := t.TempDir()
	base, short, out := filepath.Join(dir, "base"), filepath.Join(dir, "short"), filepath.Join(dir, "out")
	writeImage(t, base, 4, nil)
	writeImage(t, short, 3, nil)

	if err := Flatten(nil, out); !errdefs.IsInvalidArgument(err) {
		t.Errorf("empty chain: %v", err)
	}
	if err := Materialize(base, short, out); !errdefs.IsInvalidArgument(err) {
		t.Errorf("layer of another size: %v", err)
	}
	if err := Materialize(base, filepath.Join(dir, "nope"), out); !errdefs.IsNotFound(err) {
		t.Errorf("missing layer: %v", err)
	}
	if err := Materialize(base, base, filepath.Join(dir, "nodir", "out")); !errdefs.IsNotFound(err) {
		t.Errorf("missing directory: %v", err)
	}
	noTemps(t, dir, "base", "short")
}

func TestLayer(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base")
	writeImage(t, base, 16, map[int]bool{7: true})

	// Discarded: nothing left, and discarding again is fine.
	l, err := CreateLayer(filepath.Join(dir, "gone"), 16*int64(ps))
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Discard(); err != nil {
		t.Fatal(err)
	}
	if err := l.Discard(); err != nil {
		t.Fatal(err)
	}
	noTemps(t, dir, "base")

	// From a base: the full image with the pages written over it.
	mem := mapPrivate(t, base)
	mm := selfMap(mem)
	out := filepath.Join(dir, "full")
	l, err = CreateLayerFrom(out, base)
	if err != nil {
		t.Fatal(err)
	}
	touch(mem, []int{2, 7}, nil, nil) // a pre-copy...
	pages, err := Private(mm)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.Copy(mm, pages); err != nil {
		t.Fatal(err)
	}
	touch(mem, []int{2, 9}, nil, nil) // ...then the pause
	if pages, err = Private(mm); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Copy(mm, pages); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Fatalf("layer visible before Commit: %v", err)
	}
	if err := l.Commit(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readFile(t, out), mem) {
		t.Fatal("image differs from the child's memory")
	}
	if _, err := l.Copy(mm, pages); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Copy after Commit: %v", err)
	}
	if err := l.Commit(); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Commit twice: %v", err)
	}
	if err := l.Discard(); err != nil {
		t.Errorf("Discard after Commit: %v", err)
	}
	noTemps(t, dir, "base", "full")

	if _, err := CreateLayerFrom(filepath.Join(dir, "x"), filepath.Join(dir, "nope")); !errdefs.IsNotFound(err) {
		t.Errorf("missing base: %v", err)
	}
	if _, err := CreateLayer(filepath.Join(dir, "x"), -1); !errdefs.IsInvalidArgument(err) {
		t.Errorf("negative size: %v", err)
	}
	noTemps(t, dir, "base", "full")
}

func TestDataHashSkipsHoles(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	for _, p := range []string{a, b} {
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		if err := f.Truncate(1 << 20); err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt([]byte("page"), 8192); err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	ha, err := DataHash(a)
	if err != nil {
		t.Fatal(err)
	}
	hb, _ := DataHash(b)
	if string(ha) != string(hb) {
		t.Fatal("same data, different hashes")
	}
	f, _ := os.OpenFile(b, os.O_WRONLY, 0)
	_, _ = f.WriteAt([]byte("x"), 0)
	f.Close()
	if hb2, _ := DataHash(b); string(hb2) == string(ha) {
		t.Fatal("changed data, same hash")
	}
}
