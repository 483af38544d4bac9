package server

import (
	"context"
	"net/http"
	"slices"
	"strings"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
)

// route is one entry of the API: the pattern it is served on, what the
// OpenAPI document says about it, and its handler.
type route struct {
	Method, Path string
	Summary      string
	// Public routes need no authentication.
	Public bool
	// Status is the success status (default 200).
	Status int
	// Response is a sample of the JSON response (nil: none or not JSON).
	Response any
	// Produces is the response's content type when it is not JSON.
	Produces string
	// Consumes is the request body's content type when it is not JSON.
	Consumes string
	Query    []param
	h        handler
}

// param is a query parameter, for the docs.
type param struct {
	Name, Type, Doc string
	Required        bool
}

// handler is what a route runs: fn returns the value to write as JSON (or
// writes the response itself and returns nil, nil); req is a sample of the
// JSON request body, for the docs.
type handler struct {
	fn  func(s *Server, w http.ResponseWriter, r *http.Request) (any, error)
	req any
}

// plain is a handler without a request body.
func plain(fn func(*Server, *http.Request) (any, error)) handler {
	return handler{fn: func(s *Server, _ http.ResponseWriter, r *http.Request) (any, error) { return fn(s, r) }}
}

// body is a handler whose JSON request body (Content-Type application/json)
// is decoded strictly into Req.
func body[Req any](fn func(*Server, *http.Request, *Req) (any, error)) handler {
	return handler{
		req: new(Req),
		fn: func(s *Server, w http.ResponseWriter, r *http.Request) (any, error) {
			if _, err := bodyType(r); err != nil {
				return nil, err
			}
			var req Req
			if err := s.decodeBody(w, r, &req); err != nil {
				return nil, err
			}
			return fn(s, r, &req)
		},
	}
}

// raw is a handler that writes its own response (streams, files). An error
// it returns before writing anything is written as usual.
func raw(fn func(*Server, http.ResponseWriter, *http.Request) error, req any) handler {
	return handler{req: req, fn: func(s *Server, w http.ResponseWriter, r *http.Request) (any, error) {
		return nil, fn(s, w, r)
	}}
}

var (
	pathParam  = param{Name: "path", Type: "string", Doc: "absolute guest path", Required: true}
	ndjson     = "application/x-ndjson"
	octets     = "application/octet-stream"
	sbFilters  = []param{{Name: "snapshot", Type: "string", Doc: "only children of this snapshot"}, {Name: "metadata", Type: "string", Doc: "KEY=VALUE; repeatable, all must match"}, {Name: "status", Type: "string", Doc: "only sandboxes in this status: " + strings.Join(request.SandboxStatuses, ", ")}}
	listParams = []param{pathParam, {Name: "depth", Type: "integer", Doc: "levels to list (default 1)"}}
)

// routes is the API, in one table.
var routes = []route{
	{Method: "GET", Path: "/healthz", Summary: "Liveness; no authentication", Public: true, Response: apiv1.Health{}, h: plain((*Server).health)},
	{Method: "GET", Path: "/version", Summary: "Daemon and backend versions", Response: apiv1.VersionInfo{}, h: plain((*Server).version)},
	{Method: "GET", Path: "/metrics", Summary: "Prometheus metrics", Produces: "text/plain", h: raw((*Server).serveMetrics, nil)},
	{Method: "GET", Path: "/v1/openapi.json", Summary: "This API as an OpenAPI 3.1 document", Public: true, Response: map[string]any{}, h: raw((*Server).serveOpenAPI, nil)},

	{Method: "GET", Path: "/v1/snapshots", Summary: "List snapshots", Response: apiv1.SnapshotList{}, h: plain((*Server).listSnapshots)},
	{Method: "POST", Path: "/v1/snapshots", Summary: "Build a snapshot from an image (202 with an operation)", Status: http.StatusAccepted, Response: apiv1.Operation{}, h: body((*Server).createSnapshot)},
	{Method: "GET", Path: "/v1/snapshots/{tag}", Summary: "One snapshot, with size, refcount and status", Response: apiv1.Snapshot{}, h: plain((*Server).getSnapshot)},
	{Method: "DELETE", Path: "/v1/snapshots/{tag}", Summary: "Delete a snapshot; 409 while sandboxes use it, or while snapshots made from it remain (unless cascade or force)", Status: http.StatusNoContent,
		Query: []param{{Name: "cascade", Type: "boolean", Doc: "also remove the snapshots made from it, recursively"}, {Name: "force", Type: "boolean", Doc: "remove it and leave the snapshots made from it (each still forks; its chain is broken)"}},
		h:     plain((*Server).deleteSnapshot)},
	{Method: "GET", Path: "/v1/snapshots/{tag}/info", Summary: "A snapshot's chain (parent, depth, ancestors, dependents) and sizes", Response: apiv1.SnapshotInfo{}, h: plain((*Server).snapshotInfo)},
	{Method: "POST", Path: "/v1/snapshots/{tag}/push", Summary: "Push the snapshot (and its chain) to an OCI registry (202 with an operation)", Status: http.StatusAccepted, Response: apiv1.Operation{}, h: body((*Server).pushSnapshot)},
	{Method: "POST", Path: "/v1/snapshots/pull", Summary: "Pull a snapshot (and the links of its chain not here) from an OCI registry (202 with an operation)", Status: http.StatusAccepted, Response: apiv1.Operation{}, h: body((*Server).pullSnapshot)},
	{Method: "POST", Path: "/v1/snapshots/{tag}/pack", Summary: "Write the snapshot (and its chain) as an OCI layout tar file in the export directory (202 with an operation)", Status: http.StatusAccepted, Response: apiv1.Operation{}, h: body((*Server).packSnapshot)},
	{Method: "POST", Path: "/v1/snapshots/unpack", Summary: "Read a snapshot from an OCI layout tar file in the import directory (202 with an operation)", Status: http.StatusAccepted, Response: apiv1.Operation{}, h: body((*Server).unpackSnapshot)},
	{Method: "POST", Path: "/v1/snapshots/{tag}/compact", Summary: "Make snapshot `to`, standing alone, from this one and its chain", Status: http.StatusCreated, Response: apiv1.Snapshot{}, h: body((*Server).compactSnapshot)},
	{Method: "POST", Path: "/v1/workspaces", Summary: "Create a workspace: a named, long-lived sandbox", Status: http.StatusCreated, Response: apiv1.Workspace{}, h: body((*Server).createWorkspace)},
	{Method: "GET", Path: "/v1/workspaces", Summary: "List workspaces", Response: apiv1.WorkspaceList{}, h: plain((*Server).listWorkspaces)},
	{Method: "GET", Path: "/v1/workspaces/{name}", Summary: "One workspace", Response: apiv1.Workspace{}, h: plain((*Server).getWorkspace)},
	{Method: "POST", Path: "/v1/workspaces/{name}/suspend", Summary: "Branch the workspace's sandbox into a state snapshot and stop it", Response: apiv1.Workspace{}, h: plain((*Server).suspendWorkspace)},
	{Method: "POST", Path: "/v1/workspaces/{name}/resume", Summary: "Fork the workspace's sandbox again from its latest state (a new id)", Response: apiv1.Workspace{}, h: plain((*Server).resumeWorkspace)},
	{Method: "DELETE", Path: "/v1/workspaces/{name}", Summary: "Remove a workspace: its sandbox and its state snapshots, never the snapshot it was created from", Status: http.StatusNoContent, h: plain((*Server).deleteWorkspace)},
	{Method: "POST", Path: "/v1/e2b/keys", Summary: "Issue an E2B-format API key for the E2B listener (the key is in this answer only)", Status: http.StatusCreated, Response: apiv1.E2BKey{}, h: body((*Server).createKey)},
	{Method: "GET", Path: "/v1/e2b/keys", Summary: "List the E2B API keys (without the keys)", Response: apiv1.E2BKeyList{}, h: plain((*Server).listKeys)},
	{Method: "DELETE", Path: "/v1/e2b/keys/{id}", Summary: "Revoke an E2B API key", Status: http.StatusNoContent, h: plain((*Server).revokeKey)},
	{Method: "GET", Path: "/v1/operations", Summary: "List long-running operations", Response: apiv1.OperationList{}, h: plain((*Server).listOperations)},
	{Method: "GET", Path: "/v1/operations/{id}", Summary: "One operation", Response: apiv1.Operation{}, h: plain((*Server).getOperation)},

	{Method: "POST", Path: "/v1/sandboxes", Summary: "Fork n sandboxes from a snapshot; ready when returned", Status: http.StatusCreated, Response: apiv1.CreateSandboxesResponse{}, h: body((*Server).createSandboxes)},
	{Method: "GET", Path: "/v1/sandboxes", Summary: "List sandboxes", Query: sbFilters, Response: apiv1.SandboxList{}, h: plain((*Server).listSandboxes)},
	{Method: "GET", Path: "/v1/sandboxes/{id}", Summary: "One sandbox", Response: apiv1.Sandbox{}, h: plain((*Server).getSandbox)},
	{Method: "DELETE", Path: "/v1/sandboxes/{id}", Summary: "Kill a sandbox and reclaim what it used", Status: http.StatusNoContent, h: plain((*Server).deleteSandbox)},
	{Method: "POST", Path: "/v1/sandboxes/{id}/timeout", Summary: "Kill the sandbox timeout_secs from now (0: never)", Response: apiv1.Sandbox{}, h: body((*Server).setTimeout)},
	{Method: "PUT", Path: "/v1/sandboxes/{id}/network", Summary: "Replace the sandbox's egress policy, atomically", Response: apiv1.Sandbox{}, h: body((*Server).setNetwork)},
	{Method: "POST", Path: "/v1/sandboxes/{id}/ports", Summary: "Publish a guest TCP port on a host port", Response: apiv1.PublishedPort{}, h: body((*Server).publishPort)},
	{Method: "POST", Path: "/v1/sandboxes/{id}/branch", Summary: "Snapshot the running sandbox into a new snapshot (201; 202 with status writing when wait is false)", Status: http.StatusCreated, Response: apiv1.Snapshot{}, h: body((*Server).branchSandbox)},
	{Method: "POST", Path: "/v1/sandboxes/{id}/fork", Summary: "Fork count sandboxes from the running sandbox's current state (a snapshot of their own, gone with the last of them)", Status: http.StatusCreated, Response: apiv1.CreateSandboxesResponse{}, h: body((*Server).forkSandbox)},
	{Method: "POST", Path: "/v1/sandboxes/{id}/ping", Summary: "Round trip to the guest agent", Response: apiv1.PingResult{}, h: plain((*Server).ping)},
	{Method: "POST", Path: "/v1/sandboxes/{id}/exec", Summary: "Run a process; output buffered in the result", Response: apiv1.ExecResult{}, h: body((*Server).exec)},
	{Method: "POST", Path: "/v1/sandboxes/{id}/exec/stream", Summary: "Run a process; output streamed as NDJSON events as produced", Produces: ndjson, Response: apiv1.StreamEvent{}, h: raw((*Server).execStream, new(apiv1.ExecRequest))},
	{Method: "POST", Path: "/v1/sandboxes/{id}/processes", Summary: "Start a background process (201 with its pid)", Status: http.StatusCreated, Response: apiv1.Process{}, h: body((*Server).startProcess)},
	{Method: "GET", Path: "/v1/sandboxes/{id}/processes", Summary: "List background processes, running and recently ended", Response: apiv1.ProcessList{}, h: plain((*Server).listProcesses)},
	{Method: "GET", Path: "/v1/sandboxes/{id}/processes/{pid}", Summary: "One background process", Response: apiv1.Process{}, h: plain((*Server).getProcess)},
	{Method: "POST", Path: "/v1/sandboxes/{id}/processes/{pid}/wait", Summary: "Wait for a background process to end", Response: apiv1.ExecResult{}, h: plain((*Server).waitProcess)},
	{Method: "GET", Path: "/v1/sandboxes/{id}/processes/{pid}/stream", Summary: "Attach: recent then live output as NDJSON, ending with its exit", Produces: ndjson, Response: apiv1.StreamEvent{}, h: raw((*Server).streamProcess, nil)},
	{Method: "POST", Path: "/v1/sandboxes/{id}/processes/{pid}/stdin", Summary: "Write the raw body to its stdin (eof=true closes it after)", Consumes: octets, Status: http.StatusNoContent,
		Query: []param{{Name: "eof", Type: "boolean", Doc: "close stdin after this data"}}, h: handler{fn: (*Server).processStdin}},
	{Method: "POST", Path: "/v1/sandboxes/{id}/processes/{pid}/signal", Summary: "Send a signal to its process group", Status: http.StatusNoContent, h: body((*Server).signalProcess)},
	{Method: "DELETE", Path: "/v1/sandboxes/{id}/processes/{pid}", Summary: "Kill it (SIGKILL to its group)", Status: http.StatusNoContent, h: plain((*Server).killProcess)},
	{Method: "POST", Path: "/v1/sandboxes/{id}/eval", Summary: "Run Python in the warm interpreter", Response: apiv1.EvalResult{}, h: body((*Server).eval)},
	{Method: "POST", Path: "/v1/sandboxes/{id}/eval/stream", Summary: "Run Python; output streamed as NDJSON events", Produces: ndjson, Response: apiv1.StreamEvent{}, h: raw((*Server).evalStream, new(apiv1.EvalRequest))},
	{Method: "GET", Path: "/v1/sandboxes/{id}/files", Summary: "Read a file (raw bytes)", Query: []param{pathParam}, Produces: octets, h: raw((*Server).readFile, nil)},
	{Method: "PUT", Path: "/v1/sandboxes/{id}/files", Summary: "Write a file from the raw body, atomically", Consumes: octets, Query: []param{pathParam, {Name: "mode", Type: "string", Doc: "octal permission bits (default: keep, or 0644)"}}, Response: apiv1.WriteFileResult{}, h: handler{fn: (*Server).writeFile}},
	{Method: "DELETE", Path: "/v1/sandboxes/{id}/files", Summary: "Remove a path", Query: []param{pathParam, {Name: "recursive", Type: "boolean", Doc: "remove a non-empty directory"}}, Status: http.StatusNoContent, h: plain((*Server).removeFile)},
	{Method: "GET", Path: "/v1/sandboxes/{id}/files/list", Summary: "List a directory", Query: listParams, Response: apiv1.FileList{}, h: plain((*Server).listFiles)},
	{Method: "GET", Path: "/v1/sandboxes/{id}/files/stat", Summary: "Describe a path", Query: []param{pathParam}, Response: apiv1.FileInfo{}, h: plain((*Server).statFile)},
	{Method: "POST", Path: "/v1/sandboxes/{id}/files/mkdir", Summary: "Make a directory and its parents", Response: apiv1.MakeDirResult{}, h: body((*Server).makeDir)},
	{Method: "POST", Path: "/v1/sandboxes/{id}/files/rename", Summary: "Rename a path", Status: http.StatusNoContent, h: body((*Server).renameFile)},
}

// reqInfo is what the middleware learns about a request from deeper down.
type reqInfo struct {
	route  string // "METHOD /pattern", or "" when no route matched
	caller string
}

type reqInfoKey struct{}

func info(r *http.Request) *reqInfo {
	if ri, ok := r.Context().Value(reqInfoKey{}).(*reqInfo); ok {
		return ri
	}
	return &reqInfo{}
}

// adapt is the one adapter between a route's handler and HTTP: it
// authenticates, runs the handler and writes its value as JSON with the
// route's status, or its error as an ErrorResponse.
func (s *Server) adapt(rt route) http.Handler {
	status := rt.Status
	if status == 0 {
		status = http.StatusOK
	}
	name := rt.Method + " " + rt.Path
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ri := info(r)
		ri.route = name
		caller, err := s.authenticate(r)
		ri.caller = caller
		if err != nil && !rt.Public {
			w.Header().Set("WWW-Authenticate", `Bearer realm="forkd"`)
			s.boundDiscard(w, err)
			writeError(w, err)
			return
		}
		if err := checkQuery(r, rt.Query); err != nil {
			s.boundDiscard(w, err)
			writeError(w, err)
			return
		}
		v, err := rt.h.fn(s, w, r)
		sw, _ := w.(*statusWriter)
		switch {
		case err != nil && sw != nil && sw.wrote:
			// Too late for a status: cut the response so the caller
			// sees it incomplete.
			s.log.Warn("request failed after its response started", "route", name, "err", err)
			panic(http.ErrAbortHandler)
		case err != nil:
			s.boundDiscard(w, err)
			writeError(w, err)
		case v != nil || status == http.StatusNoContent:
			if st, ok := v.(statusValue); ok { // a status of the handler's own
				writeJSON(w, st.code, st.v)
				return
			}
			writeJSON(w, status, v)
		}
	})
}

// checkQuery refuses query parameters a route does not take, naming
// those it does.
func checkQuery(r *http.Request, params []param) error {
	for name := range r.URL.Query() {
		if !slices.ContainsFunc(params, func(p param) bool { return p.Name == name }) {
			if len(params) == 0 {
				return errdefs.InvalidArgument("unknown query parameter %s: %s %s takes none", errdefs.Quote(name), r.Method, errdefs.Quote(r.URL.Path))
			}
			names := make([]string, len(params))
			for i, p := range params {
				names[i] = p.Name
			}
			return errdefs.InvalidArgument("unknown query parameter %s: want one of %s", errdefs.Quote(name), strings.Join(names, ", "))
		}
	}
	return nil
}

// noRoute answers requests no route matched: 405 with Allow when the path
// exists under other methods, else 404, both as ErrorResponses.
func (s *Server) noRoute(w http.ResponseWriter, r *http.Request) {
	ri := info(r)
	caller, err := s.authenticate(r)
	ri.caller = caller
	if err != nil {
		writeError(w, err)
		return
	}
	var allow []string
	for _, m := range []string{"GET", "POST", "PUT", "DELETE", "PATCH"} {
		probe := r.Clone(context.Background())
		probe.Method = m
		if _, pat := s.mux.Handler(probe); pat != "" && pat != "/" {
			allow = append(allow, m)
		}
	}
	if len(allow) > 0 {
		w.Header().Set("Allow", strings.Join(allow, ", "))
		writeJSON(w, http.StatusMethodNotAllowed, apiv1.ErrorResponse{Error: apiv1.Error{
			Code: apiv1.CodeInvalidArgument, Message: r.Method + " " + errdefs.Quote(r.URL.Path) + ": method not allowed (allowed: " + strings.Join(allow, ", ") + ")"}})
		return
	}
	writeError(w, errdefs.NotFound("no route %s %s (see /v1/openapi.json)", errdefs.Quote(r.Method), errdefs.Quote(r.URL.Path)))
}
