package cli

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
)

func newFromImageCmd(g *globals) *cobra.Command {
	req := apiv1.CreateSnapshotRequest{OCI: &apiv1.OCISource{}}
	cmd := &cobra.Command{
		Use:   "from-image REF --tag TAG [--extra PKG]... [--warmup CMD]...",
		Short: "Turn an OCI image (registry ref, docker save tarball, OCI layout) into a snapshot",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req.OCI.Ref = args[0]
			// A local path is made absolute: a daemon has its own working
			// directory (and takes only paths inside its --import-dir).
			if _, err := os.Stat(req.OCI.Ref); err == nil {
				if abs, err := filepath.Abs(req.OCI.Ref); err == nil {
					req.OCI.Ref = abs
				}
			}
			if err := checkSnapshot(req); err != nil {
				return err
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			snap, err := buildSnapshot(cmd.Context(), g, c, req)
			if err != nil {
				return err
			}
			fmt.Fprintln(g.stdout, snap.Tag)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&req.Tag, "tag", "", "name of the image and its snapshot (required)")
	f.StringArrayVar(&req.OCI.Extra, "extra", nil, "Debian/Ubuntu package to install into the image (repeatable)")
	f.StringArrayVar(&req.OCI.Preload, "preload", nil, "Python module the warm interpreter imports (repeatable)")
	f.BoolVar(&req.OCI.Insecure, "insecure", false, "allow a plain-HTTP registry")
	f.IntVar(&req.MemoryMiB, "mem-size-mib", 256, "guest RAM in MiB")
	f.IntVar(&req.VCPUs, "vcpus", 1, "guest vCPUs")
	f.StringArrayVar(&req.Warmup, "warmup", nil, "shell command to run in the parent before the snapshot (repeatable)")
	requireFlag(cmd, "tag")
	return cmd
}
