package mcp

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
)

// fakeDaemon answers the REST routes the tools call, from memory, so
// that the tools are tested without VMs: what they send, what they make
// of answers, errors and large outputs. The VM tier (e2e) runs them
// against the real daemon.
type fakeDaemon struct {
	t     testing.TB
	url   string
	mu    sync.Mutex
	calls []string          // "METHOD /path", in order
	files map[string]string // path -> content, of sandbox fakeID
	// stdout is what an exec writes; polls counts file reads.
	stdout string
	reads  int
	// onRead, when set, is called with the read count before a file read.
	onRead func(n int)
}

const fakeID = "sb-abcdefgh23"

func newFake(t testing.TB) (*fakeDaemon, *sdk.ClientSession) { return newFakeWith(t, nil) }

// newFakeWith is newFake with a client of options o.
func newFakeWith(t testing.TB, o *sdk.ClientOptions) (*fakeDaemon, *sdk.ClientSession) {
	f := &fakeDaemon{t: t, files: map[string]string{}}
	mux := http.NewServeMux()
	sb := apiv1.Sandbox{ID: fakeID, SnapshotTag: "base", Status: "running", Created: time.Unix(1700000000, 0)}
	snap := apiv1.Snapshot{Tag: "base", Status: "ready", Image: "minimal", MemoryMiB: 256, VCPUs: 1}
	reply := func(w http.ResponseWriter, status int, v any) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(v)
	}
	fail := func(w http.ResponseWriter, status int, code, msg string) {
		reply(w, status, apiv1.ErrorResponse{Error: apiv1.Error{Code: code, Message: msg}})
	}
	sandbox := func(w http.ResponseWriter, r *http.Request) bool {
		if id := r.PathValue("id"); id != fakeID {
			fail(w, 404, apiv1.CodeNotFound, fmt.Sprintf("sandbox %q not found", id))
			return false
		}
		return true
	}
	mux.HandleFunc("GET /v1/snapshots", func(w http.ResponseWriter, _ *http.Request) {
		reply(w, 200, apiv1.SnapshotList{Snapshots: []apiv1.Snapshot{snap}})
	})
	mux.HandleFunc("GET /v1/snapshots/{tag}", func(w http.ResponseWriter, r *http.Request) {
		if r.PathValue("tag") != "base" && r.PathValue("tag") != "fresh" {
			fail(w, 404, apiv1.CodeNotFound, "snapshot not found")
			return
		}
		s := snap
		s.Tag = r.PathValue("tag")
		reply(w, 200, s)
	})
	mux.HandleFunc("POST /v1/snapshots", func(w http.ResponseWriter, r *http.Request) {
		var req apiv1.CreateSnapshotRequest
		_ = json.NewDecoder(r.Body).Decode(&req)
		if req.Tag == "base" {
			fail(w, 409, apiv1.CodeAlreadyExists, "snapshot base exists")
			return
		}
		reply(w, 202, apiv1.Operation{ID: "op-1", Status: "running", Snapshot: req.Tag})
	})
	polls := 0
	mux.HandleFunc("GET /v1/operations/{id}", func(w http.ResponseWriter, _ *http.Request) {
		polls++
		op := apiv1.Operation{ID: "op-1", Status: "running", Progress: []string{"kernel"}, ProgressLines: 1}
		if polls > 1 {
			op.Status, op.Progress, op.ProgressLines = "succeeded", []string{"kernel", "boot", "saved"}, 3
		}
		reply(w, 200, op)
	})
	mux.HandleFunc("POST /v1/sandboxes", func(w http.ResponseWriter, r *http.Request) {
		var req apiv1.CreateSandboxesRequest
		_ = json.NewDecoder(r.Body).Decode(&req)
		if req.SnapshotTag != "base" {
			fail(w, 404, apiv1.CodeNotFound, "snapshot "+req.SnapshotTag+" not found")
			return
		}
		reply(w, 201, apiv1.CreateSandboxesResponse{Sandboxes: []apiv1.Sandbox{sb}, WallMS: 12})
	})
	mux.HandleFunc("GET /v1/sandboxes", func(w http.ResponseWriter, _ *http.Request) {
		reply(w, 200, apiv1.SandboxList{Sandboxes: []apiv1.Sandbox{sb}})
	})
	mux.HandleFunc("GET /v1/sandboxes/{id}", func(w http.ResponseWriter, r *http.Request) {
		if sandbox(w, r) {
			reply(w, 200, sb)
		}
	})
	mux.HandleFunc("DELETE /v1/sandboxes/{id}", func(w http.ResponseWriter, r *http.Request) {
		if sandbox(w, r) {
			w.WriteHeader(204)
		}
	})
	mux.HandleFunc("POST /v1/sandboxes/{id}/exec/stream", func(w http.ResponseWriter, r *http.Request) {
		if !sandbox(w, r) {
			return
		}
		w.Header().Set("Content-Type", "application/x-ndjson")
		enc := json.NewEncoder(w)
		f.mu.Lock()
		out := f.stdout
		f.mu.Unlock()
		for len(out) > 0 {
			k := min(len(out), 8192)
			_ = enc.Encode(apiv1.StreamEvent{Type: apiv1.EventStdout, Data: out[:k]})
			out = out[k:]
		}
		_ = enc.Encode(apiv1.StreamEvent{Type: apiv1.EventStderr, Data: "warn\n"})
		_ = enc.Encode(apiv1.StreamEvent{Type: apiv1.EventExit, Exec: &apiv1.ExecResult{ExitCode: 3, DurationMS: 5}})
	})
	mux.HandleFunc("POST /v1/sandboxes/{id}/eval/stream", func(w http.ResponseWriter, r *http.Request) {
		if !sandbox(w, r) {
			return
		}
		enc := json.NewEncoder(w)
		_ = enc.Encode(apiv1.StreamEvent{Type: apiv1.EventStdout, Data: "hi\n"})
		_ = enc.Encode(apiv1.StreamEvent{Type: apiv1.EventResult, Eval: &apiv1.EvalResult{Value: "42", DurationMS: 1}})
	})
	mux.HandleFunc("GET /v1/sandboxes/{id}/files/stat", func(w http.ResponseWriter, r *http.Request) {
		if !sandbox(w, r) {
			return
		}
		p := r.URL.Query().Get("path")
		f.mu.Lock()
		c, ok := f.files[p]
		f.mu.Unlock()
		if !ok {
			fail(w, 404, apiv1.CodeNotFound, "stat "+p+": no such file or directory")
			return
		}
		reply(w, 200, apiv1.FileInfo{Name: p, Path: p, Type: "file", Size: int64(len(c)), Mode: 0o644})
	})
	mux.HandleFunc("GET /v1/sandboxes/{id}/files", func(w http.ResponseWriter, r *http.Request) {
		if !sandbox(w, r) {
			return
		}
		f.mu.Lock()
		f.reads++
		n, hook := f.reads, f.onRead
		f.mu.Unlock()
		if hook != nil {
			hook(n)
		}
		p := r.URL.Query().Get("path")
		f.mu.Lock()
		c, ok := f.files[p]
		f.mu.Unlock()
		if !ok {
			fail(w, 404, apiv1.CodeNotFound, "open "+p+": no such file or directory")
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		_, _ = io.WriteString(w, c)
	})
	mux.HandleFunc("PUT /v1/sandboxes/{id}/files", func(w http.ResponseWriter, r *http.Request) {
		if !sandbox(w, r) {
			return
		}
		b, _ := io.ReadAll(r.Body)
		p := r.URL.Query().Get("path")
		f.mu.Lock()
		f.files[p] = string(b)
		f.mu.Unlock()
		reply(w, 200, apiv1.WriteFileResult{Path: p, Bytes: int64(len(b))})
	})
	mux.HandleFunc("POST /v1/sandboxes/{id}/files/mkdir", func(w http.ResponseWriter, r *http.Request) {
		if sandbox(w, r) {
			reply(w, 200, apiv1.MakeDirResult{Created: true})
		}
	})
	mux.HandleFunc("GET /v1/sandboxes/{id}/files/list", func(w http.ResponseWriter, r *http.Request) {
		if !sandbox(w, r) {
			return
		}
		reply(w, 200, apiv1.FileList{Entries: []apiv1.FileInfo{
			{Name: "a", Path: "/root/a", Type: "file", Size: 3, Mode: 0o644, ModTime: time.Unix(1700000000, 0)},
			{Name: "d", Path: "/root/d", Type: "dir", Mode: 0o755, ModTime: time.Unix(1700000000, 0)},
		}})
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		fail(w, 404, apiv1.CodeNotFound, "fake: no route "+r.Method+" "+r.URL.Path)
	})
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.calls = append(f.calls, r.Method+" "+r.URL.Path)
		f.mu.Unlock()
		mux.ServeHTTP(w, r)
	}))
	t.Cleanup(hs.Close)
	f.url = hs.URL
	c, err := client.New(hs.URL, "")
	if err != nil {
		t.Fatal(err)
	}
	return f, connect(t, New(c, Options{Version: "test"}), o)
}

// connect is an SDK client session of s, in memory.
func connect(t testing.TB, s *sdk.Server, o *sdk.ClientOptions) *sdk.ClientSession {
	t.Helper()
	ct, st := sdk.NewInMemoryTransports()
	ctx := context.Background()
	ss, err := s.Connect(ctx, st, nil)
	if err != nil {
		t.Fatal(err)
	}
	cs, err := sdk.NewClient(&sdk.Implementation{Name: "test", Version: "1"}, o).Connect(ctx, ct, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cs.Close()
		ss.Wait()
	})
	return cs
}

func (f *fakeDaemon) callLog() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

// callTool calls a tool and returns its result's text and structured
// content.
func callTool(t *testing.T, cs *sdk.ClientSession, name string, args any) (string, map[string]any, bool) {
	t.Helper()
	res, err := cs.CallTool(context.Background(), &sdk.CallToolParams{Name: name, Arguments: args})
	if err != nil {
		t.Fatalf("%s: protocol error %v (a tool fails with a result, never this)", name, err)
	}
	var text []string
	for _, c := range res.Content {
		if tc, ok := c.(*sdk.TextContent); ok {
			text = append(text, tc.Text)
		}
	}
	var sc map[string]any
	if res.StructuredContent != nil {
		b, _ := json.Marshal(res.StructuredContent)
		_ = json.Unmarshal(b, &sc)
	}
	return strings.Join(text, "\n"), sc, res.IsError
}
