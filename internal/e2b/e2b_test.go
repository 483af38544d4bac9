package e2b

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/apikey"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/vmm"
)

// noVMs is a backend that runs nothing: the control plane's checks and
// shapes, without sandboxes.
type noVMs struct{}

func (noVMs) Name() string                            { return "none" }
func (noVMs) Version(context.Context) (string, error) { return "0", nil }
func (noVMs) Capabilities() vmm.Capabilities          { return vmm.Capabilities{Accelerator: "none"} }
func (noVMs) Boot(context.Context, vmm.BootSpec) (vmm.Machine, error) {
	return nil, errdefs.Unavailable("no VMs here")
}
func (noVMs) Restore(context.Context, vmm.RestoreSpec) (vmm.Machine, error) {
	return nil, errdefs.Unavailable("no VMs here")
}
func (noVMs) Attach(context.Context, vmm.Handle) (vmm.Machine, error) {
	return nil, errdefs.Unavailable("no VMs here")
}

// testServer is a Server over an engine without VMs, with one key.
func testServer(t *testing.T, domain string) (*Server, string) {
	t.Helper()
	data := t.TempDir()
	e, err := sandbox.New(sandbox.Config{DataDir: data, Backend: noVMs{}, Daemon: true, Logger: slog.New(slog.DiscardHandler)})
	testutil.Check(t, err)
	t.Cleanup(func() { e.Close() })
	keys, err := apikey.Open(filepath.Join(data, "keys.json"))
	testutil.Check(t, err)
	key, _, err := keys.Create("t")
	testutil.Check(t, err)
	s, err := New(Config{Engine: e, Admitter: sandbox.NewAdmitter(e, sandbox.Admission{}), Expirer: sandbox.NewExpirer(e), Keys: keys, Domain: domain})
	testutil.Check(t, err)
	t.Cleanup(s.Close)
	return s, key
}

func do(t *testing.T, h http.Handler, method, target, key string, body string, hdr ...string) *httptest.ResponseRecorder {
	t.Helper()
	r := httptest.NewRequest(method, target, strings.NewReader(body))
	if key != "" {
		r.Header.Set("X-API-Key", key)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		if strings.EqualFold(hdr[i], "Host") {
			r.Host = hdr[i+1]
			continue
		}
		r.Header.Set(hdr[i], hdr[i+1])
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// Errors come in E2B's shape, with the statuses the SDKs map: 401 for a
// missing or wrong key, 404 {"code":404} for unknown sandboxes (kill then
// returns false) and routes.
func TestControlPlaneErrors(t *testing.T) {
	s, key := testServer(t, "")
	for _, tc := range []struct {
		method, path, key, body string
		status                  int
	}{
		{"GET", "/v2/sandboxes", "", "", 401},
		{"GET", "/v2/sandboxes", "e2b_" + strings.Repeat("0", 40), "", 401},
		{"DELETE", "/sandboxes/abc123", key, "", 404},
		{"GET", "/sandboxes/abc123", key, "", 404},
		{"POST", "/sandboxes/abc123/timeout", key, `{"timeout":10}`, 404},
		{"POST", "/v2/sandboxes/abc123/connect", key, `{}`, 404},
		{"POST", "/sandboxes/abc123/pause", key, `{}`, 404},
		{"POST", "/sandboxes/abc123/fork", key, `{"count":2}`, 404},
		{"GET", "/no/such/route", key, "", 404},
		{"POST", "/v2/sandboxes", key, `{"templateID":"nonesuch"}`, 404},
		{"POST", "/v2/sandboxes", key, `{"templateID":"base","timeout":-1}`, 400},
		{"POST", "/v2/sandboxes", key, `{"templateID":"base","mcp":{"x":1}}`, 400},
		{"POST", "/v2/sandboxes", key, `not json`, 400},
	} {
		w := do(t, s, tc.method, tc.path, tc.key, tc.body)
		var e apiError
		if w.Code != tc.status || json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Code != tc.status || e.Message == "" {
			t.Errorf("%s %s: %d %s, want %d with {code, message}", tc.method, tc.path, w.Code, w.Body, tc.status)
		}
		if ct := w.Header().Get("Content-Type"); ct != "application/json" {
			t.Errorf("%s %s: content type %q", tc.method, tc.path, ct)
		}
	}
	w := do(t, s, "GET", "/v2/sandboxes", key, "")
	if w.Code != 200 || strings.TrimSpace(w.Body.String()) != "[]" || w.Header().Get("X-Next-Token") != "" {
		t.Fatalf("empty list: %d %q", w.Code, w.Body)
	}
}

// Requests for sandboxes are told apart by Host under the domain, or by
// the E2B headers on an IP, localhost or sandbox.<domain> Host; unknown
// sandboxes answer 502 with JSON, as E2B's proxy does.
func TestRouting(t *testing.T) {
	s, _ := testServer(t, "e2b.test:3000")
	for _, tc := range []struct {
		host, id, port string
		wantID         string
		wantPort       int
		ok             bool
	}{
		{host: "49983-abc123.e2b.test:3000", wantID: "abc123", wantPort: 49983, ok: true},
		{host: "8080-abc123.E2B.test", wantID: "abc123", wantPort: 8080, ok: true},
		{host: "127.0.0.1:3000", id: "abc123", port: "49999", wantID: "abc123", wantPort: 49999, ok: true},
		{host: "localhost", id: "abc123", wantID: "abc123", wantPort: EnvdPort, ok: true},
		{host: "sandbox.e2b.test:3000", id: "abc123", port: "3000", wantID: "abc123", wantPort: 3000, ok: true},
		{host: "api.e2b.test:3000"},
		{host: "evil.example", id: "abc123", port: "49983"},
		{host: "127.0.0.1:3000"},
		{host: "x-ABC.e2b.test"},
		{host: "70000-abc.e2b.test"},
	} {
		r := httptest.NewRequest("GET", "/health", nil)
		r.Host = tc.host
		if tc.id != "" {
			r.Header.Set("E2b-Sandbox-Id", tc.id)
		}
		if tc.port != "" {
			r.Header.Set("E2b-Sandbox-Port", tc.port)
		}
		id, port, ok := s.route(r)
		if ok != tc.ok || id != tc.wantID || port != tc.wantPort {
			t.Errorf("%+v: route = %q %d %v", tc, id, port, ok)
		}
	}
	w := do(t, s, "GET", "/health", "", "", "Host", "49983-abc123.e2b.test:3000")
	var body map[string]any
	if w.Code != 502 || json.Unmarshal(w.Body.Bytes(), &body) != nil || body["sandboxId"] != "abc123" || body["code"] != float64(502) {
		t.Fatalf("unknown sandbox: %d %s", w.Code, w.Body)
	}
}

// The list's metadata parameter is decoded as E2B's API does (captured
// from the SDK: {user: 'a b&c=d'}).
func TestMetadataFilter(t *testing.T) {
	r := httptest.NewRequest("GET", "/v2/sandboxes?metadata=user%3Da%252520b%252526c%25253Dd%26app%3Dx", nil)
	got, err := metadataFilter(r.URL.Query().Get("metadata"))
	if err != nil || len(got) != 2 || got["user"] != "a b&c=d" || got["app"] != "x" {
		t.Fatalf("metadata = %v, %v", got, err)
	}
}

func TestRawFilename(t *testing.T) {
	for cd, want := range map[string]string{
		`form-data; name="file"; filename="/tmp/e2bmock/m1.txt"`: "/tmp/e2bmock/m1.txt",
		`form-data; name="file"; filename="a/b%22c%0Ad.txt"`:     "a/b\"c\nd.txt",
		`form-data; name="file"`:                                 "",
	} {
		if got := rawFilename(cd); got != want {
			t.Errorf("rawFilename(%q) = %q, want %q", cd, got, want)
		}
	}
}

func TestEndEvent(t *testing.T) {
	for _, tc := range []struct {
		res  proto.ExecResult
		want string
	}{
		{proto.ExecResult{ExitCode: 0}, `{"exited":true,"status":"exit status 0"}`},
		{proto.ExecResult{ExitCode: 3}, `{"exitCode":3,"exited":true,"status":"exit status 3","error":"exit status 3"}`},
		{proto.ExecResult{ExitCode: -1, Signal: "SIGKILL"}, `{"exitCode":-1,"status":"signal: killed","error":"signal: killed"}`},
	} {
		b, _ := json.Marshal(endOf(&tc.res))
		if string(b) != tc.want {
			t.Errorf("%+v: %s, want %s", tc.res, b, tc.want)
		}
	}
	if p := permissions(proto.FileTypeDir, 0o755); p != "drwxr-xr-x" {
		t.Errorf("permissions = %q", p)
	}
	b, _ := json.Marshal(entryInfo{Name: "a", Type: "FILE_TYPE_FILE", Size: 5, ModifiedTime: time.Unix(0, 0).UTC()})
	if !strings.Contains(string(b), `"size":"5"`) {
		t.Errorf("int64 size must be a string in proto3 JSON: %s", b)
	}
}

func envelope(flags byte, v any) []byte {
	b, _ := json.Marshal(v)
	var hdr [5]byte
	hdr[0] = flags
	binary.BigEndian.PutUint32(hdr[1:], uint32(len(b)))
	return append(hdr[:], b...)
}

// The Connect codec: a unary call and its error; a stream's messages and
// its mandatory end-of-stream envelope, errors inside it with status 200.
func TestConnectCodec(t *testing.T) {
	h := unary(func(ctx context.Context, r *http.Request, req *pathRequest) (*entryResponse, error) {
		if req.Path == "/missing" {
			return nil, errdefs.NotFound("no %s", req.Path)
		}
		return &entryResponse{Entry: &entryInfo{Name: req.Path}}, nil
	})
	w := do(t, h, "POST", "/x", "", `{"path":"/a","unknown":1}`, "Content-Type", "application/json")
	if w.Code != 200 || !strings.Contains(w.Body.String(), `"name":"/a"`) {
		t.Fatalf("unary: %d %s", w.Code, w.Body)
	}
	w = do(t, h, "POST", "/x", "", `{"path":"/missing"}`, "Content-Type", "application/json")
	if w.Code != 404 || !strings.Contains(w.Body.String(), `"code":"not_found"`) {
		t.Fatalf("unary error: %d %s", w.Code, w.Body)
	}
	st := stream(nil, func(ctx context.Context, r *http.Request, req *pathRequest, sw *streamWriter) error {
		if err := sw.send(map[string]string{"got": req.Path}); err != nil {
			return err
		}
		if req.Path == "/fail" {
			return errdefs.InvalidArgument("bad")
		}
		return nil
	})
	for _, tc := range []struct{ path, end string }{{"/ok", "{}"}, {"/fail", `{"error":{"code":"invalid_argument","message":"bad"}}`}} {
		w = do(t, st, "POST", "/s", "", string(envelope(0, pathRequest{Path: tc.path})), "Content-Type", "application/connect+json")
		if w.Code != 200 || w.Header().Get("Content-Type") != "application/connect+json" {
			t.Fatalf("stream: %d %q", w.Code, w.Header().Get("Content-Type"))
		}
		br := bufio.NewReader(bytes.NewReader(w.Body.Bytes()))
		var msgs []string
		for {
			var hdr [5]byte
			if _, err := io.ReadFull(br, hdr[:]); err != nil {
				break
			}
			b := make([]byte, binary.BigEndian.Uint32(hdr[1:]))
			io.ReadFull(br, b)
			msgs = append(msgs, string([]byte{'0' + hdr[0]})+string(b))
		}
		if len(msgs) != 2 || msgs[0] != `0{"got":"`+tc.path+`"}` || msgs[1] != "2"+tc.end {
			t.Fatalf("stream %s: %q", tc.path, msgs)
		}
	}
}
