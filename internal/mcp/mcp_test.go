package mcp

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/forkd/forkd/client"
	"github.com/google/jsonschema-go/jsonschema"
	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
)

var toolNames = []string{
	"branch_sandbox", "create_snapshot", "exec_command", "fork_sandbox", "get_sandbox", "kill_sandbox", "list_files",
	"list_sandboxes", "list_snapshots", "publish_port", "read_file", "run_code", "set_egress", "spawn_sandboxes",
	"wait_for_text", "write_file",
}

// schemaOf turns a schema as a client sees it (decoded JSON) back into a
// resolved schema, failing the test if it is not valid JSON Schema.
func schemaOf(t *testing.T, what string, v any) *jsonschema.Resolved {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var s jsonschema.Schema
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatalf("%s: not a JSON Schema: %v\n%s", what, err, b)
	}
	r, err := s.Resolve(nil)
	if err != nil {
		t.Fatalf("%s: invalid JSON Schema: %v\n%s", what, err, b)
	}
	return r
}

func listTools(t *testing.T, cs *sdk.ClientSession) map[string]*sdk.Tool {
	t.Helper()
	res, err := cs.ListTools(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*sdk.Tool{}
	for _, tl := range res.Tools {
		out[tl.Name] = tl
	}
	return out
}

func TestToolsAndSchemas(t *testing.T) {
	_, cs := newFake(t)
	tools := listTools(t, cs)
	var names []string
	for n := range tools {
		names = append(names, n)
	}
	slices.Sort(names)
	if !slices.Equal(names, toolNames) {
		t.Fatalf("tools = %v, want %v", names, toolNames)
	}
	for _, tl := range tools {
		if len(tl.Description) < 60 || tl.Title == "" || tl.Annotations == nil {
			t.Errorf("%s: description %q, title %q: say what it does, for the model", tl.Name, tl.Description, tl.Title)
		}
		in := schemaOf(t, tl.Name+" input", tl.InputSchema).Schema()
		if in.Type != "object" || in.AdditionalProperties == nil || in.AdditionalProperties.Not == nil {
			t.Errorf("%s: input schema is not a closed object: %+v", tl.Name, in)
		}
		for name, p := range in.Properties {
			if p.Description == "" {
				t.Errorf("%s: argument %s has no description", tl.Name, name)
			}
			if p.Type == "" || len(p.Types) > 0 {
				t.Errorf("%s: argument %s: type %q %v, want one type", tl.Name, name, p.Type, p.Types)
			}
		}
		if strings.Contains(tl.Name, "sandbox") && tl.Name != "spawn_sandboxes" && tl.Name != "list_sandboxes" {
			if id := in.Properties["id"]; id == nil || id.Pattern == "" || !slices.Contains(in.Required, "id") {
				t.Errorf("%s: no required, patterned id", tl.Name)
			}
		}
		schemaOf(t, tl.Name+" output", tl.OutputSchema)
	}
}

func TestArgumentsAreChecked(t *testing.T) {
	f, cs := newFake(t)
	for _, tc := range []struct {
		tool string
		args map[string]any
		want string
	}{
		{"get_sandbox", map[string]any{}, "missing argument id"},
		{"get_sandbox", map[string]any{"id": "../etc"}, "sandbox id"},
		{"get_sandbox", map[string]any{"id": 7}, "argument id: want string, got number"},
		{"get_sandbox", map[string]any{"id": fakeID, "force": true}, `unknown argument "force": this tool takes id`},
		{"list_snapshots", map[string]any{"x": 1}, "takes none"},
		{"spawn_sandboxes", map[string]any{"snapshot_tag": "../x"}, "snapshot_tag"},
		{"spawn_sandboxes", map[string]any{"snapshot_tag": "base", "n": 1000}, "n = 1000: want 1 to 100"},
		{"spawn_sandboxes", map[string]any{"snapshot_tag": "base", "n": -1}, "n = -1"},
		{"spawn_sandboxes", map[string]any{"snapshot_tag": "base", "egress": "sometimes"}, "egress \"sometimes\": want one of allow, deny, allowlist"},
		{"spawn_sandboxes", map[string]any{"snapshot_tag": "base", "egress": "deny", "allow": []any{map[string]any{"cidr": "1.1.1.1/32"}}}, "deny takes no allow rules"},
		{"spawn_sandboxes", map[string]any{"snapshot_tag": "base", "publish": []any{70000}}, "publish[0] = 70000"},
		{"spawn_sandboxes", map[string]any{"snapshot_tag": "base", "timeout_secs": -5}, "timeout_secs = -5"},
		{"exec_command", map[string]any{"id": fakeID}, "exactly one of command"},
		{"exec_command", map[string]any{"id": fakeID, "command": "ls", "args": []string{"ls"}}, "exactly one of command"},
		{"exec_command", map[string]any{"id": fakeID, "args": []string{""}}, "args[0] is empty"},
		{"exec_command", map[string]any{"id": fakeID, "command": "ls", "cwd": "tmp"}, "cwd \"tmp\" is relative"},
		{"exec_command", map[string]any{"id": fakeID, "command": "ls", "timeout_secs": 99999}, "timeout_secs = 99999"},
		{"exec_command", map[string]any{"id": fakeID, "command": "ls", "env": map[string]string{"A=B": "c"}}, "env name"},
		{"run_code", map[string]any{"id": fakeID, "code": "  "}, "code is empty"},
		{"read_file", map[string]any{"id": fakeID, "path": "etc/passwd"}, "is relative"},
		{"read_file", map[string]any{"id": fakeID, "path": "/a", "max_bytes": 1 << 30}, "max_bytes"},
		{"read_file", map[string]any{"id": fakeID, "path": "/a", "encoding": "utf16"}, "encoding"},
		{"read_file", map[string]any{"id": fakeID, "path": "/a\x00b"}, "NUL"},
		{"write_file", map[string]any{"id": fakeID, "path": "/a", "content": "x", "mode": "rwx"}, "octal"},
		{"write_file", map[string]any{"id": fakeID, "path": "/a", "content": "!!", "encoding": "base64"}, "not valid base64"},
		{"write_file", map[string]any{"id": fakeID, "path": "/tmp/", "content": "x"}, "ends with /"},
		{"list_files", map[string]any{"id": fakeID, "path": "/", "depth": 9}, "depth = 9"},
		{"wait_for_text", map[string]any{"id": fakeID, "path": "/log", "text": ""}, "text is 0 bytes"},
		{"wait_for_text", map[string]any{"id": fakeID, "path": "/log", "text": "x", "interval_ms": 1}, "interval_ms = 1"},
		{"publish_port", map[string]any{"id": fakeID, "guest_port": 0}, "guest_port = 0"},
		{"set_egress", map[string]any{"id": fakeID, "egress": "allowlist", "allow": []any{map[string]any{"cidr": ""}}}, "allow[0].cidr is empty"},
		{"set_egress", map[string]any{"id": fakeID, "egress": "allow", "allow": []any{map[string]any{"cidr": "1.1.1.1/32", "proto": "sctp"}}}, "allow[0].proto"},
		{"set_egress", map[string]any{"id": fakeID, "egress": "allowlist", "allow": []any{map[string]any{"cidr": "1.1.1.1"}}}, "want CIDR form"},
		{"set_egress", map[string]any{"id": fakeID, "egress": "allowlist", "allow": []any{map[string]any{"cidr": "1.1.1.1/32", "ports": []string{"9-1"}}}}, "allow[0].ports"},
		{"spawn_sandboxes", map[string]any{"snapshot_tag": "base", "memory_limit_mib": 10}, "memory_limit_mib = 10"},
		{"spawn_sandboxes", map[string]any{"snapshot_tag": "base", "cpus": 5000}, "cpus = 5000"},
		{"list_sandboxes", map[string]any{"metadata": map[string]string{"a=b": "c"}}, "without '='"},
		{"create_snapshot", map[string]any{"tag": "t", "memory_mib": 1}, "memory_mib = 1"},
		{"branch_sandbox", map[string]any{"id": fakeID, "mode": "half"}, "mode \"half\""},
		{"fork_sandbox", map[string]any{"id": fakeID, "count": 101}, "count = 101"},
		{"create_snapshot", map[string]any{"tag": "t", "image": "python", "oci_ref": "debian"}, "not both"},
		{"create_snapshot", map[string]any{"tag": "t", "image": "windows"}, "image \"windows\": want one of"},
		{"create_snapshot", map[string]any{"tag": "t", "preload": []string{"numpy"}}, "go with oci_ref"},
		{"create_snapshot", map[string]any{"tag": "-t"}, "tag"},
	} {
		text, _, isErr := callTool(t, cs, tc.tool, tc.args)
		if !isErr || !strings.Contains(text, tc.want) || !strings.HasPrefix(text, "invalid_argument: ") {
			t.Errorf("%s %v: isError %v, %q; want invalid_argument mentioning %q", tc.tool, tc.args, isErr, text, tc.want)
		}
	}
	if calls := f.callLog(); len(calls) != 0 {
		t.Errorf("bad arguments reached the daemon: %v", calls)
	}
}

func TestFailuresAreToolResults(t *testing.T) {
	_, cs := newFake(t)
	for _, tc := range []struct {
		tool string
		args map[string]any
		want []string
	}{
		{"get_sandbox", map[string]any{"id": "sb-zzzzzzzzzz"}, []string{"not_found: ", "list_sandboxes lists the live ones"}},
		{"kill_sandbox", map[string]any{"id": "sb-zzzzzzzzzz"}, []string{"not_found: "}},
		{"exec_command", map[string]any{"id": "sb-zzzzzzzzzz", "command": "true"}, []string{"not_found: ", "sb-zzzzzzzzzz"}},
		{"spawn_sandboxes", map[string]any{"snapshot_tag": "nope"}, []string{"not_found: ", "create_snapshot builds one"}},
		{"create_snapshot", map[string]any{"tag": "base"}, []string{"already_exists: ", "pick another tag"}},
		{"read_file", map[string]any{"id": fakeID, "path": "/nope"}, []string{"not_found: ", "/nope does not exist in " + fakeID}},
	} {
		text, _, isErr := callTool(t, cs, tc.tool, tc.args)
		for _, w := range tc.want {
			if !isErr || !strings.Contains(text, w) {
				t.Errorf("%s %v: isError %v, %q; want %q", tc.tool, tc.args, isErr, text, w)
			}
		}
	}
	// An unknown tool is the one protocol error.
	if _, err := cs.CallTool(context.Background(), &sdk.CallToolParams{Name: "rm_rf"}); err == nil {
		t.Error("an unknown tool was called")
	}
}

func TestResultsMatchOutputSchemas(t *testing.T) {
	f, cs := newFake(t)
	f.files["/root/a.txt"] = "hello\n"
	tools := listTools(t, cs)
	for _, tc := range []struct {
		tool string
		args map[string]any
	}{
		{"list_snapshots", nil},
		{"list_sandboxes", map[string]any{"status": "running"}},
		{"get_sandbox", map[string]any{"id": fakeID}},
		{"spawn_sandboxes", map[string]any{"snapshot_tag": "base", "timeout_secs": 60, "metadata": map[string]string{"k": "v"}}},
		{"kill_sandbox", map[string]any{"id": fakeID}},
		{"exec_command", map[string]any{"id": fakeID, "args": []string{"true"}}},
		{"run_code", map[string]any{"id": fakeID, "code": "6*7"}},
		{"read_file", map[string]any{"id": fakeID, "path": "/root/a.txt"}},
		{"write_file", map[string]any{"id": fakeID, "path": "/root/b.txt", "content": "x"}},
		{"list_files", map[string]any{"id": fakeID, "path": "/root"}},
		{"wait_for_text", map[string]any{"id": fakeID, "path": "/root/a.txt", "text": "ell"}},
		{"create_snapshot", map[string]any{"tag": "fresh"}},
	} {
		text, sc, isErr := callTool(t, cs, tc.tool, tc.args)
		if isErr {
			t.Errorf("%s: %s", tc.tool, text)
			continue
		}
		if err := schemaOf(t, tc.tool, tools[tc.tool].OutputSchema).Validate(sc); err != nil {
			t.Errorf("%s: result does not match its output schema: %v\n%v", tc.tool, err, sc)
		}
	}
}

func TestExecOutput(t *testing.T) {
	f, cs := newFake(t)
	// A long output keeps its head and tail, and says how long it was.
	f.stdout = "BEGIN" + strings.Repeat("0123456789", 20000) + "END"
	text, sc, isErr := callTool(t, cs, "exec_command", map[string]any{"id": fakeID, "command": "yes | head"})
	if isErr {
		t.Fatal(text)
	}
	out := sc["stdout"].(string)
	if sc["stdout_bytes"].(float64) != 200008 || sc["truncated"] != true || sc["exit_code"].(float64) != 3 {
		t.Errorf("result: %v", sc)
	}
	if len(out) > MaxField+200 || !strings.HasPrefix(out, "BEGIN") || !strings.HasSuffix(out, "END") ||
		!strings.Contains(out, "output truncated: 200008 bytes in all, 134472 omitted here, 65536 shown") {
		t.Errorf("stdout (%d bytes): %.100q … %.100q", len(out), out, out[len(out)-100:])
	}
	// A non-zero exit is a result, not an error; the text reads as text.
	if !strings.HasPrefix(text, "exit code 3 (5 ms)\n--- stdout (200008 bytes) ---\nBEGIN") || !strings.Contains(text, "--- stderr (5 bytes) ---\nwarn\n") {
		t.Errorf("text: %.200q", text)
	}

	text, sc, _ = callTool(t, cs, "run_code", map[string]any{"id": fakeID, "code": "print('hi'); 42"})
	if sc["value"] != "42" || sc["stdout"] != "hi\n" || !strings.HasPrefix(text, "ok (1 ms)\n--- value ---\n42\n") {
		t.Errorf("run_code: %v %q", sc, text)
	}
}

func TestFiles(t *testing.T) {
	f, cs := newFake(t)
	if _, sc, isErr := callTool(t, cs, "write_file", map[string]any{"id": fakeID, "path": "/root/dir/f.bin", "content": base64.StdEncoding.EncodeToString([]byte{0, 1, 0xff}), "encoding": "base64", "mode": "0600"}); isErr || sc["bytes"].(float64) != 3 {
		t.Fatalf("write: %v", sc)
	}
	if !slices.Contains(f.callLog(), "POST /v1/sandboxes/"+fakeID+"/files/mkdir") {
		t.Errorf("the parent directory was not made: %v", f.callLog())
	}
	_, sc, _ := callTool(t, cs, "read_file", map[string]any{"id": fakeID, "path": "/root/dir/f.bin", "encoding": "base64"})
	if sc["content"] != "AAH/" || sc["size"].(float64) != 3 {
		t.Errorf("read base64: %v", sc)
	}
	text, sc, _ := callTool(t, cs, "read_file", map[string]any{"id": fakeID, "path": "/root/dir/f.bin"})
	if sc["binary"] != true || !strings.Contains(text, "use encoding base64") {
		t.Errorf("read binary as text: %v %q", sc, text)
	}
	// A large file is read in parts, cut at character boundaries.
	f.files["/big"] = strings.Repeat("é", 100)
	_, sc, _ = callTool(t, cs, "read_file", map[string]any{"id": fakeID, "path": "/big", "offset": 10, "max_bytes": 7})
	if sc["content"] != "ééé" || sc["bytes"].(float64) != 6 || sc["truncated"] != true || sc["size"].(float64) != 200 {
		t.Errorf("read a part: %v", sc)
	}
	text, sc, _ = callTool(t, cs, "list_files", map[string]any{"id": fakeID, "path": "/root"})
	if sc["total"].(float64) != 2 || !strings.Contains(text, "d  0755          0 2023-11-14T22:13:20Z /root/d/\n") {
		t.Errorf("list: %v\n%s", sc, text)
	}
}

func TestWaitForText(t *testing.T) {
	f, cs := newFake(t)
	f.onRead = func(n int) {
		if n == 3 {
			f.mu.Lock()
			f.files["/var/log/app.log"] = "starting\nserver: listening on :8080 (pid 7)\nmore\n"
			f.mu.Unlock()
		}
	}
	_, sc, isErr := callTool(t, cs, "wait_for_text", map[string]any{"id": fakeID, "path": "/var/log/app.log", "text": "listening on", "interval_ms": 100})
	if isErr || sc["found"] != true || sc["reads"].(float64) != 3 || sc["line"] != "server: listening on :8080 (pid 7)" || sc["offset"].(float64) != 17 {
		t.Errorf("wait: %v", sc)
	}
	// The text is data, never code: shell syntax in it is only looked for.
	text, _, isErr := callTool(t, cs, "wait_for_text", map[string]any{"id": fakeID, "path": "/var/log/app.log", "text": "'; rm -rf / #", "timeout_secs": 1.5, "interval_ms": 100})
	if !isErr || !strings.HasPrefix(text, "deadline_exceeded: text \"'; rm -rf / #\" did not appear in /var/log/app.log") ||
		!strings.Contains(text, `its last line: "more"`) {
		t.Errorf("wait that times out: %q", text)
	}
	for _, c := range f.callLog() {
		if strings.Contains(c, "exec") {
			t.Errorf("wait_for_text ran a command: %s", c)
		}
	}
	text, _, isErr = callTool(t, cs, "wait_for_text", map[string]any{"id": fakeID, "path": "/nope", "text": "x", "timeout_secs": 1.5, "interval_ms": 100})
	if !isErr || !strings.Contains(text, "the file does not exist") {
		t.Errorf("wait for a missing file: %q", text)
	}
}

func TestProgress(t *testing.T) {
	var mu sync.Mutex
	var msgs []string
	_, cs := newFakeWith(t, &sdk.ClientOptions{ProgressNotificationHandler: func(_ context.Context, req *sdk.ProgressNotificationClientRequest) {
		mu.Lock()
		msgs = append(msgs, req.Params.Message)
		mu.Unlock()
	}})
	// A client that asks for progress sees the build's lines, and a
	// spawn's start and end.
	for _, c := range []struct {
		tool string
		args map[string]any
	}{{"create_snapshot", map[string]any{"tag": "fresh"}}, {"spawn_sandboxes", map[string]any{"snapshot_tag": "base"}}} {
		res, err := cs.CallTool(context.Background(), &sdk.CallToolParams{Name: c.tool, Arguments: c.args, Meta: sdk.Meta{"progressToken": c.tool}})
		if err != nil || res.IsError {
			t.Fatalf("%s: %v %+v", c.tool, err, res)
		}
	}
	want := []string{"kernel", "boot", "saved", "forking 1 sandbox(es) from base", "1 sandbox(es) running"}
	// Notifications may trail the results.
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		mu.Lock()
		got := slices.Clone(msgs)
		mu.Unlock()
		if len(got) >= len(want) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(msgs, want) {
		t.Errorf("progress: %q, want %q", msgs, want)
	}
}

// TestHTTPHandler: the stateless streamable HTTP handler serves the tools,
// a long call's progress reaches the caller on the POST's own stream, and
// GET (a standalone stream, which a stateless server has not) is 405.
func TestHTTPHandler(t *testing.T) {
	f, _ := newFake(t)
	c, err := client.New(f.url, "")
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(Handler(New(c, Options{}), nil))
	defer hs.Close()
	var mu sync.Mutex
	var msgs []string
	cs, err := sdk.NewClient(&sdk.Implementation{Name: "test", Version: "1"}, &sdk.ClientOptions{
		ProgressNotificationHandler: func(_ context.Context, req *sdk.ProgressNotificationClientRequest) {
			mu.Lock()
			msgs = append(msgs, req.Params.Message)
			mu.Unlock()
		}}).Connect(context.Background(), &sdk.StreamableClientTransport{Endpoint: hs.URL, DisableStandaloneSSE: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	res, err := cs.CallTool(context.Background(), &sdk.CallToolParams{Name: "create_snapshot", Arguments: map[string]any{"tag": "fresh"},
		Meta: sdk.Meta{"progressToken": 7}})
	if err != nil || res.IsError {
		t.Fatalf("create_snapshot over HTTP: %v %+v", err, res)
	}
	// The server sends every notification before the result, but the
	// client hands them to the handler on its own goroutines: wait a
	// little for the last ones.
	var got []string
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		mu.Lock()
		got = slices.Clone(msgs)
		mu.Unlock()
		if len(got) >= 3 || time.Now().After(deadline) {
			break
		}
	}
	// Their order among themselves is the client's.
	if sorted := slices.Sorted(slices.Values(got)); !slices.Equal(sorted, []string{"boot", "kernel", "saved"}) {
		t.Errorf("progress over HTTP: %q, want kernel, boot and saved", got)
	}
	resp, err := http.Get(hs.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("GET: %d, want 405 (stateless: no standalone stream)", resp.StatusCode)
	}
}
