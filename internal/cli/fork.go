package cli

import (
	"context"
	"fmt"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/request"
	"github.com/forkd/forkd/internal/sandbox"
)

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
			if c, err := g.remote(cmd.Context()); err != nil {
				return err
			} else if c != nil {
				defer c.Close()
				return forkRemote(cmd.Context(), g, c, req, asJSON)
			}
			e, err := g.engine()
			if err != nil {
				return err
			}
			defer e.Close()
			spec, err := request.ForkSpec(&req, e.Config().MaxChildren)
			if err != nil {
				return err
			}
			bar := newCounter(g.stderr, "forking "+spec.Tag, spec.N)
			spec.OnDone = func(c sandbox.Child) { bar.add(c.Err == nil) }
			res, err := e.Fork(cmd.Context(), spec)
			bar.finish()
			if res == nil && err != nil {
				return err
			}
			ready := 0
			for _, c := range res.Children {
				if c.Err == nil {
					ready++
				}
			}
			if asJSON {
				// Only the children that came up, as through the daemon;
				// the failures are on stderr and in the exit code.
				out := *res
				out.Children = []sandbox.Child{}
				for _, c := range res.Children {
					if c.Err == nil {
						out.Children = append(out.Children, c)
					} else {
						fmt.Fprintf(g.stderr, "%s failed: %v\n", c.ID, c.Err)
					}
				}
				if jerr := writeJSON(g.stdout, &out); jerr != nil {
					return jerr
				}
			} else {
				for _, c := range res.Children {
					if c.Err != nil {
						fmt.Fprintf(g.stderr, "%s failed: %v\n", c.ID, c.Err)
						continue
					}
					fmt.Fprintf(g.stdout, "%s\t%.0f ms\n", c.ID, c.ReadyMS)
				}
				fmt.Fprintf(g.stderr, "%d of %d children of %s ready in %.0f ms\n", ready, len(res.Children), req.SnapshotTag, res.WallMS)
			}
			return err
		},
	}
	batch.register(cmd, "child", "children")
	cmd.Flags().BoolVar(&asJSON, "json", false, `print {"children":[{"id","ready_ms"}],"wall_ms"}`)
	return cmd
}

// forkRemote is fork through the daemon, with fork's own output.
func forkRemote(ctx context.Context, g *globals, c *client.Client, req apiv1.CreateSandboxesRequest, asJSON bool) error {
	res, err := c.CreateSandboxes(ctx, req)
	if err != nil {
		return err
	}
	if !asJSON {
		return printSpawned(g, req.SnapshotTag, res, false)
	}
	out := sandbox.ForkResult{WallMS: res.WallMS, Children: []sandbox.Child{}}
	for _, sb := range res.Sandboxes {
		out.Children = append(out.Children, sandbox.Child{ID: sb.ID, ReadyMS: float64(sb.ReadyMS)})
	}
	if err := writeJSON(g.stdout, out); err != nil {
		return err
	}
	return batchError(res)
}
