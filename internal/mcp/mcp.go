// Package mcp is forkd's Model Context Protocol face: tools and resources
// an AI agent uses to run sandboxes, on the official Go SDK. Each tool
// checks its arguments and makes one or a few calls of the Go client
// (package client), so it behaves as the REST API does and owns no
// lifecycle of its own; `forkd mcp` serves it over stdio with a client of
// the daemon (or of an in-process server), `forkd serve` at /mcp
// (streamable HTTP) with a client of itself.
package mcp

import (
	"log/slog"
	"net/http"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/forkd/forkd/client"
)

// Options configure a server.
type Options struct {
	Version string       // forkd's version, told to clients
	Logger  *slog.Logger // nil: discard
}

// instructions tell the model what the server is for and how its tools
// go together.
const instructions = `forkd runs isolated microVM sandboxes (Linux guests) forked in moments from warm snapshots.
Typical use: list_snapshots to see what can be forked (create_snapshot builds one from a built-in image such as "minimal" or "python", or an OCI image);
spawn_sandboxes to start sandboxes from a snapshot; exec_command, run_code (Python in a warm interpreter whose state persists between calls),
read_file, write_file, list_files and wait_for_text to work inside one; branch_sandbox or fork_sandbox to save or clone a sandbox's running state;
kill_sandbox when done (set timeout_secs when spawning so forgotten sandboxes go away by themselves).
Sandbox ids look like sb-abcdefgh23. Paths in a sandbox are absolute. Long outputs are truncated, with a marker saying so.`

// New returns an MCP server whose tools act through c.
func New(c *client.Client, o Options) *sdk.Server {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Version == "" {
		o.Version = "dev"
	}
	s := sdk.NewServer(&sdk.Implementation{Name: "forkd", Title: "forkd microVM sandboxes", Version: o.Version},
		&sdk.ServerOptions{Instructions: instructions, Logger: o.Logger})
	t := &tools{c: c}
	t.register(s)
	addResources(s, c)
	return s
}

// Handler serves s over streamable HTTP, stateless: every POST is a
// session of its own (no session ids, no server-held state, no GET
// stream), its answer streamed as server-sent events so that a long
// call's progress notifications reach the caller. It does no
// authentication: mount it behind the daemon's (server.Mount).
func Handler(s *sdk.Server, log *slog.Logger) http.Handler {
	return sdk.NewStreamableHTTPHandler(func(*http.Request) *sdk.Server { return s },
		&sdk.StreamableHTTPOptions{Stateless: true, Logger: log})
}

// tools holds what the tool handlers share.
type tools struct {
	c *client.Client
}

// register adds every tool to s.
func (t *tools) register(s *sdk.Server) {
	t.snapshotTools(s)
	t.sandboxTools(s)
	t.execTools(s)
	t.fileTools(s)
}
