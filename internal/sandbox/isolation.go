package sandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/forkd/forkd/internal/cgroup"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/vmm"
)

// NetSpec is the network of children: their egress policy and the guest
// TCP ports published on host ports.
type NetSpec struct {
	Policy  netns.Policy
	Publish []int
}

// validate checks the spec and fills in the default policy. Under "allow",
// the host's DNS resolvers (which the guest was configured with) stay
// reachable on port 53 even when they sit in a range "allow" blocks.
func (n *NetSpec) validate() error {
	if n.Policy.Mode == "" {
		n.Policy = netns.DefaultPolicy
	}
	if n.Policy.Mode == netns.ModeAllow {
		n.Policy.Allow = append(append([]netns.Rule(nil), n.Policy.Allow...), dnsRules(hostResolvers())...)
	}
	p, err := n.Policy.Validate()
	if err != nil {
		return err
	}
	n.Policy = p
	seen := map[int]bool{}
	for _, port := range n.Publish {
		if port < 1 || port > 65535 {
			return errdefs.InvalidArgument("publish port %d: want 1 to 65535", port)
		}
		if seen[port] {
			return errdefs.InvalidArgument("publish port %d given twice", port)
		}
		seen[port] = true
	}
	return nil
}

// MinPIDs is the lowest pids limit a sandbox may have: its VMM's threads
// count against it.
const MinPIDs = 32

// validateLimits checks limits before any cgroup is made.
func validateLimits(l *state.Limits) error {
	if l == nil {
		return nil
	}
	switch {
	case l.MemoryMiB < 0 || l.MemoryMiB > 1<<20:
		return errdefs.InvalidArgument("memory limit %d MiB: want 1 to %d", l.MemoryMiB, 1<<20)
	case math.IsNaN(l.CPUs) || l.CPUs < 0 || (l.CPUs > 0 && l.CPUs < 0.01) || l.CPUs > 1024:
		return errdefs.InvalidArgument("cpus %g: want 0.01 to 1024 CPUs (0 for no limit)", l.CPUs)
	case l.PIDs < 0 || l.PIDs > 1<<22:
		return errdefs.InvalidArgument("pids limit %d: want a positive number", l.PIDs)
	case l.PIDs > 0 && l.PIDs < MinPIDs:
		// The limit counts the VMM's own threads (vCPUs, IO, RCU, ...).
		return errdefs.InvalidArgument("pids limit %d is too low for the VMM's own threads: want at least %d", l.PIDs, MinPIDs)
	case l.IOWeight > 10000:
		return errdefs.InvalidArgument("io weight %d: want 1 to 10000", l.IOWeight)
	}
	return nil
}

// isolate gives sandbox sb (already recorded, with its slot when it has a
// network) its network namespace and cgroup, records them, and returns how
// its VMM must be launched, and done, to call once the VMM has started (or
// failed to): it closes what the launch borrowed. On error what it made is
// left to release.
func (e *Engine) isolate(ctx context.Context, sb *state.Sandbox, ns *NetSpec) (launch vmm.Launch, nics []vmm.NIC, done func(), err error) {
	launch = vmm.Launch{User: e.cfg.VMMUser}
	done = func() {}
	if sb.Net != nil {
		n, err := e.cfg.Net.Create(ctx, sb.Net.Slot, ns.Policy)
		if err != nil {
			return launch, nil, done, fmt.Errorf("network: %w", err)
		}
		pol, _ := json.Marshal(ns.Policy)
		sb.Net.Address, sb.Net.NetNS, sb.Net.Policy = n.ChildAddr.String(), n.NetNS, pol
		launch.NetNS = n.NetNSPath
		nics = []vmm.NIC{{Tap: n.Tap, MAC: n.GuestMAC}}
	}
	if l := sb.Limits; l != nil {
		cl := cgroup.Limits{MemoryMiB: l.MemoryMiB, CPUs: l.CPUs, PIDs: l.PIDs, IOWeight: l.IOWeight}
		if l.IOReadBps > 0 || l.IOWriteBps > 0 {
			// The VMM's disk IO is the snapshot's memory file and the
			// image's rootfs, both on the data dir's disk (or the cache's).
			maj, min, err := cgroup.DeviceOf(e.cfg.DataDir)
			if err != nil {
				return launch, nil, done, fmt.Errorf("io limit: %w", err)
			}
			cl.IO = []cgroup.IOLimit{{Major: maj, Minor: min, ReadBps: l.IOReadBps, WriteBps: l.IOWriteBps}}
		}
		g, err := e.cfg.Cgroups.Create(sb.ID, cl)
		if err != nil {
			return launch, nil, done, fmt.Errorf("cgroup: %w", err)
		}
		// The launch borrows the group's directory fd until the VMM runs.
		done = func() { g.Close() }
		pl := g.Placement()
		launch.CgroupFD = pl.CgroupFD
		if len(pl.Procs) > 0 {
			procs := pl.Procs
			launch.Enter = []vmm.EnterFunc{func() (func() error, error) { return e.cfg.Cgroups.EnterProcs(procs) }}
		}
	}
	if err := e.state.Put(sb); err != nil {
		return launch, nil, done, err
	}
	return launch, nics, done, nil
}

// release removes what a sandbox holds on the host besides its VMM: its
// cgroup, its network slot and its run dir (its disk with it, and the
// disk layers nothing else uses). Idempotent; the VMM must be gone (a
// namespace lives on while a process is inside).
func (e *Engine) release(ctx context.Context, sb *state.Sandbox) error {
	var errs []error
	// A sandbox without limits has a cgroup too once it was frozen.
	if e.cfg.Cgroups != nil {
		if g, err := e.cfg.Cgroups.Open(sb.ID); err == nil {
			errs = append(errs, g.Destroy())
		} else if !errdefs.IsNotFound(err) {
			errs = append(errs, err)
		}
	}
	if sb.Net != nil && e.cfg.Net != nil {
		errs = append(errs, e.cfg.Net.Destroy(ctx, sb.Net.Slot))
	}
	// The run dir goes last, and only when the rest is gone: while it
	// stays, the expirer's sweep (and reconcile) try the rest again.
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if sb.Handle.RunDir != "" {
		if err := os.RemoveAll(sb.Handle.RunDir); err != nil {
			return err
		}
	}
	if sb.Disk != nil {
		// Its disk may have held the last use of some layers.
		e.gcDisks()
	}
	return nil
}

// DefaultMaxPortsPerSandbox is Config.MaxPortsPerSandbox's default.
const DefaultMaxPortsPerSandbox = 32

// MaxPortsPerSandbox is the most host ports one sandbox may publish.
func (e *Engine) MaxPortsPerSandbox() int {
	if e.cfg.MaxPortsPerSandbox > 0 {
		return e.cfg.MaxPortsPerSandbox
	}
	return DefaultMaxPortsPerSandbox
}

// publishTCP publishes guest TCP port of sb, within the engine's limit of
// ports per sandbox.
func (e *Engine) publishTCP(ctx context.Context, sb *state.Sandbox, port int) (int, error) {
	limit := e.MaxPortsPerSandbox()
	hp, err := e.cfg.Net.PublishAtMost(ctx, sb.Net.Slot, port, "tcp", limit)
	if errors.Is(err, netns.ErrPortLimit) {
		return 0, errdefs.ResourceExhausted("sandbox %s already publishes %d ports, the limit per sandbox (forkd serve --max-ports-per-sandbox)", sb.ID, limit)
	}
	return hp, err
}

// publish publishes guest TCP ports of a running sandbox and records them.
func (e *Engine) publish(ctx context.Context, sb *state.Sandbox, ports []int) error {
	for _, p := range ports {
		hp, err := e.publishTCP(ctx, sb, p)
		if err != nil {
			return fmt.Errorf("publish port %d: %w", p, err)
		}
		sb.Net.Ports = append(sb.Net.Ports, state.Port{Proto: "tcp", GuestPort: p, HostPort: hp})
	}
	return nil
}

// Publish makes guest TCP port of sandbox id reachable on a host port (on
// 127.0.0.1 and the host's addresses) and returns it. Publishing a port
// twice returns the same host port. A sandbox publishes at most
// Config.MaxPortsPerSandbox ports (ResourceExhausted beyond), counted on
// the host under the network's lock, so concurrent calls cannot pass it.
func (e *Engine) Publish(ctx context.Context, id string, port int) (state.Port, error) {
	sb, err := e.networked(ctx, id)
	if err != nil {
		return state.Port{}, err
	}
	if port < 1 || port > 65535 {
		return state.Port{}, errdefs.InvalidArgument("port %d: want 1 to 65535", port)
	}
	for _, p := range sb.Net.Ports {
		if p.GuestPort == port && p.Proto == "tcp" {
			return p, nil
		}
	}
	hp, err := e.publishTCP(ctx, sb, port)
	if err != nil {
		return state.Port{}, err
	}
	pub := state.Port{Proto: "tcp", GuestPort: port, HostPort: hp}
	_, err = e.state.Update(id, func(r *state.Sandbox) error {
		if r.Net == nil {
			return errdefs.FailedPrecondition("sandbox %s lost its network", id)
		}
		// A concurrent call for the same port recorded it already.
		if !slices.Contains(r.Net.Ports, pub) {
			r.Net.Ports = append(r.Net.Ports, pub)
		}
		return nil
	})
	return pub, err
}

// SetPolicy replaces the egress policy of a running sandbox, atomically.
func (e *Engine) SetPolicy(ctx context.Context, id string, p netns.Policy) (*state.Sandbox, error) {
	ns := NetSpec{Policy: p}
	if err := ns.validate(); err != nil {
		return nil, err
	}
	sb, err := e.networked(ctx, id)
	if err != nil {
		return nil, err
	}
	if err := e.cfg.Net.SetPolicy(ctx, sb.Net.Slot, ns.Policy); err != nil {
		return nil, err
	}
	pol, _ := json.Marshal(ns.Policy)
	return e.state.Update(id, func(r *state.Sandbox) error {
		if r.Net != nil {
			r.Net.Policy = pol
		}
		return nil
	})
}

// networked returns a running sandbox that has its own network.
func (e *Engine) networked(ctx context.Context, id string) (*state.Sandbox, error) {
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if !state.Live(sb.Status) {
		return nil, errdefs.FailedPrecondition("sandbox %s is %s", id, sb.Status)
	}
	if sb.Net == nil || e.cfg.Net == nil {
		return nil, errdefs.FailedPrecondition("sandbox %s has no network of its own (its snapshot was made without one)", id)
	}
	return sb, nil
}

// guestNetCmdline is the kernel command line that configures a parent's
// NIC; its children inherit the configuration.
func guestNetCmdline() []string {
	gw := netns.GatewayAddr
	args := []string{
		"forkd.ip=" + netip.PrefixFrom(netns.GuestAddr, 30).String(),
		"forkd.gw=" + gw.String(),
	}
	if dns := hostResolvers(); len(dns) > 0 {
		args = append(args, "forkd.dns="+strings.Join(dns, ","))
	}
	return args
}

// dnsRules allow DNS (UDP and TCP port 53) to each resolver.
func dnsRules(resolvers []string) []netns.Rule {
	var out []netns.Rule
	for _, r := range resolvers {
		a, err := netip.ParseAddr(r)
		if err != nil {
			continue
		}
		for _, proto := range []string{"udp", "tcp"} {
			out = append(out, netns.Rule{CIDR: netip.PrefixFrom(a, 32), Proto: proto, Ports: []netns.PortRange{{First: 53, Last: 53}}})
		}
	}
	return out
}

// hostResolvers are the host's DNS servers a guest can use: those in
// /etc/resolv.conf that are not on loopback.
func hostResolvers() []string {
	b, err := os.ReadFile("/etc/resolv.conf")
	if err != nil {
		return nil
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == "nameserver" {
			if a, err := netip.ParseAddr(f[1]); err == nil && a.Is4() && !a.IsLoopback() {
				out = append(out, a.String())
			}
		}
	}
	return out
}
