package agent_test

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/guest"
	"github.com/forkd/forkd/internal/testutil"
)

// A 20 MiB file goes to the guest and comes back byte-identical, streamed
// in chunks both ways.
func TestFilesRoundTrip20MiB(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	dir := t.TempDir()
	path := filepath.Join(dir, "a", "b", "big.bin")
	data := make([]byte, 20<<20)
	rand.Read(data)
	want := sha256.Sum256(data)

	n, err := c.WriteFile(ctx, path, bytes.NewReader(data), 0o640)
	if err != nil || n != int64(len(data)) {
		t.Fatalf("WriteFile = %d, %v", n, err)
	}
	st, err := c.Stat(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size != int64(len(data)) || st.Mode != 0o640 || st.Type != proto.FileTypeFile || st.Name != "big.bin" {
		t.Fatalf("stat = %+v", st)
	}
	h := sha256.New()
	n, err = c.ReadFile(ctx, path, h)
	if err != nil || n != int64(len(data)) {
		t.Fatalf("ReadFile = %d, %v", n, err)
	}
	if !bytes.Equal(h.Sum(nil), want[:]) {
		t.Fatal("file read back differs")
	}
	onDisk, _ := os.ReadFile(path)
	if sha256.Sum256(onDisk) != want {
		t.Fatal("file on disk differs")
	}
	// Overwrite keeps the mode; no temporary files are left behind.
	if _, err := c.WriteFile(ctx, path, bytes.NewReader([]byte("small")), 0); err != nil {
		t.Fatal(err)
	}
	st, _ = c.Stat(ctx, path)
	if st.Size != 5 || st.Mode != 0o640 {
		t.Fatalf("after overwrite: %+v", st)
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 1 {
		t.Fatalf("directory holds %d entries, want only the file", len(entries))
	}
}

// A failing source leaves the old file untouched and no temporary behind.
func TestWriteFileAbortsOnReadError(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	testutil.WriteFile(t, path, []byte("old"), 0o644)
	boom := errors.New("source broke")
	src := io.MultiReader(bytes.NewReader(make([]byte, 100000)), errReader{boom})
	if _, err := c.WriteFile(testCtx(t), path, src, 0); !errors.Is(err, boom) {
		t.Fatalf("WriteFile = %v", err)
	}
	if b, _ := os.ReadFile(path); string(b) != "old" {
		t.Fatalf("file now %q", b)
	}
	// The guest removes its temporary once it sees the cancel.
	if _, err := c.Ping(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.Name() != "f" {
			t.Errorf("left behind: %s", e.Name())
		}
	}
}

// A data frame lost on its way to the guest (here: a byte flipped, so the
// guest's reader skips the frame) leaves a file short of what was sent;
// the write fails instead of reporting a whole file.
func TestWriteFileLostFrameFails(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	// Past the handshake and the request, inside the data.
	cd.flipToGuest.Store(600 << 10)
	c := cd.dial()
	path := filepath.Join(t.TempDir(), "f")
	_, err := c.WriteFile(testCtx(t), path, bytes.NewReader(make([]byte, 1<<20)), 0)
	if !errdefs.IsUnavailable(err) {
		t.Fatalf("WriteFile with a frame lost = %v, want Unavailable", err)
	}
	// What arrived is still all zeros and short: the loss was real.
	if st, err := os.Stat(path); err != nil || st.Size() >= 1<<20 {
		t.Fatalf("file after a lost frame: %v, %v", st, err)
	}
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

func TestFileOperations(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	dir := t.TempDir()

	created, err := c.MakeDir(ctx, dir+"/x/y/z")
	if err != nil || !created {
		t.Fatalf("MakeDir = %v, %v", created, err)
	}
	created, err = c.MakeDir(ctx, dir+"/x/y")
	if err != nil || created {
		t.Fatalf("MakeDir of an existing dir = %v, %v", created, err)
	}
	testutil.WriteFile(t, dir+"/x/file", []byte("hi"), 0o600)
	testutil.WriteFile(t, dir+"/plain", nil, 0o600)
	testutil.Symlink(t, "file", dir+"/x/link")

	entries, err := c.ListDir(ctx, dir+"/x", 1)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, e := range entries {
		got[e.Path] = e.Type
	}
	want := map[string]string{dir + "/x/file": "file", dir + "/x/link": "symlink", dir + "/x/y": "dir"}
	if len(got) != len(want) {
		t.Fatalf("depth 1: %v", got)
	}
	for p, typ := range want {
		if got[p] != typ {
			t.Fatalf("depth 1: %v, want %v", got, want)
		}
	}
	entries, _ = c.ListDir(ctx, dir+"/x", 3)
	if len(entries) != 4 || entries[len(entries)-1].Path != dir+"/x/y/z" {
		t.Fatalf("depth 3: %+v", entries)
	}
	st, err := c.Stat(ctx, dir+"/x/link")
	if err != nil || st.Type != proto.FileTypeSymlink || st.Target != "file" {
		t.Fatalf("stat of a symlink = %+v, %v", st, err)
	}

	if err := c.Rename(ctx, dir+"/x/file", dir+"/x/y/renamed"); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(dir + "/x/y/renamed"); string(b) != "hi" {
		t.Fatalf("renamed file holds %q", b)
	}
	if err := c.Remove(ctx, dir+"/x/y", false); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("non-recursive remove of a full dir = %v", err)
	}
	if err := c.Remove(ctx, dir+"/x/y", true); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir + "/x/y"); !os.IsNotExist(err) {
		t.Fatalf("after recursive remove: %v", err)
	}

	var sink bytes.Buffer
	for _, tc := range []struct {
		name  string
		err   error
		class error
	}{
		{"read missing", second(c.ReadFile(ctx, dir+"/nope", &sink)), errdefs.ErrNotFound},
		{"read relative", second(c.ReadFile(ctx, "etc/passwd", &sink)), errdefs.ErrInvalidArgument},
		{"read dir", second(c.ReadFile(ctx, dir, &sink)), errdefs.ErrInvalidArgument},
		{"stat missing", second(c.Stat(ctx, dir+"/nope")), errdefs.ErrNotFound},
		{"list missing", second(c.ListDir(ctx, dir+"/nope", 1)), errdefs.ErrNotFound},
		{"list file", second(c.ListDir(ctx, dir+"/plain", 1)), errdefs.ErrInvalidArgument},
		{"mkdir over file", second(c.MakeDir(ctx, dir+"/plain")), errdefs.ErrAlreadyExists},
		{"mkdir under file", second(c.MakeDir(ctx, dir+"/plain/sub")), errdefs.ErrInvalidArgument},
		{"remove missing", c.Remove(ctx, dir+"/nope", true), errdefs.ErrNotFound},
		{"remove root", c.Remove(ctx, "/", true), errdefs.ErrInvalidArgument},
		{"rename missing", c.Rename(ctx, dir+"/nope", dir+"/nope2"), errdefs.ErrNotFound},
		{"write over dir", second(c.WriteFile(ctx, dir+"/x", bytes.NewReader(nil), 0)), errdefs.ErrInvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !errors.Is(tc.err, tc.class) {
				t.Errorf("%v, want class %v", tc.err, tc.class)
			}
		})
	}
}

// Permission errors come back classed when the agent runs unprivileged.
func TestFilePermissionDenied(t *testing.T) {
	if testutil.AsNobody(t) {
		return
	}
	c := startGuest(t, guest.Config{}).dial()
	dir := t.TempDir()
	testutil.WriteFile(t, dir+"/secret", []byte("x"), 0o000)
	_, err := c.ReadFile(testCtx(t), dir+"/secret", io.Discard)
	if !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("read of a 0000 file = %v", err)
	}
}

func second[T any](_ T, err error) error { return err }

// A listing whose answer would not fit one message fails with a clear
// resource-exhausted error instead of leaving the call waiting.
func TestListDirTooLargeForOneMessage(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	dir := t.TempDir()
	// JSON escapes '<' as \u003c: each entry's name and path cost over
	// 2 KiB, so 8000 entries pass proto.MaxMessage well under the count limit.
	long := strings.Repeat("<", 200)
	for i := range 8000 {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("%s%05d", long, i)), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	_, err := c.ListDir(ctx, dir, 1)
	if !errdefs.IsResourceExhausted(err) || !strings.Contains(err.Error(), "bytes encoded") {
		t.Fatalf("ListDir of a huge directory = %v", err)
	}
	// The session still works, and a smaller listing succeeds.
	sub := filepath.Join(dir, "sub")
	testutil.Mkdir(t, sub, 0o755)
	testutil.WriteFile(t, filepath.Join(sub, "f"), nil, 0o644)
	if entries, err := c.ListDir(ctx, sub, 1); err != nil || len(entries) != 1 {
		t.Fatalf("ListDir after the failure = %v, %v", entries, err)
	}
}
