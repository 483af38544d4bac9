package cpio

import (
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/testutil"
)

type member struct {
	h    Header
	data string
}

func sample() []member {
	return []member{
		{h: Header{Name: "bin", Mode: TypeDir | 0o755}},
		{h: Header{Name: "bin/busybox", Mode: TypeReg | 0o755, Size: 5}, data: "hello"},
		{h: Header{Name: "bin/sh", Mode: TypeSymlink | 0o777, Linkname: "/bin/busybox"}},
		{h: Header{Name: "dev", Mode: TypeDir | 0o755}},
		{h: Header{Name: "dev/console", Mode: TypeChar | 0o600, RDevMajor: 5, RDevMinor: 1}},
		{h: Header{Name: "etc/odd-length-name.txt", Mode: TypeReg | 0o644, UID: 1000, GID: 100, ModTime: 1700000000, Size: 3}, data: "abc"},
		{h: Header{Name: "empty", Mode: TypeReg | 0o600}},
	}
}

func write(t *testing.T, ms []member) []byte {
	t.Helper()
	var buf bytes.Buffer
	w := NewWriter(&buf)
	for _, m := range ms {
		h := m.h
		if err := w.WriteHeader(&h); err != nil {
			t.Fatalf("WriteHeader(%s): %v", m.h.Name, err)
		}
		if m.data != "" && h.Mode&TypeMask == TypeReg {
			if _, err := io.WriteString(w, m.data); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if buf.Len()%512 != 0 {
		t.Fatalf("archive length %d not a multiple of 512", buf.Len())
	}
	return buf.Bytes()
}

func TestRoundTrip(t *testing.T) {
	ms := sample()
	b := write(t, ms)
	if !bytes.Equal(b, write(t, ms)) {
		t.Fatal("writer is not deterministic")
	}
	r := NewReader(bytes.NewReader(b))
	for i, want := range ms {
		h, err := r.Next()
		if err != nil {
			t.Fatalf("member %d: %v", i, err)
		}
		// Read only every other file's data to check that Next skips the rest.
		var data []byte
		if i%2 == 1 || h.Mode&TypeMask != TypeReg {
			data, err = io.ReadAll(r)
			if err != nil {
				t.Fatal(err)
			}
		} else {
			data = []byte(want.data)
		}
		if h.Mode&TypeMask == TypeSymlink {
			data = nil
		}
		got := *h
		got.ino = 0
		w := want.h
		if w.NLink == 0 {
			w.NLink = 1
			if w.IsDir() {
				w.NLink = 2
			}
		}
		if w.Mode&TypeMask == TypeSymlink {
			w.Size = int64(len(w.Linkname))
		}
		if !reflect.DeepEqual(got, w) {
			t.Errorf("member %d:\n got %+v\nwant %+v", i, got, w)
		}
		if h.Mode&TypeMask == TypeReg && string(data) != want.data {
			t.Errorf("%s: data %q, want %q", h.Name, data, want.data)
		}
	}
	if _, err := r.Next(); !errors.Is(err, io.EOF) {
		t.Fatalf("after last member: %v, want io.EOF", err)
	}
}

func TestWriterRefuses(t *testing.T) {
	for _, h := range []Header{
		{Name: "", Mode: TypeReg},
		{Name: "a\x00b", Mode: TypeReg},
		{Name: "notype", Mode: 0o644},
		{Name: "dir-with-data", Mode: TypeDir | 0o755, Size: 3},
		{Name: "file-with-link", Mode: TypeReg, Linkname: "x"},
		{Name: "huge", Mode: TypeReg, Size: 1 << 33},
	} {
		t.Run(h.Name, func(t *testing.T) {
			w := NewWriter(io.Discard)
			if err := w.WriteHeader(&h); err == nil {
				t.Errorf("WriteHeader(%q) accepted", h.Name)
			}
		})
	}
	w := NewWriter(io.Discard)
	if err := w.WriteHeader(&Header{Name: "f", Mode: TypeReg, Size: 2}); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write([]byte("abc")); err == nil {
		t.Error("Write past Size accepted")
	}
	if err := w.WriteHeader(&Header{Name: "g", Mode: TypeReg}); err == nil {
		t.Error("WriteHeader with the previous member short accepted")
	}
}

func TestReaderMalformed(t *testing.T) {
	good := write(t, sample())
	for name, b := range map[string][]byte{
		"bad magic": append([]byte("070707"), good[6:]...),
		"truncated": good[:200],
		"bad hex":   append(append([]byte("070701"), []byte("zzzzzzzz")...), good[14:]...),
	} {
		t.Run(name, func(t *testing.T) {
			r := NewReader(bytes.NewReader(b))
			var err error
			for err == nil {
				if _, err = r.Next(); err == nil {
					_, err = io.ReadAll(r)
				}
			}
			if !errors.Is(err, ErrFormat) {
				t.Errorf("got %v, want ErrFormat", err)
			}
		})
	}
}

// TestGNUCpio checks the format against GNU cpio in both directions.
func TestGNUCpio(t *testing.T) {
	cpioBin := testutil.RequireCommand(t, "cpio")
	testutil.RequireRoot(t) // extracting device nodes
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	if err := os.Mkdir(out, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(cpioBin, "-idm", "--quiet", "--no-absolute-filenames")
	cmd.Dir = out
	cmd.Stdin = bytes.NewReader(write(t, sample()))
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cpio -id: %v: %s", err, b)
	}
	if b, err := os.ReadFile(filepath.Join(out, "bin/busybox")); err != nil || string(b) != "hello" {
		t.Errorf("bin/busybox: %q, %v", b, err)
	}
	if l, err := os.Readlink(filepath.Join(out, "bin/sh")); err != nil || l != "/bin/busybox" {
		t.Errorf("bin/sh: %q, %v", l, err)
	}
	if fi, err := os.Stat(filepath.Join(out, "etc/odd-length-name.txt")); err != nil || fi.ModTime().Unix() != 1700000000 || fi.Mode().Perm() != 0o644 {
		t.Errorf("etc/odd-length-name.txt: %v, %v", fi, err)
	}
	if fi, err := os.Lstat(filepath.Join(out, "dev/console")); err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		t.Errorf("dev/console: %v, %v", fi, err)
	}

	// And GNU cpio's output through our reader.
	cmd = exec.Command(cpioBin, "-o", "-H", "newc", "--quiet")
	cmd.Dir = out
	cmd.Stdin = strings.NewReader("bin\nbin/busybox\nbin/sh\netc/odd-length-name.txt\n")
	archive, err := cmd.Output()
	if err != nil {
		t.Fatalf("cpio -o: %v", err)
	}
	r := NewReader(bytes.NewReader(archive))
	seen := map[string]string{}
	for {
		h, err := r.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(r)
		seen[h.Name] = string(b) + h.Linkname
	}
	want := map[string]string{"bin": "", "bin/busybox": "hello", "bin/sh": "/bin/busybox", "etc/odd-length-name.txt": "abc"}
	if !reflect.DeepEqual(seen, want) {
		t.Errorf("read back %v, want %v", seen, want)
	}
}
