package sandbox

import (
	"math"
	"net/netip"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/state"
)

func TestDNSRules(t *testing.T) {
	rules := dnsRules([]string{"10.255.255.53", "not-an-address"})
	if len(rules) != 2 {
		t.Fatalf("rules %+v", rules)
	}
	for i, proto := range []string{"udp", "tcp"} {
		r := rules[i]
		if r.CIDR != netip.MustParsePrefix("10.255.255.53/32") || r.Proto != proto || len(r.Ports) != 1 || r.Ports[0].First != 53 || r.Ports[0].Last != 53 {
			t.Fatalf("rule %d: %+v", i, r)
		}
	}
}

func TestNetSpecDefaults(t *testing.T) {
	var n NetSpec
	if err := n.validate(); err != nil {
		t.Fatal(err)
	}
	if n.Policy.Mode != netns.ModeAllow {
		t.Fatalf("default mode %q", n.Policy.Mode)
	}
	deny := NetSpec{Policy: netns.Policy{Mode: netns.ModeDeny}}
	if err := deny.validate(); err != nil || len(deny.Policy.Allow) != 0 {
		t.Fatalf("deny gained rules: %+v %v", deny.Policy, err)
	}
	for _, bad := range []NetSpec{{Publish: []int{0}}, {Publish: []int{80, 80}}, {Policy: netns.Policy{Mode: "sometimes"}}} {
		if err := bad.validate(); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}

func TestValidateLimits(t *testing.T) {
	for _, ok := range []*state.Limits{nil, {}, {CPUs: 0.01}, {CPUs: 1024}, {MemoryMiB: 128, PIDs: 64, IOWeight: 100}} {
		if err := validateLimits(ok); err != nil {
			t.Errorf("%+v refused: %v", ok, err)
		}
	}
	for _, bad := range []*state.Limits{{CPUs: math.NaN()}, {CPUs: math.Inf(1)}, {CPUs: 0.005}, {CPUs: -1},
		{MemoryMiB: -1}, {PIDs: -1}, {PIDs: 1}, {PIDs: MinPIDs - 1}, {IOWeight: 10001}} {
		if err := validateLimits(bad); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%+v: %v, want invalid argument", bad, err)
		}
	}
}
