package testutil

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"io/fs"
	"os"
	"testing"
	"time"
)

// FileSHA256 returns the hex sha256 of the file at path, failing t if it
// cannot be read.
func FileSHA256(t testing.TB, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// The helpers below do a test's setup on the file system and fail t at
// once, naming the operation and the path, when it goes wrong: a fixture
// that silently failed to appear would make the test check something else.

// fatal fails t with "op what: err", leaving out of err the operation
// and path the os package put in it when they are the ones named.
func fatal(t testing.TB, op, what string, err error) {
	t.Helper()
	var pe *fs.PathError
	var le *os.LinkError
	switch {
	case errors.As(err, &pe) && pe.Path == what:
		err = pe.Err
	case errors.As(err, &le):
		err = le.Err
	}
	t.Fatalf("%s %s: %v", op, what, err)
}

// WriteFile is os.WriteFile, failing t on error.
func WriteFile(t testing.TB, path string, data []byte, perm os.FileMode) {
	t.Helper()
	if err := os.WriteFile(path, data, perm); err != nil {
		fatal(t, "write", path, err)
	}
}

// Mkdir is os.Mkdir, failing t on error.
func Mkdir(t testing.TB, path string, perm os.FileMode) {
	t.Helper()
	if err := os.Mkdir(path, perm); err != nil {
		fatal(t, "mkdir", path, err)
	}
}

// MkdirAll is os.MkdirAll, failing t on error.
func MkdirAll(t testing.TB, path string, perm os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(path, perm); err != nil {
		fatal(t, "mkdir -p", path, err)
	}
}

// Symlink is os.Symlink, failing t on error.
func Symlink(t testing.TB, oldname, newname string) {
	t.Helper()
	if err := os.Symlink(oldname, newname); err != nil {
		fatal(t, "symlink", newname+" -> "+oldname, err)
	}
}

// Link is os.Link, failing t on error.
func Link(t testing.TB, oldname, newname string) {
	t.Helper()
	if err := os.Link(oldname, newname); err != nil {
		fatal(t, "link", newname+" to "+oldname, err)
	}
}

// Chmod is os.Chmod, failing t on error.
func Chmod(t testing.TB, path string, mode os.FileMode) {
	t.Helper()
	if err := os.Chmod(path, mode); err != nil {
		fatal(t, "chmod", path, err)
	}
}

// Chtimes is os.Chtimes, failing t on error.
func Chtimes(t testing.TB, path string, atime, mtime time.Time) {
	t.Helper()
	if err := os.Chtimes(path, atime, mtime); err != nil {
		fatal(t, "chtimes", path, err)
	}
}

// Remove is os.Remove, failing t on error.
func Remove(t testing.TB, path string) {
	t.Helper()
	if err := os.Remove(path); err != nil {
		fatal(t, "remove", path, err)
	}
}

// RemoveAll is os.RemoveAll, failing t on error.
func RemoveAll(t testing.TB, path string) {
	t.Helper()
	if err := os.RemoveAll(path); err != nil {
		fatal(t, "remove -r", path, err)
	}
}

// Rename is os.Rename, failing t on error.
func Rename(t testing.TB, oldpath, newpath string) {
	t.Helper()
	if err := os.Rename(oldpath, newpath); err != nil {
		fatal(t, "rename", oldpath+" to "+newpath, err)
	}
}

// Write writes data to w, failing t on error (a short write is an error).
// what names w in the message.
func Write(t testing.TB, what string, w io.Writer, data []byte) {
	t.Helper()
	if _, err := w.Write(data); err != nil {
		fatal(t, "write", what, err)
	}
}

// Close closes c, failing t on error: for a writer whose Close flushes
// (a file, a tar or gzip writer), an error there means data was lost.
// what names c in the message.
func Close(t testing.TB, what string, c io.Closer) {
	t.Helper()
	if err := c.Close(); err != nil {
		fatal(t, "close", what, err)
	}
}
