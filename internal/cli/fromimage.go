package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
)

func newFromImageCmd(g *globals) *cobra.Command {
	var spec sandbox.SnapshotSpec
	var opts image.OCIOptions
	cmd := &cobra.Command{
		Use:   "from-image REF --tag TAG [--extra PKG]... [--warmup CMD]...",
		Short: "Turn an OCI image (registry ref, docker save tarball, OCI layout) into a snapshot",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := snapshot.ValidateTag(spec.Tag); err != nil {
				return err
			}
			e, err := g.engine()
			if err != nil {
				return err
			}
			defer e.Close()
			if _, err := e.Snapshots().Get(spec.Tag); err == nil {
				return errdefs.AlreadyExists("snapshot %q already exists (forkd rmi %s to replace it)", spec.Tag, spec.Tag)
			}
			opts.Tag = spec.Tag
			img, err := e.Images().FromOCI(cmd.Context(), args[0], opts)
			if err != nil {
				return err
			}
			spec.Built = img
			snap, err := e.CreateSnapshot(cmd.Context(), spec)
			if err != nil {
				return err
			}
			fmt.Fprintln(g.stdout, snap.Tag)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&spec.Tag, "tag", "", "name of the image and its snapshot (required)")
	f.StringArrayVar(&opts.Extra, "extra", nil, "Debian/Ubuntu package to install into the image (repeatable)")
	f.StringArrayVar(&opts.Preload, "preload", nil, "Python module the warm interpreter imports (repeatable)")
	f.BoolVar(&opts.Insecure, "insecure", false, "allow a plain-HTTP registry")
	f.IntVar(&spec.MemoryMiB, "mem-size-mib", 256, "guest RAM in MiB")
	f.IntVar(&spec.VCPUs, "vcpus", 1, "guest vCPUs")
	f.StringArrayVar(&spec.Warmup, "warmup", nil, "shell command to run in the parent before the snapshot (repeatable)")
	cmd.MarkFlagRequired("tag")
	return cmd
}
