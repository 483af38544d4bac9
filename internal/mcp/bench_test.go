package mcp

import (
	"context"
	"io"
	"net/http/httptest"
	"testing"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
)

// BenchmarkExecCommand measures what the MCP layer adds to the REST call
// exec_command wraps, without a guest (the fake daemon answers at once):
// client.ExecStream alone, then exec_command through the SDK's client
// in memory and over streamable HTTP (the Handler /mcp mounts).
//
//	go test -run=^$ -bench=ExecCommand ./internal/mcp
func BenchmarkExecCommand(b *testing.B) {
	f, inMem := newFake(b)
	ctx := context.Background()
	args := map[string]any{"id": fakeID, "args": []string{"true"}}
	b.Run("rest-stream", func(b *testing.B) {
		c := restClientOf(b, f)
		for b.Loop() {
			if _, err := c.ExecStream(ctx, fakeID, apiv1.ExecRequest{Args: []string{"true"}}, nil, io.Discard, io.Discard); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("mcp-memory", func(b *testing.B) {
		for b.Loop() {
			if r, err := inMem.CallTool(ctx, &sdk.CallToolParams{Name: "exec_command", Arguments: args}); err != nil || r.IsError {
				b.Fatal(err, r)
			}
		}
	})
	b.Run("mcp-http", func(b *testing.B) {
		hs := httptest.NewServer(Handler(New(restClientOf(b, f), Options{}), nil))
		defer hs.Close()
		cs, err := sdk.NewClient(&sdk.Implementation{Name: "bench", Version: "1"}, nil).Connect(ctx,
			&sdk.StreamableClientTransport{Endpoint: hs.URL, DisableStandaloneSSE: true}, nil)
		if err != nil {
			b.Fatal(err)
		}
		defer cs.Close()
		for b.Loop() {
			if r, err := cs.CallTool(ctx, &sdk.CallToolParams{Name: "exec_command", Arguments: args}); err != nil || r.IsError {
				b.Fatal(err, r)
			}
		}
	})
}

func restClientOf(b *testing.B, f *fakeDaemon) *client.Client {
	c, err := client.New(f.url, "")
	if err != nil {
		b.Fatal(err)
	}
	return c
}
