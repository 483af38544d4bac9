package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
)

func newNetCmd(g *globals) *cobra.Command {
	var iso isoFlags
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "net ID --egress allow|deny|allowlist [--allow CIDR[:PROTO[:PORTS]]]...",
		Short: "Change a running sandbox's egress policy",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if iso.egress == "" {
				return errdefs.InvalidArgument("--egress is required")
			}
			var req apiv1.CreateSandboxesRequest
			if err := iso.apply(&req); err != nil {
				return err
			}
			if _, err := request.NetworkPolicy(req.Network); err != nil {
				return err
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			sb, err := c.SetNetwork(cmd.Context(), args[0], *req.Network)
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(g.stdout, viewSandbox(*sb))
			}
			fmt.Fprintf(g.stdout, "%s\tegress %s\n", sb.ID, sb.Network.Egress)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&iso.egress, "egress", "", "allow, deny or allowlist")
	f.StringArrayVar(&iso.allow, "allow", nil, "egress destination CIDR[:PROTO[:PORTS]] (repeatable)")
	f.BoolVar(&asJSON, "json", false, "print the sandbox as JSON")
	return cmd
}

func newPublishCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "publish ID GUEST_PORT",
		Short: "Make a guest TCP port reachable on a host port; prints the host port",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			port, err := portArg(args[1])
			if err != nil {
				return err
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			p, err := c.Publish(cmd.Context(), args[0], port)
			if err != nil {
				return err
			}
			fmt.Fprintln(g.stdout, p.HostPort)
			return nil
		},
	}
}
