package cli

import (
	"context"
	"fmt"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/sandbox"
)

func newSnapshotCmd(g *globals) *cobra.Command {
	var spec sandbox.SnapshotSpec
	var asJSON bool
	var netFlag bool
	cmd := &cobra.Command{
		Use:   "snapshot --tag TAG [--image minimal] [--warmup CMD]...",
		Short: "Boot a parent VM from an image, warm it, and save it as a snapshot",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var net *bool
			if cmd.Flags().Changed("per-child-netns") {
				net = &netFlag
			}
			if c, err := g.remote(cmd.Context()); err != nil {
				return err
			} else if c != nil {
				defer c.Close()
				return snapshotRemote(cmd.Context(), g, c, spec, net, asJSON)
			}
			e, err := g.engine()
			if err != nil {
				return err
			}
			defer e.Close()
			spec.Network = e.Config().Net != nil
			if net != nil {
				spec.Network = *net
			}
			snap, err := e.CreateSnapshot(cmd.Context(), spec)
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(g.stdout, viewSnapshot(snap, 0))
			}
			fmt.Fprintf(g.stdout, "%s\n", snap.Tag)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&spec.Tag, "tag", "", "name of the snapshot (required)")
	f.StringVar(&spec.Image, "image", "minimal", "image to boot (built-in: minimal, python)")
	f.IntVar(&spec.MemoryMiB, "mem-size-mib", 256, "guest RAM in MiB")
	f.IntVar(&spec.VCPUs, "vcpus", 1, "guest vCPUs")
	f.StringArrayVar(&spec.Warmup, "warmup", nil, "shell command to run in the parent before the snapshot (repeatable)")
	f.BoolVar(&asJSON, "json", false, "print the snapshot as JSON")
	f.BoolVar(&netFlag, "per-child-netns", false, "give the machine a NIC; every child then gets its own network namespace (default: on as root)")
	cmd.MarkFlagRequired("tag")
	return cmd
}

// snapshotRemote builds the snapshot in the daemon and waits for it.
func snapshotRemote(ctx context.Context, g *globals, c *client.Client, spec sandbox.SnapshotSpec, net *bool, asJSON bool) error {
	op, err := c.CreateSnapshot(ctx, apiv1.CreateSnapshotRequest{
		Tag: spec.Tag, Image: spec.Image, MemoryMiB: spec.MemoryMiB, VCPUs: spec.VCPUs, Warmup: spec.Warmup, Network: net,
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(g.stderr, "building %s in the daemon (operation %s)\n", spec.Tag, op.ID)
	if _, err := c.WaitOperation(ctx, op.ID); err != nil {
		return err
	}
	snap, err := c.GetSnapshot(ctx, spec.Tag)
	if err != nil {
		return err
	}
	if asJSON {
		return writeJSON(g.stdout, apiSnapshotView(*snap))
	}
	fmt.Fprintln(g.stdout, snap.Tag)
	return nil
}
