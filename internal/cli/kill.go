package cli

import (
	"context"
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
)

func newKillCmd(g *globals) *cobra.Command {
	var all bool
	var tag string
	cmd := &cobra.Command{
		Use:   "kill ID... | --all | --tag TAG",
		Short: "Stop sandboxes and remove everything they used",
		RunE: func(cmd *cobra.Command, ids []string) error {
			if (len(ids) > 0) == (all || tag != "") || (all && tag != "") {
				return errdefs.InvalidArgument("give sandbox ids, or --all, or --tag TAG")
			}
			if tag != "" {
				if err := snapshot.ValidateTag(tag); err != nil {
					return err
				}
			}
			for _, id := range ids {
				if err := sandbox.ValidateID(id); err != nil {
					return err
				}
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			return kill(cmd.Context(), g, c, ids, all, tag)
		},
	}
	cmd.Flags().BoolVar(&all, "all", false, "kill every sandbox")
	cmd.Flags().StringVar(&tag, "tag", "", "kill every sandbox of this snapshot")
	return cmd
}

// kill kills the sandboxes ids, or all of them (of snapshot tag when set);
// ids and tag are valid.
func kill(ctx context.Context, g *globals, c *client.Client, ids []string, all bool, tag string) error {
	bulk := all || tag != ""
	if bulk {
		list, err := c.ListSandboxes(ctx, client.ListOptions{Snapshot: tag})
		if err != nil {
			return err
		}
		ids = ids[:0]
		for _, sb := range list {
			// As the engine's KillAll: a parent being built belongs to
			// its build, a child still starting to its fork.
			if sb.Status == state.StatusBuilding || sb.Status == state.StatusStarting || sb.Status == state.StatusParked {
				continue
			}
			ids = append(ids, sb.ID)
		}
	}
	var errs []error
	for _, id := range ids {
		err := c.DeleteSandbox(ctx, id)
		if bulk && errdefs.IsNotFound(err) {
			continue // gone meanwhile
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		fmt.Fprintln(g.stdout, id)
	}
	return errors.Join(errs...)
}
