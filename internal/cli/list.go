package cli

import (
	"context"
	"fmt"
	"text/tabwriter"

	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/sandbox"
)

// throughDaemon runs remote with a client of the daemon serving this data
// dir when one runs (see remote), else local with the data dir's engine,
// opened for the call.
func (g *globals) throughDaemon(ctx context.Context, remote func(*client.Client) error, local func(*sandbox.Engine) error) error {
	if c, err := g.remote(ctx); err != nil {
		return err
	} else if c != nil {
		defer c.Close()
		return remote(c)
	}
	e, err := g.engine()
	if err != nil {
		return err
	}
	defer e.Close()
	return local(e)
}

// printList prints the rows of a list command: with --json an object
// {key: rows} (rows is [] when empty, never null), else a table of header
// and one line a row, its cells tab-separated.
func printList[V any](g *globals, asJSON bool, key, header string, rows []V, line func(V) string) error {
	if asJSON {
		return writeJSON(g.stdout, map[string]any{key: rows})
	}
	tw := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, header)
	for _, v := range rows {
		fmt.Fprintln(tw, line(v))
	}
	return tw.Flush()
}
