// Package e2b is forkd's E2B face: one HTTP listener that the official E2B
// SDKs (npm e2b and @e2b/code-interpreter) use unchanged. It translates,
// on the host, E2B's control plane onto the engine's sandboxes and
// snapshots, envd (the agent E2B runs in its sandboxes: Connect RPC and a
// little REST) onto forkd's guest agent, the code interpreter onto the warm
// interpreter, and any other sandbox port onto the sandbox's own network.
// No second agent runs in the guest.
//
// Requests are told apart as E2B's proxy does: a Host of the form
// <port>-<sandbox id>.<domain> (with Config.Domain set), or, on a Host
// that is an IP address, localhost or sandbox.<domain>, the
// E2b-Sandbox-Id and E2b-Sandbox-Port headers, name a sandbox's port
// (49983 envd, 49999 the code interpreter, any other a guest port);
// everything else is the control plane. See docs/e2b.md.
package e2b

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/apikey"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
)

// Ports of a sandbox that the listener serves itself.
const (
	EnvdPort        = 49983
	InterpreterPort = 49999
)

// EnvdVersion is the envd version this face reports: the SDKs gate
// features on it (watchDir recursive 0.1.4, metrics 0.1.5, stdin false
// 0.3.0, default user 0.4.0, closeStdin 0.5.2, octet-stream and gzip
// uploads 0.5.7, file metadata 0.6.2, watch includeEntry 0.6.3,
// allowNetworkMounts 0.6.4).
const EnvdVersion = "0.6.13"

// Default templates and timeouts.
const (
	DefaultTimeout     = 300 * time.Second
	DefaultForkTimeout = 15 * time.Second
	defaultUser        = "user"
)

// Config configures a Server.
type Config struct {
	Engine   *sandbox.Engine
	Admitter *sandbox.Admitter
	Expirer  *sandbox.Expirer
	// Keys are the API keys the control plane accepts (X-API-Key).
	Keys *apikey.Store
	// Dir keeps the E2B sandbox records (default <data>/e2b).
	Dir string
	// Domain, if set, is the sandboxes' domain (with a :port when not the
	// listener's default): create answers it, and Hosts under it route to
	// sandboxes.
	Domain string
	// Templates maps E2B template ids to forkd snapshot tags (base and
	// code-interpreter-v1 by default map to "base" and
	// "code-interpreter"); any other template id names a tag itself.
	Templates map[string]string
	Logger    *slog.Logger
}

// Server serves the E2B listener. Create it with New and run its
// background work with Start.
type Server struct {
	cfg   Config
	e     *sandbox.Engine
	log   *slog.Logger
	store *store
	mux   *http.ServeMux
	base  context.Context // the daemon's lifetime, for work no request owns

	ops    opLocks // one lifecycle operation per E2B sandbox at a time
	wake   chan struct{}
	procs  procTable
	watch  watchers
	users  userCache
	trOnce sync.Once
	tr     *http.Transport // the port proxy's
	cancel context.CancelFunc
	work   sync.WaitGroup
}

// New returns a Server over cfg.Engine.
func New(cfg Config) (*Server, error) {
	if cfg.Engine == nil || cfg.Admitter == nil || cfg.Expirer == nil || cfg.Keys == nil {
		return nil, errdefs.InvalidArgument("e2b: engine, admitter, expirer and keys are needed")
	}
	if cfg.Dir == "" {
		cfg.Dir = filepath.Join(cfg.Engine.Config().DataDir, "e2b")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	tpl := map[string]string{"base": "base", "code-interpreter-v1": "code-interpreter"}
	for k, v := range cfg.Templates {
		tpl[k] = v
	}
	cfg.Templates = tpl
	st, err := openStore(cfg.Dir)
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, e: cfg.Engine, log: cfg.Logger, store: st, wake: make(chan struct{}, 1)}
	s.base, s.cancel = context.WithCancel(context.Background())
	s.procs.init()
	s.watch.init()
	s.mux = http.NewServeMux()
	for _, rt := range controlRoutes {
		s.mux.HandleFunc(rt.pattern, s.control(rt))
	}
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if _, err := s.authenticate(r); err != nil {
			writeAPIError(w, err)
			return
		}
		writeAPIError(w, errdefs.NotFound("no route %s %s", r.Method, errdefs.Quote(r.URL.Path)))
	})
	return s, nil
}

// Close stops the server's background work (watchers, the expiry loop).
// Sandboxes keep running.
func (s *Server) Close() {
	s.cancel()
	s.watch.closeAll()
	s.work.Wait()
}

// ServeHTTP routes a request to a sandbox's port or to the control plane.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if id, port, ok := s.route(r); ok {
		s.serveSandbox(w, r, id, port)
		return
	}
	s.mux.ServeHTTP(w, r)
}

// HTTPServer returns an http.Server for s: no read or write timeouts, so
// that streams live as long as their callers (E2B's keepalives are 50 s).
func (s *Server) HTTPServer() *http.Server {
	return &http.Server{
		Handler:           s,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
}

// route finds the sandbox and port a request is for, as E2B's proxy does.
func (s *Server) route(r *http.Request) (id string, port int, ok bool) {
	host := hostOnly(r.Host)
	domain := hostOnly(s.cfg.Domain)
	if domain != "" && strings.HasSuffix(host, "."+domain) {
		label, _, _ := strings.Cut(host, ".")
		p, sid, found := strings.Cut(label, "-")
		if n, err := strconv.Atoi(p); found && err == nil && n > 0 && n < 65536 && validSandboxID(sid) {
			return sid, n, true
		}
		if label != "sandbox" && label != "api" {
			return "", 0, false
		}
	}
	sid := r.Header.Get("E2b-Sandbox-Id")
	if sid == "" {
		return "", 0, false
	}
	if !(net.ParseIP(host) != nil || host == "localhost" || domain != "" && host == "sandbox."+domain) {
		return "", 0, false
	}
	port = EnvdPort
	if p := r.Header.Get("E2b-Sandbox-Port"); p != "" {
		n, err := strconv.Atoi(p)
		if err != nil || n <= 0 || n >= 65536 {
			return "", 0, false
		}
		port = n
	}
	return sid, port, true
}

// hostOnly strips a port from a host.
func hostOnly(h string) string {
	if host, _, err := net.SplitHostPort(h); err == nil {
		h = host
	}
	return strings.ToLower(strings.TrimSuffix(strings.Trim(h, "[]"), "."))
}

// validSandboxID checks an E2B sandbox id: what newSandboxID makes.
func validSandboxID(id string) bool {
	if len(id) == 0 || len(id) > 64 {
		return false
	}
	for _, c := range id {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

// newSandboxID returns 20 characters of [a-z0-9], as E2B's ids.
func newSandboxID() string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, 20)
	rand.Read(b)
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	return string(b)
}

// newToken returns a random token for a sandbox (envd access, traffic).
func newToken() string {
	b := make([]byte, 24)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// tokenEqual compares tokens in constant time.
func tokenEqual(a, b string) bool {
	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1 && a != ""
}

// authenticate checks the control plane's X-API-Key.
func (s *Server) authenticate(r *http.Request) (apikey.Key, error) {
	key := r.Header.Get("X-Api-Key")
	if key == "" {
		if a := r.Header.Get("Authorization"); strings.HasPrefix(a, "Bearer ") {
			key = strings.TrimPrefix(a, "Bearer ")
		}
	}
	if key == "" {
		return apikey.Key{}, errdefs.Unauthenticated("no API key: set X-API-Key (E2B_API_KEY) to a key from forkd e2b key create")
	}
	k, ok := s.cfg.Keys.Check(key)
	if !ok {
		return apikey.Key{}, errdefs.Unauthenticated("invalid API key")
	}
	return k, nil
}

// writeJSON writes v with status.
func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status, b = http.StatusInternalServerError, []byte(`{"code":500,"message":"encode response"}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// apiError is E2B's error body: {"code": <status>, "message": ...}.
type apiError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// statusOf maps an error's class to an HTTP status.
func statusOf(err error) int {
	switch {
	case errdefs.IsNotFound(err):
		return http.StatusNotFound
	case errdefs.IsAlreadyExists(err), errdefs.IsFailedPrecondition(err):
		return http.StatusConflict
	case errdefs.IsInvalidArgument(err):
		return http.StatusBadRequest
	case errdefs.IsUnauthenticated(err):
		return http.StatusUnauthorized
	case errdefs.IsResourceExhausted(err):
		return http.StatusTooManyRequests
	case errdefs.IsUnavailable(err):
		return http.StatusServiceUnavailable
	case errdefs.IsNotImplemented(err):
		return http.StatusNotImplemented
	case errdefs.IsDeadlineExceeded(err):
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

// writeAPIError writes err as E2B's control plane does, with a status the
// SDKs turn into their own error classes.
func writeAPIError(w http.ResponseWriter, err error) {
	status := statusOf(err)
	writeJSON(w, status, apiError{Code: status, Message: err.Error()})
}

// opLocks serialise the lifecycle operations (pause, resume, kill, fork)
// of each E2B sandbox.
type opLocks struct {
	mu sync.Mutex
	m  map[string]*opLock
}

type opLock struct {
	sync.Mutex
	users int
}

func (o *opLocks) lock(id string) func() {
	o.mu.Lock()
	if o.m == nil {
		o.m = map[string]*opLock{}
	}
	l := o.m[id]
	if l == nil {
		l = &opLock{}
		o.m[id] = l
	}
	l.users++
	o.mu.Unlock()
	l.Lock()
	return func() {
		l.Unlock()
		o.mu.Lock()
		if l.users--; l.users == 0 {
			delete(o.m, id)
		}
		o.mu.Unlock()
	}
}
