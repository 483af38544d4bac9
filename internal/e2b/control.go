package e2b

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
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
