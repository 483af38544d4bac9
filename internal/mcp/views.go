package mcp

import (
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
)

// The views are what tools return: the API's objects, trimmed to what a
// model acts on, times as RFC 3339 strings.

type sandboxView struct {
	ID          string            `json:"id"`
	SnapshotTag string            `json:"snapshot_tag"`
	Status      string            `json:"status" jsonschema:"starting, running, unresponsive, dead or oom"`
	Created     string            `json:"created"`
	ReadyMS     int64             `json:"ready_ms,omitempty"`
	ExpiresAt   string            `json:"expires_at,omitempty" jsonschema:"when the sandbox is killed by itself (its timeout)"`
	Metadata    map[string]string `json:"metadata,omitempty"`
	Network     *networkView      `json:"network,omitempty"`
}

type networkView struct {
	Address string              `json:"address" jsonschema:"where the host reaches the guest"`
	Egress  string              `json:"egress"`
	Allow   []apiv1.NetworkRule `json:"allow,omitempty"`
	Ports   []portView          `json:"ports,omitempty"`
}

type portView struct {
	GuestPort int    `json:"guest_port"`
	HostPort  int    `json:"host_port"`
	Proto     string `json:"proto"`
	// HostAddress is where the port is reached from the host.
	HostAddress string `json:"host_address" jsonschema:"host:port that reaches the guest port from the host"`
}

type snapshotView struct {
	Tag       string `json:"tag"`
	Status    string `json:"status" jsonschema:"writing (being built), ready, failed or corrupt"`
	Image     string `json:"image,omitempty"`
	MemoryMiB int    `json:"memory_mib,omitempty"`
	VCPUs     int    `json:"vcpus,omitempty"`
	Python    string `json:"python,omitempty" jsonschema:"the warm interpreter's version; empty when run_code is unavailable"`
	Network   bool   `json:"network,omitempty" jsonschema:"children get a network of their own (set_egress, publish_port)"`
	Refcount  int    `json:"refcount" jsonschema:"live sandboxes forked from it"`
	Kind      string `json:"kind,omitempty" jsonschema:"boot (built from an image) or branch (a sandbox's saved state)"`
	Parent    string `json:"parent,omitempty"`
	Source    string `json:"source,omitempty"`
	Created   string `json:"created,omitempty"`
	Problem   string `json:"problem,omitempty" jsonschema:"why it cannot be forked now, if it cannot"`
	Error     string `json:"error,omitempty" jsonschema:"why it failed"`
}

func rfc3339(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(time.RFC3339)
}

func viewSandbox(sb *apiv1.Sandbox) sandboxView {
	v := sandboxView{ID: sb.ID, SnapshotTag: sb.SnapshotTag, Status: sb.Status, Created: rfc3339(sb.Created),
		ReadyMS: sb.ReadyMS, ExpiresAt: rfc3339(sb.ExpiresAt), Metadata: sb.Metadata}
	if n := sb.Network; n != nil {
		v.Network = viewNetwork(n)
	}
	return v
}

func viewNetwork(n *apiv1.SandboxNetwork) *networkView {
	nv := &networkView{Address: n.Address, Egress: n.Egress, Allow: n.Allow}
	for _, p := range n.Ports {
		nv.Ports = append(nv.Ports, viewPort(p))
	}
	return nv
}

func viewPort(p apiv1.PublishedPort) portView {
	return portView{GuestPort: p.GuestPort, HostPort: p.HostPort, Proto: p.Proto, HostAddress: "127.0.0.1:" + itoa(p.HostPort)}
}

func viewSandboxes(list []apiv1.Sandbox) []sandboxView {
	out := make([]sandboxView, 0, len(list))
	for i := range list {
		out = append(out, viewSandbox(&list[i]))
	}
	return out
}

func viewSnapshot(s *apiv1.Snapshot) snapshotView {
	return snapshotView{Tag: s.Tag, Status: s.Status, Image: s.Image, MemoryMiB: s.MemoryMiB, VCPUs: s.VCPUs, Python: s.Python,
		Network: s.Network, Refcount: s.Refcount, Kind: s.Kind, Parent: s.Parent, Source: s.Source, Created: rfc3339(s.Created),
		Problem: s.Problem, Error: s.Error}
}
