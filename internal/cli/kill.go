package cli

import (
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/internal/errdefs"
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
