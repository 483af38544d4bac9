package netns

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/forkd/forkd/internal/errdefs"
)

// Mode is the base of an egress policy.
type Mode string

const (
	// ModeAllow lets the guest reach anything but the Blocked ranges,
	// except those its Allow rules name.
	ModeAllow Mode = "allow"
	// ModeDeny lets the guest start no connection at all.
	ModeDeny Mode = "deny"
	// ModeAllowlist lets the guest reach only what its Allow rules name
	// (Blocked ranges only when a rule lies inside them).
	ModeAllowlist Mode = "allowlist"
)

// Policy says which connections a guest may start. Replies to connections
// the host starts towards the guest are always allowed. Whatever the
// policy, a guest never reaches another child, nor the host itself (the
// host table refuses both); the Blocked ranges are refused unless an Allow
// rule names them.
type Policy struct {
	Mode Mode `json:"mode"`
	// Allow: in ModeAllowlist the only destinations, in ModeAllow
	// exceptions to Blocked. Must be empty in ModeDeny.
	Allow []Rule `json:"allow,omitempty"`
}

// Rule allows connections to a network, optionally for one protocol and
// some destination ports.
type Rule struct {
	CIDR netip.Prefix `json:"cidr"`
	// Proto is "", "tcp", "udp" or "icmp". Empty means any protocol, or
	// tcp and udp when Ports are given.
	Proto string `json:"proto,omitempty"`
	// Ports are destination ports (tcp/udp only); empty means all.
	Ports []PortRange `json:"ports,omitempty"`
}

// PortRange is an inclusive range of ports; its text form is "80" or
// "8000-8100".
type PortRange struct {
	First, Last uint16
}

// MarshalText implements encoding.TextMarshaler.
func (r PortRange) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (r *PortRange) UnmarshalText(b []byte) error {
	p, err := ParsePortRange(string(b))
	if err != nil {
		return err
	}
	*r = p
	return nil
}

func (r PortRange) String() string {
	if r.First == r.Last {
		return strconv.Itoa(int(r.First))
	}
	return fmt.Sprintf("%d-%d", r.First, r.Last)
}

// ParsePortRange parses "80" or "8000-8100".
func ParsePortRange(s string) (PortRange, error) {
	a, b, isRange := strings.Cut(s, "-")
	first, err1 := strconv.ParseUint(a, 10, 16)
	last := first
	var err2 error
	if isRange {
		last, err2 = strconv.ParseUint(b, 10, 16)
	}
	r := PortRange{uint16(first), uint16(last)}
	if err1 != nil || err2 != nil {
		return PortRange{}, errdefs.InvalidArgument("port range %s: want PORT or FIRST-LAST", errdefs.Quote(s))
	}
	return r, r.validate()
}

func (r PortRange) validate() error {
	if r.First == 0 || r.Last < r.First {
		return errdefs.InvalidArgument("port range %s: want 1 <= first <= last", r)
	}
	return nil
}

// Blocked are the ranges every mode refuses unless an Allow rule names
// them (lies inside one; 0.0.0.0/0 names none): "this network", RFC 1918,
// shared address space (100.64/10), loopback, link-local (cloud metadata
// at 169.254.169.254), IETF protocol assignments, Azure's host endpoint,
// benchmarking, multicast, reserved and broadcast.
var Blocked = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("100.64.0.0/10"),
	netip.MustParsePrefix("127.0.0.0/8"),
	netip.MustParsePrefix("169.254.0.0/16"),
	netip.MustParsePrefix("172.16.0.0/12"),
	netip.MustParsePrefix("192.0.0.0/24"),
	netip.MustParsePrefix("168.63.129.16/32"),
	netip.MustParsePrefix("192.168.0.0/16"),
	netip.MustParsePrefix("198.18.0.0/15"),
	netip.MustParsePrefix("224.0.0.0/4"),
	netip.MustParsePrefix("240.0.0.0/4"),
}

// DefaultPolicy is what a sandbox gets when its caller names none.
var DefaultPolicy = Policy{Mode: ModeAllow}

// Validate checks p and returns it normalised (prefixes masked).
func (p Policy) Validate() (Policy, error) {
	switch p.Mode {
	case ModeAllow, ModeAllowlist:
	case ModeDeny:
		if len(p.Allow) > 0 {
			return Policy{}, errdefs.InvalidArgument("policy deny takes no allow rules")
		}
	default:
		return Policy{}, errdefs.InvalidArgument("policy mode %s: want allow, deny or allowlist", errdefs.Quote(string(p.Mode)))
	}
	out := Policy{Mode: p.Mode}
	for i, r := range p.Allow {
		if !r.CIDR.IsValid() || !r.CIDR.Addr().Is4() {
			return Policy{}, errdefs.InvalidArgument("allow rule %d: %q is not an IPv4 prefix", i, r.CIDR)
		}
		r.CIDR = r.CIDR.Masked()
		switch r.Proto {
		case "", "tcp", "udp":
		case "icmp":
			if len(r.Ports) > 0 {
				return Policy{}, errdefs.InvalidArgument("allow rule %d: icmp has no ports", i)
			}
		default:
			return Policy{}, errdefs.InvalidArgument("allow rule %d: protocol %s: want tcp, udp or icmp", i, errdefs.Quote(r.Proto))
		}
		for _, pr := range r.Ports {
			if err := pr.validate(); err != nil {
				return Policy{}, fmt.Errorf("allow rule %d: %w", i, err)
			}
		}
		r.Ports = slices.Clone(r.Ports)
		out.Allow = append(out.Allow, r)
	}
	return out, nil
}

func (p Policy) clone() Policy {
	out := Policy{Mode: p.Mode}
	for _, r := range p.Allow {
		r.Ports = slices.Clone(r.Ports)
		out.Allow = append(out.Allow, r)
	}
	return out
}
