// Package request turns API v1 requests into the engine's specs and the
// agent's requests, checking every field on the way, and engine records
// back into API views. It is shared by the faces of the engine (the REST
// server, and the CLI for its flags), so that a field is validated by one
// function whatever door it came in by.
package request

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/disk"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image"
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

// minGuestPIDs is the least guest_pids_limit: room for a shell and its
// pipeline beside the warm interpreter.
const minGuestPIDs = 16

// CheckCPUs checks a CPU limit in cores: 0 (no limit) or 0.01 to 1024,
// never NaN or infinite. field names it in the error.
func CheckCPUs(field string, cpus float64) error {
	if cpus != 0 && !(cpus >= minCPUs && cpus <= maxCPUs) {
		return errdefs.InvalidArgument("%s = %g: want 0 (no limit) or %g to %d cores", field, cpus, minCPUs, maxCPUs)
	}
	return nil
}

// SandboxStatuses are the statuses GET /v1/sandboxes?status= filters on.
var SandboxStatuses = []string{state.StatusStarting, state.StatusRunning, state.StatusUnresponsive, state.StatusFrozen, state.StatusParked, state.StatusBuilding,
	state.StatusDead, state.StatusOOM}

// ForkSpec validates a create request into a fork spec. maxN is the
// largest batch one request may ask for.
func ForkSpec(req *apiv1.CreateSandboxesRequest, maxN int) (sandbox.ForkSpec, error) {
	var spec sandbox.ForkSpec
	if err := snapshot.ValidateTag(req.SnapshotTag); err != nil {
		return spec, errdefs.InvalidArgument("snapshot_tag: %w", err)
	}
	n := req.N
	if n == 0 {
		n = 1
	}
	if n < 1 || n > maxN {
		return spec, errdefs.InvalidArgument("n = %d: want 1 to %d (0 means 1)", req.N, maxN)
	}
	maxSecs := int(sandbox.MaxTimeout / time.Second)
	if req.TimeoutSecs < 0 || req.TimeoutSecs > maxSecs {
		return spec, errdefs.InvalidArgument("timeout_secs = %d: want 0 (none) to %d", req.TimeoutSecs, maxSecs)
	}
	for k, v := range req.Metadata {
		if k == "" || len(k) > 128 || len(v) > 1024 || strings.ContainsAny(k, "=\x00") {
			return spec, errdefs.InvalidArgument("metadata %s: keys are 1 to 128 bytes without '=', values at most 1024 bytes", errdefs.Quote(k))
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
	if g := req.GuestPIDsLimit; g != 0 && (g < minGuestPIDs || g > 1<<22) {
		return spec, errdefs.InvalidArgument("guest_pids_limit = %d: want 0 (the guest's default) or %d to %d", g, minGuestPIDs, 1<<22)
	}
	if req.IOWeight < 0 || req.IOWeight > 10000 {
		return spec, errdefs.InvalidArgument("io_weight = %d: want 0 (default) or 1 to 10000", req.IOWeight)
	}
	if req.IOReadBps < 0 || req.IOWriteBps < 0 || req.IOReadBps > MaxIOBps || req.IOWriteBps > MaxIOBps {
		return spec, errdefs.InvalidArgument("io_read_bps and io_write_bps: want 0 (no limit) or 1 to %d bytes per second", int64(MaxIOBps))
	}
	if err := disk.ValidateMiB("disk_mib", req.DiskMiB); err != nil {
		return spec, err
	}
	pol, err := NetworkPolicy(req.Network)
	if err != nil {
		return spec, err
	}
	md := req.Metadata
	if len(md) == 0 {
		md = nil
	}
	if err := sandbox.ValidateUnresponsive(req.OnUnresponsive); err != nil {
		return spec, fmt.Errorf("on_unresponsive: %w", err)
	}
	if err := sandbox.ValidateIdleFreezeSecs(req.IdleFreezeSecs); err != nil {
		return spec, err
	}
	spec = sandbox.ForkSpec{
		Tag: req.SnapshotTag, N: n, Metadata: md, KeepPartial: req.KeepPartial, OnUnresponsive: req.OnUnresponsive,
		IdleFreezeSecs: req.IdleFreezeSecs,
		Timeout:        time.Duration(req.TimeoutSecs) * time.Second,
		GuestPIDsLimit: req.GuestPIDsLimit,
		DiskMiB:        req.DiskMiB,
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
			return netns.Policy{}, errdefs.InvalidArgument("network.allow[%d].cidr %s: want a CIDR such as 10.1.0.0/16", i, errdefs.Quote(r.CIDR))
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
		OnUnresponsive: sb.OnUnresponsive, IdleFreezeSecs: sb.IdleFreezeSecs,
	}
	if sb.Disk != nil {
		v.DiskMiB = sb.Disk.MiB
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

// Bounds of snapshot requests.
const (
	maxWarmups     = 32
	maxWarmupBytes = 4096
)

// ViewSnapshot is a snapshot as the API shows it; refs is its number of
// live sandboxes and problem why it cannot be forked here (nil: it can).
func ViewSnapshot(sn *snapshot.Snapshot, refs int, problem error) apiv1.Snapshot {
	v := apiv1.Snapshot{
		Tag: sn.Tag, Status: string(sn.Status), Image: sn.Image, Backend: sn.Backend,
		Accelerator: sn.Accelerator, MemoryMiB: sn.MemoryMiB, VCPUs: sn.VCPUs,
		SizeBytes: sn.SizeBytes(), Refcount: refs, Created: sn.Created, Parent: sn.Parent, Error: sn.Error,
		Network: sn.Network, Python: sn.Python,
	}
	if problem != nil {
		v.Problem = problem.Error()
	}
	v.Kind, v.Ephemeral = sn.Kind, sn.Ephemeral
	if v.Kind == "" && sn.Status != snapshot.StatusCorrupt && sn.Status != snapshot.StatusWriting {
		v.Kind = snapshot.KindBoot
	}
	if b := sn.Branch; b != nil {
		v.Mode, v.Source, v.Depth = b.Mode, b.Source, b.Depth
	}
	if o := sn.Origin; o != nil {
		v.Origin = &apiv1.SnapshotOrigin{Ref: o.Ref, Digest: o.Digest, Pulled: o.Pulled}
	}
	v.DiskSlot = sn.DiskSlot
	_, v.DiskMiB = sn.DiskLayer()
	return v
}

// SnapshotSpec validates a create request into a snapshot spec and, when
// it imports an OCI image, the import's options. importDir confines local
// image paths (image.OCIOptions.ImportDir; empty: anywhere, for the local
// CLI only). Nothing is built or started.
func SnapshotSpec(req *apiv1.CreateSnapshotRequest, importDir string) (sandbox.SnapshotSpec, *image.OCIOptions, error) {
	spec, err := snapshotSpec(req)
	if err != nil || req.OCI == nil {
		return spec, nil, err
	}
	oci := &image.OCIOptions{Tag: spec.Tag, Extra: req.OCI.Extra, Preload: req.OCI.Preload, Insecure: req.OCI.Insecure,
		ImportDir: importDir}
	if err := image.ValidateOCIOptions(req.OCI.Ref, *oci); err != nil {
		return spec, nil, fmt.Errorf("oci: %w", err)
	}
	spec.OCIRef, spec.OCI = req.OCI.Ref, oci
	return spec, oci, nil
}

// snapshotSpec validates a create request but its OCI source.
func snapshotSpec(req *apiv1.CreateSnapshotRequest) (sandbox.SnapshotSpec, error) {
	spec := sandbox.SnapshotSpec{Tag: req.Tag, Image: req.Image, MemoryMiB: req.MemoryMiB, VCPUs: req.VCPUs, Warmup: req.Warmup}
	if err := snapshot.ValidateTag(spec.Tag); err != nil {
		return spec, err
	}
	if spec.Image == "" {
		spec.Image = "minimal"
	}
	if err := image.ValidateName(spec.Image); err != nil {
		return spec, err
	}
	if m := spec.MemoryMiB; m != 0 && (m < sandbox.MinMemoryMiB || m > sandbox.MaxMemoryMiB) {
		return spec, errdefs.InvalidArgument("memory_mib = %d: want %d to %d", m, sandbox.MinMemoryMiB, sandbox.MaxMemoryMiB)
	}
	if v := spec.VCPUs; v < 0 || v > sandbox.MaxVCPUs {
		return spec, errdefs.InvalidArgument("vcpus = %d: want 1 to %d", v, sandbox.MaxVCPUs)
	}
	if len(spec.Warmup) > maxWarmups {
		return spec, errdefs.InvalidArgument("%d warmup commands; the limit is %d", len(spec.Warmup), maxWarmups)
	}
	for _, w := range spec.Warmup {
		if w == "" || len(w) > maxWarmupBytes {
			return spec, errdefs.InvalidArgument("warmup commands are 1 to %d bytes", maxWarmupBytes)
		}
	}
	return spec, nil
}

// maxCallSecs bounds exec and eval timeouts.
const maxCallSecs = 24 * 60 * 60

// CallTimeout checks an exec or eval timeout of secs seconds: 0 (none) to
// a day, never negative, NaN or infinite. field names it in the error.
func CallTimeout(field string, secs float64) (time.Duration, error) {
	if !(secs >= 0 && secs <= maxCallSecs) {
		return 0, errdefs.InvalidArgument("%s = %v: want 0 (none) to %d seconds", field, secs, maxCallSecs)
	}
	return time.Duration(secs * float64(time.Second)), nil
}

// agentExec validates an exec request into the agent's form.
func Exec(req *apiv1.ExecRequest) (agent.ExecRequest, error) {
	var out agent.ExecRequest
	if (len(req.Args) == 0) == (req.Shell == "") {
		return out, errdefs.InvalidArgument("give exactly one of args and shell")
	}
	if len(req.Args) > 0 && req.Args[0] == "" {
		return out, errdefs.InvalidArgument("args[0] is empty")
	}
	for k := range req.Env {
		if k == "" || strings.ContainsAny(k, "=\x00") {
			return out, errdefs.InvalidArgument("env name %s: want a name without '=' or NUL", errdefs.Quote(k))
		}
	}
	d, err := CallTimeout("timeout_secs", req.TimeoutSecs)
	if err != nil {
		return out, err
	}
	out = agent.ExecRequest{Args: req.Args, Shell: req.Shell, Env: req.Env, Dir: req.Cwd, User: req.User, Timeout: d}
	if req.Stdin != nil {
		out.Stdin = bytes.NewReader(req.Stdin)
	}
	return out, nil
}

func ExecResult(res *proto.ExecResult) apiv1.ExecResult {
	return apiv1.ExecResult{ExitCode: res.ExitCode, Signal: res.Signal, TimedOut: res.TimedOut, DurationMS: res.DurationMS}
}

func Eval(req *apiv1.EvalRequest) (proto.EvalRequest, error) {
	if strings.TrimSpace(req.Code) == "" {
		return proto.EvalRequest{}, errdefs.InvalidArgument("code is empty")
	}
	d, err := CallTimeout("timeout_secs", req.TimeoutSecs)
	if err != nil {
		return proto.EvalRequest{}, err
	}
	return proto.EvalRequest{Code: req.Code, Timeout: d}, nil
}

func EvalResult(res *proto.EvalResult) apiv1.EvalResult {
	out := apiv1.EvalResult{
		Value: res.Value, Stdout: res.Stdout, Stderr: res.Stderr, Truncated: res.Truncated,
		TimedOut: res.TimedOut, Restarted: res.Restarted, DurationMS: res.DurationMS,
	}
	if res.Error != nil {
		out.Error = &apiv1.EvalError{Name: res.Error.Name, Message: res.Error.Message, Traceback: res.Error.Traceback}
	}
	return out
}

// ForkFrom validates a request to fork from a running sandbox into the
// branch mode and the spec of the fork (its Tag left empty: the branch
// names it). maxN is the largest batch one request may ask for.
func ForkFrom(req *apiv1.ForkRequest, maxN int) (string, sandbox.ForkSpec, error) {
	if err := sandbox.ValidateBranchMode(req.Mode); err != nil {
		return "", sandbox.ForkSpec{}, fmt.Errorf("mode: %w", err)
	}
	if req.Count < 0 || req.Count > maxN {
		return "", sandbox.ForkSpec{}, errdefs.InvalidArgument("count = %d: want 1 to %d per request (0 means 1)", req.Count, maxN)
	}
	spec, err := ForkSpec(&apiv1.CreateSandboxesRequest{
		SnapshotTag: "from-sandbox", N: req.Count, TimeoutSecs: req.TimeoutSecs, Metadata: req.Metadata,
		Limits: req.Limits, Network: req.Network, KeepPartial: req.KeepPartial, OnUnresponsive: req.OnUnresponsive,
		DiskMiB:        req.DiskMiB,
		IdleFreezeSecs: req.IdleFreezeSecs,
	}, maxN)
	spec.Tag = ""
	return req.Mode, spec, err
}

// Branch validates a branch request into the engine's spec for sandbox id
// and whether to wait for it.
func Branch(id string, req *apiv1.BranchRequest) (sandbox.BranchSpec, bool, error) {
	if err := sandbox.ValidateBranchMode(req.Mode); err != nil {
		return sandbox.BranchSpec{}, false, fmt.Errorf("mode: %w", err)
	}
	if req.Tag != "" {
		if err := snapshot.ValidateTag(req.Tag); err != nil {
			return sandbox.BranchSpec{}, false, fmt.Errorf("tag: %w", err)
		}
	}
	wait := req.Wait == nil || *req.Wait
	return sandbox.BranchSpec{ID: id, Tag: req.Tag, Mode: req.Mode}, wait, nil
}

// ViewInfo is a snapshot's info as the API shows it.
func ViewInfo(in *snapshot.Info, refs int, problem error) apiv1.SnapshotInfo {
	v := apiv1.SnapshotInfo{
		Snapshot: ViewSnapshot(in.Snapshot, refs, problem), LogicalBytes: in.LogicalBytes,
		PhysicalBytes: in.PhysicalBytes, LayerBytes: in.LayerBytes,
		Ancestors: append([]string{}, in.Ancestors...), ChainError: in.ChainError,
		Dependents: append([]string{}, in.Dependents...),
	}
	if b := in.Snapshot.Branch; b != nil {
		v.PauseMS, v.DirtyBytes, v.TotalMS = b.PauseMS, b.DirtyBytes, b.TotalMS
		v.DiskSwitchMS = b.DiskSwitchMS
	}
	return v
}

// Workspace validates a workspace create request into its name and the
// spec of its one sandbox.
func Workspace(req *apiv1.CreateWorkspaceRequest, maxN int) (string, sandbox.ForkSpec, error) {
	if err := sandbox.ValidateWorkspaceName(req.Name); err != nil {
		return "", sandbox.ForkSpec{}, err
	}
	if req.N > 1 || req.KeepPartial {
		return "", sandbox.ForkSpec{}, errdefs.InvalidArgument("a workspace has one sandbox: n must be 0 or 1, keep_partial unset")
	}
	if req.TimeoutSecs != 0 {
		return "", sandbox.ForkSpec{}, errdefs.InvalidArgument("a workspace lives until removed: timeout_secs must be 0")
	}
	spec, err := ForkSpec(&req.CreateSandboxesRequest, maxN)
	return req.Name, spec, err
}

// ViewWorkspace is a workspace as the API shows it.
func ViewWorkspace(w *state.Workspace) apiv1.Workspace {
	return apiv1.Workspace{Name: w.Name, Snapshot: w.Snapshot, Status: w.Status, Sandbox: w.Sandbox,
		States: append([]string(nil), w.States...), Created: w.Created, Updated: w.Updated}
}
