package cli

import (
	"fmt"

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
	cmd := &cobra.Command{
		Use:   "fork --tag TAG -n N",
		Short: "Restore N children of a snapshot; each is ready when its agent answers",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			req, err := batch.request()
			if err != nil {
				return err
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			res, err := c.CreateSandboxes(cmd.Context(), req)
			if err != nil {
				return err
			}
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
	return cmd
}
