package cli

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/snapshot"
)

func newSnapshotInfoCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "snapshot-info TAG [--json]",
		Short: "Show a snapshot's chain (parent, depth, ancestors, dependents) and sizes",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := snapshot.ValidateTag(args[0]); err != nil {
				return err
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			in, err := c.SnapshotInfo(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(g.stdout, in)
			}
			mib := func(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }
			w := g.stdout
			fmt.Fprintf(w, "tag:        %s (%s, %s)\n", in.Tag, in.Kind, in.Status)
			if in.Mode != "" {
				fmt.Fprintf(w, "branch:     %s of %s, depth %d, paused %.1f ms, %s written, %.0f ms in all\n",
					in.Mode, in.Source, in.Depth, in.PauseMS, mib(in.DirtyBytes), in.TotalMS)
			}
			if in.DiskMiB > 0 {
				fmt.Fprintf(w, "disk:       %d MiB, every child's (switched in %.1f ms of the pause)\n", in.DiskMiB, in.DiskSwitchMS)
			}
			fmt.Fprintf(w, "parent:     %s\n", dash(in.Parent))
			fmt.Fprintf(w, "ancestors:  %s\n", dash(strings.Join(in.Ancestors, " <- ")))
			if in.ChainError != "" {
				fmt.Fprintf(w, "chain:      %s\n", in.ChainError)
			}
			fmt.Fprintf(w, "dependents: %s\n", dash(strings.Join(in.Dependents, ", ")))
			fmt.Fprintf(w, "size:       %s logical, %s on disk, %s layer\n", mib(in.LogicalBytes), mib(in.PhysicalBytes), mib(in.LayerBytes))
			fmt.Fprintf(w, "children:   %d\n", in.Refcount)
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func newSnapshotCompactCmd(g *globals) *cobra.Command {
	var from, to string
	cmd := &cobra.Command{
		Use:   "snapshot-compact --from TAG --to NEW",
		Short: "Make a snapshot that stands alone from one at the end of a chain",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			for _, t := range []struct{ flag, v string }{{"--from", from}, {"--to", to}} {
				if t.v == "" {
					return errdefs.InvalidArgument("%s is required", t.flag)
				}
				if err := snapshot.ValidateTag(t.v); err != nil {
					return fmt.Errorf("%s: %w", t.flag, err)
				}
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			snap, err := c.CompactSnapshot(cmd.Context(), from, to)
			if err != nil {
				return err
			}
			fmt.Fprintln(g.stdout, snap.Tag)
			return nil
		},
	}
	cmd.Flags().StringVar(&from, "from", "", "the snapshot to compact")
	cmd.Flags().StringVar(&to, "to", "", "the new snapshot's tag")
	return cmd
}
