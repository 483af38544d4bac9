package netns

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

// --- unit tests (anyone)

func TestNewValidates(t *testing.T) {
	for _, c := range []struct {
		name string
		o    Options
	}{
		{"prefix upper", Options{Prefix: "Forkd"}},
		{"prefix digit", Options{Prefix: "1abc"}},
		{"prefix long", Options{Prefix: "averyveryverylongprefix"}},
		{"network small", Options{Network: netip.MustParsePrefix("10.0.0.0/30")}},
		{"network guest", Options{Network: netip.MustParsePrefix("172.16.0.0/16")}}, // holds the guest network
		{"network ipv6", Options{Network: netip.MustParsePrefix("fd00::/64")}},
		{"ports reversed", Options{Ports: PortRange{First: 10, Last: 5}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if _, err := New(c.o); !errdefs.IsInvalidArgument(err) {
				t.Errorf("New(%+v) = %v, want InvalidArgument", c.o, err)
			}
		})
	}
	m, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	if m.MaxSlots() != 16384 || m.Prefix() != "forkd" {
		t.Fatalf("defaults: %d slots, prefix %q", m.MaxSlots(), m.Prefix())
	}
}

func TestAddressing(t *testing.T) {
	m, err := New(Options{Network: netip.MustParsePrefix("10.200.0.0/16")})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		slot        int
		host, child string
	}{{0, "10.200.0.1", "10.200.0.2"}, {1, "10.200.0.5", "10.200.0.6"}, {16383, "10.200.255.253", "10.200.255.254"}} {
		t.Run(fmt.Sprint("slot ", c.slot), func(t *testing.T) {
			n := m.netFor(c.slot)
			if n.HostAddr.String() != c.host || n.ChildAddr.String() != c.child {
				t.Errorf("host %s child %s, want %s %s", n.HostAddr, n.ChildAddr, c.host, c.child)
			}
			if got := m.slotOf(n.ChildAddr); got != c.slot {
				t.Errorf("slotOf(%s) = %d", n.ChildAddr, got)
			}
			if len(n.HostLink) > 15 {
				t.Errorf("link name %q too long", n.HostLink)
			}
		})
	}
	if m.slotOf(netip.MustParseAddr("10.200.0.1")) != -1 || m.slotOf(netip.MustParseAddr("10.201.0.2")) != -1 {
		t.Error("slotOf accepts a host address or a foreign one")
	}
	for name, want := range map[string]int{"forkd-0": 0, "forkd-12": 12, "forkd-012": -1, "forkd-": -1,
		"forkd-16384": -1, "forkdx-1": -1, "forkd-1a": -1} {
		t.Run(name, func(t *testing.T) {
			if got := m.parseSlot(name, "-"); got != want {
				t.Errorf("parseSlot(%q) = %d, want %d", name, got, want)
			}
		})
	}
}

func TestAllocRecyclesLate(t *testing.T) {
	m, err := New(Options{Network: netip.MustParsePrefix("10.200.0.0/28"), NetNSDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	var got []int
	for range 4 {
		s, err := m.Alloc()
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, s)
	}
	if !slices.Equal(got, []int{0, 1, 2, 3}) {
		t.Fatalf("alloc order %v", got)
	}
	if _, err := m.Alloc(); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("alloc on full pool: %v", err)
	}
	m.Release(1)
	m.Release(2)
	if s, _ := m.Alloc(); s != 1 {
		t.Fatalf("after release got %d, want 1", s)
	}
	if err := m.Reserve(2); err != nil {
		t.Fatal(err)
	}
	if err := m.Reserve(2); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("double reserve: %v", err)
	}
	// A slot whose namespace exists on the host is skipped.
	m.Release(3)
	testutil.WriteFile(t, filepath.Join(m.opts.NetNSDir, "forkd-3"), nil, 0o644)
	if _, err := m.Alloc(); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("alloc skipped nothing: %v", err)
	}
}
