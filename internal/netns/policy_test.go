package netns

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
)

func TestPolicyValidate(t *testing.T) {
	type policyCase struct {
		name string
		p    Policy
	}
	good := []policyCase{
		{"allow", Policy{Mode: ModeAllow}},
		{"deny", Policy{Mode: ModeDeny}},
		{"allowlist", Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("1.2.3.4/24")}}}},
		{"allow with rules", Policy{Mode: ModeAllow, Allow: []Rule{{CIDR: netip.MustParsePrefix("10.1.0.0/16"), Proto: "tcp", Ports: []PortRange{{443, 443}, {8000, 8100}}}}}},
	}
	for _, c := range good {
		t.Run(c.name, func(t *testing.T) {
			v, err := c.p.Validate()
			if err != nil {
				t.Errorf("%+v: %v", c.p, err)
			}
			for _, r := range v.Allow {
				if r.CIDR != r.CIDR.Masked() {
					t.Errorf("not masked: %s", r.CIDR)
				}
			}
		})
	}
	bad := []policyCase{
		{"empty", Policy{}},
		{"unknown mode", Policy{Mode: "open"}},
		{"deny with rules", Policy{Mode: ModeDeny, Allow: []Rule{{CIDR: netip.MustParsePrefix("1.2.3.4/32")}}}},
		{"ipv6", Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("::1/128")}}}},
		{"no cidr", Policy{Mode: ModeAllowlist, Allow: []Rule{{}}}},
		{"sctp", Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("1.2.3.4/32"), Proto: "sctp"}}}},
		{"icmp ports", Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("1.2.3.4/32"), Proto: "icmp", Ports: []PortRange{{1, 1}}}}}},
		{"port 0", Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("1.2.3.4/32"), Ports: []PortRange{{0, 1}}}}}},
	}
	for _, c := range bad {
		t.Run(c.name, func(t *testing.T) {
			if _, err := c.p.Validate(); !errdefs.IsInvalidArgument(err) {
				t.Errorf("%+v: %v, want InvalidArgument", c.p, err)
			}
		})
	}
}

func TestPolicyJSON(t *testing.T) {
	in := `{"mode":"allowlist","allow":[{"cidr":"198.51.100.0/24","proto":"tcp","ports":["80","8000-8100"]}]}`
	var p Policy
	if err := json.Unmarshal([]byte(in), &p); err != nil {
		t.Fatal(err)
	}
	want := Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("198.51.100.0/24"), Proto: "tcp",
		Ports: []PortRange{{80, 80}, {8000, 8100}}}}}
	if fmt.Sprint(p) != fmt.Sprint(want) {
		t.Fatalf("got %+v", p)
	}
	out, _ := json.Marshal(p)
	if string(out) != in {
		t.Fatalf("round trip: %s", out)
	}
	if _, err := ParsePortRange("9-"); err == nil {
		t.Fatal("bad range parsed")
	}
}
