// Package fsutil writes files so that a crash at any point leaves either the
// old content or the new, never a mix.
//
// An atomic write goes through a temporary file in the target's directory
// named TempPrefix(name) plus a random suffix; a crash can leave one behind,
// which whoever owns the directory may remove (all such names start with a
// dot).
package fsutil

import (
	"bufio"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
)

// TempPrefix is the prefix of the temporary files through which WriteFile,
// WriteJSON and WriteWith write the file called name.
func TempPrefix(name string) string { return ".tmp-" + name + "-" }

// WriteFile writes data to path atomically: a temporary file in the same
// directory, fsync, rename, fsync of the directory.
func WriteFile(path string, data []byte, perm os.FileMode) error {
	return writeAtomic(path, perm, func(f *os.File) error {
		_, err := f.Write(data)
		return err
	})
}

// WriteJSON marshals v (indented) and writes it with WriteFile.
func WriteJSON(path string, v any, perm os.FileMode) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return WriteFile(path, append(b, '\n'), perm)
}

// WriteWith writes path atomically as WriteFile does, with the content that
// write produces into a buffered writer. If write fails, nothing is left
// behind and path is untouched.
func WriteWith(path string, perm os.FileMode, write func(w io.Writer) error) error {
	return writeAtomic(path, perm, func(f *os.File) error {
		bw := bufio.NewWriterSize(f, 1<<20)
		if err := write(bw); err != nil {
			return err
		}
		return bw.Flush()
	})
}

// writeAtomic fills a temporary file next to path with fill, then chmods,
// fsyncs and renames it to path and fsyncs the directory. On failure the
// temporary file is removed.
func writeAtomic(path string, perm os.FileMode, fill func(f *os.File) error) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, TempPrefix(filepath.Base(path)))
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			if rerr := os.Remove(f.Name()); !errors.Is(rerr, os.ErrNotExist) {
				err = errors.Join(err, rerr)
			}
		}
	}()
	if err := fill(f); err != nil {
		return err
	}
	if err := f.Chmod(perm); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return err
	}
	return SyncDir(dir)
}

// CreateFile writes data to a new file at path (it must not exist) with mode
// perm and fsyncs it. It is not atomic: it is for files in a staging
// directory that is itself synced and renamed into place once complete.
func CreateFile(path string, data []byte, perm os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		return errors.Join(err, f.Close())
	}
	if err := f.Sync(); err != nil {
		return errors.Join(err, f.Close())
	}
	return f.Close()
}

// SyncDir fsyncs a directory, making renames and creations in it durable.
func SyncDir(dir string) error { return syncPath(dir) }

// SyncFile fsyncs the file at path, such as one another process wrote.
func SyncFile(path string) error { return syncPath(path) }

func syncPath(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}
