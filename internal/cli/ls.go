package cli

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/internal/state"
)

// sandboxView is the stable JSON shape of a sandbox in `ls --json`.
type sandboxView struct {
	ID       string            `json:"id"`
	Snapshot string            `json:"snapshot"`
	Status   string            `json:"status"`
	PID      int               `json:"pid"`
	Created  time.Time         `json:"created"`
	ReadyMS  int64             `json:"ready_ms"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

func viewSandbox(sb *state.Sandbox) sandboxView {
	return sandboxView{
		ID: sb.ID, Snapshot: sb.Snapshot, Status: sb.Status, PID: sb.Handle.Process.PID,
		Created: sb.Created, ReadyMS: sb.ReadyMS, Metadata: sb.Metadata,
	}
}

func newLsCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List sandboxes",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			e, err := g.engine()
			if err != nil {
				return err
			}
			defer e.Close()
			list, err := e.List(cmd.Context())
			if err != nil {
				return err
			}
			views := make([]sandboxView, 0, len(list))
			for _, sb := range list {
				views = append(views, viewSandbox(sb))
			}
			if asJSON {
				return writeJSON(g.stdout, map[string]any{"sandboxes": views})
			}
			tw := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tSNAPSHOT\tSTATUS\tPID\tAGE\tREADY")
			for _, v := range views {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%d ms\n", v.ID, v.Snapshot, v.Status, v.PID,
					time.Since(v.Created).Round(time.Second), v.ReadyMS)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
