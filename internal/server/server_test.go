package server

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/vmm"
)

// fakeNoVMs is a fake vmm.Backend that starts nothing: Boot and Restore
// fail with NotImplemented and Attach finds nothing. The tests that use it
// exercise what the API does before a VM would start (request decoding,
// validation, auth, routing, error mapping), which needs no QEMU; the real
// backend is exercised by the VM tier in server_vm_test.go.
type fakeNoVMs struct{}

func (fakeNoVMs) Name() string                            { return "none" }
func (fakeNoVMs) Version(context.Context) (string, error) { return "0", nil }
func (fakeNoVMs) Capabilities() vmm.Capabilities          { return vmm.Capabilities{Accelerator: "none"} }
func (fakeNoVMs) Boot(context.Context, vmm.BootSpec) (vmm.Machine, error) {
	return nil, errdefs.NotImplemented("no VMs here")
}
func (fakeNoVMs) Restore(context.Context, vmm.RestoreSpec) (vmm.Machine, error) {
	return nil, errdefs.NotImplemented("no VMs here")
}
func (fakeNoVMs) Attach(context.Context, vmm.Handle) (vmm.Machine, error) {
	return nil, errdefs.NotFound("no VMs here")
}

var _ vmm.Backend = fakeNoVMs{}

const testToken = "3f9c2b1e7a6d5c4b3a29181706f5e4d3"

// daemon is a server on real listeners: a unix socket and loopback TCP.
type daemon struct {
	srv    *Server
	e      *sandbox.Engine
	data   string
	sock   string
	url    string // http://127.0.0.1:port
	unix   *client.Client
	tcp    *client.Client
	audit  *lockedBuffer
	cancel context.CancelFunc
	done   chan error
}

func startDaemon(t testing.TB, be vmm.Backend, lim sandbox.Admission, tune func(*sandbox.Config, *Config)) *daemon {
	t.Helper()
	data := t.TempDir()
	ecfg := sandbox.Config{DataDir: data, Backend: be, Daemon: true, MaxChildren: 50,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	scfg := Config{Token: []byte(testToken)}
	if tune != nil {
		tune(&ecfg, &scfg)
	}
	e, err := sandbox.New(ecfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	d := &daemon{e: e, data: data, audit: &lockedBuffer{}, done: make(chan error, 1)}
	scfg.Engine = e
	scfg.Admitter = sandbox.NewAdmitter(e, lim)
	if scfg.Expirer == nil {
		scfg.Expirer = sandbox.NewExpirer(e)
	}
	scfg.Audit = d.audit
	d.srv, err = New(scfg)
	if err != nil {
		t.Fatal(err)
	}
	// A short path: unix socket paths are limited to 108 bytes.
	sockDir, err := os.MkdirTemp("", "fd-")
	if err != nil {
		t.Fatal(err)
	}
	// Registered now, so a Fatal below does not leak the directory; it runs
	// after the cleanup that stops the server, which is registered later.
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	d.sock = filepath.Join(sockDir, "s")
	uln, err := net.Listen("unix", d.sock)
	if err != nil {
		t.Fatal(err)
	}
	tln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	d.url = "http://" + tln.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	d.cancel = cancel
	go scfg.Expirer.Run(ctx)
	go func() { d.done <- d.srv.Serve(ctx, 5*time.Second, uln, tln) }()
	if d.unix, err = client.New("unix://"+d.sock, ""); err != nil {
		t.Fatal(err)
	}
	if d.tcp, err = client.New(d.url, testToken); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		kctx, kcancel := context.WithTimeout(context.Background(), time.Minute)
		defer kcancel()
		e.KillAll(kctx, "")
		d.stop(t)
		e.Close()
	})
	return d
}

func (d *daemon) stop(t testing.TB) {
	if d.cancel == nil {
		return
	}
	d.cancel()
	d.cancel = nil
	if err := <-d.done; err != nil {
		t.Errorf("serve: %v", err)
	}
}

// lockedBuffer is a buffer the server writes while the test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// call sends a raw request over TCP and returns status and body; a body
// goes as application/json.
func (d *daemon) call(t testing.TB, method, path, token string, body io.Reader) (int, []byte) {
	t.Helper()
	ct := ""
	if body != nil {
		ct = "application/json"
	}
	return d.send(t, method, path, token, ct, body)
}

// callCT is call with the token and a body of Content-Type ct ("": no
// header).
func (d *daemon) callCT(t testing.TB, method, path, ct string, body io.Reader) (int, []byte) {
	t.Helper()
	return d.send(t, method, path, testToken, ct, body)
}

func (d *daemon) send(t testing.TB, method, path, token, ct string, body io.Reader) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, d.url+path, body)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	if ct != "" {
		req.Header.Set("Content-Type", ct)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// apiError decodes an ErrorResponse, failing the test when the body is
// not one.
func apiError(t testing.TB, b []byte) apiv1.Error {
	t.Helper()
	var er apiv1.ErrorResponse
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&er); err != nil || er.Error.Code == "" || er.Error.Message == "" {
		t.Fatalf("not an error response: %s", b)
	}
	return er.Error
}

func TestAuth(t *testing.T) {
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, nil)
	if code, b := d.call(t, "GET", "/healthz", "", nil); code != 200 || !strings.Contains(string(b), `"ok"`) {
		t.Errorf("healthz without token: %d %s", code, b)
	}
	for _, tok := range []string{"", "wrong-token-0123456789abcdef", testToken[:16], "changeme", testToken + "x"} {
		for _, path := range []string{"/version", "/v1/sandboxes", "/metrics", "/v1/nope"} {
			code, b := d.call(t, "GET", path, tok, nil)
			if code != http.StatusUnauthorized || apiError(t, b).Code != apiv1.CodeUnauthenticated {
				t.Errorf("GET %s with token %q: %d %s", path, tok, code, b)
			}
		}
	}
	if code, b := d.call(t, "GET", "/v1/sandboxes", testToken, nil); code != 200 {
		t.Errorf("with the token: %d %s", code, b)
	}
	// A scheme other than Bearer is refused.
	req, _ := http.NewRequest("GET", d.url+"/version", nil)
	req.Header.Set("Authorization", "Basic "+testToken)
	if resp, err := http.DefaultClient.Do(req); err != nil {
		t.Errorf("Basic auth: %v", err)
	} else {
		resp.Body.Close()
		if resp.StatusCode != 401 {
			t.Errorf("Basic auth: status %d, want 401", resp.StatusCode)
		}
	}
	// The unix socket trusts the kernel: same uid, no token.
	v, err := d.unix.Version(context.Background())
	if err != nil || v.DataDir != d.data || v.APIVersion != "v1" {
		t.Errorf("version over the socket: %+v %v", v, err)
	}
	// The audit log has one line per request, with the caller; the line
	// is written as the request ends, just after the caller got its answer.
	d.stop(t)
	var n int
	for _, line := range strings.Split(strings.TrimSpace(d.audit.String()), "\n") {
		var e auditEntry
		if err := json.Unmarshal([]byte(line), &e); err != nil || e.Method == "" || e.Path == "" || e.Status == 0 || e.Caller == "" {
			t.Errorf("audit line %q", line)
		}
		n++
	}
	if n < 22 {
		t.Errorf("audit log has %d lines, want at least 22", n)
	}
	if !strings.Contains(d.audit.String(), `"caller":"uid:`) || !strings.Contains(d.audit.String(), `"caller":"token@127.0.0.1"`) {
		t.Errorf("audit callers: %s", d.audit.String())
	}
}

func TestNotFoundAndMethods(t *testing.T) {
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, nil)
	cases := []struct {
		method, path string
		status       int
		code         string
	}{
		{"GET", "/v1/nope", 404, apiv1.CodeNotFound},
		{"GET", "/v1/sandboxes/sb-aaaaaaaaaa", 404, apiv1.CodeNotFound},
		{"DELETE", "/v1/sandboxes/sb-aaaaaaaaaa", 404, apiv1.CodeNotFound},
		{"GET", "/v1/sandboxes/nope", 400, apiv1.CodeInvalidArgument},
		{"GET", "/v1/sandboxes/sb-aaaaaaaaaa/exec", 405, apiv1.CodeInvalidArgument},
		{"PATCH", "/v1/sandboxes", 405, apiv1.CodeInvalidArgument},
		{"GET", "/v1/snapshots/nope", 404, apiv1.CodeNotFound},
		{"GET", "/v1/snapshots/..%2Fetc", 400, apiv1.CodeInvalidArgument},
		{"DELETE", "/v1/snapshots/nope", 404, apiv1.CodeNotFound},
		{"GET", "/v1/operations/op-x", 404, apiv1.CodeNotFound},
		{"POST", "/v1/sandboxes/sb-aaaaaaaaaa/ping", 404, apiv1.CodeNotFound},
		{"GET", "/v1/sandboxes/sb-aaaaaaaaaa/files?path=/etc/passwd", 404, apiv1.CodeNotFound},
		{"GET", "/v1/sandboxes/sb-aaaaaaaaaa/files?path=etc", 400, apiv1.CodeInvalidArgument},
		{"GET", "/v1/sandboxes/sb-aaaaaaaaaa/files", 400, apiv1.CodeInvalidArgument},
		{"GET", "/v1/sandboxes?snapshot=../x", 400, apiv1.CodeInvalidArgument},
		{"GET", "/v1/sandboxes?metadata=novalue", 400, apiv1.CodeInvalidArgument},
	}
	for _, c := range cases {
		code, b := d.call(t, c.method, c.path, testToken, nil)
		if code != c.status || apiError(t, b).Code != c.code {
			t.Errorf("%s %s: %d %s, want %d %s", c.method, c.path, code, b, c.status, c.code)
		}
	}
	// The client maps codes back to classes.
	_, err := d.tcp.GetSandbox(context.Background(), "sb-aaaaaaaaaa")
	if !errdefs.IsNotFound(err) {
		t.Errorf("client GetSandbox: %v, want NotFound class", err)
	}
	_, err = d.tcp.CreateSandboxes(context.Background(), apiv1.CreateSandboxesRequest{SnapshotTag: "../x"})
	if !errdefs.IsInvalidArgument(err) {
		t.Errorf("client CreateSandboxes: %v, want InvalidArgument class", err)
	}
}

func TestHostileCreateChangesNothing(t *testing.T) {
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, nil)
	huge := `{"snapshot_tag":"base","metadata":{"k":"` + strings.Repeat("x", 10<<20) + `"}}`
	cases := []struct {
		name, body string
		status     int
		want       string
	}{
		{"traversal tag", `{"snapshot_tag":"../../etc"}`, 400, "snapshot_tag"},
		{"absolute tag", `{"snapshot_tag":"/etc/passwd"}`, 400, "snapshot_tag"},
		{"slash tag", `{"snapshot_tag":"a/b"}`, 400, "snapshot_tag"},
		{"empty tag", `{"snapshot_tag":""}`, 400, "snapshot_tag"},
		{"long tag", `{"snapshot_tag":"` + strings.Repeat("a", 300) + `"}`, 400, "snapshot_tag"},
		{"huge n", `{"snapshot_tag":"base","n":1000000}`, 400, "n = 1000000"},
		{"negative n", `{"snapshot_tag":"base","n":-1}`, 400, "n = -1"},
		{"n overflow", `{"snapshot_tag":"base","n":99999999999999999999}`, 400, "field n"},
		{"n float", `{"snapshot_tag":"base","n":1.5}`, 400, "field n"},
		{"n string", `{"snapshot_tag":"base","n":"5"}`, 400, "field n: want int"},
		{"tag number", `{"snapshot_tag":5}`, 400, "field snapshot_tag: want string"},
		{"metadata array", `{"snapshot_tag":"base","metadata":[1]}`, 400, "field metadata"},
		{"unknown field", `{"snapshot_tag":"base","live_fork":true}`, 400, `unknown field "live_fork"`},
		{"malformed", `{"snapshot_tag":`, 400, "malformed JSON"},
		{"garbage", `not json`, 400, "want a JSON object"},
		{"array", `[{"snapshot_tag":"base"}]`, 400, "want a JSON object, got an array"},
		{"null", `null`, 400, "got null"},
		{"two objects", `{"snapshot_tag":"base"}{"snapshot_tag":"base"}`, 400, "more than one JSON value"},
		{"empty", ``, 400, "empty"},
		{"10 MiB", huge, 413, "over the limit"},
		{"negative timeout", `{"snapshot_tag":"base","timeout_secs":-5}`, 400, "timeout_secs"},
		{"memory too small", `{"snapshot_tag":"base","memory_limit_mib":1}`, 400, "memory_limit_mib"},
		{"bad egress", `{"snapshot_tag":"base","network":{"egress":"sometimes"}}`, 400, "network"},
		{"bad cidr", `{"snapshot_tag":"base","network":{"egress":"allowlist","allow":[{"cidr":"nope"}]}}`, 400, "cidr"},
		{"bad port", `{"snapshot_tag":"base","network":{"allow":[{"cidr":"1.2.3.0/24","ports":["0"]}]}}`, 400, "port"},
		{"too many keys", `{"snapshot_tag":"base","metadata":{` + manyKeys(100) + `}}`, 400, "metadata"},
		{"missing snapshot", `{"snapshot_tag":"base","n":2}`, 404, "not found"},
	}
	for _, c := range cases {
		code, b := d.call(t, "POST", "/v1/sandboxes", testToken, strings.NewReader(c.body))
		e := apiError(t, b)
		if code != c.status || !strings.Contains(e.Message, c.want) {
			t.Errorf("%s: %d %s, want %d and %q", c.name, code, b, c.status, c.want)
		}
	}
	for _, c := range []struct{ path, body, want string }{
		{"/v1/snapshots", `{"tag":"../x"}`, "tag"},
		{"/v1/snapshots", `{"tag":"x","image":"../../bin"}`, "image"},
		{"/v1/snapshots", `{"tag":"x","memory_mib":1}`, "memory_mib"},
		{"/v1/snapshots", `{"tag":"x","warmup":[""]}`, "warmup"},
		{"/v1/sandboxes/sb-aaaaaaaaaa/exec", `{"args":[]}`, "exactly one of args and shell"},
		{"/v1/sandboxes/sb-aaaaaaaaaa/exec", `{"args":["ls"],"shell":"ls"}`, "exactly one"},
		{"/v1/sandboxes/sb-aaaaaaaaaa/exec", `{"args":["ls"],"timeout_secs":-1}`, "timeout_secs"},
		{"/v1/sandboxes/sb-aaaaaaaaaa/exec", `{"args":"ls"}`, "field args"},
		{"/v1/sandboxes/sb-aaaaaaaaaa/exec/stream", `{"args":["ls"],"x":1}`, "unknown field"},
		{"/v1/sandboxes/sb-aaaaaaaaaa/eval", `{"code":""}`, "code is empty"},
		{"/v1/sandboxes/sb-aaaaaaaaaa/timeout", `{"timeout_secs":-1}`, "timeout_secs"},
		{"/v1/sandboxes/sb-aaaaaaaaaa/files/mkdir", `{"path":"rel"}`, "absolute"},
		{"/v1/sandboxes/sb-aaaaaaaaaa/files/rename", `{"from":"/a","to":""}`, "to is required"},
	} {
		code, b := d.call(t, "POST", c.path, testToken, strings.NewReader(c.body))
		if e := apiError(t, b); code != 400 || !strings.Contains(e.Message, c.want) {
			t.Errorf("POST %s %s: %d %s, want 400 and %q", c.path, c.body, code, b, c.want)
		}
	}
	// Nothing was created anywhere.
	for _, sub := range []string{"run", "snapshots"} {
		if ents, _ := os.ReadDir(filepath.Join(d.data, sub)); len(ents) != 0 {
			t.Errorf("%s holds %v after hostile requests", sub, ents)
		}
	}
	if list, err := d.e.State().List(); err != nil || len(list) != 0 {
		t.Errorf("state after hostile requests: %v %v", list, err)
	}
	if ops, _ := d.tcp.ListSnapshots(context.Background()); len(ops) != 0 {
		t.Errorf("snapshots after hostile requests: %v", ops)
	}
}

func manyKeys(n int) string {
	var b strings.Builder
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(`"k` + strings.Repeat("x", i%5) + string(rune('a'+i%26)) + string(rune('a'+i/26)) + `":"v"`)
	}
	return b.String()
}

func TestOpenAPIMatchesRoutes(t *testing.T) {
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, nil)
	code, b := d.call(t, "GET", "/v1/openapi.json", "", nil)
	if code != 200 {
		t.Fatalf("openapi.json: %d %s", code, b)
	}
	var doc struct {
		OpenAPI string                               `json:"openapi"`
		Paths   map[string]map[string]map[string]any `json:"paths"`
		Comps   struct {
			Schemas map[string]any `json:"schemas"`
		} `json:"components"`
	}
	if err := json.Unmarshal(b, &doc); err != nil || !strings.HasPrefix(doc.OpenAPI, "3.") {
		t.Fatalf("openapi.json: %v %.200s", err, b)
	}
	// Every route is documented, with its path parameters, and nothing else.
	seen := map[string]bool{}
	for _, rt := range routes {
		op := doc.Paths[rt.Path][strings.ToLower(rt.Method)]
		if op == nil {
			t.Errorf("route %s %s is not in the document", rt.Method, rt.Path)
			continue
		}
		seen[rt.Method+" "+rt.Path] = true
		for _, seg := range strings.Split(rt.Path, "/") {
			if strings.HasPrefix(seg, "{") && !strings.Contains(string(mustJSON(op["parameters"])), `"name":"`+strings.Trim(seg, "{}")+`"`) {
				t.Errorf("%s %s: path parameter %s undocumented", rt.Method, rt.Path, seg)
			}
		}
		// The route is really served: the mux sends this method and path
		// to this pattern.
		probe, _ := http.NewRequest(rt.Method, strings.NewReplacer("{id}", "sb-aaaaaaaaaa", "{tag}", "base").Replace(rt.Path), nil)
		if _, pat := d.srv.mux.Handler(probe); pat != rt.Method+" "+rt.Path {
			t.Errorf("%s %s is served by %q", rt.Method, rt.Path, pat)
		}
	}
	for path, ops := range doc.Paths {
		for m := range ops {
			if !seen[strings.ToUpper(m)+" "+path] {
				t.Errorf("document has %s %s, which no route serves", m, path)
			}
		}
	}
	// Referenced schemas exist.
	for _, ref := range strings.Split(string(b), `"$ref": "#/components/schemas/`)[1:] {
		name := ref[:strings.IndexByte(ref, '"')]
		if doc.Comps.Schemas[name] == nil {
			t.Errorf("schema %s referenced but not defined", name)
		}
	}
	for _, name := range []string{"CreateSandboxesRequest", "Sandbox", "ExecRequest", "ExecResult", "StreamEvent", "ErrorResponse"} {
		if doc.Comps.Schemas[name] == nil {
			t.Errorf("schema %s missing", name)
		}
	}
}

func mustJSON(v any) []byte {
	b, _ := json.Marshal(v)
	return b
}

func TestMetrics(t *testing.T) {
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, nil)
	d.call(t, "GET", "/v1/sandboxes", testToken, nil)
	code, b := d.call(t, "GET", "/metrics", testToken, nil)
	if code != 200 {
		t.Fatalf("metrics: %d", code)
	}
	for _, want := range []string{
		`forkd_http_requests_total{code="200",route="GET /v1/sandboxes"} 1`,
		"forkd_sandboxes_live 0", "forkd_snapshots 0", "forkd_http_body_bytes_in_flight 0", "go_goroutines",
	} {
		if !bytes.Contains(b, []byte(want)) {
			t.Errorf("metrics lack %q", want)
		}
	}
}
