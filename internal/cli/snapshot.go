package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/internal/sandbox"
)

func newSnapshotCmd(g *globals) *cobra.Command {
	var spec sandbox.SnapshotSpec
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "snapshot --tag TAG [--image minimal] [--warmup CMD]...",
		Short: "Boot a parent VM from an image, warm it, and save it as a snapshot",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			e, err := g.engine()
			if err != nil {
				return err
			}
			defer e.Close()
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
	cmd.MarkFlagRequired("tag")
	return cmd
}
