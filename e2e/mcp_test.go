package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/testutil"
	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
)

// mcpReport is the last line e2e/mcp-client/client.mjs prints.
type mcpReport struct {
	OK        bool                `json:"ok"`
	Transport string              `json:"transport"`
	Steps     []string            `json:"steps"`
	Tools     int                 `json:"tools"`
	Progress  map[string][]string `json:"progress"`
	BenchMS   []float64           `json:"bench_ms"`
	Error     string              `json:"error"`
}

// benchCalls is how many exec_command `true` calls each transport times,
// after 3 of warm-up.
const benchCalls = 30

// TestMCP drives forkd's MCP server with a real third-party client, the
// official TypeScript SDK (pinned by e2e/mcp-client/package-lock.json):
// over stdio (`forkd mcp` serving the data dir in its own process, then
// through the daemon) and over streamable HTTP (`forkd serve`'s /mcp with
// the bearer token), on real VMs: every tool's schema compiles, snapshots
// built with progress, spawn → exec → files → wait → run_code → kill,
// errors as isError results. It also runs examples/mcp-session, and times
// an MCP exec_command against the REST call it wraps.
func TestMCP(t *testing.T) {
	c := newCLI(t)
	testutil.RequireRoot(t) // the python image is built with debootstrap
	testutil.RequireCommand(t, "node", "npm")
	// A daemon and data dir of its own, mostly waiting on guests and
	// other processes: it runs beside the other SDK, MCP and example
	// tests (go test -parallel, GOMAXPROCS at a time).
	t.Parallel()
	dir := copyProject(t, "mcp-client")
	npmCI(context.Background(), t, dir, "--loglevel=error")

	// stdio, no daemon: forkd mcp serves the data dir itself, and builds
	// the snapshots.
	rep := runMCPClient(t, c, dir, "client.mjs", "MCP_TRANSPORT=stdio", "MCP_CREATE=1")
	if len(rep.Progress["create_snapshot"]) == 0 || len(rep.Progress["spawn_sandboxes"]) < 2 {
		t.Errorf("progress reported: %v", rep.Progress)
	}

	// streamable HTTP on forkd serve, with the token; the same daemon
	// over stdio; and the REST call exec_command wraps, for comparison.
	d := startServe(t, c)
	httpRep := runMCPClient(t, c, dir, "client.mjs", "MCP_TRANSPORT=http", "MCP_URL="+d.url+"/mcp", "FORKD_TOKEN="+d.token,
		fmt.Sprint("MCP_BENCH=", benchCalls))
	stdioRep := runMCPClient(t, c, dir, "client.mjs", "MCP_TRANSPORT=stdio", "FORKD_URL=unix://"+d.sock,
		fmt.Sprint("MCP_BENCH=", benchCalls))
	if len(httpRep.Progress["spawn_sandboxes"]) < 2 {
		t.Errorf("progress over HTTP: %v", httpRep.Progress)
	}
	rounds := benchExec(t, c, d)
	for _, r := range []struct {
		name string
		ms   []float64
	}{
		{"REST client.Exec, TCP + token", rounds["rest-exec"]},
		{"REST client.ExecStream, TCP + token (what exec_command calls)", rounds["rest-stream"]},
		{"MCP exec_command, Go SDK client, stdio (forkd mcp → socket)", rounds["mcp-stdio"]},
		{"MCP exec_command, Go SDK client, HTTP /mcp + token", rounds["mcp-http"]},
		{"MCP exec_command, TS SDK client, stdio (forkd mcp → socket)", stdioRep.BenchMS},
		{"MCP exec_command, TS SDK client, HTTP /mcp + token", httpRep.BenchMS},
	} {
		p50, p90 := percentiles(r.ms)
		t.Logf("%-64s p50 %6.1f ms  p90 %6.1f ms  (%d calls)", r.name, p50, p90, len(r.ms))
	}
	for _, k := range []string{"mcp-stdio", "mcp-http"} {
		var diff []float64
		for i, ms := range rounds[k] {
			diff = append(diff, ms-rounds["rest-stream"][i])
		}
		p50, p90 := percentiles(diff)
		t.Logf("%-64s p50 %+6.1f ms  p90 %+6.1f ms", k+" minus rest-stream, same round", p50, p90)
	}

	// Without the token, /mcp is refused like every route.
	resp, err := httpPost(d.url+"/mcp", "", `{"jsonrpc":"2.0","id":1,"method":"tools/list"}`)
	if err != nil || resp != 401 {
		t.Errorf("POST /mcp without token: %d %v", resp, err)
	}

	// The example runs with one command against the daemon.
	ex := copyProject(t, filepath.Join("..", "examples", "mcp-session"))
	npmCI(context.Background(), t, ex, "--loglevel=error")
	cmd := exec.Command("sh", "run")
	cmd.Dir = ex
	cmd.Env = append(slices.Clone(c.env), "FORKD_BIN="+forkdBin, "MCP_SNAPSHOT=mini")
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil || !strings.Contains(out.String(), "Linux") || !strings.Contains(out.String(), "killed") {
		t.Errorf("examples/mcp-session: %v\n%s\n%s", err, out.String(), errb.String())
	}
}

// copyProject copies the files of the npm project in e2e/<rel>
// (package.json, its lock, scripts, not node_modules) to a temporary
// directory, for an npm ci there, and returns it.
func copyProject(t *testing.T, rel string) string {
	t.Helper()
	src, err := filepath.Abs(rel)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	ents, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.IsDir() {
			continue // node_modules of a developer's own install
		}
		b, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		testutil.WriteFile(t, filepath.Join(dir, e.Name()), b, 0o644)
	}
	return dir
}

// runMCPClient runs a node script of the MCP client with the CLI's
// environment and extra, and returns its report, failing the test unless
// it says ok.
func runMCPClient(t *testing.T, c *cli, dir, script string, extra ...string) mcpReport {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	env := slices.Concat(c.env, []string{"FORKD_BIN=" + forkdBin, "MCP_MIN_TAG=mini", "MCP_PY_TAG=py"}, extra)
	out, errb := runNode(ctx, t, dir, env, "node", script)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var rep mcpReport
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &rep); err != nil || !rep.OK {
		t.Fatalf("%s %v: %v\nreport: %s\nerror: %s\nstderr:\n%s", script, extra, err, lines[len(lines)-1], rep.Error, errb)
	}
	if rep.Tools != 16 || len(rep.Steps) < 10 {
		t.Errorf("%s %v: %d tools, steps %v", script, extra, rep.Tools, rep.Steps)
	}
	return rep
}

// benchExec times exec of `true` in one sandbox of snapshot mini through
// the daemon, four ways in turn in each round, so that they share the
// machine's load: the REST calls exec_command wraps (client.Exec and
// client.ExecStream, TCP with the token) and exec_command with the Go
// SDK's client over stdio (forkd mcp, through the daemon's socket) and
// over HTTP (/mcp with the token). The first 3 rounds warm up.
func benchExec(t *testing.T, c *cli, d *daemonProc) map[string][]float64 {
	t.Helper()
	ctx := context.Background()
	api := d.client(d.token)
	res, err := api.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: "mini", TimeoutSecs: 600})
	if err != nil {
		t.Fatal(err)
	}
	id := res.Sandboxes[0].ID
	defer api.DeleteSandbox(ctx, id)

	sess := func(tr sdk.Transport) *sdk.ClientSession {
		cs, err := sdk.NewClient(&sdk.Implementation{Name: "bench", Version: "1"}, nil).Connect(ctx, tr, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cs.Close() })
		return cs
	}
	cmd := exec.Command(forkdBin, "mcp")
	cmd.Env = append(slices.Clone(c.env), "FORKD_URL=unix://"+d.sock)
	stdio := sess(&sdk.CommandTransport{Command: cmd})
	web := sess(&sdk.StreamableClientTransport{Endpoint: d.url + "/mcp", DisableStandaloneSSE: true,
		HTTPClient: &http.Client{Transport: bearer{d.token}}})
	mcpCall := func(cs *sdk.ClientSession) error {
		r, err := cs.CallTool(ctx, &sdk.CallToolParams{Name: "exec_command", Arguments: map[string]any{"id": id, "args": []string{"true"}}})
		if err == nil && r.IsError {
			err = fmt.Errorf("exec_command: %v", r.Content)
		}
		return err
	}
	req := apiv1.ExecRequest{Args: []string{"true"}, TimeoutSecs: 60}
	ways := []struct {
		name string
		do   func() error
	}{
		{"rest-exec", func() error { _, err := api.Exec(ctx, id, req); return err }},
		{"rest-stream", func() error { _, err := api.ExecStream(ctx, id, req, nil, io.Discard, io.Discard); return err }},
		{"mcp-stdio", func() error { return mcpCall(stdio) }},
		{"mcp-http", func() error { return mcpCall(web) }},
	}
	out := map[string][]float64{}
	for i := range benchCalls + 3 {
		for _, w := range ways {
			start := time.Now()
			if err := w.do(); err != nil {
				t.Fatalf("%s: %v", w.name, err)
			}
			if i >= 3 {
				out[w.name] = append(out[w.name], float64(time.Since(start).Microseconds())/1000)
			}
		}
	}
	return out
}

// bearer adds the daemon's token to requests.
type bearer struct{ token string }

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return http.DefaultTransport.RoundTrip(r)
}

func percentiles(ms []float64) (p50, p90 float64) {
	if len(ms) == 0 {
		return 0, 0
	}
	s := slices.Sorted(slices.Values(ms))
	return s[len(s)/2], s[min(len(s)-1, len(s)*9/10)]
}

// httpPost posts a JSON body with an optional bearer token, as an MCP
// client would, and returns the status.
func httpPost(url, token, body string) (int, error) {
	req, err := http.NewRequest("POST", url, strings.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}
