package e2b

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/state"
)

// envdCall is one request to a sandbox's envd.
type envdCall struct {
	s   *Server
	rec *record
	sb  *state.Sandbox
	c   *agent.Client
}

// serveEnvd serves envd's REST and Connect RPC for rec.
func (s *Server) serveEnvd(w http.ResponseWriter, r *http.Request, rec *record, sb *state.Sandbox) {
	if r.URL.Path == "/health" {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	rpc := strings.HasPrefix(r.URL.Path, "/process.Process/") || strings.HasPrefix(r.URL.Path, "/filesystem.Filesystem/")
	// fail answers err as a Connect error to an RPC, as E2B's JSON to REST;
	// rpcCode, when not empty, is the Connect code an RPC gets.
	fail := func(err error, rpcCode string) {
		if !rpc {
			writeAPIError(w, err)
		} else if rpcCode != "" {
			writeUnaryError(w, withCode(rpcCode, err))
		} else {
			writeUnaryError(w, err)
		}
	}
	if !tokenEqual(r.Header.Get("X-Access-Token"), rec.AccessToken) && !(r.URL.Path == "/files" && s.signed(r, rec)) {
		fail(errdefs.Unauthenticated("invalid or missing X-Access-Token for sandbox %s", rec.ID), "")
		return
	}
	c, release, err := s.e.Agent(r.Context(), sb.ID)
	if err != nil {
		writeGone(w, rec.ID, err)
		return
	}
	defer release() // the idle watch freezes it again once done
	for _, f := range []string{proto.FeatureAttach, proto.FeaturePTY, proto.FeatureWatch} {
		if !slices.Contains(c.Features(), f) {
			fail(errdefs.FailedPrecondition("sandbox %s runs an agent without %s: remake its snapshot (%s) with this forkd", rec.ID, f, sb.Snapshot), "")
			return
		}
	}
	ec := &envdCall{s: s, rec: rec, sb: sb, c: c}
	var h http.HandlerFunc
	switch r.URL.Path {
	case "/files":
		switch r.Method {
		case http.MethodGet:
			h = ec.readFile
		case http.MethodPost:
			h = ec.writeFiles
		}
	case "/process.Process/Start":
		h = stream(startResponse{Event: processEvent{Keepalive: &struct{}{}}}, ec.start)
	case "/process.Process/Connect":
		h = stream(startResponse{Event: processEvent{Keepalive: &struct{}{}}}, ec.connect)
	case "/process.Process/List":
		h = unary(ec.list)
	case "/process.Process/SendInput":
		h = unary(ec.sendInput)
	case "/process.Process/StreamInput":
		h = ec.streamInput
	case "/process.Process/SendSignal":
		h = unary(ec.sendSignal)
	case "/process.Process/CloseStdin":
		h = unary(ec.closeStdin)
	case "/process.Process/Update":
		h = unary(ec.update)
	case "/filesystem.Filesystem/Stat":
		h = unary(ec.stat)
	case "/filesystem.Filesystem/ListDir":
		h = unary(ec.listDir)
	case "/filesystem.Filesystem/MakeDir":
		h = unary(ec.makeDir)
	case "/filesystem.Filesystem/Move":
		h = unary(ec.move)
	case "/filesystem.Filesystem/Remove":
		h = unary(ec.remove)
	case "/filesystem.Filesystem/WatchDir":
		h = stream(watchDirResponse{Keepalive: &struct{}{}}, ec.watchDir)
	case "/filesystem.Filesystem/CreateWatcher":
		h = unary(ec.createWatcher)
	case "/filesystem.Filesystem/GetWatcherEvents":
		h = unary(ec.getWatcherEvents)
	case "/filesystem.Filesystem/RemoveWatcher":
		h = unary(ec.removeWatcher)
	}
	if h == nil {
		fail(errdefs.NotFound("envd: no route %s %s", r.Method, errdefs.Quote(r.URL.Path)), codeUnimplemented)
		return
	}
	if rpc && r.Method != http.MethodPost {
		writeUnaryError(w, withCode(codeUnimplemented, fmt.Errorf("%s %s: want POST", r.Method, r.URL.Path)))
		return
	}
	h(w, r)
}

// writeGone answers a request for a sandbox that is not there (or not
// reachable) as E2B's proxy does: 502 with JSON.
func writeGone(w http.ResponseWriter, id string, cause error) {
	msg := "The sandbox was not found"
	if cause != nil && !errdefs.IsNotFound(cause) {
		msg += ": " + cause.Error()
	}
	writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "message": msg, "code": http.StatusBadGateway})
}

// guestUser is an account of the guest.
type guestUser struct {
	Name string
	UID  int
	Home string
}

// abs resolves a path of user's: relative paths and ~ start at its home.
func (u guestUser) abs(p string) string {
	switch {
	case p == "" || p == "~":
		return u.Home
	case strings.HasPrefix(p, "~/"):
		return path.Join(u.Home, p[2:])
	case !strings.HasPrefix(p, "/"):
		return path.Join(u.Home, p)
	}
	return path.Clean(p)
}

// userCache holds each sandbox's accounts, read from its /etc/passwd.
type userCache struct {
	mu   sync.Mutex
	m    map[string]map[string]guestUser // forkd sandbox → name → account; guarded by mu
	read map[string]time.Time            // forkd sandbox → when read; guarded by mu
}

// rereadAfter is how long a name missing from a sandbox's /etc/passwd is
// taken as missing before the file is read again.
const rereadAfter = 5 * time.Second

func (u *userCache) drop(sb string) {
	u.mu.Lock()
	delete(u.m, sb)
	delete(u.read, sb)
	u.mu.Unlock()
}

// lookup returns account name of forkd sandbox sb, reading its
// /etc/passwd when the name is not known yet.
func (u *userCache) lookup(ctx context.Context, c *agent.Client, sb, name string) (guestUser, bool, error) {
	u.mu.Lock()
	acct, ok := u.m[sb][name]
	fresh := time.Since(u.read[sb]) < rereadAfter
	u.mu.Unlock()
	if ok || fresh {
		return acct, ok, nil
	}
	var buf bytes.Buffer
	if _, err := c.ReadFile(ctx, "/etc/passwd", &limitWriter{w: &buf, n: 4 << 20}); err != nil {
		return guestUser{}, false, err
	}
	users := map[string]guestUser{}
	sc := bufio.NewScanner(&buf)
	for sc.Scan() {
		f := strings.Split(sc.Text(), ":")
		if len(f) < 7 {
			continue
		}
		uid, err := strconv.Atoi(f[2])
		if err != nil {
			continue
		}
		if _, dup := users[f[0]]; !dup {
			users[f[0]] = guestUser{Name: f[0], UID: uid, Home: f[5]}
		}
	}
	u.mu.Lock()
	if u.m == nil {
		u.m, u.read = map[string]map[string]guestUser{}, map[string]time.Time{}
	}
	u.m[sb], u.read[sb] = users, time.Now()
	u.mu.Unlock()
	acct, ok = users[name]
	return acct, ok, nil
}

// limitWriter takes at most n bytes.
type limitWriter struct {
	w *bytes.Buffer
	n int
}

func (l *limitWriter) Write(p []byte) (int, error) {
	if l.w.Len()+len(p) > l.n {
		return 0, errdefs.ResourceExhausted("over %d bytes", l.n)
	}
	return l.w.Write(p)
}

// user returns the account a request acts as: the user name of its
// Basic authorization (or name, for /files), else the default user (user,
// or root in images without it). An unknown name is unauthenticated.
func (ec *envdCall) user(ctx context.Context, r *http.Request, name string) (guestUser, error) {
	if name == "" {
		if a := r.Header.Get("Authorization"); strings.HasPrefix(a, "Basic ") {
			b, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(a, "Basic "))
			if err != nil {
				return guestUser{}, withCode(codeUnauthenticated, fmt.Errorf("authorization: %w", err))
			}
			name, _, _ = strings.Cut(string(b), ":")
		}
	}
	explicit := name != ""
	if !explicit {
		name = defaultUser
	}
	u, ok, err := ec.s.users.lookup(ctx, ec.c, ec.sb.ID, name)
	if err != nil {
		return guestUser{}, err
	}
	if !ok && !explicit {
		u, ok, err = ec.s.users.lookup(ctx, ec.c, ec.sb.ID, "root")
		if err != nil {
			return guestUser{}, err
		}
	}
	if !ok {
		return guestUser{}, withCode(codeUnauthenticated, fmt.Errorf("invalid username %s: no such user in the sandbox", errdefs.Quote(name)))
	}
	return u, nil
}

// envOf is a process's environment: the sandbox's envVars under the
// request's own.
func (ec *envdCall) envOf(extra map[string]string) map[string]string {
	env := cloneMap(ec.rec.EnvVars)
	if env == nil {
		env = map[string]string{}
	}
	for k, v := range extra {
		env[k] = v
	}
	return env
}

// procTable remembers, per forkd sandbox, how its envd processes were
// started (the agent keeps argv and dir only).
type procTable struct {
	mu sync.Mutex
	m  map[string]map[int]procInfo // guarded by mu
}

type procInfo struct {
	config processConfig
	tag    string
	pty    bool
}

func (p *procTable) init() { p.m = map[string]map[int]procInfo{} }

func (p *procTable) add(sb string, pid int, pi procInfo) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m[sb] == nil {
		p.m[sb] = map[int]procInfo{}
	}
	p.m[sb][pid] = pi
}

func (p *procTable) get(sb string, pid int) (procInfo, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pi, ok := p.m[sb][pid]
	return pi, ok
}

// keep forgets sb's processes not in running.
func (p *procTable) keep(sb string, running map[int]bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for pid := range p.m[sb] {
		if !running[pid] {
			delete(p.m[sb], pid)
		}
	}
}

func (p *procTable) drop(sb string) {
	p.mu.Lock()
	delete(p.m, sb)
	p.mu.Unlock()
}

// signed reports whether a /files request carries a valid signature (the
// SDK's uploadUrl/downloadUrl): v1_ and the unpadded base64 of
// sha256("path:operation:user:token[:expiration]").
func (s *Server) signed(r *http.Request, rec *record) bool {
	q := r.URL.Query()
	sig := q.Get("signature")
	if !strings.HasPrefix(sig, "v1_") {
		return false
	}
	op := "read"
	if r.Method == http.MethodPost {
		op = "write"
	}
	raw := q.Get("path") + ":" + op + ":" + q.Get("username") + ":" + rec.AccessToken
	if exp := q.Get("signature_expiration"); exp != "" {
		n, err := strconv.ParseInt(exp, 10, 64)
		if err != nil || time.Now().Unix() > n {
			return false
		}
		raw += ":" + exp
	}
	return tokenEqual(sig, "v1_"+signature(raw))
}

// serveSandbox serves a request for port of E2B sandbox id.
func (s *Server) serveSandbox(w http.ResponseWriter, r *http.Request, id string, port int) {
	rec, err := s.lookup(r.Context(), id)
	if err != nil {
		writeGone(w, id, nil)
		return
	}
	if rec.State == statePaused {
		if !rec.AutoResume {
			writeGone(w, id, nil)
			return
		}
		if rec, err = s.autoResume(r.Context(), id); err != nil {
			writeGone(w, id, err)
			return
		}
	}
	sb, err := s.sandboxOf(r.Context(), rec)
	if err != nil {
		writeGone(w, id, nil)
		return
	}
	switch port {
	case EnvdPort:
		s.serveEnvd(w, r, rec, sb)
	case InterpreterPort:
		s.serveInterpreter(w, r, rec, sb)
	default:
		s.proxy(w, r, rec, sb, port)
	}
}

// autoResume resumes paused sandbox id for traffic that came for it.
func (s *Server) autoResume(ctx context.Context, id string) (*record, error) {
	unlock := s.ops.lock(id)
	defer unlock()
	rec, err := s.lookup(ctx, id)
	if err != nil || rec.State == stateRunning {
		return rec, err
	}
	return s.resumeLocked(context.WithoutCancel(ctx), rec, DefaultTimeout)
}

// decodeJSON unmarshals b into v.
func decodeJSON(b []byte, v any) error { return json.Unmarshal(b, v) }
