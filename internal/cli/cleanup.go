package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
)

func newCleanupCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "cleanup",
		Short: "Reconcile the data dir with the host after a crash (what forkd serve does at start)",
		Long: `Reconcile the data dir with the host, as forkd serve does when it starts:
re-adopt running sandboxes, mark dead ones and release what they held, abort
children whose restore was cut short, kill VMMs and remove run dirs, network
namespaces, nftables state and cgroups of this data dir that no record owns.
It holds the state store for its whole run; a fork another forkd command has
in flight is aborted. When a daemon serves the data dir, restart it instead.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if c, err := g.remote(cmd.Context()); err != nil {
				return err
			} else if c != nil {
				c.Close()
				return errdefs.FailedPrecondition("forkd serve runs for this data dir and reconciles it at start; restart it instead")
			}
			e, err := g.openEngine(func(c *sandbox.Config) { c.Daemon = true })
			if err != nil {
				return err
			}
			defer e.Close()
			rep, err := e.Reconcile(cmd.Context())
			if rep != nil {
				if asJSON {
					if jerr := writeJSON(g.stdout, rep); jerr != nil {
						return jerr
					}
				} else {
					fmt.Fprintf(g.stdout, "adopted %d, dead %d, aborted %d, orphan VMMs killed %d, orphan run dirs removed %d\n",
						len(rep.Adopted), len(rep.Dead), len(rep.Aborted), len(rep.OrphanProcesses), len(rep.OrphanDirs))
				}
			}
			return err
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print what was found and done as JSON")
	return cmd
}
