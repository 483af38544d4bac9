package cli

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
	"github.com/forkd/forkd/internal/sandbox"
)

func newWorkspaceCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "workspace create|suspend|resume|ls|rm",
		Short: "Named, long-lived sandboxes that survive restarts and suspend to a snapshot",
		Long: `A workspace is a named sandbox that lives until removed. suspend branches its
sandbox into a state snapshot and stops it (no CPU, no RAM held); resume forks a
new sandbox (a new id, the same name) from that state. Workspaces survive daemon
restarts. rm removes the workspace's sandbox and state snapshots, never the
snapshot it was created from.`,
	}
	var batch batchFlags
	var asJSON bool
	create := &cobra.Command{
		Use:   "create NAME --tag TAG",
		Short: "Create a workspace from a snapshot",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req, err := batch.request()
			if err != nil {
				return err
			}
			wreq := apiv1.CreateWorkspaceRequest{Name: args[0], CreateSandboxesRequest: req}
			if _, _, err := request.Workspace(&wreq, sandbox.DefaultMaxChildren); err != nil {
				return err
			}
			return workspaceCall(cmd.Context(), g, asJSON, func(c *client.Client) (*apiv1.Workspace, error) {
				return c.CreateWorkspace(cmd.Context(), wreq)
			})
		},
	}
	batch.register(create, "sandbox", "sandboxes")
	create.Flags().BoolVar(&asJSON, "json", false, "print the workspace as JSON")
	call := func(use, short string, do func(*client.Client, context.Context, string) (*apiv1.Workspace, error)) *cobra.Command {
		var asJSON bool
		c := &cobra.Command{
			Use: use + " NAME", Short: short, Args: cobra.ExactArgs(1),
			RunE: func(cmd *cobra.Command, args []string) error {
				if err := sandbox.ValidateWorkspaceName(args[0]); err != nil {
					return err
				}
				return workspaceCall(cmd.Context(), g, asJSON, func(c *client.Client) (*apiv1.Workspace, error) {
					return do(c, cmd.Context(), args[0])
				})
			},
		}
		c.Flags().BoolVar(&asJSON, "json", false, "print the workspace as JSON")
		return c
	}
	var lsJSON bool
	ls := &cobra.Command{
		Use: "ls", Short: "List workspaces", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			list, err := c.ListWorkspaces(cmd.Context())
			if err != nil {
				return err
			}
			if list == nil {
				list = []apiv1.Workspace{}
			}
			return printList(g, lsJSON, "workspaces", "NAME\tSTATUS\tSANDBOX\tSNAPSHOT\tSTATES\tUPDATED", list, func(w apiv1.Workspace) string {
				return fmt.Sprintf("%s\t%s\t%s\t%s\t%d\t%s", w.Name, w.Status, dash(w.Sandbox), w.Snapshot, len(w.States),
					w.Updated.Local().Format(time.DateTime))
			})
		},
	}
	ls.Flags().BoolVar(&lsJSON, "json", false, "print JSON")
	rm := &cobra.Command{
		Use: "rm NAME...", Short: "Remove workspaces: their sandbox and state snapshots", Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, names []string) error {
			for _, n := range names {
				if err := sandbox.ValidateWorkspaceName(n); err != nil {
					return err
				}
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			var errs []string
			for _, n := range names {
				if err := c.DeleteWorkspace(cmd.Context(), n); err != nil {
					errs = append(errs, n+": "+err.Error())
					continue
				}
				fmt.Fprintln(g.stdout, n)
			}
			if len(errs) > 0 {
				return errdefs.FailedPrecondition("%s", strings.Join(errs, "; "))
			}
			return nil
		},
	}
	cmd.AddCommand(create,
		call("suspend", "Save a workspace's state and stop its sandbox", (*client.Client).SuspendWorkspace),
		call("resume", "Start a workspace's sandbox again from its latest state", (*client.Client).ResumeWorkspace),
		ls, rm)
	return cmd
}

// workspaceCall runs do through the API and prints the workspace.
func workspaceCall(ctx context.Context, g *globals, asJSON bool, do func(*client.Client) (*apiv1.Workspace, error)) error {
	c, done, err := g.api(ctx)
	if err != nil {
		return err
	}
	defer done()
	w, err := do(c)
	if err != nil {
		return err
	}
	if asJSON {
		return writeJSON(g.stdout, w)
	}
	fmt.Fprintf(g.stdout, "%s\t%s\t%s\n", w.Name, w.Status, dash(w.Sandbox))
	return nil
}
