package cli

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
)

func newForkCmd(g *globals) *cobra.Command {
	var spec sandbox.ForkSpec
	var asJSON bool
	var meta []string
	cmd := &cobra.Command{
		Use:   "fork --tag TAG -n N",
		Short: "Restore N children of a snapshot; each is ready when its agent answers",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			md, err := parseKV(meta, "--metadata")
			if err != nil {
				return err
			}
			spec.Metadata = md
			e, err := g.engine()
			if err != nil {
				return err
			}
			defer e.Close()
			res, err := e.Fork(cmd.Context(), spec)
			if res == nil && err != nil {
				return err
			}
			if asJSON {
				if jerr := writeJSON(g.stdout, res); jerr != nil {
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
				fmt.Fprintf(g.stderr, "%d children of %s ready in %.0f ms\n", len(res.Children), spec.Tag, res.WallMS)
			}
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&spec.Tag, "tag", "", "snapshot to fork (required)")
	f.IntVarP(&spec.N, "n", "n", 1, "number of children")
	f.BoolVar(&spec.KeepPartial, "keep-partial", false, "keep the children that came up when others failed")
	f.StringArrayVar(&meta, "metadata", nil, "KEY=VALUE recorded with each child (repeatable)")
	f.BoolVar(&asJSON, "json", false, `print {"children":[{"id","ready_ms"}],"wall_ms"}`)
	cmd.MarkFlagRequired("tag")
	return cmd
}

// parseKV parses KEY=VALUE flags.
func parseKV(kvs []string, flag string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, errdefs.InvalidArgument("%s %q: want KEY=VALUE", flag, kv)
		}
		out[k] = v
	}
	return out, nil
}
