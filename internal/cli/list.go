package cli

import (
	"fmt"
	"text/tabwriter"
)

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
