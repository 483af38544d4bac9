package cli

import (
	"fmt"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/spf13/cobra"
)

// forkJSON is fork --json's stable shape.
type forkJSON struct {
	Children []forkChild `json:"children"`
	WallMS   float64     `json:"wall_ms"`
}

type forkChild struct {
	ID      string  `json:"id"`
	ReadyMS float64 `json:"ready_ms"`
}

func newForkCmd(g *globals) *cobra.Command {
	var batch batchFlags
	var asJSON bool
	var from, mode string
	cmd := &cobra.Command{
		Use:   "fork --tag TAG -n N | --from ID -n N",
		Short: "Restore N children of a snapshot, or of a running sandbox's current state",
		Long: `Restore N children of a snapshot (--tag); each is ready when its agent answers.

With --from ID the children start from the running sandbox's current state: it is
branched (--mode, default diff) into a snapshot of their own, removed once the last
of them is gone.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if (from == "") == (batch.req.SnapshotTag == "") {
				return errdefs.InvalidArgument("give --tag TAG (a snapshot) or --from ID (a running sandbox)")
			}
			var fr apiv1.ForkRequest
			var req apiv1.CreateSandboxesRequest
			var err error
			if from != "" {
				if err := sandbox.ValidateID(from); err != nil {
					return err
				}
				fr, err = batch.forkRequest(mode)
			} else {
				req, err = batch.request()
			}
			if err != nil {
				return err
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			var res *apiv1.CreateSandboxesResponse
			label := req.SnapshotTag
			if from != "" {
				res, err = c.ForkFrom(cmd.Context(), from, fr)
				label = from
			} else {
				res, err = c.CreateSandboxes(cmd.Context(), req)
			}
			if err != nil {
				return err
			}
			req.SnapshotTag = label
			if !asJSON {
				return printSpawned(g, req.SnapshotTag, res, false)
			}
			// Only the children that came up; the failures are on stderr
			// and in the exit code.
			out := forkJSON{WallMS: res.WallMS, Children: []forkChild{}}
			for _, sb := range res.Sandboxes {
				out.Children = append(out.Children, forkChild{ID: sb.ID, ReadyMS: float64(sb.ReadyMS)})
			}
			for _, f := range res.Failed {
				fmt.Fprintf(g.stderr, "%s failed: %s\n", f.ID, f.Error.Message)
			}
			if err := writeJSON(g.stdout, out); err != nil {
				return err
			}
			return batchError(res)
		},
	}
	batch.register(cmd, "child", "children")
	cmd.Flags().BoolVar(&asJSON, "json", false, `print {"children":[{"id","ready_ms"}],"wall_ms"}`)
	cmd.Flags().StringVar(&from, "from", "", "fork from this running sandbox's current state")
	cmd.Flags().StringVar(&mode, "mode", "", "with --from: the branch's mode, full, diff (default) or live")
	return cmd
}
