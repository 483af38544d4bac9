package cli

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
)

func newSpawnCmd(g *globals) *cobra.Command {
	var batch batchFlags
	var asJSON bool
	var ttl time.Duration
	cmd := &cobra.Command{
		Use:   "spawn --tag TAG [-n N] [--timeout 10m]",
		Short: "Fork sandboxes through the daemon (forkd serve), with a time to live",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if ttl%time.Second != 0 {
				return errdefs.InvalidArgument("--timeout %v: want whole seconds", ttl)
			}
			batch.req.TimeoutSecs = int(ttl / time.Second)
			req, err := batch.request()
			if err != nil {
				return err
			}
			c, err := g.needRemote(cmd.Context(), "spawn")
			if err != nil {
				return err
			}
			defer c.Close()
			res, err := c.CreateSandboxes(cmd.Context(), req)
			if err != nil {
				return err
			}
			return printSpawned(g, req.SnapshotTag, res, asJSON)
		},
	}
	batch.register(cmd, "sandbox", "sandboxes")
	timeoutFlag(cmd.Flags(), &ttl, "timeout", "kill each sandbox this long after it is ready (0: never)")
	secondsAlias(cmd.Flags(), &ttl, "timeout-secs")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the daemon's answer as JSON")
	return cmd
}

// printSpawned prints a create answer: ids and ready times on stdout,
// failures and the summary on stderr. It fails when any child failed.
func printSpawned(g *globals, tag string, res *apiv1.CreateSandboxesResponse, asJSON bool) error {
	if asJSON {
		if err := writeJSON(g.stdout, res); err != nil {
			return err
		}
	} else {
		for _, sb := range res.Sandboxes {
			fmt.Fprintf(g.stdout, "%s\t%d ms\n", sb.ID, sb.ReadyMS)
		}
		for _, f := range res.Failed {
			fmt.Fprintf(g.stderr, "%s failed: %s\n", f.ID, f.Error.Message)
		}
		fmt.Fprintf(g.stderr, "%d children of %s ready in %.0f ms\n", len(res.Sandboxes), tag, res.WallMS)
	}
	return batchError(res)
}

// batchError is the error of a batch in which some children failed.
func batchError(res *apiv1.CreateSandboxesResponse) error {
	if len(res.Failed) == 0 {
		return nil
	}
	f := res.Failed[0]
	return fmt.Errorf("%d of %d children failed: %w", len(res.Failed), len(res.Failed)+len(res.Sandboxes),
		errdefs.FromCode(f.Error.Code, f.Error.Message))
}
