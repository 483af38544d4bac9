package cli

import (
	"github.com/spf13/cobra"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/forkd/forkd/internal/mcp"
)

func newMCPCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "mcp",
		Short: "Serve the Model Context Protocol on stdin/stdout: sandbox tools for AI agents",
		Long: `Serve forkd's MCP tools (spawn_sandboxes, exec_command, run_code, read_file, …)
and resources to an MCP client over stdio: newline-delimited JSON-RPC on stdin and
stdout, logs on stderr. Configure a client with the command "forkd" and the
argument "mcp" (docs/mcp.md).

The tools act through the daemon serving the data dir when one runs (FORKD_URL
and FORKD_TOKEN name one explicitly), else through the same API served in this
process over the data dir, which then also kills sandboxes at their timeout
while it runs. forkd serve offers the same tools over HTTP at /mcp.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, done, err := g.apiFor(cmd.Context(), true)
			if err != nil {
				return err
			}
			defer done()
			s := mcp.New(c, mcp.Options{Version: Version, Logger: g.logger()})
			return s.Run(cmd.Context(), &sdk.StdioTransport{})
		},
	}
}
