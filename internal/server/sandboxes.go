package server

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"strings"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
)

// extraKey is this package's key in state.Sandbox.Extra.
const extraKey = "api"

// sandboxExtra is what the API records with a sandbox beyond the engine's
// own fields: requested limits not yet enforced by the engine.
type sandboxExtra struct {
	MemoryLimitMiB int                `json:"memory_limit_mib,omitempty"`
	Network        *apiv1.NetworkSpec `json:"network,omitempty"`
}

// Bounds of request fields.
const (
	minMemoryLimitMiB = 64
	maxMemoryLimitMiB = 1 << 20
	maxNetworkRules   = 64
	maxRulePorts      = 16
)

// forkSpec validates a create request into a fork spec. maxN is the
// largest batch one request may ask for.
func forkSpec(req *apiv1.CreateSandboxesRequest, maxN int) (sandbox.ForkSpec, error) {
	var spec sandbox.ForkSpec
	if err := snapshot.ValidateTag(req.SnapshotTag); err != nil {
		return spec, errdefs.InvalidArgument("snapshot_tag: %v", err)
	}
	n := req.N
	if n == 0 {
		n = 1
	}
	if n < 1 || n > maxN {
		return spec, errdefs.InvalidArgument("n = %d: want 1 to %d per request", req.N, maxN)
	}
	maxSecs := int(sandbox.MaxTimeout / time.Second)
	if req.TimeoutSecs < 0 || req.TimeoutSecs > maxSecs {
		return spec, errdefs.InvalidArgument("timeout_secs = %d: want 0 (none) to %d", req.TimeoutSecs, maxSecs)
	}
	for k, v := range req.Metadata {
		if k == "" || len(k) > 128 || len(v) > 1024 || strings.ContainsAny(k, "=\x00") {
			return spec, errdefs.InvalidArgument("metadata %q: keys are 1 to 128 bytes without '=', values at most 1024 bytes", k)
		}
	}
	if len(req.Metadata) > 64 {
		return spec, errdefs.InvalidArgument("metadata has %d keys; the limit is 64", len(req.Metadata))
	}
	if m := req.MemoryLimitMiB; m != 0 && (m < minMemoryLimitMiB || m > maxMemoryLimitMiB) {
		return spec, errdefs.InvalidArgument("memory_limit_mib = %d: want 0 (none) or %d to %d", m, minMemoryLimitMiB, maxMemoryLimitMiB)
	}
	if err := validateNetwork(req.Network); err != nil {
		return spec, err
	}
	md := req.Metadata
	if len(md) == 0 {
		md = nil
	}
	spec = sandbox.ForkSpec{
		Tag: req.SnapshotTag, N: n, Metadata: md, KeepPartial: req.KeepPartial,
		Timeout: time.Duration(req.TimeoutSecs) * time.Second,
	}
	if req.MemoryLimitMiB != 0 || req.Network != nil {
		b, err := json.Marshal(sandboxExtra{MemoryLimitMiB: req.MemoryLimitMiB, Network: req.Network})
		if err != nil {
			return spec, err
		}
		spec.Extra = map[string]json.RawMessage{extraKey: b}
	}
	return spec, nil
}

// validateNetwork checks a network spec by the rules the network layer
// enforces (netns.Policy), plus the API's size bounds.
func validateNetwork(n *apiv1.NetworkSpec) error {
	if n == nil {
		return nil
	}
	if len(n.Allow) > maxNetworkRules {
		return errdefs.InvalidArgument("network.allow has %d rules; the limit is %d", len(n.Allow), maxNetworkRules)
	}
	p := netns.Policy{Mode: netns.Mode(n.Egress)}
	if p.Mode == "" {
		p.Mode = netns.ModeAllow
	}
	for i, r := range n.Allow {
		cidr, err := netip.ParsePrefix(r.CIDR)
		if err != nil {
			return errdefs.InvalidArgument("network.allow[%d].cidr %q: want a CIDR such as 10.1.0.0/16", i, r.CIDR)
		}
		if len(r.Ports) > maxRulePorts {
			return errdefs.InvalidArgument("network.allow[%d] has %d port ranges; the limit is %d", i, len(r.Ports), maxRulePorts)
		}
		rule := netns.Rule{CIDR: cidr, Proto: r.Proto}
		for _, ps := range r.Ports {
			pr, err := netns.ParsePortRange(ps)
			if err != nil {
				return fmt.Errorf("network.allow[%d].ports: %w", i, err)
			}
			rule.Ports = append(rule.Ports, pr)
		}
		p.Allow = append(p.Allow, rule)
	}
	if _, err := p.Validate(); err != nil {
		return fmt.Errorf("network: %w", err)
	}
	return nil
}

// viewSandbox is a sandbox record as the API shows it.
func viewSandbox(sb *state.Sandbox) apiv1.Sandbox {
	v := apiv1.Sandbox{
		ID: sb.ID, SnapshotTag: sb.Snapshot, Status: sb.Status, PID: sb.Handle.Process.PID,
		Created: sb.Created, ReadyMS: sb.ReadyMS, ExpiresAt: sb.ExpiresAt, Metadata: sb.Metadata,
	}
	if raw, ok := sb.Extra[extraKey]; ok {
		var x sandboxExtra
		if json.Unmarshal(raw, &x) == nil {
			v.MemoryLimitMiB, v.Network = x.MemoryLimitMiB, x.Network
		}
	}
	return v
}

func (s *Server) createSandboxes(r *http.Request, req *apiv1.CreateSandboxesRequest) (any, error) {
	spec, err := forkSpec(req, s.e.Config().MaxChildren)
	if err != nil {
		return nil, err
	}
	res, err := s.cfg.Admitter.Fork(r.Context(), spec)
	if res == nil {
		if errdefs.IsResourceExhausted(err) {
			s.metrics.rejected.Inc()
		} else if err != nil && !errdefs.IsInvalidArgument(err) && !errdefs.IsNotFound(err) {
			s.metrics.failed.Add(float64(spec.N))
		}
		return nil, err
	}
	out := apiv1.CreateSandboxesResponse{Sandboxes: []apiv1.Sandbox{}, WallMS: res.WallMS}
	for _, c := range res.Children {
		if c.Err != nil {
			s.metrics.failed.Inc()
			out.Failed = append(out.Failed, apiv1.ChildFailure{ID: c.ID, Error: wireError(c.Err)})
			continue
		}
		s.metrics.created.Inc()
		s.metrics.readyTime.Observe(c.ReadyMS / 1000)
		out.Sandboxes = append(out.Sandboxes, viewSandbox(c.Sandbox))
	}
	if len(out.Sandboxes) == 0 {
		return nil, err
	}
	if spec.Timeout > 0 {
		s.cfg.Expirer.Poke()
	}
	return out, nil
}

func (s *Server) listSandboxes(r *http.Request) (any, error) {
	q := r.URL.Query()
	tag := q.Get("snapshot")
	if tag != "" {
		if err := snapshot.ValidateTag(tag); err != nil {
			return nil, err
		}
	}
	want := map[string]string{}
	for _, kv := range q["metadata"] {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, errdefs.InvalidArgument("metadata filter %q: want KEY=VALUE", kv)
		}
		want[k] = v
	}
	status := q.Get("status")
	list, err := s.e.List(r.Context())
	if err != nil {
		return nil, err
	}
	out := apiv1.SandboxList{Sandboxes: []apiv1.Sandbox{}}
next:
	for _, sb := range list {
		if tag != "" && sb.Snapshot != tag || status != "" && sb.Status != status {
			continue
		}
		for k, v := range want {
			if got, ok := sb.Metadata[k]; !ok || got != v {
				continue next
			}
		}
		out.Sandboxes = append(out.Sandboxes, viewSandbox(sb))
	}
	return out, nil
}

func (s *Server) getSandbox(r *http.Request) (any, error) {
	sb, err := s.e.Get(r.Context(), r.PathValue("id"))
	if err != nil {
		return nil, err
	}
	return viewSandbox(sb), nil
}

func (s *Server) deleteSandbox(r *http.Request) (any, error) {
	return nil, s.e.Kill(r.Context(), r.PathValue("id"))
}

func (s *Server) setTimeout(r *http.Request, req *apiv1.SetTimeoutRequest) (any, error) {
	maxSecs := int(sandbox.MaxTimeout / time.Second)
	if req.TimeoutSecs < 0 || req.TimeoutSecs > maxSecs {
		return nil, errdefs.InvalidArgument("timeout_secs = %d: want 0 (none) to %d", req.TimeoutSecs, maxSecs)
	}
	sb, err := s.cfg.Expirer.SetTimeout(r.Context(), r.PathValue("id"), time.Duration(req.TimeoutSecs)*time.Second)
	if err != nil {
		return nil, err
	}
	return viewSandbox(sb), nil
}
