package cli

import (
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/internal/errdefs"
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
				return errdefs.InvalidArgument("exactly one side must be ID:GUESTPATH")
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
			e, err := g.engine()
			if err != nil {
				return err
			}
			defer e.Close()
			c, release, err := e.Agent(cmd.Context(), id)
			if err != nil {
				return err
			}
			defer release()
			if dstID != "" { // host -> guest
				in, mode, closeIn, err := openHostSource(g, srcPath)
				if err != nil {
					return err
				}
				defer closeIn()
				_, err = c.WriteFile(cmd.Context(), guest, in, mode)
				return err
			}
			// guest -> host: write a temp file next to the target, rename.
			if dstPath == "-" {
				_, err := c.ReadFile(cmd.Context(), guest, g.stdout)
				return err
			}
			target := dstPath
			if st, err := os.Stat(target); err == nil && st.IsDir() {
				target = filepath.Join(target, filepath.Base(guest))
			}
			tmp, err := os.CreateTemp(filepath.Dir(target), "."+filepath.Base(target)+".forkd-*")
			if err != nil {
				return err
			}
			defer os.Remove(tmp.Name())
			if _, err := c.ReadFile(cmd.Context(), guest, tmp); err != nil {
				tmp.Close()
				return err
			}
			if err := tmp.Sync(); err != nil {
				tmp.Close()
				return err
			}
			if err := tmp.Close(); err != nil {
				return err
			}
			return os.Rename(tmp.Name(), target)
		},
	}
}

// splitRemote splits "ID:PATH" when the part before ':' looks like an id.
func splitRemote(arg string) (id, path string) {
	if before, after, ok := strings.Cut(arg, ":"); ok && strings.HasPrefix(before, "sb-") {
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
		return nil, 0, nil, errdefs.NotFound("%v", err)
	}
	st, err := f.Stat()
	if err != nil || !st.Mode().IsRegular() {
		f.Close()
		return nil, 0, nil, errdefs.InvalidArgument("%s is not a regular file", path)
	}
	return f, st.Mode().Perm(), func() { f.Close() }, nil
}
