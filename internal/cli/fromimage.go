package cli

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
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
			if c, err := g.remote(cmd.Context()); err != nil {
				return err
			} else if c != nil {
				defer c.Close()
				return fromImageRemote(cmd.Context(), g, c, args[0], spec, opts)
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

// fromImageRemote imports and snapshots the image in the daemon. A local
// path is made absolute: the daemon has its own working directory.
func fromImageRemote(ctx context.Context, g *globals, c *client.Client, ref string, spec sandbox.SnapshotSpec, opts image.OCIOptions) error {
	if _, err := os.Stat(ref); err == nil {
		if abs, err := filepath.Abs(ref); err == nil {
			ref = abs
		}
	}
	op, err := c.CreateSnapshot(ctx, apiv1.CreateSnapshotRequest{
		Tag: spec.Tag, MemoryMiB: spec.MemoryMiB, VCPUs: spec.VCPUs, Warmup: spec.Warmup,
		OCI: &apiv1.OCISource{Ref: ref, Extra: opts.Extra, Preload: opts.Preload, Insecure: opts.Insecure},
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(g.stderr, "importing %s as %s in the daemon (operation %s)\n", ref, spec.Tag, op.ID)
	if _, err := c.WaitOperation(ctx, op.ID); err != nil {
		return err
	}
	fmt.Fprintln(g.stdout, spec.Tag)
	return nil
}
