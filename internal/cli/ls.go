package cli

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
)

// sandboxView is the stable JSON shape of a sandbox in `ls --json`.
type sandboxView struct {
	ID       string                `json:"id"`
	Snapshot string                `json:"snapshot"`
	Status   string                `json:"status"`
	PID      int                   `json:"pid"`
	Created  time.Time             `json:"created"`
	ReadyMS  int64                 `json:"ready_ms"`
	Metadata map[string]string     `json:"metadata,omitempty"`
	Network  *apiv1.SandboxNetwork `json:"network,omitempty"`
	apiv1.Limits
	DiskMiB int `json:"disk_mib,omitempty"`
}

// viewSandbox is the ls form of a sandbox as the API shows it.
func viewSandbox(sb apiv1.Sandbox) sandboxView {
	return sandboxView{
		ID: sb.ID, Snapshot: sb.SnapshotTag, Status: sb.Status, PID: sb.PID,
		Created: sb.Created, ReadyMS: sb.ReadyMS, Metadata: sb.Metadata, Network: sb.Network,
		Limits: sb.Limits, DiskMiB: sb.DiskMiB,
	}
}

// address is the host-reachable address and published ports, for tables.
func (v sandboxView) address() string {
	if v.Network == nil {
		return "-"
	}
	out := v.Network.Address
	for _, p := range v.Network.Ports {
		out += fmt.Sprintf(" %d->%d", p.HostPort, p.GuestPort)
	}
	return out
}

func newLsCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List sandboxes",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			views, err := g.listSandboxes(cmd.Context())
			if err != nil {
				return err
			}
			return printList(g, asJSON, "sandboxes", "ID\tSNAPSHOT\tSTATUS\tPID\tAGE\tREADY\tADDRESS", views, func(v sandboxView) string {
				return fmt.Sprintf("%s\t%s\t%s\t%d\t%s\t%d ms\t%s", v.ID, v.Snapshot, v.Status, v.PID,
					time.Since(v.Created).Round(time.Second), v.ReadyMS, v.address())
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// listSandboxes lists the sandboxes in ls's shape.
func (g *globals) listSandboxes(ctx context.Context) ([]sandboxView, error) {
	c, done, err := g.api(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	list, err := c.ListSandboxes(ctx, client.ListOptions{})
	views := []sandboxView{}
	for _, sb := range list {
		views = append(views, viewSandbox(sb))
	}
	return views, err
}
