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
	for _, c := range []struct {
		name string
		spec NetSpec
	}{
		{"publish 0", NetSpec{Publish: []int{0}}},
		{"publish twice", NetSpec{Publish: []int{80, 80}}},
		{"bad mode", NetSpec{Policy: netns.Policy{Mode: "sometimes"}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if err := c.spec.validate(); err == nil {
				t.Errorf("%+v accepted", c.spec)
			}
		})
	}
}

func TestValidateLimits(t *testing.T) {
	type limitsCase struct {
		name string
		l    *state.Limits
	}
	for _, c := range []limitsCase{
		{"nil", nil},
		{"none", &state.Limits{}},
		{"cpus min", &state.Limits{CPUs: 0.01}},
		{"cpus max", &state.Limits{CPUs: 1024}},
		{"all", &state.Limits{MemoryMiB: 128, PIDs: 64, IOWeight: 100}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if err := validateLimits(c.l); err != nil {
				t.Errorf("%+v refused: %v", c.l, err)
			}
		})
	}
	for _, c := range []limitsCase{
		{"cpus nan", &state.Limits{CPUs: math.NaN()}},
		{"cpus inf", &state.Limits{CPUs: math.Inf(1)}},
		{"cpus tiny", &state.Limits{CPUs: 0.005}},
		{"cpus negative", &state.Limits{CPUs: -1}},
		{"memory negative", &state.Limits{MemoryMiB: -1}},
		{"pids negative", &state.Limits{PIDs: -1}},
		{"pids 1", &state.Limits{PIDs: 1}},
		{"pids under min", &state.Limits{PIDs: MinPIDs - 1}},
		{"io weight", &state.Limits{IOWeight: 10001}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if err := validateLimits(c.l); !errdefs.IsInvalidArgument(err) {
				t.Errorf("%+v: %v, want invalid argument", c.l, err)
			}
		})
	}
}
