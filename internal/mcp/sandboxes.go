package mcp

import (
	"context"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/request"
)

func itoa(n int) string { return strconv.Itoa(n) }

// idArgs names one sandbox.
type idArgs struct {
	ID string `json:"id" jsonschema:"the sandbox id (sb- and 10 characters), as spawn_sandboxes or list_sandboxes give it"`
}

// notFoundSandbox is the hint for a sandbox that is not there.
func notFoundSandbox(id string, err error) error {
	return withHint(err, errdefs.IsNotFound, fmt.Sprintf("No sandbox %s: it was killed, expired, or never existed; list_sandboxes lists the live ones.", id))
}

type spawnArgs struct {
	SnapshotTag    string            `json:"snapshot_tag" jsonschema:"the snapshot to fork the sandboxes from (list_snapshots shows the ready ones)"`
	N              int               `json:"n,omitempty" jsonschema:"how many sandboxes (default 1)"`
	TimeoutSecs    int               `json:"timeout_secs,omitempty" jsonschema:"kill each sandbox this many seconds after it is ready (0 or absent: never; recommended, so that forgotten sandboxes go away)"`
	Metadata       map[string]string `json:"metadata,omitempty" jsonschema:"labels to find the sandboxes by later (list_sandboxes metadata filter)"`
	MemoryLimitMiB int               `json:"memory_limit_mib,omitempty" jsonschema:"cap of each sandbox's host memory in MiB (64 or more; needs a daemon running as root)"`
	CPUs           float64           `json:"cpus,omitempty" jsonschema:"cap of each sandbox's CPU time, in cores (needs a daemon running as root)"`
	Egress         string            `json:"egress,omitempty" jsonschema:"outbound network policy: allow (default), deny or allowlist (only the allow rules); needs a snapshot with a network"`
	Allow          []ruleArgs        `json:"allow,omitempty" jsonschema:"destinations allowed: the only ones with egress allowlist, exceptions to the blocked private ranges with allow"`
	Publish        []int             `json:"publish,omitempty" jsonschema:"guest TCP ports to publish on host ports (see the result's network.ports)"`
	KeepPartial    bool              `json:"keep_partial,omitempty" jsonschema:"keep the sandboxes that came up when some failed (default: all or nothing)"`
}

type ruleArgs struct {
	CIDR  string   `json:"cidr" jsonschema:"an IPv4 network in CIDR form: 1.1.1.1/32 for one address, 10.0.0.0/8 for a range"`
	Proto string   `json:"proto,omitempty" jsonschema:"tcp, udp or icmp (absent: all)"`
	Ports []string `json:"ports,omitempty" jsonschema:"ports or ranges, e.g. 443 or 8000-8100 (absent: all)"`
}

type spawnResult struct {
	Sandboxes []sandboxView `json:"sandboxes"`
	Failed    []failureView `json:"failed,omitempty" jsonschema:"the sandboxes that did not come up (keep_partial only)"`
	WallMS    float64       `json:"wall_ms"`
}

type failureView struct {
	ID    string `json:"id"`
	Error string `json:"error"`
}

type sandboxList struct {
	Sandboxes []sandboxView `json:"sandboxes"`
}

type listSandboxesArgs struct {
	SnapshotTag string            `json:"snapshot_tag,omitempty" jsonschema:"only the sandboxes forked from this snapshot"`
	Status      string            `json:"status,omitempty" jsonschema:"only the sandboxes in this status"`
	Metadata    map[string]string `json:"metadata,omitempty" jsonschema:"only the sandboxes with all these labels"`
}

type killResult struct {
	ID     string `json:"id"`
	Killed bool   `json:"killed"`
}

type branchArgs struct {
	ID   string `json:"id" jsonschema:"the running sandbox to save"`
	Tag  string `json:"tag,omitempty" jsonschema:"the new snapshot's tag (absent: one is made up)"`
	Mode string `json:"mode,omitempty" jsonschema:"diff (default: a layer over the sandbox's snapshot), full (stands alone) or live (the sandbox pauses only to switch over)"`
}

type forkArgs struct {
	ID          string            `json:"id" jsonschema:"the running sandbox to clone"`
	Count       int               `json:"count,omitempty" jsonschema:"how many clones (default 1)"`
	Mode        string            `json:"mode,omitempty" jsonschema:"how the state is captured: diff (default), full or live"`
	TimeoutSecs int               `json:"timeout_secs,omitempty" jsonschema:"kill each clone this many seconds after it is ready (0 or absent: never)"`
	Metadata    map[string]string `json:"metadata,omitempty" jsonschema:"labels of the clones"`
}

type egressArgs struct {
	ID     string     `json:"id" jsonschema:"the sandbox"`
	Egress string     `json:"egress" jsonschema:"allow (all but the host's private ranges), deny (nothing) or allowlist (only the allow rules)"`
	Allow  []ruleArgs `json:"allow,omitempty" jsonschema:"destinations allowed (replaces the current rules)"`
}

type publishArgs struct {
	ID        string `json:"id" jsonschema:"the sandbox"`
	GuestPort int    `json:"guest_port" jsonschema:"the TCP port a server in the sandbox listens on"`
}

func rules(in []ruleArgs) []apiv1.NetworkRule {
	var out []apiv1.NetworkRule
	for _, r := range in {
		out = append(out, apiv1.NetworkRule{CIDR: r.CIDR, Proto: r.Proto, Ports: r.Ports})
	}
	return out
}

// checkRules checks network rules before the daemon does, for clearer
// messages on the common mistakes.
func checkRules(egress string, allow []ruleArgs) error {
	if err := checkOneOf("egress", egress, apiv1.EgressAllow, apiv1.EgressDeny, apiv1.EgressAllowlist); err != nil {
		return err
	}
	if len(allow) > 64 {
		return errdefs.InvalidArgument("allow has %d rules; the limit is 64", len(allow))
	}
	for i, r := range allow {
		if r.CIDR == "" {
			return errdefs.InvalidArgument("allow[%d].cidr is empty: give a network such as 1.1.1.1/32", i)
		}
		if _, err := netip.ParsePrefix(r.CIDR); err != nil {
			return errdefs.InvalidArgument("allow[%d].cidr %s: want CIDR form, such as 1.1.1.1/32 for one address or 10.0.0.0/8", i, errdefs.Quote(r.CIDR))
		}
		if err := checkOneOf(fmt.Sprintf("allow[%d].proto", i), r.Proto, "tcp", "udp", "icmp"); err != nil {
			return err
		}
		if len(r.Ports) > 16 {
			return errdefs.InvalidArgument("allow[%d].ports has %d entries; the limit is 16", i, len(r.Ports))
		}
		for _, p := range r.Ports {
			if _, err := netns.ParsePortRange(p); err != nil {
				return fmt.Errorf("allow[%d].ports: %w", i, err)
			}
		}
	}
	if egress == apiv1.EgressDeny && len(allow) > 0 {
		return errdefs.InvalidArgument("egress deny takes no allow rules: use allowlist to allow only some destinations")
	}
	return nil
}

func checkMetadata(md map[string]string) error {
	if len(md) > 64 {
		return errdefs.InvalidArgument("metadata has %d keys; the limit is 64", len(md))
	}
	for k, v := range md {
		if k == "" || len(k) > 128 || len(v) > 1024 || strings.ContainsAny(k, "=\x00") {
			return errdefs.InvalidArgument("metadata %s: keys are 1 to 128 bytes without '=', values at most 1024", errdefs.Quote(k))
		}
	}
	return nil
}

func viewSpawn(res *apiv1.CreateSandboxesResponse) *spawnResult {
	out := &spawnResult{Sandboxes: viewSandboxes(res.Sandboxes), WallMS: res.WallMS}
	for _, f := range res.Failed {
		out.Failed = append(out.Failed, failureView{ID: f.ID, Error: f.Error.Code + ": " + f.Error.Message})
	}
	return out
}

func (t *tools) sandboxTools(s *sdk.Server) {
	add(s, tool[spawnArgs, spawnResult]{
		name: "spawn_sandboxes", title: "Spawn sandboxes",
		desc: "Start n sandboxes (microVMs) forked from a ready snapshot; returns once all are running, with their ids. " +
			"Each is a copy of the snapshot's warm machine: exec_command, run_code and the file tools then work in it. " +
			"Set timeout_secs so that sandboxes you forget are killed; kill_sandbox ends one.",
		props: map[string][]prop{
			"snapshot_tag": tagProp, "n": {between(1, maxSpawn), byDefault(1)},
			"timeout_secs": {between(0, float64(maxTTLSecs))}, "memory_limit_mib": {between(0, 1<<20)}, "cpus": {between(0, 1024)},
			"egress": {oneOf(apiv1.EgressAllow, apiv1.EgressDeny, apiv1.EgressAllowlist)},
			"allow":  {maxItems(64), field("proto", oneOf("tcp", "udp", "icmp"))}, "publish": {maxItems(16), items(between(1, 65535))},
		},
		run: t.spawn,
	})
	add(s, tool[listSandboxesArgs, sandboxList]{
		name: "list_sandboxes", title: "List sandboxes", readOnly: true,
		desc:  "List the sandboxes (all, or those matching the filters): id, snapshot, status, expiry, labels, network.",
		props: map[string][]prop{"snapshot_tag": tagProp, "status": {oneOf("starting", "running", "unresponsive", "dead", "oom")}},
		run: func(ctx context.Context, _ *call, in *listSandboxesArgs) (*sandboxList, error) {
			if in.SnapshotTag != "" {
				if err := checkTag("snapshot_tag", in.SnapshotTag); err != nil {
					return nil, err
				}
			}
			if err := checkOneOf("status", in.Status, "starting", "running", "unresponsive", "dead", "oom"); err != nil {
				return nil, err
			}
			if err := checkMetadata(in.Metadata); err != nil {
				return nil, err
			}
			list, err := t.c.ListSandboxes(ctx, client.ListOptions{Snapshot: in.SnapshotTag, Status: in.Status, Metadata: in.Metadata})
			if err != nil {
				return nil, err
			}
			return &sandboxList{Sandboxes: viewSandboxes(list)}, nil
		},
	})
	add(s, tool[idArgs, sandboxView]{
		name: "get_sandbox", title: "Get a sandbox", readOnly: true,
		desc:  "Describe one sandbox: its status, snapshot, expiry, labels and network (address, egress policy, published ports).",
		props: map[string][]prop{"id": idProp},
		run: func(ctx context.Context, _ *call, in *idArgs) (*sandboxView, error) {
			if err := checkID(in.ID); err != nil {
				return nil, err
			}
			sb, err := t.c.GetSandbox(ctx, in.ID)
			if err != nil {
				return nil, notFoundSandbox(in.ID, err)
			}
			v := viewSandbox(sb)
			return &v, nil
		},
	})
	add(s, tool[idArgs, killResult]{
		name: "kill_sandbox", title: "Kill a sandbox", destructive: true,
		desc:  "Kill a sandbox and free what it used. Its state is lost unless it was saved first with branch_sandbox.",
		props: map[string][]prop{"id": idProp},
		run: func(ctx context.Context, _ *call, in *idArgs) (*killResult, error) {
			if err := checkID(in.ID); err != nil {
				return nil, err
			}
			if err := t.c.DeleteSandbox(ctx, in.ID); err != nil {
				return nil, notFoundSandbox(in.ID, err)
			}
			return &killResult{ID: in.ID, Killed: true}, nil
		},
	})
	add(s, tool[branchArgs, snapshotView]{
		name: "branch_sandbox", title: "Save a sandbox's state as a snapshot",
		desc: "Save a running sandbox's whole state (memory, processes, files) as a new snapshot that spawn_sandboxes can fork from; " +
			"the sandbox keeps running. Use it to checkpoint before a risky step, or to start many sandboxes from a prepared one.",
		props: map[string][]prop{"id": idProp, "tag": tagProp, "mode": {oneOf(apiv1.BranchDiff, apiv1.BranchFull, apiv1.BranchLive)}},
		run: func(ctx context.Context, c *call, in *branchArgs) (*snapshotView, error) {
			if err := checkID(in.ID); err != nil {
				return nil, err
			}
			if in.Tag != "" {
				if err := checkTag("tag", in.Tag); err != nil {
					return nil, err
				}
			}
			if err := checkOneOf("mode", in.Mode, apiv1.BranchDiff, apiv1.BranchFull, apiv1.BranchLive); err != nil {
				return nil, err
			}
			req := apiv1.BranchRequest{Tag: in.Tag, Mode: in.Mode}
			if _, _, err := request.Branch(in.ID, &req); err != nil {
				return nil, err
			}
			defer c.progress().heartbeat(ctx, "saving "+in.ID)()
			sn, err := t.c.Branch(ctx, in.ID, req)
			if err != nil {
				return nil, notFoundSandbox(in.ID, err)
			}
			v := viewSnapshot(sn)
			return &v, nil
		},
	})
	add(s, tool[forkArgs, spawnResult]{
		name: "fork_sandbox", title: "Clone a running sandbox",
		desc: "Clone a running sandbox: its current state (memory, processes, files) is captured and count new sandboxes start from it; " +
			"the original keeps running. The clones' snapshot goes away with the last of them.",
		props: map[string][]prop{"id": idProp, "count": {between(1, maxSpawn), byDefault(1)},
			"mode": {oneOf(apiv1.BranchDiff, apiv1.BranchFull, apiv1.BranchLive)}, "timeout_secs": {between(0, float64(maxTTLSecs))}},
		run: t.fork,
	})
	add(s, tool[egressArgs, networkView]{
		name: "set_egress", title: "Set a sandbox's outbound network policy", destructive: true,
		desc: "Replace a sandbox's outbound network policy at once: allow (everything but the host's private ranges and metadata addresses), " +
			"deny (nothing), or allowlist (only the allow rules). Needs a sandbox whose snapshot has a network.",
		props: map[string][]prop{"id": idProp, "egress": {oneOf(apiv1.EgressAllow, apiv1.EgressDeny, apiv1.EgressAllowlist)},
			"allow": {maxItems(64), field("proto", oneOf("tcp", "udp", "icmp"))}},
		run: func(ctx context.Context, _ *call, in *egressArgs) (*networkView, error) {
			if err := checkID(in.ID); err != nil {
				return nil, err
			}
			if in.Egress == "" {
				return nil, errdefs.InvalidArgument("egress is empty: want allow, deny or allowlist")
			}
			if err := checkRules(in.Egress, in.Allow); err != nil {
				return nil, err
			}
			spec := apiv1.NetworkSpec{Egress: in.Egress, Allow: rules(in.Allow)}
			if _, err := request.NetworkPolicy(&spec); err != nil {
				return nil, err
			}
			sb, err := t.c.SetNetwork(ctx, in.ID, spec)
			if err != nil {
				return nil, notFoundSandbox(in.ID, err)
			}
			if sb.Network == nil {
				return &networkView{Egress: in.Egress}, nil
			}
			return viewNetwork(sb.Network), nil
		},
	})
	add(s, tool[publishArgs, portView]{
		name: "publish_port", title: "Publish a sandbox's TCP port on the host",
		desc: "Make a TCP port a server in the sandbox listens on reachable from the host, on a host port chosen by forkd " +
			"(host_address in the result). Needs a sandbox whose snapshot has a network.",
		props: map[string][]prop{"id": idProp, "guest_port": {between(1, 65535)}},
		run: func(ctx context.Context, _ *call, in *publishArgs) (*portView, error) {
			if err := checkID(in.ID); err != nil {
				return nil, err
			}
			if err := checkInt("guest_port", in.GuestPort, 1, 65535); err != nil {
				return nil, err
			}
			p, err := t.c.Publish(ctx, in.ID, in.GuestPort)
			if err != nil {
				return nil, notFoundSandbox(in.ID, err)
			}
			v := viewPort(*p)
			return &v, nil
		},
	})
}

func (t *tools) spawn(ctx context.Context, c *call, in *spawnArgs) (*spawnResult, error) {
	if err := checkTag("snapshot_tag", in.SnapshotTag); err != nil {
		return nil, err
	}
	n := in.N
	if n == 0 {
		n = 1
	}
	if err := checkInt("n", n, 1, maxSpawn); err != nil {
		return nil, err
	}
	if err := checkInt("timeout_secs", in.TimeoutSecs, 0, maxTTLSecs); err != nil {
		return nil, err
	}
	if err := checkMetadata(in.Metadata); err != nil {
		return nil, err
	}
	if err := checkRules(in.Egress, in.Allow); err != nil {
		return nil, err
	}
	if len(in.Publish) > 16 {
		return nil, errdefs.InvalidArgument("publish has %d ports; the limit is 16", len(in.Publish))
	}
	for i, p := range in.Publish {
		if err := checkInt(fmt.Sprintf("publish[%d]", i), p, 1, 65535); err != nil {
			return nil, err
		}
	}
	req := apiv1.CreateSandboxesRequest{SnapshotTag: in.SnapshotTag, N: n, TimeoutSecs: in.TimeoutSecs, Metadata: in.Metadata,
		Limits: apiv1.Limits{MemoryLimitMiB: in.MemoryLimitMiB, CPUs: in.CPUs}, KeepPartial: in.KeepPartial}
	if in.Egress != "" || len(in.Allow) > 0 || len(in.Publish) > 0 {
		req.Network = &apiv1.NetworkSpec{Egress: in.Egress, Allow: rules(in.Allow), Publish: in.Publish}
	}
	// The API's own checks, the same function the daemon runs.
	if _, err := request.ForkSpec(&req, maxSpawn); err != nil {
		return nil, err
	}
	p := c.progress()
	p.report(ctx, 0, float64(n), fmt.Sprintf("forking %d sandbox(es) from %s", n, in.SnapshotTag))
	stop := p.heartbeat(ctx, fmt.Sprintf("forking %d sandbox(es) from %s", n, in.SnapshotTag))
	res, err := t.c.CreateSandboxes(ctx, req)
	stop()
	if err != nil {
		return nil, withHint(err, errdefs.IsNotFound, fmt.Sprintf("No snapshot %s: list_snapshots shows the ready ones; create_snapshot builds one.", in.SnapshotTag))
	}
	p.report(ctx, float64(n), float64(n), fmt.Sprintf("%d sandbox(es) running", len(res.Sandboxes)))
	return viewSpawn(res), nil
}

func (t *tools) fork(ctx context.Context, c *call, in *forkArgs) (*spawnResult, error) {
	if err := checkID(in.ID); err != nil {
		return nil, err
	}
	n := in.Count
	if n == 0 {
		n = 1
	}
	if err := checkInt("count", n, 1, maxSpawn); err != nil {
		return nil, err
	}
	if err := checkOneOf("mode", in.Mode, apiv1.BranchDiff, apiv1.BranchFull, apiv1.BranchLive); err != nil {
		return nil, err
	}
	if err := checkInt("timeout_secs", in.TimeoutSecs, 0, maxTTLSecs); err != nil {
		return nil, err
	}
	if err := checkMetadata(in.Metadata); err != nil {
		return nil, err
	}
	req := apiv1.ForkRequest{Count: n, Mode: in.Mode, TimeoutSecs: in.TimeoutSecs, Metadata: in.Metadata}
	if _, _, err := request.ForkFrom(&req, maxSpawn); err != nil {
		return nil, err
	}
	p := c.progress()
	p.report(ctx, 0, float64(n), fmt.Sprintf("cloning %s %d time(s)", in.ID, n))
	stop := p.heartbeat(ctx, fmt.Sprintf("cloning %s", in.ID))
	res, err := t.c.ForkFrom(ctx, in.ID, req)
	stop()
	if err != nil {
		return nil, notFoundSandbox(in.ID, err)
	}
	p.report(ctx, float64(n), float64(n), fmt.Sprintf("%d clone(s) running", len(res.Sandboxes)))
	return viewSpawn(res), nil
}
