package cli

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/apikey"
	"github.com/forkd/forkd/internal/e2b"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/loopback"
	"github.com/forkd/forkd/internal/mcp"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/server"
	"github.com/forkd/forkd/internal/snapshot"
)

// serveOptions are the flags of forkd serve.
type serveOptions struct {
	socket, listen, tokenFile   string
	tlsCert, tlsKey             string
	noAuth, allowPlaintext      bool
	allowImageScripts           bool
	maxSandboxes, maxPerRequest int
	maxParallel, maxPending     int
	pool, poolMax, maxPorts     int
	maxBody, maxBodyInFlight    int64
	auditLog, importDir         string
	exportDir                   string
	unresponsive                string
	maxBranches                 int
	grace, bodyTimeout          time.Duration
	// The E2B listener (docs/e2b.md).
	e2bListen, e2bDomain    string
	e2bTLSCert, e2bTLSKey   string
	e2bBase, e2bInterpreter string
	idleFreeze, idleReclaim time.Duration
}

func newServeCmd(g *globals) *cobra.Command {
	var o serveOptions
	cmd := &cobra.Command{
		Use:   "serve [--socket PATH] [--listen ADDR] [--token-file PATH] [--tls-cert F --tls-key F]",
		Short: "Run the controller daemon: REST API v1 on a unix socket and on 127.0.0.1:8889",
		Long: `Run the controller daemon. It owns the data dir (the CLI then goes through it),
re-adopts the sandboxes still running from an earlier run, reaps dead ones and
anything of ours the store does not know, kills sandboxes at their deadline,
and serves REST API v1 (GET /v1/openapi.json describes it) and the MCP tools
at /mcp (streamable HTTP, docs/mcp.md).

The unix socket (mode 0600) trusts the kernel: root or the daemon's user. TCP
callers (of /mcp too) need the bearer token in --token-file (created with 32 random bytes when
missing). A non-loopback --listen needs TLS (--tls-cert/--tls-key) unless
--allow-plaintext. SIGTERM stops the daemon; sandboxes keep running.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return serve(cmd.Context(), g, o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.socket, "socket", client.DefaultSocket(), `unix socket to listen on ("" for none)`)
	f.StringVar(&o.listen, "listen", client.DefaultAddr, `TCP address to listen on ("" for none)`)
	f.StringVar(&o.tokenFile, "token-file", "", "bearer token file for TCP callers (default <data-dir>/token)")
	f.StringVar(&o.tlsCert, "tls-cert", "", "TLS certificate (PEM) for the TCP listener")
	f.StringVar(&o.tlsKey, "tls-key", "", "TLS private key (PEM) for the TCP listener")
	f.BoolVar(&o.noAuth, "no-auth", false, "no token on TCP (refused unless --listen is a loopback address)")
	f.BoolVar(&o.allowPlaintext, "allow-plaintext", false, "allow a non-loopback --listen without TLS")
	f.IntVar(&o.maxSandboxes, "max-sandboxes", 256, fmt.Sprintf("live sandboxes in total, 1 to %d (0 = no limit)", maxServeSandboxes))
	f.IntVar(&o.maxPerRequest, "max-per-request", 100, fmt.Sprintf("sandboxes one request may create, 1 to %d", maxServePerRequest))
	f.IntVar(&o.maxParallel, "max-parallel-restores", 0, fmt.Sprintf("restores running at once, 1 to %d (0 = CPUs under TCG, 2 × CPUs with KVM)", maxServeParallel))
	f.IntVar(&o.maxPending, "max-pending-restores", 1024, fmt.Sprintf("children admitted but not yet ready, all requests together, 1 to %d (0 = no limit)", maxServeSandboxes))
	f.IntVar(&o.pool, "pool", min(2*runtime.NumCPU(), maxServePool), fmt.Sprintf("VMMs kept restored and stopped (~25 MiB each, no CPU) for each of the 4 snapshots forked most recently, 0 (none) to %d", maxServePool))
	f.IntVar(&o.poolMax, "pool-max", defaultServePoolMax, fmt.Sprintf("VMMs kept in all pools together, 0 to %d: a snapshot's pool grows to its largest fork of the last 10 minutes within this bound (never below --pool), and is not refilled while the host has under a fifth of its memory available", maxServePoolMax))
	f.IntVar(&o.maxPorts, "max-ports-per-sandbox", sandbox.DefaultMaxPortsPerSandbox, fmt.Sprintf("host ports one sandbox may publish, 1 to %d", maxServePorts))
	f.Int64Var(&o.maxBody, "max-body-bytes", 1<<20, "largest JSON request body, 1024 (1 KiB) to 67108864 (64 MiB)")
	f.Int64Var(&o.maxBodyInFlight, "max-body-bytes-in-flight", server.DefaultMaxBodyBytesInFlight,
		"JSON request body bytes held at once, all requests together, --max-body-bytes to 4294967296 (4 GiB); beyond it requests get 429")
	o.bodyTimeout = 30 * time.Second
	timeoutFlag(f, &o.bodyTimeout, "body-timeout", "time a JSON request body may take to arrive, 1s to 1h (any body is also cut after 10s without a byte)")
	f.StringVar(&o.auditLog, "audit-log", "", `audit log, one JSON line per request (default <data-dir>/audit.log; "-" for stderr)`)
	f.BoolVar(&o.allowImageScripts, "allow-image-scripts", false, "let API callers install oci.extra packages, which runs the image's own apt scripts as root on this host (only if every token holder is trusted with root)")
	f.StringVar(&o.exportDir, "export-dir", "", "the only directory forkd pack writes layout files into for API callers (default <data-dir>/exports)")
	f.StringVar(&o.importDir, "import-dir", "", "the only directory whose tarballs and OCI layouts API callers may import (default <data-dir>/imports; other refs must be registry references)")
	f.IntVar(&o.maxBranches, "max-branches", sandbox.DefaultMaxBranches, "branches taken at once, 1 to 64; more are refused with 429")
	f.StringVar(&o.unresponsive, "unresponsive", sandbox.UnresponsiveKeep, "what happens to a sandbox whose agent stops answering: keep (marked unresponsive, kept for inspection) or kill; a create request's on_unresponsive overrides it")
	f.DurationVar(&o.idleFreeze, "idle-freeze", sandbox.DefaultIdleFreeze, "freeze a sandbox's VMM (no CPU) after this long without requests or inbound traffic, 0 (never) or 1s to 24h; any request wakes it (root, cgroup freezer); a create request's idle_freeze_secs overrides it")
	f.DurationVar(&o.idleReclaim, "idle-reclaim", sandbox.DefaultIdleReclaim, "page a frozen sandbox's VMM memory out to swap after it stayed frozen this long (its next wake faults back what it touches), 0 (never) or 1s to 24h; needs swap: scripts/zram-swap.sh")
	f.DurationVar(&o.grace, "shutdown-grace", 10*time.Second, "time requests in flight get to finish at shutdown, 0 to 1h")
	f.StringVar(&o.e2bListen, "e2b-listen", "", `serve E2B's API on this TCP address too, e.g. 127.0.0.1:3000 (keys: forkd e2b key create; see docs/e2b.md)`)
	f.StringVar(&o.e2bDomain, "e2b-domain", "", "the E2B sandboxes' domain (with :port if not 443): hosts <port>-<id>.<domain> reach sandbox ports (E2B_DOMAIN)")
	f.StringVar(&o.e2bTLSCert, "e2b-tls-cert", "", "TLS certificate (PEM) for the E2B listener (a wildcard *.<domain> for host routing)")
	f.StringVar(&o.e2bTLSKey, "e2b-tls-key", "", "TLS private key (PEM) for the E2B listener")
	f.StringVar(&o.e2bBase, "e2b-base-template", "base", "snapshot tag of E2B's base template")
	f.StringVar(&o.e2bInterpreter, "e2b-code-interpreter-template", "code-interpreter", "snapshot tag of E2B's code-interpreter-v1 template")
	return cmd
}

// Bounds of forkd serve's flags.
const (
	maxServeSandboxes  = 100000
	maxServePerRequest = 1000 // the engine's largest fork
	maxServeParallel   = 1024
	maxServePool       = 64
	maxServePoolMax    = 1000
	maxServePorts      = 1000
	minServeBody       = 1 << 10
	maxServeBody       = 64 << 20
	maxServeInFlight   = 4 << 30
	maxServeGrace      = time.Hour
)

// defaultServePoolMax lets a fork of the default --max-per-request find
// its pool full the next time.
const defaultServePoolMax = 100

// validate checks the flags before serve touches anything.
func (o serveOptions) validate() error {
	if o.socket == "" && o.listen == "" {
		return errdefs.InvalidArgument("nothing to listen on: give --socket or --listen")
	}
	if (o.tlsCert == "") != (o.tlsKey == "") {
		return errdefs.InvalidArgument("--tls-cert and --tls-key go together")
	}
	// zero, when set, is what 0 means (allowed besides lo to hi).
	for _, c := range []struct {
		flag      string
		v, lo, hi int64
		zero      string
	}{
		{"--max-sandboxes", int64(o.maxSandboxes), 1, maxServeSandboxes, "no limit"},
		{"--max-per-request", int64(o.maxPerRequest), 1, maxServePerRequest, ""},
		{"--max-parallel-restores", int64(o.maxParallel), 1, maxServeParallel, "CPUs under TCG, 2 × CPUs with KVM"},
		{"--max-pending-restores", int64(o.maxPending), 1, maxServeSandboxes, "no limit"},
		{"--pool", int64(o.pool), 0, maxServePool, ""},
		{"--pool-max", int64(o.poolMax), 0, maxServePoolMax, ""},
		{"--max-branches", int64(o.maxBranches), 1, 64, ""},
		{"--max-ports-per-sandbox", int64(o.maxPorts), 1, maxServePorts, ""},
		{"--max-body-bytes", o.maxBody, minServeBody, maxServeBody, ""},
		{"--max-body-bytes-in-flight", o.maxBodyInFlight, max(o.maxBody, minServeBody), maxServeInFlight, ""},
	} {
		if c.v == 0 && c.zero != "" || c.v >= c.lo && c.v <= c.hi {
			continue
		}
		if c.zero != "" {
			return errdefs.InvalidArgument("%s %d: want 0 (%s) or %d to %d", c.flag, c.v, c.zero, c.lo, c.hi)
		}
		return errdefs.InvalidArgument("%s %d: want %d to %d", c.flag, c.v, c.lo, c.hi)
	}
	if err := sandbox.ValidateUnresponsive(o.unresponsive); err != nil {
		return fmt.Errorf("--unresponsive: %w", err)
	}
	if o.grace < 0 || o.grace > maxServeGrace {
		return errdefs.InvalidArgument("--shutdown-grace %v: want 0 to %v", o.grace, maxServeGrace)
	}
	if o.idleFreeze != 0 && (o.idleFreeze < time.Second || o.idleFreeze > sandbox.MaxIdleFreezeSecs*time.Second) {
		return errdefs.InvalidArgument("--idle-freeze %v: want 0 (never) or 1s to 24h", o.idleFreeze)
	}
	if o.idleReclaim != 0 && (o.idleReclaim < time.Second || o.idleReclaim > sandbox.MaxIdleFreezeSecs*time.Second) {
		return errdefs.InvalidArgument("--idle-reclaim %v: want 0 (never) or 1s to 24h", o.idleReclaim)
	}
	if o.bodyTimeout < time.Second || o.bodyTimeout > time.Hour {
		return errdefs.InvalidArgument("--body-timeout %v: want 1s to 1h", o.bodyTimeout)
	}
	if o.importDir != "" {
		if st, err := os.Stat(o.importDir); err != nil || !st.IsDir() {
			return errdefs.InvalidArgument("--import-dir %s: want an existing directory", o.importDir)
		}
	}
	if o.exportDir != "" {
		if st, err := os.Stat(o.exportDir); err != nil || !st.IsDir() {
			return errdefs.InvalidArgument("--export-dir %s: want an existing directory", o.exportDir)
		}
	}
	if (o.e2bTLSCert == "") != (o.e2bTLSKey == "") {
		return errdefs.InvalidArgument("--e2b-tls-cert and --e2b-tls-key go together")
	}
	if o.e2bListen != "" {
		loopback, err := isLoopback(o.e2bListen)
		if err != nil {
			return err
		}
		if !loopback && o.e2bTLSCert == "" && !o.allowPlaintext {
			return errdefs.InvalidArgument("--e2b-listen %s is not a loopback address: give --e2b-tls-cert and --e2b-tls-key (or --allow-plaintext to send keys in clear)", o.e2bListen)
		}
		for _, t := range []struct{ flag, tag string }{{"--e2b-base-template", o.e2bBase}, {"--e2b-code-interpreter-template", o.e2bInterpreter}} {
			if err := snapshot.ValidateTag(t.tag); err != nil {
				return fmt.Errorf("%s: %w", t.flag, err)
			}
		}
		if strings.ContainsAny(o.e2bDomain, "/ ") {
			return errdefs.InvalidArgument("--e2b-domain %q: want a host name, with :port if needed", o.e2bDomain)
		}
	}
	if o.listen != "" {
		loopback, err := isLoopback(o.listen)
		if err != nil {
			return err
		}
		if !loopback && o.noAuth {
			return errdefs.InvalidArgument("--listen %s is not a loopback address: refusing to serve it without a token (drop --no-auth)", o.listen)
		}
		if !loopback && o.tlsCert == "" && !o.allowPlaintext {
			return errdefs.InvalidArgument("--listen %s is not a loopback address: give --tls-cert and --tls-key (or --allow-plaintext to send the token in clear)", o.listen)
		}
	}
	return nil
}

func serve(ctx context.Context, g *globals, o serveOptions) error {
	if err := o.validate(); err != nil {
		return err
	}
	dir, err := g.resolveDataDir()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	importDir := o.importDir
	if importDir == "" {
		importDir = filepath.Join(dir, "imports")
		if err := os.MkdirAll(importDir, 0o700); err != nil {
			return err
		}
	}
	if importDir, err = filepath.Abs(importDir); err != nil {
		return err
	}
	exportDir := o.exportDir
	if exportDir == "" {
		exportDir = filepath.Join(dir, "exports")
		if err := os.MkdirAll(exportDir, 0o700); err != nil {
			return err
		}
	}
	if exportDir, err = filepath.Abs(exportDir); err != nil {
		return err
	}
	var token []byte
	if o.listen != "" && !o.noAuth {
		tf := o.tokenFile
		if tf == "" {
			tf = filepath.Join(dir, "token")
		}
		tok, created, err := server.LoadToken(tf, true)
		if err != nil {
			return err
		}
		if created {
			fmt.Fprintf(g.stderr, "forkd: created token file %s\n", tf)
		}
		token = tok
	}
	var tlsCfg *tls.Config
	if o.tlsCert != "" {
		cert, err := tls.LoadX509KeyPair(o.tlsCert, o.tlsKey)
		if err != nil {
			return errdefs.InvalidArgument("TLS certificate: %w", err)
		}
		tlsCfg = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	}

	log := g.logger()
	events := &eventRelay{}
	e, err := g.openEngine(func(c *sandbox.Config) {
		c.Daemon = true
		c.MaxChildren = o.maxPerRequest
		c.MaxParallel = o.maxParallel
		c.Pool = o.pool
		c.PoolMax = o.poolMax
		c.MaxPortsPerSandbox = o.maxPorts
		c.Unresponsive = o.unresponsive
		c.MaxBranches = o.maxBranches
		c.OnEvent = events.send
		c.IdleFreeze = o.idleFreeze
		c.IdleReclaim = o.idleReclaim
		c.Progress = io.Discard
	})
	if err != nil {
		return err
	}
	defer e.Close()
	rep, err := e.Reconcile(ctx)
	if err != nil {
		log.Warn("reconcile", "err", err)
	}
	if rep != nil {
		log.Info("reconciled", "adopted", len(rep.Adopted), "dead", len(rep.Dead), "aborted", len(rep.Aborted),
			"orphan_processes", len(rep.OrphanProcesses), "orphan_dirs", len(rep.OrphanDirs))
		fmt.Fprintf(g.stderr, "forkd: %d sandbox(es) re-adopted, %d found dead, %d half-started aborted, %d orphan VMM(s) killed\n",
			len(rep.Adopted), len(rep.Dead), len(rep.Aborted), len(rep.OrphanProcesses))
	}

	audit, closeAudit, err := openAudit(o.auditLog, dir, g.stderr)
	if err != nil {
		return err
	}
	defer closeAudit()
	keys, err := apikey.Open(filepath.Join(dir, server.KeysFile))
	if err != nil {
		return err
	}
	exp := sandbox.NewExpirer(e)
	admit := sandbox.NewAdmitter(e, sandbox.Admission{MaxSandboxes: o.maxSandboxes, MaxPending: o.maxPending})
	srv, err := server.New(server.Config{
		Engine:               e,
		Admitter:             admit,
		Expirer:              exp,
		Keys:                 keys,
		Token:                token,
		MaxBodyBytes:         o.maxBody,
		MaxBodyBytesInFlight: o.maxBodyInFlight,
		BodyTimeout:          o.bodyTimeout,
		ImportDir:            importDir,
		ExportDir:            exportDir,
		AllowImageScripts:    o.allowImageScripts,
		Audit:                audit,
		Logger:               log,
		Version:              Version,
	})
	if err != nil {
		return err
	}
	events.set(srv.Event)
	stopMCP := mountMCP(srv, log)

	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	info := apiv1.ControllerInfo{PID: os.Getpid()}
	if o.socket != "" {
		ln, err := listenUnix(o.socket)
		if err != nil {
			return err
		}
		lns = append(lns, ln)
		info.Socket = o.socket
		defer os.Remove(o.socket)
	}
	if o.listen != "" {
		ln, err := net.Listen("tcp", o.listen)
		if err != nil {
			return fmt.Errorf("listen %s: %w", o.listen, err)
		}
		scheme := "http"
		if tlsCfg != nil {
			ln, scheme = tls.NewListener(ln, tlsCfg), "https"
		}
		lns = append(lns, ln)
		info.URL = scheme + "://" + ln.Addr().String()
	}
	if remove, err := srv.Announce(info); err != nil {
		log.Warn("announce the daemon in the data dir", "err", err)
	} else {
		defer remove()
	}
	fmt.Fprintf(g.stderr, "forkd: serving %s on %s %s\n", dir, info.Socket, info.URL)

	sctx, stop := context.WithCancel(ctx)
	defer stop()
	go exp.Run(sctx)
	if o.e2bListen != "" {
		stopE2B, err := serveE2B(sctx, g, o, e, admit, exp, keys, log)
		if err != nil {
			return err
		}
		defer stopE2B()
	}
	idleDone := make(chan struct{})
	go func() {
		defer close(idleDone)
		e.RunIdle(sctx)
	}()
	err = srv.Serve(ctx, o.grace, lns...)
	stop()
	stopMCP(o.grace)
	<-idleDone // it thaws what it froze
	fmt.Fprintln(g.stderr, "forkd: stopped; sandboxes keep running")
	return err
}

// mountMCP serves the MCP tools at /mcp (streamable HTTP) behind the
// daemon's authentication (server.Mount). Their client talks to this same
// server in-process (server.Pipe), as a trusted local caller: the /mcp
// request was authenticated, and its tools' REST calls are audited as the
// daemon's own uid. stop ends the in-process connection once the daemon
// has stopped serving.
func mountMCP(srv *server.Server, log *slog.Logger) (stop func(grace time.Duration)) {
	dial, shutdown := srv.Pipe()
	c := client.NewDialer("this daemon", dial)
	srv.Mount("/mcp", mcp.Handler(mcp.New(c, mcp.Options{Version: Version, Logger: log}), log))
	return func(grace time.Duration) {
		c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), grace)
		defer cancel()
		if err := shutdown(ctx); err != nil {
			log.Warn("stop the MCP endpoint's in-process connection", "err", err)
		}
	}
}

// isLoopback reports whether a listen address binds only loopback.
func isLoopback(addr string) (bool, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false, errdefs.InvalidArgument("--listen %q: %w", addr, err)
	}
	return loopback.Host(host), nil
}

// listenUnix listens on a unix socket of mode 0600, replacing a stale
// socket file but never one a live daemon answers on.
func listenUnix(path string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, err
	}
	if st, err := os.Lstat(path); err == nil {
		if st.Mode().Type() != os.ModeSocket {
			return nil, errdefs.FailedPrecondition("%s exists and is not a socket", path)
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil, errdefs.FailedPrecondition("another daemon listens on %s", path)
		}
		os.Remove(path)
	}
	// The socket is born 0600: no moment in which another user could
	// connect before a chmod (SO_PEERCRED would still refuse them).
	old := syscall.Umask(0o177)
	ln, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, err
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	return ln, nil
}

// openAudit opens the audit log named by flag.
func openAudit(flag, dir string, stderr io.Writer) (io.Writer, func(), error) {
	switch flag {
	case "-":
		return stderr, func() {}, nil
	case "":
		flag = filepath.Join(dir, "audit.log")
	}
	f, err := os.OpenFile(flag, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return nil, nil, fmt.Errorf("audit log: %w", err)
	}
	return f, func() { f.Close() }, nil
}

// localAPI serves the API in this process over the data dir's engine, for
// a command run while no daemon serves the data dir: the command then has
// the one code path it has through a daemon. done shuts the server down,
// waiting for requests in flight and undoing background work an
// interrupted command leaves (a snapshot build), and closes the engine.
// With expire, the process also kills sandboxes at their deadline while
// it runs, as the daemon does (for a long-lived command: forkd mcp).
func (g *globals) localAPI(expire bool) (*client.Client, func(), error) {
	e, err := g.openEngine(func(c *sandbox.Config) { c.Progress = io.Discard })
	if err != nil {
		return nil, nil, err
	}
	exp := sandbox.NewExpirer(e)
	srv, err := server.New(server.Config{
		Engine:   e,
		Admitter: sandbox.NewAdmitter(e, sandbox.Admission{}),
		Expirer:  exp,
		Local:    true,
		Logger:   g.logger(),
		Version:  Version,
	})
	if err != nil {
		e.Close()
		return nil, nil, err
	}
	stopExpiry := func() {}
	if expire {
		ctx, cancel := context.WithCancel(context.Background())
		stopped := make(chan struct{})
		go func() { exp.Run(ctx); close(stopped) }()
		stopExpiry = func() { cancel(); <-stopped }
	}
	dial, shutdown := srv.Pipe()
	c := client.NewDialer("the data dir "+e.Config().DataDir, dial)
	return c, func() {
		stopExpiry()
		c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := shutdown(ctx); err != nil {
			g.logger().Warn("stop the in-process server", "err", err)
		}
		e.Close()
	}, nil
}

// eventRelay passes the engine's events to the server, which is made
// after the engine. Safe for concurrent use.
type eventRelay struct {
	mu sync.Mutex
	to func(sandbox.Event)
}

func (r *eventRelay) set(to func(sandbox.Event)) {
	r.mu.Lock()
	r.to = to
	r.mu.Unlock()
}

func (r *eventRelay) send(ev sandbox.Event) {
	r.mu.Lock()
	to := r.to
	r.mu.Unlock()
	if to != nil {
		to(ev)
	}
}

// serveE2B serves the E2B listener until ctx ends; stop shuts it down,
// giving requests in flight the shutdown grace.
func serveE2B(ctx context.Context, g *globals, o serveOptions, e *sandbox.Engine, admit *sandbox.Admitter,
	exp *sandbox.Expirer, keys *apikey.Store, log *slog.Logger) (stop func(), err error) {
	es, err := e2b.New(e2b.Config{
		Engine: e, Admitter: admit, Expirer: exp, Keys: keys, Domain: o.e2bDomain, Logger: log,
		Templates: map[string]string{"base": o.e2bBase, "code-interpreter-v1": o.e2bInterpreter},
	})
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", o.e2bListen)
	if err != nil {
		es.Close()
		return nil, fmt.Errorf("listen %s: %w", o.e2bListen, err)
	}
	hs := es.HTTPServer()
	scheme := "http"
	served := make(chan error, 1)
	if o.e2bTLSCert != "" {
		cert, err := tls.LoadX509KeyPair(o.e2bTLSCert, o.e2bTLSKey)
		if err != nil {
			ln.Close()
			es.Close()
			return nil, errdefs.InvalidArgument("E2B TLS certificate: %v", err)
		}
		hs.TLSConfig = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
		scheme = "https"
		go func() { served <- hs.ServeTLS(ln, "", "") }()
	} else {
		go func() { served <- hs.Serve(ln) }()
	}
	es.Start(ctx)
	if ks, err := keys.List(); err == nil && len(ks) == 0 {
		fmt.Fprintln(g.stderr, "forkd: no E2B API key yet: forkd e2b key create")
	}
	fmt.Fprintf(g.stderr, "forkd: E2B API on %s://%s\n", scheme, ln.Addr())
	return func() {
		sctx, cancel := context.WithTimeout(context.Background(), o.grace)
		defer cancel()
		if err := hs.Shutdown(sctx); err != nil {
			hs.Close()
		}
		if err := <-served; err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("e2b listener", "err", err)
		}
		es.Close()
	}, nil
}
