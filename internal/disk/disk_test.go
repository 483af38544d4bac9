package disk

import (
	"bytes"
	"context"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

// qcow2Header is the start of a qcow2 image whose backing file is
// backing ("" for none), the name placed where qemu-img places it.
func qcow2Header(version uint32, backing string) []byte {
	b := make([]byte, 104+len(backing))
	binary.BigEndian.PutUint32(b[0:], qcowMagic)
	binary.BigEndian.PutUint32(b[4:], version)
	if backing != "" {
		binary.BigEndian.PutUint64(b[8:], 104)
		binary.BigEndian.PutUint32(b[16:], uint32(len(backing)))
		copy(b[104:], backing)
	}
	return b
}

func TestReadBacking(t *testing.T) {
	for _, c := range []struct {
		name    string
		image   []byte
		want    string
		wantErr string
	}{
		{"none", qcow2Header(3, ""), "", ""},
		{"v2", qcow2Header(2, "/data/disks/dl-0123456789abcdef.qcow2"), "/data/disks/dl-0123456789abcdef.qcow2", ""},
		{"v3", qcow2Header(3, "/cache/disk/ext4-64m.img"), "/cache/disk/ext4-64m.img", ""},
		{"raw", make([]byte, 4096), "", "not a qcow2"},
		{"short", []byte("QFI"), "", "header"},
		{"version", qcow2Header(4, "x"), "", "version 4"},
		{"name past the end", qcow2Header(3, "/x")[:105], "", "backing file name"},
		{"name too long", func() []byte {
			b := qcow2Header(3, "/x")
			binary.BigEndian.PutUint32(b[16:], 4096)
			return b
		}(), "", "4096 bytes"},
		{"offset in the header", func() []byte {
			b := qcow2Header(3, "/x")
			binary.BigEndian.PutUint64(b[8:], 4)
			return b
		}(), "", "at 4"},
		{"NUL", qcow2Header(3, "/a\x00b"), "", "NUL"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := readBacking(bytes.NewReader(c.image))
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("readBacking = %q, %v; want an error with %q", got, err, c.wantErr)
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("readBacking = %q, %v; want %q", got, err, c.want)
			}
		})
	}
}

// layer writes a layer file of s backed by backing.
func layer(t *testing.T, s *Store, id, backing string) string {
	t.Helper()
	p := s.Path(id)
	testutil.WriteFile(t, p, qcow2Header(3, backing), 0o600)
	return p
}

func TestChain(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.img")
	testutil.WriteFile(t, base, make([]byte, 4096), 0o600)
	a, b := filepath.Join(dir, "a.qcow2"), filepath.Join(dir, "b.qcow2")
	testutil.WriteFile(t, a, qcow2Header(3, base), 0o600)
	testutil.WriteFile(t, b, qcow2Header(3, "a.qcow2"), 0o600) // relative: to its own directory
	got, err := Chain(b)
	if err != nil || !slices.Equal(got, []string{b, a, base}) {
		t.Fatalf("Chain = %v, %v", got, err)
	}
	// A missing link ends the chain with its error, keeping what was read.
	testutil.Remove(t, base)
	if got, err := Chain(b); !os.IsNotExist(err) || !slices.Equal(got, []string{b, a, base}) {
		t.Fatalf("Chain with its base gone = %v, %v", got, err)
	}
	// A loop is refused.
	testutil.WriteFile(t, a, qcow2Header(3, b), 0o600)
	if _, err := Chain(b); err == nil || !strings.Contains(err.Error(), "loops") {
		t.Fatalf("Chain of a loop = %v", err)
	}
	// The top must be qcow2.
	testutil.WriteFile(t, a, make([]byte, 64), 0o600)
	if _, err := Chain(a); err == nil {
		t.Fatal("Chain of a raw image accepted")
	}
}

func TestValidate(t *testing.T) {
	for _, mib := range []int{0, MinMiB, 4096, MaxMiB} {
		if err := ValidateMiB("disk_mib", mib); err != nil {
			t.Errorf("ValidateMiB(%d): %v", mib, err)
		}
	}
	for _, mib := range []int{-1, 1, MinMiB - 1, MaxMiB + 1} {
		if err := ValidateMiB("disk_mib", mib); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "disk_mib") {
			t.Errorf("ValidateMiB(%d) = %v", mib, err)
		}
	}
	if err := ValidateID(NewID()); err != nil {
		t.Error(err)
	}
	for _, id := range []string{"", "dl-", "dl-0123456789ABCDEF", "dl-0123456789abcde", "../x", "dl-0123456789abcdef/"} {
		if err := ValidateID(id); err == nil {
			t.Errorf("ValidateID(%q) accepted", id)
		}
	}
}

// TestGC checks the lifetime rules: a layer lives while a snapshot names
// it, another layer backs onto it, or an image in use (a sandbox's
// overlay) reaches it; the rest goes.
func TestGC(t *testing.T) {
	s, err := Open(t.TempDir())
	testutil.Check(t, err)
	run := t.TempDir()
	base := filepath.Join(run, "ext4-64m.img") // the image cache's, outside the store
	testutil.WriteFile(t, base, make([]byte, 4096), 0o600)
	ids := make([]string, 6)
	for i := range ids {
		ids[i] = NewID()
	}
	// 0 <- 1 <- 2 (a chain of branches); 3 <- a sandbox's overlay; 4 and
	// 5 <- 4 unreferenced.
	layer(t, s, ids[0], base)
	layer(t, s, ids[1], s.Path(ids[0]))
	layer(t, s, ids[2], s.Path(ids[1]))
	layer(t, s, ids[3], base)
	layer(t, s, ids[4], base)
	layer(t, s, ids[5], s.Path(ids[4]))
	top := filepath.Join(run, "scratch.qcow2")
	testutil.WriteFile(t, top, qcow2Header(3, s.Path(ids[3])), 0o600)
	testutil.WriteFile(t, filepath.Join(s.Dir(), "not-a-layer.qcow2"), nil, 0o600)
	refs := Refs{Layers: []string{ids[2], "bogus"}, Images: []string{top, filepath.Join(run, "gone.qcow2")}}
	gc := func() []string {
		t.Helper()
		removed, err := s.GC(func() (Refs, error) { return refs, nil })
		if err != nil {
			t.Fatalf("GC: %v", err)
		}
		return removed
	}
	want := []string{ids[4], ids[5]}
	slices.Sort(want)
	if got := gc(); !slices.Equal(got, want) {
		t.Fatalf("GC removed %v, want %v", got, want)
	}
	for _, id := range ids[:4] {
		if _, err := os.Stat(s.Path(id)); err != nil {
			t.Errorf("layer %s: %v", id, err)
		}
	}
	// The snapshot naming the top of the chain goes (rmi): the chain goes
	// with it, the base stays.
	refs.Layers = nil
	want = []string{ids[0], ids[1], ids[2]}
	slices.Sort(want)
	if got := gc(); !slices.Equal(got, want) {
		t.Fatalf("GC removed %v, want %v", got, want)
	}
	// rmi --force of a parent whose layer a dependent's layer backs onto:
	// the dependent's reference keeps both.
	a, b := NewID(), NewID()
	layer(t, s, a, base)
	layer(t, s, b, s.Path(a))
	refs.Layers = []string{b}
	if got := gc(); len(got) != 0 {
		t.Fatalf("GC removed %v of a referenced chain", got)
	}
	// The sandbox is released: its overlay goes, and its layer.
	testutil.Remove(t, top)
	if got := gc(); !slices.Equal(got, []string{ids[3]}) {
		t.Fatalf("GC removed %v, want [%s]", got, ids[3])
	}
	if _, err := os.Stat(base); err != nil {
		t.Fatalf("the base image: %v", err)
	}
	if _, err := os.Stat(filepath.Join(s.Dir(), "not-a-layer.qcow2")); err != nil {
		t.Fatalf("GC removed a file that is not a layer: %v", err)
	}
	// A failing reference lookup removes nothing.
	if _, err := s.GC(func() (Refs, error) { return Refs{}, os.ErrPermission }); err == nil {
		t.Fatal("GC went on without its references")
	}
	if _, err := os.Stat(s.Path(b)); err != nil {
		t.Fatal("GC removed layers without knowing the references")
	}
}

func TestAddRemove(t *testing.T) {
	s, err := Open(t.TempDir())
	testutil.Check(t, err)
	top := filepath.Join(s.Dir(), "..", filepath.Base(s.Dir())+"-top.qcow2")
	testutil.WriteFile(t, top, qcow2Header(3, ""), 0o600)
	id := NewID()
	testutil.Check(t, s.Add(id, top))
	var a, b os.FileInfo
	a, _ = os.Stat(top)
	b, _ = os.Stat(s.Path(id))
	if a == nil || b == nil || !os.SameFile(a, b) {
		t.Fatal("Add did not hard-link the image")
	}
	if err := s.Add(id, top); err == nil {
		t.Fatal("Add over an existing layer accepted")
	}
	if err := s.Add("../x", top); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("Add of a bad id = %v", err)
	}
	testutil.Check(t, s.Remove(id))
	testutil.Check(t, s.Remove(id)) // idempotent
	if _, err := os.Stat(top); err != nil {
		t.Fatal("Remove took the sandbox's own name too")
	}
}

func TestOverlay(t *testing.T) {
	testutil.RequireCommand(t, "qemu-img")
	s, err := Open(t.TempDir())
	testutil.Check(t, err)
	ctx := context.Background()
	base := filepath.Join(s.Dir(), "base.img")
	testutil.WriteFile(t, base, nil, 0o600)
	testutil.Check(t, os.Truncate(base, 64<<20))
	ov := filepath.Join(s.Dir(), "ov.qcow2")
	testutil.Check(t, s.Overlay(ctx, ov, base, "raw", 64<<20))
	if got, err := BackingFile(ov); err != nil || got != base {
		t.Fatalf("BackingFile = %q, %v", got, err)
	}
	out, err := exec.Command("qemu-img", "info", "--output=json", ov).Output()
	testutil.Check(t, err)
	for _, want := range []string{`"virtual-size": 67108864`, `"backing-filename-format": "raw"`} {
		if !strings.Contains(string(out), want) {
			t.Errorf("qemu-img info lacks %s:\n%s", want, out)
		}
	}
	if fi, err := os.Stat(ov); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("overlay mode: %v %v", fi.Mode(), err)
	}
	if err := s.Overlay(ctx, ov, base, "raw", 64<<20); !errdefs.IsAlreadyExists(err) {
		t.Errorf("Overlay over a file = %v", err)
	}
	if err := s.Overlay(ctx, ov+"2", "base.img", "raw", 64<<20); !errdefs.IsInvalidArgument(err) {
		t.Errorf("Overlay on a relative backing = %v", err)
	}
}

// TestFlatten: a chain of a raw base and two layers, each written in a
// place of its own, flattens into one layer with no backing file that
// reads the same, added to the store; the chain is left as it was.
func TestFlatten(t *testing.T) {
	testutil.RequireCommand(t, "qemu-img")
	testutil.RequireCommand(t, "qemu-io")
	s, err := Open(t.TempDir())
	testutil.Check(t, err)
	ctx := context.Background()
	base := filepath.Join(t.TempDir(), "base.img")
	testutil.WriteFile(t, base, []byte("base"), 0o600)
	testutil.Check(t, os.Truncate(base, 64<<20))
	write := func(path, at string) {
		t.Helper()
		if out, err := exec.Command("qemu-io", "-c", "write -P 0xab "+at+" 64k", path).CombinedOutput(); err != nil {
			t.Fatalf("qemu-io %s: %v: %s", path, err, out)
		}
	}
	lower, upper := NewID(), NewID()
	testutil.Check(t, s.Overlay(ctx, s.Path(lower), base, "raw", 64<<20))
	write(s.Path(lower), "1M")
	testutil.Check(t, s.Overlay(ctx, s.Path(upper), s.Path(lower), "qcow2", 64<<20))
	write(s.Path(upper), "2M")

	flat := NewID()
	testutil.Check(t, s.Flatten(ctx, flat, upper, t.TempDir()))
	if got, err := BackingFile(s.Path(flat)); err != nil || got != "" {
		t.Fatalf("flattened layer's backing file %q, %v", got, err)
	}
	if out, err := exec.Command("qemu-img", "compare", "-q", s.Path(upper), s.Path(flat)).CombinedOutput(); err != nil {
		t.Fatalf("the flattened layer reads otherwise: %v: %s", err, out)
	}
	if got, err := BackingFile(s.Path(upper)); err != nil || got != s.Path(lower) {
		t.Errorf("the chain changed: %q, %v", got, err)
	}
	if err := s.Flatten(ctx, NewID(), "../x", t.TempDir()); !errdefs.IsInvalidArgument(err) {
		t.Errorf("Flatten of a bad id = %v", err)
	}
}
