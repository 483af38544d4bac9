package fsutil

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// entries returns the names in dir.
func entries(t *testing.T, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range es {
		out = append(out, e.Name())
	}
	return out
}

func TestWriteFileReplaces(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(p, []byte("new"), 0o600); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil || string(b) != "new" {
		t.Fatalf("content = %q, %v; want new", b, err)
	}
	st, err := os.Stat(p)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("mode = %v, %v; want 0600", st.Mode(), err)
	}
	if got := entries(t, dir); len(got) != 1 {
		t.Fatalf("dir holds %v, want only f", got)
	}
}

func TestWriteJSON(t *testing.T) {
	p := filepath.Join(t.TempDir(), "v.json")
	if err := WriteJSON(p, map[string]int{"a": 1}, 0o644); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(p)
	if want := "{\n  \"a\": 1\n}\n"; string(b) != want {
		t.Fatalf("content = %q, want %q", b, want)
	}
}

func TestWriteWithFailureLeavesNothing(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	err := WriteWith(p, 0o644, func(w io.Writer) error {
		if _, err := io.WriteString(w, "partial"); err != nil {
			return err
		}
		// The temporary file exists while write runs, under TempPrefix.
		for _, n := range entries(t, dir) {
			if n != "f" && !strings.HasPrefix(n, TempPrefix("f")) {
				t.Errorf("temporary file %q does not start with %q", n, TempPrefix("f"))
			}
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("WriteWith = %v, want boom", err)
	}
	if b, _ := os.ReadFile(p); string(b) != "old" {
		t.Fatalf("content = %q after a failed write, want old", b)
	}
	if got := entries(t, dir); len(got) != 1 {
		t.Fatalf("dir holds %v after a failed write, want only f", got)
	}
}

func TestWriteWithStreams(t *testing.T) {
	p := filepath.Join(t.TempDir(), "big")
	chunk := strings.Repeat("x", 64<<10)
	err := WriteWith(p, 0o644, func(w io.Writer) error {
		for range 40 { // past the buffer
			if _, err := io.WriteString(w, chunk); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(p); err != nil || st.Size() != 40*64<<10 {
		t.Fatalf("size = %v, %v; want %d", st.Size(), err, 40*64<<10)
	}
}

func TestCreateFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := CreateFile(p, []byte("a"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := CreateFile(p, []byte("b"), 0o644); !errors.Is(err, os.ErrExist) {
		t.Fatalf("CreateFile over an existing file = %v, want ErrExist", err)
	}
	if b, _ := os.ReadFile(p); string(b) != "a" {
		t.Fatalf("content = %q, want a", b)
	}
}

func TestSync(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := SyncFile(p); err != nil {
		t.Fatal(err)
	}
	if err := SyncDir(dir); err != nil {
		t.Fatal(err)
	}
	if err := SyncDir(filepath.Join(dir, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("SyncDir of a missing dir = %v, want ErrNotExist", err)
	}
}
