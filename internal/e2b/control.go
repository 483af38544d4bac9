package e2b

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
)

// controlRoute is one route of the control plane.
type controlRoute struct {
	pattern string
	fn      func(s *Server, w http.ResponseWriter, r *http.Request) error
}

// controlRoutes are the control plane's routes that the SDKs call, with
// the legacy forms older SDK versions send.
var controlRoutes = []controlRoute{
	{"POST /sandboxes", (*Server).createSandbox},
	{"POST /v2/sandboxes", (*Server).createSandbox},
	{"GET /sandboxes", (*Server).listSandboxesV1},
	{"GET /v2/sandboxes", (*Server).listSandboxes},
	{"GET /sandboxes/{id}", (*Server).getSandbox},
	{"DELETE /sandboxes/{id}", (*Server).killSandbox},
	{"POST /sandboxes/{id}/timeout", (*Server).setTimeout},
	{"POST /sandboxes/{id}/refreshes", (*Server).refresh},
	{"POST /sandboxes/{id}/pause", (*Server).pause},
	{"POST /sandboxes/{id}/resume", (*Server).resume},
	{"POST /sandboxes/{id}/connect", (*Server).connect},
	{"POST /v2/sandboxes/{id}/connect", (*Server).connect},
	{"POST /sandboxes/{id}/fork", (*Server).fork},
	{"GET /sandboxes/{id}/metrics", (*Server).metrics},
	{"PUT /sandboxes/{id}/network", (*Server).network},
	{"GET /sandboxes/{id}/logs", (*Server).logs},
	{"GET /v2/sandboxes/{id}/logs", (*Server).logs},
	{"POST /sandboxes/{id}/snapshots", (*Server).createSnapshot},
	{"GET /snapshots", (*Server).listSnapshots},
	{"DELETE /templates/{id}", (*Server).deleteSnapshot},
}

// control wraps a route: authentication, then the handler, whose error is
// written in E2B's shape.
func (s *Server) control(rt controlRoute) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if _, err := s.authenticate(r); err != nil {
			writeAPIError(w, err)
			return
		}
		if id := r.PathValue("id"); id != "" && !validSandboxID(id) && !strings.HasPrefix(rt.pattern, "DELETE /templates") {
			writeAPIError(w, errdefs.NotFound("sandbox %s not found", errdefs.Quote(id)))
			return
		}
		if err := rt.fn(s, w, r); err != nil {
			writeAPIError(w, err)
		}
	}
}

// decode reads a JSON body into v; an empty body leaves v as it is.
func decode(r *http.Request, v any) error {
	b, err := io.ReadAll(io.LimitReader(r.Body, 1<<20+1))
	if err != nil {
		return errdefs.InvalidArgument("read body: %v", err)
	}
	if len(b) > 1<<20 {
		return errdefs.InvalidArgument("body over 1 MiB")
	}
	if len(strings.TrimSpace(string(b))) == 0 {
		return nil
	}
	if err := json.Unmarshal(b, v); err != nil {
		return errdefs.InvalidArgument("body: %v", err)
	}
	return nil
}

func noContent(w http.ResponseWriter) { w.WriteHeader(http.StatusNoContent) }

// seconds converts a timeout in seconds from a request, checked.
func seconds(v *int, def time.Duration) (time.Duration, error) {
	if v == nil {
		return def, nil
	}
	d := time.Duration(*v) * time.Second
	if *v <= 0 || d > sandbox.MaxTimeout {
		return 0, errdefs.InvalidArgument("timeout %d s: want 1 to %d", *v, int(sandbox.MaxTimeout/time.Second))
	}
	return d, nil
}

// template resolves a template id to a snapshot tag.
func (s *Server) template(id string) (string, error) {
	if id == "" {
		id = "base"
	}
	if tag, ok := s.cfg.Templates[id]; ok {
		return tag, nil
	}
	tag := strings.TrimSuffix(id, ":default")
	if i := strings.LastIndexByte(tag, '/'); i >= 0 {
		tag = tag[i+1:]
	}
	if err := snapshot.ValidateTag(tag); err != nil {
		return "", errdefs.NotFound("template %s not found", errdefs.Quote(id))
	}
	return tag, nil
}

func (s *Server) domain() *string {
	if s.cfg.Domain == "" {
		return nil
	}
	d := s.cfg.Domain
	return &d
}

// wire is a record as create, connect and fork answer it.
func (s *Server) wire(rec *record) *sandboxWire {
	traffic := rec.TrafficToken
	return &sandboxWire{SandboxID: rec.ID, TemplateID: rec.Template, Alias: rec.Template, ClientID: "forkd",
		EnvdVersion: EnvdVersion, EnvdAccessToken: rec.AccessToken, TrafficAccessToken: &traffic, Domain: s.domain()}
}

func (s *Server) listed(rec *record) listedSandbox {
	md := rec.Metadata
	if md == nil {
		md = map[string]string{}
	}
	return listedSandbox{SandboxID: rec.ID, TemplateID: rec.Template, Alias: rec.Template, ClientID: "forkd",
		StartedAt: rec.StartedAt, EndAt: rec.EndAt, State: rec.State, CPUCount: rec.CPUCount, MemoryMB: rec.MemoryMB,
		DiskSizeMB: 0, EnvdVersion: EnvdVersion, Metadata: md}
}

// netSpec is the network of rec's sandboxes when their snapshot has one.
func netSpec(rec *record, snap *snapshot.Snapshot) *sandbox.NetSpec {
	if !snap.Network || !rec.NoInternet {
		return nil
	}
	return &sandbox.NetSpec{Policy: netns.Policy{Mode: netns.ModeDeny}}
}

// start forks rec's next sandbox from snapshot tag, to live for timeout
// (killed then by the engine, unless rec pauses instead).
func (s *Server) start(ctx context.Context, rec *record, tag string, timeout time.Duration) (string, error) {
	snap, err := s.e.Snapshots().Get(tag)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return "", errdefs.NotFound("template %s: no snapshot %s (forkd snapshot --tag %s)", errdefs.Quote(rec.Template), errdefs.Quote(tag), tag)
		}
		return "", err
	}
	spec := sandbox.ForkSpec{Tag: tag, N: 1, Metadata: map[string]string{"e2b.sandbox": rec.ID}, Net: netSpec(rec, snap)}
	if !rec.AutoPause {
		spec.Timeout = timeout
	}
	res, err := s.cfg.Admitter.Fork(ctx, spec)
	if err != nil {
		return "", err
	}
	c := res.Children[0]
	if c.Err != nil {
		return "", c.Err
	}
	if cerr := ctx.Err(); cerr != nil {
		// The caller left: nobody learns of the sandbox.
		s.kill(c.ID)
		return "", errdefs.Unavailable("the caller went away before the sandbox was ready: %v", cerr)
	}
	s.cfg.Expirer.Poke()
	return c.ID, nil
}

// kill kills forkd sandbox id, whatever the caller does meanwhile.
func (s *Server) kill(id string) {
	ctx, cancel := context.WithTimeout(s.base, time.Minute)
	defer cancel()
	if err := s.e.Kill(ctx, id); err != nil && !errdefs.IsNotFound(err) {
		s.log.Warn("kill sandbox", "sandbox", id, "err", err)
	}
}

// lookup returns record id, checked against its forkd sandbox: a running
// record whose sandbox is gone (expired, died) is reaped, and NotFound.
func (s *Server) lookup(ctx context.Context, id string) (*record, error) {
	rec, err := s.store.get(id)
	if err != nil {
		return nil, err
	}
	if rec.State == stateRunning && !s.alive(ctx, rec.Sandbox) {
		s.reap(rec)
		return nil, errdefs.NotFound("sandbox %s not found", errdefs.Quote(id))
	}
	return rec, nil
}

// alive reports whether forkd sandbox id is live.
func (s *Server) alive(ctx context.Context, id string) bool {
	if id == "" {
		return false
	}
	sb, err := s.e.Get(ctx, id)
	return err == nil && state.Live(sb.Status)
}

// sandboxOf returns rec's live forkd sandbox.
func (s *Server) sandboxOf(ctx context.Context, rec *record) (*state.Sandbox, error) {
	if rec.State != stateRunning {
		return nil, errdefs.FailedPrecondition("sandbox %s is paused", rec.ID)
	}
	sb, err := s.e.Get(ctx, rec.Sandbox)
	if err != nil || !state.Live(sb.Status) {
		return nil, errdefs.NotFound("sandbox %s not found", errdefs.Quote(rec.ID))
	}
	return sb, nil
}

// reap forgets a record whose sandbox is gone, with its pause snapshots.
func (s *Server) reap(rec *record) {
	unlock := s.ops.lock(rec.ID)
	defer unlock()
	cur, err := s.store.get(rec.ID)
	if err != nil || cur.State != stateRunning || cur.Sandbox != rec.Sandbox {
		return // changed meanwhile
	}
	s.forget(cur)
	s.log.Info("e2b sandbox ended", "e2b", rec.ID, "sandbox", rec.Sandbox)
}

// forget removes a record, its snapshots and what the face held for it.
// Called with the record's op lock held.
func (s *Server) forget(rec *record) {
	for i := len(rec.States) - 1; i >= 0; i-- {
		if _, err := s.e.RemoveSnapshotWith(rec.States[i], snapshot.RemoveOptions{Force: true}); err != nil && !errdefs.IsNotFound(err) {
			s.log.Warn("remove pause snapshot", "e2b", rec.ID, "snapshot", rec.States[i], "err", err)
		}
	}
	if err := s.store.remove(rec.ID); err != nil {
		s.log.Warn("remove e2b record", "e2b", rec.ID, "err", err)
	}
	s.watch.dropSandbox(rec.ID)
	if rec.Sandbox != "" {
		s.procs.drop(rec.Sandbox)
		s.users.drop(rec.Sandbox)
	}
}

func (s *Server) createSandbox(w http.ResponseWriter, r *http.Request) error {
	var req newSandboxRequest
	if err := decode(r, &req); err != nil {
		return err
	}
	if len(req.MCP) > 0 || len(req.VolumeMounts) > 0 || len(req.IAM) > 0 {
		return errdefs.InvalidArgument("mcp, volumeMounts and iam are not supported by forkd")
	}
	timeout, err := seconds(req.Timeout, DefaultTimeout)
	if err != nil {
		return err
	}
	tag, err := s.template(req.TemplateID)
	if err != nil {
		return err
	}
	snap, err := s.e.Snapshots().Get(tag)
	if err != nil {
		return errdefs.NotFound("template %s: no snapshot %s (make it: forkd snapshot --tag %s)", errdefs.Quote(req.TemplateID), errdefs.Quote(tag), tag)
	}
	tpl := req.TemplateID
	if tpl == "" {
		tpl = "base"
	}
	now := time.Now().UTC()
	rec := &record{ID: newSandboxID(), Template: tpl, Snapshot: tag, State: stateRunning,
		Metadata: req.Metadata, EnvVars: req.EnvVars, AccessToken: newToken(), TrafficToken: newToken(),
		StartedAt: now, EndAt: now.Add(timeout), CPUCount: snap.VCPUs, MemoryMB: snap.MemoryMiB,
		AutoPause: req.AutoPause != nil && *req.AutoPause, AutoResume: req.AutoResume != nil && req.AutoResume.Enabled}
	if req.AllowInternetAccess != nil && !*req.AllowInternetAccess {
		rec.NoInternet = true
	}
	if n := req.Network; n != nil {
		if len(n.AllowOut) > 0 || len(n.Rules) > 0 || len(n.EgressProxy) > 0 || n.MaskRequestHost != nil || len(n.HTTPSPorts) > 0 {
			return errdefs.InvalidArgument("network: allowOut, rules, egressProxy, maskRequestHost and httpsPorts are not supported by forkd (allow_internet_access, denyOut [\"0.0.0.0/0\"] and allowPublicTraffic are)")
		}
		for _, d := range n.DenyOut {
			if d != "0.0.0.0/0" {
				return errdefs.InvalidArgument("network.denyOut %s: forkd denies all or nothing (0.0.0.0/0)", errdefs.Quote(d))
			}
			rec.NoInternet = true
		}
		rec.Private = n.AllowPublicTraffic != nil && !*n.AllowPublicTraffic
	}
	// Recorded once its sandbox runs: a crash before leaves a forkd
	// sandbox that its timeout ends, and no record.
	id, err := s.start(r.Context(), rec, tag, timeout)
	if err != nil {
		return err
	}
	rec.Sandbox, rec.StartedAt, rec.EndAt = id, time.Now().UTC(), time.Now().UTC().Add(timeout)
	if err := s.store.put(rec); err != nil {
		s.kill(id)
		return err
	}
	s.poke()
	s.log.Info("e2b sandbox created", "e2b", rec.ID, "sandbox", id, "template", tpl)
	writeJSON(w, http.StatusCreated, s.wire(rec))
	return nil
}

func (s *Server) getSandbox(w http.ResponseWriter, r *http.Request) error {
	rec, err := s.lookup(r.Context(), r.PathValue("id"))
	if err != nil {
		return err
	}
	allow := !rec.NoInternet
	onTimeout := "kill"
	if rec.AutoPause {
		onTimeout = "pause"
	}
	writeJSON(w, http.StatusOK, sandboxDetail{listedSandbox: s.listed(rec), EnvdAccessToken: rec.AccessToken,
		Domain: s.domain(), AllowInternetAccess: &allow, Lifecycle: lifecycle{OnTimeout: onTimeout, AutoResume: rec.AutoResume}})
	return nil
}

func (s *Server) killSandbox(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	unlock := s.ops.lock(id)
	defer unlock()
	rec, err := s.store.get(id)
	if err != nil {
		return err
	}
	if rec.Sandbox != "" {
		s.kill(rec.Sandbox)
	}
	s.forget(rec)
	s.log.Info("e2b sandbox killed", "e2b", id, "sandbox", rec.Sandbox)
	noContent(w)
	return nil
}

// extend sets rec's end to now + d (only later, when onlyExtend), on the
// engine's clock too when the engine kills it then.
func (s *Server) extend(ctx context.Context, id string, d time.Duration, onlyExtend bool) (*record, error) {
	rec, err := s.store.update(id, func(cur *record) error {
		end := time.Now().UTC().Add(d)
		if onlyExtend && cur.EndAt.After(end) {
			return nil
		}
		cur.EndAt = end
		return nil
	})
	if err != nil {
		return nil, err
	}
	if rec.State == stateRunning && !rec.AutoPause {
		if _, err := s.cfg.Expirer.SetTimeout(ctx, rec.Sandbox, time.Until(rec.EndAt).Round(time.Second)+time.Second); err != nil {
			return nil, err
		}
	}
	s.poke()
	return rec, nil
}

func (s *Server) setTimeout(w http.ResponseWriter, r *http.Request) error {
	var req timeoutRequest
	if err := decode(r, &req); err != nil {
		return err
	}
	d, err := seconds(&req.Timeout, 0)
	if err != nil {
		return err
	}
	return s.retime(w, r, d, false)
}

func (s *Server) refresh(w http.ResponseWriter, r *http.Request) error {
	var req struct {
		Duration *int `json:"duration"`
	}
	if err := decode(r, &req); err != nil {
		return err
	}
	d, err := seconds(req.Duration, 60*time.Second)
	if err != nil {
		return err
	}
	return s.retime(w, r, d, true)
}

// retime sets the end of the sandbox in r's path to d from now (only
// later, when onlyExtend) and answers 204.
func (s *Server) retime(w http.ResponseWriter, r *http.Request, d time.Duration, onlyExtend bool) error {
	id := r.PathValue("id")
	unlock := s.ops.lock(id)
	defer unlock()
	if _, err := s.lookup(r.Context(), id); err != nil {
		return err
	}
	if _, err := s.extend(r.Context(), id, d, onlyExtend); err != nil {
		return err
	}
	noContent(w)
	return nil
}

func (s *Server) pause(w http.ResponseWriter, r *http.Request) error {
	var req pauseRequest
	if err := decode(r, &req); err != nil {
		return err
	}
	id := r.PathValue("id")
	unlock := s.ops.lock(id)
	defer unlock()
	rec, err := s.lookup(r.Context(), id)
	if err != nil {
		return err
	}
	if rec.State == statePaused {
		writeJSON(w, http.StatusConflict, apiError{Code: http.StatusConflict, Message: "sandbox " + id + " is already paused"})
		return nil
	}
	if err := s.pauseLocked(context.WithoutCancel(r.Context()), rec); err != nil {
		return err
	}
	noContent(w)
	return nil
}

// pauseLocked saves rec's sandbox (memory, devices, files) into a snapshot
// and stops it; the record keeps its id and tokens. Called with rec's op
// lock held. The work belongs to the daemon: a caller leaving does not cut
// it short.
func (s *Server) pauseLocked(ctx context.Context, rec *record) error {
	sb, err := s.sandboxOf(ctx, rec)
	if err != nil {
		return err
	}
	// A diff of the snapshot it came from, unless that chain grew long or
	// its snapshot goes with its sandboxes (a fork's): then one that
	// stands alone.
	mode := sandbox.BranchDiff
	if src, err := s.e.Snapshots().Get(sb.Snapshot); err != nil || src.Ephemeral ||
		src.Branch != nil && src.Branch.Depth >= snapshot.MaxDepth/2 {
		mode = sandbox.BranchFull
	}
	tag := fmt.Sprintf("e2b-%s-%d", rec.ID, time.Now().UnixMilli())
	// Recorded first: a crash meanwhile leaves the tag known, removed
	// with the sandbox.
	if _, err := s.store.update(rec.ID, func(cur *record) error {
		cur.States = append(cur.States, tag)
		return nil
	}); err != nil {
		return err
	}
	if _, err := s.e.Branch(ctx, sandbox.BranchSpec{ID: sb.ID, Tag: tag, Mode: mode}); err != nil {
		if _, rerr := s.e.RemoveSnapshotWith(tag, snapshot.RemoveOptions{Force: true}); rerr != nil && !errdefs.IsNotFound(rerr) {
			s.log.Warn("remove failed pause snapshot", "snapshot", tag, "err", rerr)
		}
		_, _ = s.store.update(rec.ID, func(cur *record) error {
			cur.States = slices.DeleteFunc(cur.States, func(t string) bool { return t == tag })
			return nil
		})
		return fmt.Errorf("pause %s: %w", rec.ID, err)
	}
	s.kill(sb.ID)
	s.procs.drop(sb.ID)
	s.users.drop(sb.ID)
	if _, err := s.store.update(rec.ID, func(cur *record) error {
		cur.State, cur.Paused, cur.Sandbox = statePaused, tag, ""
		return nil
	}); err != nil {
		return err
	}
	s.log.Info("e2b sandbox paused", "e2b", rec.ID, "sandbox", sb.ID, "snapshot", tag, "mode", mode)
	return nil
}

// resumeLocked starts a paused rec again from its pause snapshot, to live
// for timeout. Called with rec's op lock held.
func (s *Server) resumeLocked(ctx context.Context, rec *record, timeout time.Duration) (*record, error) {
	id, err := s.start(ctx, rec, rec.Paused, timeout)
	if err != nil {
		return nil, fmt.Errorf("resume %s: %w", rec.ID, err)
	}
	rec, err = s.store.update(rec.ID, func(cur *record) error {
		cur.State, cur.Paused, cur.Sandbox = stateRunning, "", id
		cur.EndAt = time.Now().UTC().Add(timeout)
		return nil
	})
	if err != nil {
		s.kill(id)
		return nil, err
	}
	s.poke()
	s.log.Info("e2b sandbox resumed", "e2b", rec.ID, "sandbox", id)
	return rec, nil
}

func (s *Server) connect(w http.ResponseWriter, r *http.Request) error {
	var req connectRequest
	if err := decode(r, &req); err != nil {
		return err
	}
	timeout, err := seconds(req.Timeout, DefaultTimeout)
	if err != nil {
		return err
	}
	id := r.PathValue("id")
	unlock := s.ops.lock(id)
	defer unlock()
	rec, err := s.lookup(r.Context(), id)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return errdefs.NotFound("paused sandbox %s not found", errdefs.Quote(id))
		}
		return err
	}
	if rec.State == stateRunning {
		if rec, err = s.extend(r.Context(), id, timeout, true); err != nil {
			return err
		}
		writeJSON(w, http.StatusOK, s.wire(rec))
		return nil
	}
	if rec, err = s.resumeLocked(r.Context(), rec, timeout); err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, s.wire(rec))
	return nil
}

func (s *Server) resume(w http.ResponseWriter, r *http.Request) error {
	var req struct {
		Timeout   *int  `json:"timeout,omitempty"`
		AutoPause *bool `json:"autoPause,omitempty"`
	}
	if err := decode(r, &req); err != nil {
		return err
	}
	timeout, err := seconds(req.Timeout, DefaultTimeout)
	if err != nil {
		return err
	}
	id := r.PathValue("id")
	unlock := s.ops.lock(id)
	defer unlock()
	rec, err := s.lookup(r.Context(), id)
	if err != nil {
		return err
	}
	if rec.State == stateRunning {
		return errdefs.AlreadyExists("sandbox %s is already running", id)
	}
	if rec, err = s.resumeLocked(r.Context(), rec, timeout); err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, s.wire(rec))
	return nil
}

func (s *Server) fork(w http.ResponseWriter, r *http.Request) error {
	var req forkRequest
	if err := decode(r, &req); err != nil {
		return err
	}
	timeout, err := seconds(req.Timeout, DefaultForkTimeout)
	if err != nil {
		return err
	}
	count := 1
	if req.Count != nil {
		count = *req.Count
	}
	if most := s.e.Config().MaxChildren; count < 1 || count > most {
		return errdefs.InvalidArgument("count %d: want 1 to %d", count, most)
	}
	id := r.PathValue("id")
	unlock := s.ops.lock(id)
	defer unlock()
	src, err := s.lookup(r.Context(), id)
	if err != nil {
		return err
	}
	if src.State != stateRunning {
		return errdefs.FailedPrecondition("sandbox %s is paused: connect to it first", id)
	}
	snap, err := s.e.Snapshots().Get(src.Snapshot)
	if err != nil {
		snap = &snapshot.Snapshot{}
	}
	children := make([]*record, count)
	now := time.Now().UTC()
	for i := range children {
		c := src.clone()
		c.ID, c.Sandbox, c.AccessToken, c.TrafficToken = newSandboxID(), "", newToken(), newToken()
		c.State, c.Paused, c.States = stateRunning, "", nil
		c.StartedAt, c.EndAt, c.AutoPause = now, now.Add(timeout), false
		children[i] = c
	}
	spec := sandbox.ForkSpec{N: count, KeepPartial: true, Timeout: timeout,
		Metadata: map[string]string{"e2b.fork-of": id}, Net: netSpec(src, snap)}
	res, err := s.cfg.Admitter.ForkFrom(r.Context(), src.Sandbox, "", spec)
	if res == nil {
		return err
	}
	if cerr := r.Context().Err(); cerr != nil {
		for _, c := range res.Children {
			if c.Err == nil {
				s.kill(c.ID)
			}
		}
		return errdefs.Unavailable("the caller went away before the forks were ready: %v", cerr)
	}
	s.cfg.Expirer.Poke()
	out := make([]forkResult, 0, count)
	for i, c := range res.Children {
		if c.Err != nil {
			st := statusOf(c.Err)
			out = append(out, forkResult{Error: &apiError{Code: st, Message: c.Err.Error()}})
			continue
		}
		rec := children[i]
		rec.Sandbox = c.ID
		if err := s.store.put(rec); err != nil {
			s.kill(c.ID)
			out = append(out, forkResult{Error: &apiError{Code: http.StatusInternalServerError, Message: err.Error()}})
			continue
		}
		out = append(out, forkResult{Sandbox: s.wire(rec)})
	}
	s.log.Info("e2b sandbox forked", "e2b", id, "count", count)
	writeJSON(w, http.StatusCreated, out)
	return nil
}

func (s *Server) network(w http.ResponseWriter, r *http.Request) error {
	var req networkUpdate
	if err := decode(r, &req); err != nil {
		return err
	}
	if len(req.AllowOut) > 0 || len(req.DenyOut) > 0 || len(req.Rules) > 0 || len(req.EgressProxy) > 0 {
		return errdefs.InvalidArgument("network: only allow_internet_access is supported by forkd")
	}
	id := r.PathValue("id")
	unlock := s.ops.lock(id)
	defer unlock()
	rec, err := s.lookup(r.Context(), id)
	if err != nil {
		return err
	}
	if req.AllowInternetAccess == nil {
		noContent(w)
		return nil
	}
	deny := !*req.AllowInternetAccess
	if rec.State == stateRunning {
		pol := netns.Policy{Mode: netns.ModeAllow}
		if deny {
			pol = netns.Policy{Mode: netns.ModeDeny}
		}
		if _, err := s.e.SetPolicy(r.Context(), rec.Sandbox, pol); err != nil {
			return err
		}
	}
	if _, err := s.store.update(id, func(cur *record) error { cur.NoInternet = deny; return nil }); err != nil {
		return err
	}
	noContent(w)
	return nil
}

func (s *Server) logs(w http.ResponseWriter, r *http.Request) error {
	if _, err := s.lookup(r.Context(), r.PathValue("id")); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, map[string]any{"logs": []any{}, "logEntries": []any{}})
	return nil
}

// metadataFilter decodes the list's metadata parameter as E2B's API does:
// the query already decoded once, unescape the whole, split on & and =,
// unescape each key and value.
func metadataFilter(raw string) (map[string]string, error) {
	if raw == "" {
		return nil, nil
	}
	whole, err := url.QueryUnescape(raw)
	if err != nil {
		return nil, errdefs.InvalidArgument("metadata %s: %v", errdefs.Quote(raw), err)
	}
	out := map[string]string{}
	for _, kv := range strings.Split(whole, "&") {
		if kv == "" {
			continue
		}
		k, v, _ := strings.Cut(kv, "=")
		if k, err = url.QueryUnescape(k); err != nil {
			return nil, errdefs.InvalidArgument("metadata key %s: %v", errdefs.Quote(k), err)
		}
		if v, err = url.QueryUnescape(v); err != nil {
			return nil, errdefs.InvalidArgument("metadata value %s: %v", errdefs.Quote(v), err)
		}
		out[k] = v
	}
	return out, nil
}

// listFilter is what a list asks for.
type listFilter struct {
	metadata     map[string]string
	states       []string
	template     string
	startedAfter time.Time
}

func (f listFilter) match(rec *record) bool {
	if len(f.states) > 0 && !slices.Contains(f.states, rec.State) {
		return false
	}
	if f.template != "" && rec.Template != f.template {
		return false
	}
	if !f.startedAfter.IsZero() && rec.StartedAt.Before(f.startedAfter) {
		return false
	}
	for k, v := range f.metadata {
		if got, ok := rec.Metadata[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// live returns the records f matches, reaping the dead.
func (s *Server) live(ctx context.Context, f listFilter) []*record {
	var out []*record
	for _, rec := range s.store.list() {
		if rec.State == stateRunning && !s.alive(ctx, rec.Sandbox) {
			if cur, err := s.store.get(rec.ID); err == nil && cur.Sandbox == rec.Sandbox && cur.State == stateRunning {
				s.reap(rec)
			}
			continue
		}
		if f.match(rec) {
			out = append(out, rec)
		}
	}
	return out
}

func (s *Server) listSandboxes(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	var f listFilter
	var err error
	if f.metadata, err = metadataFilter(q.Get("metadata")); err != nil {
		return err
	}
	for _, st := range strings.Split(q.Get("state"), ",") {
		switch st {
		case "":
		case stateRunning, statePaused:
			f.states = append(f.states, st)
		default:
			return errdefs.InvalidArgument("state %s: want running or paused", errdefs.Quote(st))
		}
	}
	f.template = q.Get("template")
	if v := q.Get("startedAfter"); v != "" {
		if f.startedAfter, err = time.Parse(time.RFC3339Nano, v); err != nil {
			return errdefs.InvalidArgument("startedAfter %s: want RFC 3339", errdefs.Quote(v))
		}
	}
	limit := 100
	if v := q.Get("limit"); v != "" {
		if limit, err = strconv.Atoi(v); err != nil || limit < 1 || limit > 100 {
			return errdefs.InvalidArgument("limit %s: want 1 to 100", errdefs.Quote(v))
		}
	}
	recs := s.live(r.Context(), f)
	if q.Get("order") == "asc" {
		slices.Reverse(recs)
	} else if o := q.Get("order"); o != "" && o != "desc" {
		return errdefs.InvalidArgument("order %s: want asc or desc", errdefs.Quote(o))
	}
	if tok := q.Get("nextToken"); tok != "" {
		after, err := base64.RawURLEncoding.DecodeString(tok)
		if err != nil {
			return errdefs.InvalidArgument("nextToken %s: not one this server made", errdefs.Quote(tok))
		}
		i := slices.IndexFunc(recs, func(rec *record) bool { return rec.ID == string(after) })
		if i < 0 {
			return errdefs.InvalidArgument("nextToken %s: its sandbox is gone; list again", errdefs.Quote(tok))
		}
		recs = recs[i+1:]
	}
	out := make([]listedSandbox, 0, min(limit, len(recs)))
	for _, rec := range recs[:min(limit, len(recs))] {
		out = append(out, s.listed(rec))
	}
	if len(recs) > limit {
		w.Header().Set("X-Next-Token", base64.RawURLEncoding.EncodeToString([]byte(recs[limit-1].ID)))
	}
	w.Header().Set("X-Total-Running", strconv.Itoa(len(s.live(r.Context(), listFilter{states: []string{stateRunning}}))))
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *Server) listSandboxesV1(w http.ResponseWriter, r *http.Request) error {
	md, err := metadataFilter(r.URL.Query().Get("metadata"))
	if err != nil {
		return err
	}
	out := []listedSandbox{}
	for _, rec := range s.live(r.Context(), listFilter{metadata: md, states: []string{stateRunning}}) {
		out = append(out, s.listed(rec))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *Server) createSnapshot(w http.ResponseWriter, r *http.Request) error {
	var req snapshotRequest
	if err := decode(r, &req); err != nil {
		return err
	}
	id := r.PathValue("id")
	unlock := s.ops.lock(id)
	defer unlock()
	rec, err := s.lookup(r.Context(), id)
	if err != nil {
		return err
	}
	sb, err := s.sandboxOf(r.Context(), rec)
	if err != nil {
		return err
	}
	tag := fmt.Sprintf("e2b-snap-%s-%d", rec.ID, time.Now().UnixMilli())
	name := tag
	if req.Name != "" {
		name = req.Name
		t := strings.TrimSuffix(req.Name, ":default")
		if i := strings.LastIndexByte(t, '/'); i >= 0 {
			t = t[i+1:]
		}
		if err := snapshot.ValidateTag(t); err != nil {
			return fmt.Errorf("snapshot name: %w", err)
		}
		tag = t
	}
	// A persistent template: one that stands alone when its sandbox's
	// snapshot is a fork's, else a diff of it.
	mode := sandbox.BranchDiff
	if src, err := s.e.Snapshots().Get(sb.Snapshot); err != nil || src.Ephemeral || src.Branch != nil && src.Branch.Depth >= snapshot.MaxDepth/2 {
		mode = sandbox.BranchFull
	}
	if _, err := s.e.Branch(context.WithoutCancel(r.Context()), sandbox.BranchSpec{ID: sb.ID, Tag: tag, Mode: mode}); err != nil {
		return err
	}
	m := &snapMark{Tag: tag, Sandbox: rec.ID, Names: []string{name}, Created: time.Now().UTC()}
	if err := s.store.markSnapshot(m); err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, snapshotInfo{SnapshotID: tag, Names: m.Names})
	return nil
}

func (s *Server) listSnapshots(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	limit := 100
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 100 {
			return errdefs.InvalidArgument("limit %s: want 1 to 100", errdefs.Quote(v))
		}
		limit = n
	}
	var marks []snapMark
	for _, m := range s.store.snapshots() {
		if sid := q.Get("sandboxID"); sid != "" && m.Sandbox != sid {
			continue
		}
		if n := q.Get("name"); n != "" && !slices.Contains(m.Names, n) && m.Tag != n {
			continue
		}
		if _, err := s.e.Snapshots().Get(m.Tag); err != nil {
			continue // removed behind our back
		}
		marks = append(marks, m)
	}
	if tok := q.Get("nextToken"); tok != "" {
		after, err := base64.RawURLEncoding.DecodeString(tok)
		i := slices.IndexFunc(marks, func(m snapMark) bool { return m.Tag == string(after) })
		if err != nil || i < 0 {
			return errdefs.InvalidArgument("nextToken %s: not one this server made", errdefs.Quote(tok))
		}
		marks = marks[i+1:]
	}
	out := []snapshotInfo{}
	for _, m := range marks[:min(limit, len(marks))] {
		out = append(out, snapshotInfo{SnapshotID: m.Tag, Names: m.Names})
	}
	if len(marks) > limit {
		w.Header().Set("X-Next-Token", base64.RawURLEncoding.EncodeToString([]byte(marks[limit-1].Tag)))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *Server) deleteSnapshot(w http.ResponseWriter, r *http.Request) error {
	tag := r.PathValue("id")
	known := false
	for _, m := range s.store.snapshots() {
		if m.Tag == tag {
			known = true
		}
	}
	if !known {
		return errdefs.NotFound("snapshot %s not found", errdefs.Quote(tag))
	}
	if err := s.e.RemoveSnapshot(tag); err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	if _, err := s.store.unmarkSnapshot(tag); err != nil {
		return err
	}
	noContent(w)
	return nil
}

// poke wakes the expiry loop.
func (s *Server) poke() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Start starts the server's background work until ctx or the server
// ends: pausing the sandboxes that asked to be paused at their timeout, and
// forgetting those whose forkd sandbox ended (the engine's expirer kills
// the others at theirs).
func (s *Server) Start(ctx context.Context) {
	s.work.Add(1)
	go func() {
		defer s.work.Done()
		s.run(ctx)
	}()
}

func (s *Server) run(ctx context.Context) {
	for {
		next := s.pass(ctx)
		wait := 10 * time.Second
		if !next.IsZero() {
			wait = min(wait, max(time.Until(next), 10*time.Millisecond))
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-s.base.Done():
			t.Stop()
			return
		case <-s.wake:
			t.Stop()
		case <-t.C:
		}
	}
}

// pass does one round of run and returns the next auto-pause deadline.
func (s *Server) pass(ctx context.Context) time.Time {
	var next time.Time
	now := time.Now()
	for _, rec := range s.live(ctx, listFilter{states: []string{stateRunning}}) {
		if !rec.AutoPause {
			continue
		}
		if rec.EndAt.After(now) {
			if next.IsZero() || rec.EndAt.Before(next) {
				next = rec.EndAt
			}
			continue
		}
		unlock := s.ops.lock(rec.ID)
		cur, err := s.store.get(rec.ID)
		if err == nil && cur.State == stateRunning && !cur.EndAt.After(time.Now()) {
			if err := s.pauseLocked(ctx, cur); err != nil {
				s.log.Warn("auto-pause", "e2b", rec.ID, "err", err)
				// Kill rather than run on forever past its end.
				s.kill(cur.Sandbox)
			}
		}
		unlock()
	}
	return next
}
