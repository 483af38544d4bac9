package cli

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/sandbox"
)

func newCpCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "cp HOSTPATH ID:GUESTPATH | ID:GUESTPATH HOSTPATH",
		Short: "Copy a file into or out of a sandbox (streamed; - is stdin/stdout)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			srcID, srcPath := splitRemote(args[0])
			dstID, dstPath := splitRemote(args[1])
			if (srcID == "") == (dstID == "") {
				return errdefs.InvalidArgument("exactly one side must be ID:GUESTPATH (ID: sb- and 10 characters)")
			}
			id, guest := srcID, srcPath
			if dstID != "" {
				id, guest = dstID, dstPath
			}
			if err := sandbox.ValidateID(id); err != nil {
				return err
			}
			if !strings.HasPrefix(guest, "/") {
				return errdefs.InvalidArgument("guest path %q must be absolute", guest)
			}
			files, done, err := g.files(cmd.Context(), id)
			if err != nil {
				return err
			}
			defer done()
			if dstID != "" { // host -> guest
				in, mode, closeIn, err := openHostSource(g, srcPath)
				if err != nil {
					return err
				}
				defer closeIn()
				return files.write(cmd.Context(), guest, in, mode)
			}
			// guest -> host: write a temp file next to the target, rename.
			if dstPath == "-" {
				return files.read(cmd.Context(), guest, g.stdout)
			}
			target := dstPath
			if st, err := os.Stat(target); err == nil && st.IsDir() {
				target = filepath.Join(target, filepath.Base(guest))
			}
			mode := os.FileMode(0o600) // a new file: the guest's bytes are private
			if st, err := os.Stat(target); err == nil {
				if !st.Mode().IsRegular() {
					// A device, FIFO or what a symlink names (/dev/null,
					// /dev/stdout): written in place, never replaced.
					f, err := os.OpenFile(target, os.O_WRONLY|os.O_TRUNC, 0)
					if err != nil {
						return err
					}
					err = files.read(cmd.Context(), guest, f)
					return errors.Join(err, f.Close())
				}
				mode = st.Mode().Perm() // an existing file keeps its mode
			}
			return fsutil.WriteWith(target, mode, func(w io.Writer) error {
				return files.read(cmd.Context(), guest, w)
			})
		},
	}
}

// splitRemote splits "ID:PATH" when the part before ':' is a sandbox id;
// anything else (a host path such as sb-notes:v2.txt) is a host path.
func splitRemote(arg string) (id, path string) {
	if before, after, ok := strings.Cut(arg, ":"); ok && sandbox.ValidateID(before) == nil {
		return before, after
	}
	return "", arg
}

func openHostSource(g *globals, path string) (io.Reader, os.FileMode, func(), error) {
	if path == "-" {
		return g.stdin, 0o644, func() {}, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, 0, nil, errdefs.NotFound("%w", err)
	}
	st, err := f.Stat()
	if err != nil || !st.Mode().IsRegular() {
		f.Close()
		return nil, 0, nil, errdefs.InvalidArgument("%s is not a regular file", path)
	}
	return f, st.Mode().Perm(), func() { f.Close() }, nil
}

// fileOps reads and writes one sandbox's files.
type fileOps struct {
	read  func(ctx context.Context, path string, w io.Writer) error
	write func(ctx context.Context, path string, r io.Reader, mode os.FileMode) error
}

// files returns the file operations of sandbox id and how to release them.
func (g *globals) files(ctx context.Context, id string) (fileOps, func(), error) {
	c, done, err := g.api(ctx)
	if err != nil {
		return fileOps{}, nil, err
	}
	return fileOps{
		read: func(ctx context.Context, p string, w io.Writer) error {
			_, err := c.ReadFile(ctx, id, p, w)
			return err
		},
		write: func(ctx context.Context, p string, r io.Reader, m os.FileMode) error {
			_, err := c.WriteFile(ctx, id, p, r, uint32(m.Perm()))
			return err
		},
	}, done, nil
}
