// Package server is forkd's REST API v1 over HTTP: the routes of `forkd
// serve`, in one table (routes.go), each handler returning (value, error)
// behind one adapter that writes JSON and maps error classes to HTTP
// statuses (errors.go).
//
// The server owns no VM: sandboxes belong to the engine and outlive both
// requests and the server. A request's context only bounds how long its
// caller waits; work it started that cannot finish is rolled back by the
// engine.
package server

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/apikey"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/sandbox"
)

// Config configures a Server.
type Config struct {
	Engine   *sandbox.Engine
	Admitter *sandbox.Admitter
	Expirer  *sandbox.Expirer
	// Token is the bearer token TCP callers must present. Nil disables
	// authentication on TCP: only for a loopback listener (the caller of
	// New decides; forkd serve refuses anything else).
	Token []byte
	// MaxBodyBytes bounds JSON request bodies (default 1 MiB).
	MaxBodyBytes int64
	// MaxBodyBytesInFlight bounds the bytes of JSON request bodies held
	// at once, all requests together (default 64 MiB, at least
	// MaxBodyBytes). A request that finds no room within BodyWait
	// (default 1 s) is refused with 429 and Retry-After.
	MaxBodyBytesInFlight int64
	BodyWait             time.Duration
	// BodyTimeout bounds how long a JSON body (or a streamed exec's JSON
	// head) may take to arrive (default 30 s); BodyStallTimeout how long
	// any body, file uploads included, may go without a byte (default
	// 10 s). Either cuts the request with 408. A streamed exec's stdin
	// has no such bound, nor has any body of a Local server.
	BodyTimeout, BodyStallTimeout time.Duration
	// MaxFileBytes bounds a file upload (default 1 GiB).
	MaxFileBytes int64
	// MaxExecOutput bounds each stream of a buffered exec's output
	// (default 16 MiB); more is dropped and Truncated set.
	MaxExecOutput int
	// OperationsDir keeps long-running operations (default
	// <data>/operations).
	OperationsDir string
	// ImportDir is the one directory whose tarballs and OCI layouts
	// snapshot requests may import (default <data>/imports); any other
	// oci.ref must be a registry reference. Unpack reads only from it too.
	ImportDir string
	// ExportDir is the one directory pack writes into (default
	// <data>/exports).
	ExportDir string
	// AllowImageScripts lets snapshot requests install oci.extra packages,
	// which runs the image's apt and maintainer scripts as root on the host
	// (in a chroot); without it such requests are refused with 400.
	AllowImageScripts bool
	// Local makes a server for one CLI process that runs the engine
	// itself (see Pipe): operations live in memory, local images are
	// imported from any path and oci.extra is allowed, since both run with
	// the caller's own rights. OperationsDir, ImportDir and
	// AllowImageScripts are ignored.
	Local bool
	// Keys are the E2B API keys (default: <data>/e2b-keys.json).
	Keys *apikey.Store
	// Audit receives one JSON line per request; nil discards.
	Audit   io.Writer
	Logger  *slog.Logger
	Version string
}

// DefaultMaxBodyBytesInFlight is Config.MaxBodyBytesInFlight's default.
const DefaultMaxBodyBytesInFlight = 64 << 20

// Server serves the API. Create it with New.
type Server struct {
	cfg      Config
	e        *sandbox.Engine
	log      *slog.Logger
	tokenSum []byte // sha256 of the token; nil: no auth on TCP
	handler  http.Handler
	mux      *http.ServeMux
	ops      *operations
	metrics  *metrics
	registry *prometheus.Registry
	audit    *auditLog
	openapi  []byte // the OpenAPI document, built once
	bodies   *byteBudget

	base      context.Context // the daemon's lifetime; cancelled by Close
	cancel    context.CancelFunc
	work      sync.WaitGroup // background work (snapshot builds, transfers)
	builds    chan struct{}  // one token per snapshot build running
	transfers chan struct{}  // one token per push, pull, pack or unpack running
}

// New returns a Server over cfg.Engine.
func New(cfg Config) (*Server, error) {
	if cfg.Engine == nil {
		return nil, errdefs.InvalidArgument("server: no engine")
	}
	if cfg.Admitter == nil {
		cfg.Admitter = sandbox.NewAdmitter(cfg.Engine, sandbox.Admission{})
	}
	if cfg.Expirer == nil {
		cfg.Expirer = sandbox.NewExpirer(cfg.Engine)
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = 1 << 20
	}
	if cfg.MaxBodyBytesInFlight <= 0 {
		cfg.MaxBodyBytesInFlight = DefaultMaxBodyBytesInFlight
	}
	if cfg.MaxBodyBytesInFlight < cfg.MaxBodyBytes {
		return nil, errdefs.InvalidArgument("server: %d bytes of bodies in flight cannot hold one body of %d bytes", cfg.MaxBodyBytesInFlight, cfg.MaxBodyBytes)
	}
	if cfg.BodyWait <= 0 {
		cfg.BodyWait = time.Second
	}
	if cfg.BodyTimeout <= 0 {
		cfg.BodyTimeout = 30 * time.Second
	}
	if cfg.BodyStallTimeout <= 0 {
		cfg.BodyStallTimeout = 10 * time.Second
	}
	if cfg.MaxFileBytes <= 0 {
		cfg.MaxFileBytes = 1 << 30
	}
	if cfg.MaxExecOutput <= 0 {
		cfg.MaxExecOutput = 16 << 20
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Version == "" {
		cfg.Version = "dev"
	}
	switch {
	case cfg.Local:
		cfg.OperationsDir, cfg.ImportDir, cfg.ExportDir, cfg.AllowImageScripts = "", "", "", true
	default:
		if cfg.OperationsDir == "" {
			cfg.OperationsDir = cfg.Engine.Config().DataDir + "/operations"
		}
		if cfg.ImportDir == "" {
			cfg.ImportDir = cfg.Engine.Config().DataDir + "/imports"
		}
		if cfg.ExportDir == "" {
			cfg.ExportDir = cfg.Engine.Config().DataDir + "/exports"
		}
	}
	if cfg.Token != nil {
		if err := CheckToken(cfg.Token); err != nil {
			return nil, err
		}
	}
	if cfg.Keys == nil {
		keys, err := apikey.Open(filepath.Join(cfg.Engine.Config().DataDir, KeysFile))
		if err != nil {
			return nil, err
		}
		cfg.Keys = keys
	}
	ops, err := openOperations(cfg.OperationsDir)
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, e: cfg.Engine, log: cfg.Logger, ops: ops, audit: newAuditLog(cfg.Audit),
		bodies: newByteBudget(cfg.MaxBodyBytesInFlight)}
	if cfg.Token != nil {
		sum := sha256.Sum256(cfg.Token)
		s.tokenSum = sum[:]
	}
	s.base, s.cancel = context.WithCancel(context.Background())
	s.builds = make(chan struct{}, 2)
	s.transfers = make(chan struct{}, 2)
	s.registry = prometheus.NewRegistry()
	s.metrics = newMetrics(s, s.registry)
	cfg.Expirer.OnKill = func(string) { s.metrics.expired.Inc() }
	if s.openapi, err = openAPI(cfg.Version); err != nil {
		return nil, err
	}
	s.mux = http.NewServeMux()
	for _, rt := range routes {
		s.mux.Handle(rt.Method+" "+rt.Path, s.adapt(rt))
	}
	s.mux.HandleFunc("/", s.noRoute)
	s.handler = s.middleware(s.mux)
	return s, nil
}

// Handler is the server's HTTP handler. Connections should be served with
// ConnContext set to the server's (Serve does it), or unix socket callers
// are treated as TCP callers.
func (s *Server) Handler() http.Handler { return s.handler }

// HTTPServer returns an http.Server for s with sane timeouts.
func (s *Server) HTTPServer() *http.Server {
	return &http.Server{
		Handler:           s.handler,
		ConnContext:       connContext,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
}

// Serve serves the listeners until ctx ends, then shuts down gracefully:
// it stops accepting, gives requests in flight up to grace to finish,
// cancels background work (a snapshot being built is abandoned and its
// operation marked failed), and returns. Sandboxes keep running.
func (s *Server) Serve(ctx context.Context, grace time.Duration, listeners ...net.Listener) error {
	hs := s.HTTPServer()
	errc := make(chan error, len(listeners))
	for _, ln := range listeners {
		go func(ln net.Listener) { errc <- hs.Serve(ln) }(ln)
	}
	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errc:
	}
	sctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	err := hs.Shutdown(sctx)
	if errors.Is(err, context.DeadlineExceeded) {
		hs.Close()
	}
	s.Close()
	if errors.Is(serveErr, http.ErrServerClosed) {
		serveErr = nil
	}
	return errors.Join(serveErr, err)
}

// Close cancels the server's background work and waits for it. It does
// not close the engine.
func (s *Server) Close() {
	s.cancel()
	s.work.Wait()
}

// Metrics returns the server's Prometheus registry.
func (s *Server) Metrics() *prometheus.Registry { return s.registry }

// Announce writes info to <data>/controller.json, where the CLI looks for
// the daemon serving a data dir; the returned func removes it.
func (s *Server) Announce(info apiv1.ControllerInfo) (remove func(), err error) {
	b, err := json.Marshal(info)
	if err != nil {
		return nil, err
	}
	path := filepath.Join(s.e.Config().DataDir, apiv1.ControllerFile)
	if err := fsutil.WriteFile(path, b, 0o644); err != nil {
		return nil, err
	}
	return func() { os.Remove(path) }, nil
}
