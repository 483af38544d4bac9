package e2b

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/state"
)

// The code interpreter (port 49999) on the warm interpreter: each E2B
// context is a namespace of it ("" the default python one); an execution
// streams NDJSON lines as E2B's server does.

// defaultContext is the id under which the default python context is
// listed.
const defaultContext = "default"

type executeRequest struct {
	Code      string            `json:"code"`
	ContextID string            `json:"context_id,omitempty"`
	Language  string            `json:"language,omitempty"`
	EnvVars   map[string]string `json:"env_vars,omitempty"`
}

type contextRequest struct {
	Language string `json:"language,omitempty"`
	Cwd      string `json:"cwd,omitempty"`
}

// serveInterpreter serves the code interpreter of rec.
func (s *Server) serveInterpreter(w http.ResponseWriter, r *http.Request, rec *record, sb *state.Sandbox) {
	p := r.URL.Path
	if p == "/health" {
		writeJSON(w, http.StatusOK, "OK")
		return
	}
	if !tokenEqual(r.Header.Get("E2B-Traffic-Access-Token"), rec.TrafficToken) && !tokenEqual(r.Header.Get("X-Access-Token"), rec.AccessToken) {
		writeAPIError(w, errdefs.Unauthenticated("invalid or missing E2B-Traffic-Access-Token for sandbox %s", rec.ID))
		return
	}
	c, release, err := s.e.Agent(r.Context(), sb.ID)
	if err != nil {
		writeGone(w, rec.ID, err)
		return
	}
	defer release() // the idle watch freezes it again once done
	if !slices.Contains(c.Features(), proto.FeatureRich) {
		writeAPIError(w, errdefs.FailedPrecondition("sandbox %s has no warm interpreter of this forkd (snapshot %s): remake it from a python image", rec.ID, sb.Snapshot))
		return
	}
	switch {
	case p == "/execute" && r.Method == http.MethodPost:
		s.execute(w, r, rec, sb, c)
	case p == "/contexts" && r.Method == http.MethodPost:
		s.createContext(w, r, rec)
	case p == "/contexts" && r.Method == http.MethodGet:
		s.listContexts(w, rec)
	case strings.HasPrefix(p, "/contexts/") && strings.HasSuffix(p, "/restart") && r.Method == http.MethodPost:
		s.resetContext(w, r, rec, c, strings.TrimSuffix(strings.TrimPrefix(p, "/contexts/"), "/restart"), false)
	case strings.HasPrefix(p, "/contexts/") && r.Method == http.MethodDelete:
		s.resetContext(w, r, rec, c, strings.TrimPrefix(p, "/contexts/"), true)
	default:
		writeAPIError(w, errdefs.NotFound("code interpreter: no route %s %s", r.Method, errdefs.Quote(p)))
	}
}

// contextOf finds context id of rec; nil with no error for the default.
func contextOf(rec *record, id string) (*codeContext, error) {
	if id == "" || id == defaultContext {
		return nil, nil
	}
	for i := range rec.Contexts {
		if rec.Contexts[i].ID == id {
			return &rec.Contexts[i], nil
		}
	}
	return nil, errdefs.NotFound("Context %s not found", id)
}

// language normalises a language name as E2B's server does.
func language(l string) string {
	switch l := strings.ToLower(l); l {
	case "", "python", "python3":
		return "python"
	case "js":
		return "javascript"
	case "ts":
		return "typescript"
	default:
		return l
	}
}

// ndjson writes the lines of an execution, each flushed.
type ndjson struct {
	mu sync.Mutex
	w  http.ResponseWriter
	rc *http.ResponseController
}

func (n *ndjson) line(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	_, _ = n.w.Write(append(b, '\n')) // a caller that left reads nothing
	_ = n.rc.Flush()
}

// outputLines writes a stream of the code's output as lines of type t.
type outputLines struct {
	n *ndjson
	t string
}

func (o outputLines) Write(p []byte) (int, error) {
	o.n.line(map[string]any{"type": o.t, "text": string(p), "timestamp": time.Now().UTC().Format(time.RFC3339Nano)})
	return len(p), nil
}

func (s *Server) execute(w http.ResponseWriter, r *http.Request, rec *record, sb *state.Sandbox, c *agent.Client) {
	var req executeRequest
	if err := decode(r, &req); err != nil {
		writeAPIError(w, err)
		return
	}
	if req.ContextID != "" && req.Language != "" {
		writeAPIError(w, errdefs.InvalidArgument("give context_id or language, not both"))
		return
	}
	cc, err := contextOf(rec, req.ContextID)
	if err != nil {
		writeAPIError(w, err)
		return
	}
	lang := language(req.Language)
	if cc != nil {
		lang = cc.Language
	}
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(http.StatusOK)
	n := &ndjson{w: w, rc: http.NewResponseController(w)}
	_ = n.rc.Flush()
	if lang != "python" {
		n.line(map[string]any{"type": "error", "name": "UnsupportedLanguage",
			"value": fmt.Sprintf("language %q is not supported by forkd: only python runs in the warm interpreter", lang), "traceback": ""})
		n.line(map[string]any{"type": "end_of_execution"})
		return
	}
	// The default context works in the default user's home, as E2B's.
	ereq := proto.EvalRequest{Code: req.Code, Env: req.EnvVars, Rich: true}
	if u, ok, err := s.users.lookup(r.Context(), c, sb.ID, defaultUser); err == nil && ok {
		ereq.Dir = u.Home
	}
	if cc != nil {
		ereq.Context, ereq.Dir = cc.ID, cc.Cwd
	}
	res, err := c.EvalStream(r.Context(), ereq, outputLines{n, "stdout"}, outputLines{n, "stderr"})
	if err != nil {
		if r.Context().Err() == nil {
			n.line(map[string]any{"type": "error", "name": "ExecutionError", "value": err.Error(), "traceback": ""})
			n.line(map[string]any{"type": "unexpected_end_of_execution"})
		}
		return
	}
	for _, d := range res.Results {
		line := map[string]any{"type": "result", "is_main_result": d.Main}
		for k, v := range d.Formats {
			line[k] = v
		}
		n.line(line)
	}
	if e := res.Error; e != nil {
		n.line(map[string]any{"type": "error", "name": e.Name, "value": e.Message, "traceback": e.Traceback})
	}
	n.line(map[string]any{"type": "number_of_executions", "execution_count": res.Count})
	n.line(map[string]any{"type": "end_of_execution"})
}

func (s *Server) createContext(w http.ResponseWriter, r *http.Request, rec *record) {
	var req contextRequest
	if err := decode(r, &req); err != nil {
		writeAPIError(w, err)
		return
	}
	lang := language(req.Language)
	if lang != "python" {
		writeAPIError(w, errdefs.InvalidArgument("language %q is not supported by forkd: only python", lang))
		return
	}
	cwd := req.Cwd
	if cwd == "" {
		cwd = "/home/user"
	}
	var b [16]byte
	rand.Read(b[:])
	cc := codeContext{ID: hex.EncodeToString(b[:]), Language: lang, Cwd: cwd}
	if _, err := s.store.update(rec.ID, func(cur *record) error {
		if len(cur.Contexts) >= 256 {
			return errdefs.ResourceExhausted("sandbox %s has 256 contexts: remove some", rec.ID)
		}
		cur.Contexts = append(cur.Contexts, cc)
		return nil
	}); err != nil {
		writeAPIError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, cc)
}

func (s *Server) listContexts(w http.ResponseWriter, rec *record) {
	out := []codeContext{{ID: defaultContext, Language: "python", Cwd: "/home/user"}}
	out = append(out, rec.Contexts...)
	writeJSON(w, http.StatusOK, out)
}

// resetContext restarts (empties) a context, or removes it.
func (s *Server) resetContext(w http.ResponseWriter, r *http.Request, rec *record, c *agent.Client, id string, remove bool) {
	cc, err := contextOf(rec, id)
	if err != nil {
		writeAPIError(w, err)
		return
	}
	name := ""
	if cc != nil {
		name = cc.ID
	}
	ctx, cancel := context.WithTimeout(r.Context(), time.Minute)
	defer cancel()
	if _, err := c.Eval(ctx, proto.EvalRequest{Context: name, Reset: true}); err != nil {
		writeAPIError(w, err)
		return
	}
	if remove && cc != nil {
		if _, err := s.store.update(rec.ID, func(cur *record) error {
			for i := range cur.Contexts {
				if cur.Contexts[i].ID == id {
					cur.Contexts = append(cur.Contexts[:i], cur.Contexts[i+1:]...)
					return nil
				}
			}
			return nil
		}); err != nil {
			writeAPIError(w, err)
			return
		}
	}
	writeJSON(w, http.StatusOK, nil)
}
