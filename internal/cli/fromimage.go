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
	"github.com/forkd/forkd/internal/request"
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
			req := fromImageRequest(args[0], spec, opts)
			if c, err := g.remote(cmd.Context()); err != nil {
				return err
			} else if c != nil {
				defer c.Close()
				return fromImageRemote(cmd.Context(), g, c, req)
			}
			// Everything is checked as the daemon would (but a local path
			// may be anywhere: the import runs as the invoking user)
			// before the import, which is long.
			spec, oci, err := request.SnapshotSpec(&req, "")
			if err != nil {
				return err
			}
			e, err := g.engine()
			if err != nil {
				return err
			}
			defer e.Close()
			if _, err := e.Snapshots().Get(spec.Tag); err == nil {
				return errdefs.AlreadyExists("snapshot %q already exists (forkd rmi %s to replace it)", spec.Tag, spec.Tag)
			} else if !errdefs.IsNotFound(err) {
				return err
			}
			img, err := e.Images().FromOCI(cmd.Context(), args[0], *oci)
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

// fromImageRequest is the API request the flags make.
func fromImageRequest(ref string, spec sandbox.SnapshotSpec, opts image.OCIOptions) apiv1.CreateSnapshotRequest {
	return apiv1.CreateSnapshotRequest{
		Tag: spec.Tag, MemoryMiB: spec.MemoryMiB, VCPUs: spec.VCPUs, Warmup: spec.Warmup,
		OCI: &apiv1.OCISource{Ref: ref, Extra: opts.Extra, Preload: opts.Preload, Insecure: opts.Insecure},
	}
}

// fromImageRemote imports and snapshots the image in the daemon. A local
// path is made absolute: the daemon has its own working directory (and
// takes only paths inside its --import-dir).
func fromImageRemote(ctx context.Context, g *globals, c *client.Client, req apiv1.CreateSnapshotRequest) error {
	if _, err := os.Stat(req.OCI.Ref); err == nil {
		if abs, err := filepath.Abs(req.OCI.Ref); err == nil {
			req.OCI.Ref = abs
		}
	}
	op, err := c.CreateSnapshot(ctx, req)
	if err != nil {
		return err
	}
	fmt.Fprintf(g.stderr, "importing %s as %s in the daemon (operation %s)\n", req.OCI.Ref, req.Tag, op.ID)
	if _, err := c.WaitOperation(ctx, op.ID); err != nil {
		return err
	}
	fmt.Fprintln(g.stdout, req.Tag)
	return nil
}
