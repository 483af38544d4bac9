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
			if c, err := g.remote(cmd.Context()); err != nil {
				return err
			} else if c != nil {
				defer c.Close()
				return killRemote(cmd.Context(), g, c, ids, all, tag)
			}
			e, err := g.engine()
			if err != nil {
				return err
			}
			defer e.Close()
			if all || tag != "" {
				killed, err := e.KillAll(cmd.Context(), tag)
				for _, id := range killed {
					fmt.Fprintln(g.stdout, id)
				}
				return err
			}
			var errs []error
			for _, id := range ids {
				if err := e.Kill(cmd.Context(), id); err != nil {
					errs = append(errs, err)
					continue
				}
				fmt.Fprintln(g.stdout, id)
			}
			return errors.Join(errs...)
		},
	}
	cmd.Flags().BoolVar(&all, "all", false, "kill every sandbox")
	cmd.Flags().StringVar(&tag, "tag", "", "kill every sandbox of this snapshot")
	return cmd
}

// killRemote is kill through the daemon; ids and tag are valid.
func killRemote(ctx context.Context, g *globals, c *client.Client, ids []string, all bool, tag string) error {
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
