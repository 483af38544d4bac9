package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
)

// Bounds of request fields.
const (
	minMemoryLimitMiB = 64
	maxMemoryLimitMiB = 1 << 20
	maxNetworkRules   = 64
	maxRulePorts      = 16
	maxPublished      = 16
	minCPUs           = 0.01 // the cgroup layer's smallest quota
	maxCPUs           = 1024
	// MaxIOBps bounds io_read_bps and io_write_bps.
	MaxIOBps = 1 << 40
)

// CheckCPUs checks a CPU limit in cores: 0 (no limit) or 0.01 to 1024,
// never NaN or infinite. field names it in the error.
func CheckCPUs(field string, cpus float64) error {
	if cpus != 0 && !(cpus >= minCPUs && cpus <= maxCPUs) {
		return errdefs.InvalidArgument("%s = %g: want 0 (no limit) or %g to %d cores", field, cpus, minCPUs, maxCPUs)
	}
	return nil
}

// sandboxStatuses are the statuses GET /v1/sandboxes?status= filters on.
var sandboxStatuses = []string{state.StatusStarting, state.StatusRunning, state.StatusParked, state.StatusBuilding,
	state.StatusDead, state.StatusOOM}

// ForkSpec validates a create request into a fork spec. maxN is the
// largest batch one request may ask for.
func ForkSpec(req *apiv1.CreateSandboxesRequest, maxN int) (sandbox.ForkSpec, error) {
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
	if err := CheckCPUs("cpus", req.CPUs); err != nil {
		return spec, err
	}
	if req.PIDsLimit < 0 || req.PIDsLimit > 1<<22 {
		return spec, errdefs.InvalidArgument("pids_limit = %d: want 0 (no limit) or a positive number", req.PIDsLimit)
	}
	if req.IOWeight < 0 || req.IOWeight > 10000 {
		return spec, errdefs.InvalidArgument("io_weight = %d: want 0 (default) or 1 to 10000", req.IOWeight)
	}
	if req.IOReadBps < 0 || req.IOWriteBps < 0 || req.IOReadBps > MaxIOBps || req.IOWriteBps > MaxIOBps {
		return spec, errdefs.InvalidArgument("io_read_bps and io_write_bps: want 0 (no limit) or 1 to %d bytes per second", int64(MaxIOBps))
	}
	pol, err := NetworkPolicy(req.Network)
	if err != nil {
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
	if req.Network != nil {
		spec.Net = &sandbox.NetSpec{Policy: pol, Publish: req.Network.Publish}
	}
	if req.Limits != (apiv1.Limits{}) {
		spec.Limits = &state.Limits{MemoryMiB: int64(req.MemoryLimitMiB), CPUs: req.CPUs, PIDs: int64(req.PIDsLimit),
			IOWeight: uint64(req.IOWeight), IOReadBps: uint64(req.IOReadBps), IOWriteBps: uint64(req.IOWriteBps)}
	}
	return spec, nil
}

// NetworkPolicy turns a network spec into the egress policy the network
// layer enforces (netns.Policy), checking its rules and the API's size
// bounds. A nil spec is the default policy.
func NetworkPolicy(n *apiv1.NetworkSpec) (netns.Policy, error) {
	if n == nil {
		return netns.DefaultPolicy, nil
	}
	if len(n.Allow) > maxNetworkRules {
		return netns.Policy{}, errdefs.InvalidArgument("network.allow has %d rules; the limit is %d", len(n.Allow), maxNetworkRules)
	}
	if len(n.Publish) > maxPublished {
		return netns.Policy{}, errdefs.InvalidArgument("network.publish has %d ports; the limit is %d", len(n.Publish), maxPublished)
	}
	for _, port := range n.Publish {
		if port < 1 || port > 65535 {
			return netns.Policy{}, errdefs.InvalidArgument("network.publish port %d: want 1 to 65535", port)
		}
	}
	p := netns.Policy{Mode: netns.Mode(n.Egress)}
	if p.Mode == "" {
		p.Mode = netns.ModeAllow
	}
	for i, r := range n.Allow {
		cidr, err := netip.ParsePrefix(r.CIDR)
		if err != nil {
			return netns.Policy{}, errdefs.InvalidArgument("network.allow[%d].cidr %q: want a CIDR such as 10.1.0.0/16", i, r.CIDR)
		}
		if len(r.Ports) > maxRulePorts {
			return netns.Policy{}, errdefs.InvalidArgument("network.allow[%d] has %d port ranges; the limit is %d", i, len(r.Ports), maxRulePorts)
		}
		rule := netns.Rule{CIDR: cidr, Proto: r.Proto}
		for _, ps := range r.Ports {
			pr, err := netns.ParsePortRange(ps)
			if err != nil {
				return netns.Policy{}, fmt.Errorf("network.allow[%d].ports: %w", i, err)
			}
			rule.Ports = append(rule.Ports, pr)
		}
		p.Allow = append(p.Allow, rule)
	}
	p, err := p.Validate()
	if err != nil {
		return netns.Policy{}, fmt.Errorf("network: %w", err)
	}
	return p, nil
}

// View is a sandbox record as the API shows it.
func View(sb *state.Sandbox) apiv1.Sandbox {
	v := apiv1.Sandbox{
		ID: sb.ID, SnapshotTag: sb.Snapshot, Status: sb.Status, PID: sb.Handle.Process.PID,
		Created: sb.Created, ReadyMS: sb.ReadyMS, ExpiresAt: sb.ExpiresAt, Metadata: sb.Metadata,
	}
	if l := sb.Limits; l != nil {
		v.MemoryLimitMiB, v.CPUs, v.PIDsLimit = int(l.MemoryMiB), l.CPUs, int(l.PIDs)
		v.IOWeight, v.IOReadBps, v.IOWriteBps = int(l.IOWeight), int64(l.IOReadBps), int64(l.IOWriteBps)
	}
	if n := sb.Net; n != nil && n.Address != "" {
		sn := &apiv1.SandboxNetwork{Address: n.Address}
		var p netns.Policy
		if json.Unmarshal(n.Policy, &p) == nil {
			sn.Egress, sn.Allow = string(p.Mode), wireRules(p.Allow)
		}
		for _, port := range n.Ports {
			sn.Ports = append(sn.Ports, apiv1.PublishedPort{Proto: port.Proto, GuestPort: port.GuestPort, HostPort: port.HostPort})
		}
		v.Network = sn
	}
	return v
}

// wireRules is the API form of a policy's rules.
func wireRules(rules []netns.Rule) []apiv1.NetworkRule {
	var out []apiv1.NetworkRule
	for _, r := range rules {
		w := apiv1.NetworkRule{CIDR: r.CIDR.String(), Proto: r.Proto}
		for _, pr := range r.Ports {
			w.Ports = append(w.Ports, pr.String())
		}
		out = append(out, w)
	}
	return out
}

func (s *Server) createSandboxes(r *http.Request, req *apiv1.CreateSandboxesRequest) (any, error) {
	spec, err := ForkSpec(req, s.e.Config().MaxChildren)
	if err != nil {
		return nil, err
	}
	res, err := s.cfg.Admitter.Fork(r.Context(), spec)
	if res == nil {
		switch {
		case errdefs.IsResourceExhausted(err):
			s.metrics.rejected.Inc()
		default:
			// A batch rolled back after restores failed; refusals before
			// any restore (bad snapshot, not ready) count as nothing.
			if b := (*sandbox.BatchError)(nil); errors.As(err, &b) {
				s.metrics.failed.Add(float64(b.Failed))
			}
		}
		return nil, err
	}
	if cerr := r.Context().Err(); cerr != nil {
		// The caller left: nobody will learn these ids, so nobody would
		// ever kill them. They go now.
		kctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), time.Minute)
		defer cancel()
		for _, c := range res.Children {
			if c.Err == nil {
				if kerr := s.e.Kill(kctx, c.ID); kerr != nil && !errdefs.IsNotFound(kerr) {
					s.log.Warn("kill sandbox of a departed caller", "sandbox", c.ID, "err", kerr)
				}
			}
		}
		return nil, errdefs.Unavailable("the caller went away before the sandboxes were ready: %v", cerr)
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
		out.Sandboxes = append(out.Sandboxes, View(c.Sandbox))
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
	if status != "" && !slices.Contains(sandboxStatuses, status) {
		return nil, errdefs.InvalidArgument("status %q: want one of %s", status, strings.Join(sandboxStatuses, ", "))
	}
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
		out.Sandboxes = append(out.Sandboxes, View(sb))
	}
	return out, nil
}

func (s *Server) getSandbox(r *http.Request) (any, error) {
	sb, err := s.e.Get(r.Context(), r.PathValue("id"))
	if err != nil {
		return nil, err
	}
	return View(sb), nil
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
	return View(sb), nil
}

func (s *Server) setNetwork(r *http.Request, req *apiv1.NetworkSpec) (any, error) {
	if len(req.Publish) > 0 {
		return nil, errdefs.InvalidArgument("publish ports with POST /v1/sandboxes/{id}/ports")
	}
	p, err := NetworkPolicy(req)
	if err != nil {
		return nil, err
	}
	sb, err := s.e.SetPolicy(r.Context(), r.PathValue("id"), p)
	if err != nil {
		return nil, err
	}
	return View(sb), nil
}

func (s *Server) publishPort(r *http.Request, req *apiv1.PublishRequest) (any, error) {
	p, err := s.e.Publish(r.Context(), r.PathValue("id"), req.GuestPort)
	if err != nil {
		return nil, err
	}
	return apiv1.PublishedPort{Proto: p.Proto, GuestPort: p.GuestPort, HostPort: p.HostPort}, nil
}
