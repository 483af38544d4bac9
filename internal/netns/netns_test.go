package netns

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/cgroup"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

// --- unit tests (anyone)

func TestNewValidates(t *testing.T) {
	for _, o := range []Options{
		{Prefix: "Forkd"},
		{Prefix: "1abc"},
		{Prefix: "averyveryverylongprefix"},
		{Network: netip.MustParsePrefix("10.0.0.0/30")},
		{Network: netip.MustParsePrefix("172.16.0.0/16")}, // holds the guest network
		{Network: netip.MustParsePrefix("fd00::/64")},
		{Ports: PortRange{First: 10, Last: 5}},
	} {
		if _, err := New(o); !errdefs.IsInvalidArgument(err) {
			t.Errorf("New(%+v) = %v, want InvalidArgument", o, err)
		}
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
		n := m.netFor(c.slot)
		if n.HostAddr.String() != c.host || n.ChildAddr.String() != c.child {
			t.Errorf("slot %d: host %s child %s, want %s %s", c.slot, n.HostAddr, n.ChildAddr, c.host, c.child)
		}
		if got := m.slotOf(n.ChildAddr); got != c.slot {
			t.Errorf("slotOf(%s) = %d", n.ChildAddr, got)
		}
		if len(n.HostLink) > 15 {
			t.Errorf("link name %q too long", n.HostLink)
		}
	}
	if m.slotOf(netip.MustParseAddr("10.200.0.1")) != -1 || m.slotOf(netip.MustParseAddr("10.201.0.2")) != -1 {
		t.Error("slotOf accepts a host address or a foreign one")
	}
	for name, want := range map[string]int{"forkd-0": 0, "forkd-12": 12, "forkd-012": -1, "forkd-": -1,
		"forkd-16384": -1, "forkdx-1": -1, "forkd-1a": -1} {
		if got := m.parseSlot(name, "-"); got != want {
			t.Errorf("parseSlot(%q) = %d, want %d", name, got, want)
		}
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
	os.WriteFile(filepath.Join(m.opts.NetNSDir, "forkd-3"), nil, 0o644)
	if _, err := m.Alloc(); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("alloc skipped nothing: %v", err)
	}
}

func TestPolicyValidate(t *testing.T) {
	good := []Policy{
		{Mode: ModeAllow},
		{Mode: ModeDeny},
		{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("1.2.3.4/24")}}},
		{Mode: ModeAllow, Allow: []Rule{{CIDR: netip.MustParsePrefix("10.1.0.0/16"), Proto: "tcp", Ports: []PortRange{{443, 443}, {8000, 8100}}}}},
	}
	for _, p := range good {
		v, err := p.Validate()
		if err != nil {
			t.Errorf("%+v: %v", p, err)
		}
		for _, r := range v.Allow {
			if r.CIDR != r.CIDR.Masked() {
				t.Errorf("not masked: %s", r.CIDR)
			}
		}
	}
	bad := []Policy{
		{},
		{Mode: "open"},
		{Mode: ModeDeny, Allow: []Rule{{CIDR: netip.MustParsePrefix("1.2.3.4/32")}}},
		{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("::1/128")}}},
		{Mode: ModeAllowlist, Allow: []Rule{{}}},
		{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("1.2.3.4/32"), Proto: "sctp"}}},
		{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("1.2.3.4/32"), Proto: "icmp", Ports: []PortRange{{1, 1}}}}},
		{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("1.2.3.4/32"), Ports: []PortRange{{0, 1}}}}},
	}
	for _, p := range bad {
		if _, err := p.Validate(); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%+v: %v, want InvalidArgument", p, err)
		}
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

// --- root tests: real namespaces, veths, taps and nftables

// The test world, shared by the root tests of one process. The addresses
// are fixed, so test processes on one host take a host-wide lock first.
const (
	inetNS   = "fdtinet"  // "the internet": 198.51.100.1 behind the host
	privNS   = "fdtpriv"  // a host-side private network: 192.168.250.1
	inetLink = "fdtinet0" // host ends
	privLink = "fdtpriv0"
)

var (
	inetAddr     = netip.MustParseAddr("198.51.100.1")
	inetHostAddr = netip.MustParseAddr("198.51.100.254")
	privAddr     = netip.MustParseAddr("192.168.250.1")
	privHostAddr = netip.MustParseAddr("192.168.250.254")
)

var world struct {
	once sync.Once
	err  error
}

// setupWorld takes the host-wide test lock and creates the "internet" and
// "private" namespaces, each with an HTTP server answering its name, once
// per process; they are removed when the process ends (TestMain).
func setupWorld(t *testing.T) {
	t.Helper()
	testutil.RequireRoot(t)
	world.once.Do(func() { world.err = buildWorld() })
	if world.err != nil {
		t.Fatalf("test world: %v", world.err)
	}
}

var lockFile *os.File

func buildWorld() error {
	if err := os.MkdirAll("/run/lock", 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile("/run/lock/forkd-netns-test.lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		return err
	}
	lockFile = f
	teardownWorld() // leftovers of a crashed run
	for _, w := range []struct {
		ns, link   string
		addr, host netip.Addr
	}{{inetNS, inetLink, inetAddr, inetHostAddr}, {privNS, privLink, privAddr, privHostAddr}} {
		path := filepath.Join("/run/netns", w.ns)
		if err := createNamed(path); err != nil {
			return err
		}
		ns, err := vnetns.GetFromPath(path)
		if err != nil {
			return err
		}
		err = netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: w.link}, PeerName: "eth0", PeerNamespace: netlink.NsFd(ns)})
		if err != nil {
			ns.Close()
			return err
		}
		h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
		ns.Close()
		if err != nil {
			return err
		}
		err = errors.Join(addAddrUp(nil, w.link, netip.PrefixFrom(w.host, 24)), addAddrUp(h, "eth0", netip.PrefixFrom(w.addr, 24)))
		if lo, lerr := h.LinkByName("lo"); lerr == nil {
			err = errors.Join(err, h.LinkSetUp(lo))
		}
		h.Close()
		if err != nil {
			return err
		}
		if _, err := serveIn(path, netip.AddrPortFrom(w.addr, 80), w.ns); err != nil {
			return err
		}
	}
	return nil
}

func teardownWorld() {
	deleteLink(inetLink)
	deleteLink(privLink)
	deleteNamed("/run/netns/" + inetNS)
	deleteNamed("/run/netns/" + privNS)
}

func TestMain(m *testing.M) {
	code := m.Run()
	if lockFile != nil {
		teardownWorld()
		lockFile.Close()
	}
	os.Exit(code)
}

// serveIn serves HTTP on addr inside the namespace at nsPath, answering
// body to every request. The server lives until the process ends.
func serveIn(nsPath string, addr netip.AddrPort, body string) (net.Listener, error) {
	var l net.Listener
	err := inNetNS(nsPath, func() error {
		var err error
		l, err = net.Listen("tcp4", addr.String())
		return err
	})
	if err != nil {
		return nil, err
	}
	go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, body) }))
	return l, nil
}

// get fetches http://addr/ from inside the namespace at nsPath ("" for the
// host) and returns the body.
func get(nsPath string, addr netip.AddrPort, timeout time.Duration) (string, error) {
	var conn net.Conn
	dial := func() error {
		var err error
		conn, err = net.DialTimeout("tcp4", addr.String(), timeout)
		return err
	}
	var err error
	if nsPath == "" {
		err = dial()
	} else {
		err = inNetNS(nsPath, dial)
	}
	if err != nil {
		return "", err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(timeout))
	req, _ := http.NewRequest("GET", "http://"+addr.String()+"/", nil)
	if err := req.Write(conn); err != nil {
		return "", err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var sb strings.Builder
	_, err = bufio.NewReader(resp.Body).WriteTo(&sb)
	return sb.String(), err
}

// testManager returns a Manager on its own prefix and network whose taps
// are replaced by a veth into a per-slot "guest" namespace holding
// GuestAddr, so a guest can be simulated without a VM. guestNS(slot) is
// that namespace's path.
func testManager(t *testing.T, prefix, network string, guests bool) *Manager {
	t.Helper()
	m, err := New(Options{Prefix: prefix, Network: netip.MustParsePrefix(network), Ports: PortRange{First: 28500, Last: 28599}})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Reclaim(context.Background(), func(int) bool { return false }); err != nil {
		t.Fatalf("reclaim leftovers: %v", err)
	}
	if guests {
		m.makeTap = func(nsPath string, slot int, uid, gid uint32) error {
			gpath := m.guestNS(slot)
			deleteNamed(gpath)
			if err := createNamed(gpath); err != nil {
				return err
			}
			g, err := vnetns.GetFromPath(gpath)
			if err != nil {
				return err
			}
			defer g.Close()
			if err := inNetNS(nsPath, func() error {
				return netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: TapName}, PeerName: "eth0", PeerNamespace: netlink.NsFd(g)})
			}); err != nil {
				return err
			}
			h, err := netlink.NewHandleAt(g, unix.NETLINK_ROUTE)
			if err != nil {
				return err
			}
			defer h.Close()
			if err := addAddrUp(h, "eth0", netip.PrefixFrom(GuestAddr, 30)); err != nil {
				return err
			}
			lo, _ := h.LinkByName("lo")
			h.LinkSetUp(lo)
			eth, _ := h.LinkByName("eth0")
			return h.RouteAdd(&netlink.Route{LinkIndex: eth.Attrs().Index, Gw: GatewayAddr.AsSlice()})
		}
	}
	t.Cleanup(func() {
		if err := m.Reclaim(context.Background(), func(int) bool { return false }); err != nil {
			t.Errorf("reclaim: %v", err)
		}
		for s := range m.maxSlots {
			if _, err := os.Lstat(m.guestNS(s)); err == nil {
				deleteNamed(m.guestNS(s))
			}
		}
		assertNothingLeft(t, m)
	})
	return m
}

func (m *Manager) guestNS(slot int) string {
	return filepath.Join(m.opts.NetNSDir, fmt.Sprintf("%sguest%d", m.opts.Prefix, slot))
}

// leftovers lists, by looking at the host, every namespace, mount, link and
// nft table of m's prefix.
func leftovers(m *Manager) ([]string, error) {
	var out []string
	ents, err := os.ReadDir(m.opts.NetNSDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), m.opts.Prefix+"-") || strings.HasPrefix(e.Name(), m.opts.Prefix+"guest") {
			out = append(out, "netns "+e.Name())
		}
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	for _, line := range strings.Split(string(mi), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.HasPrefix(f[4], filepath.Join(m.opts.NetNSDir, m.opts.Prefix)) {
			out = append(out, "mount "+f[4])
		}
	}
	var links []netlink.Link
	for range 20 {
		if links, err = netlink.LinkList(); !errors.Is(err, netlink.ErrDumpInterrupted) {
			break
		}
	}
	if err != nil {
		return nil, err
	}
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Name, m.opts.Prefix) {
			out = append(out, "link "+l.Attrs().Name)
		}
	}
	c, err := nftables.New()
	if err != nil {
		return nil, err
	}
	tables, err := c.ListTables()
	if err != nil {
		return nil, err
	}
	for _, tb := range tables {
		if strings.HasPrefix(tb.Name, m.opts.Prefix) {
			out = append(out, "nft table "+tb.Name)
		}
	}
	chains, err := c.ListChains()
	if err != nil {
		return nil, err
	}
	for _, ch := range chains {
		if strings.HasPrefix(ch.Table.Name, m.opts.Prefix) {
			out = append(out, "nft chain "+ch.Table.Name+"/"+ch.Name)
		}
	}
	return out, nil
}

func assertNothingLeft(t *testing.T, m *Manager) {
	t.Helper()
	left, err := leftovers(m)
	if err != nil {
		t.Fatal(err)
	}
	if len(left) > 0 {
		t.Fatalf("left on the host: %v", left)
	}
}

func mustCreate(t *testing.T, m *Manager, slot int, p Policy) *Net {
	t.Helper()
	n, err := m.Create(context.Background(), slot, p)
	if err != nil {
		t.Fatalf("create slot %d: %v", slot, err)
	}
	return n
}

func expectGet(t *testing.T, ns string, addr netip.AddrPort, want string) {
	t.Helper()
	got, err := get(ns, addr, 3*time.Second)
	if err != nil || got != want {
		t.Fatalf("GET %s from %q: %q, %v; want %q", addr, ns, got, err, want)
	}
}

func expectNoGet(t *testing.T, ns string, addr netip.AddrPort, timeout time.Duration) {
	t.Helper()
	if got, err := get(ns, addr, timeout); err == nil {
		t.Fatalf("GET %s from %q answered %q; want no connection", addr, ns, got)
	}
}

func ap(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }

// TestChildren: three children with the same guest address, each reached
// at its own address with its own answer, isolated from each other and
// from the host's services, egress per policy.
func TestChildren(t *testing.T) {
	setupWorld(t)
	t.Parallel()
	m := testManager(t, "fdta", "10.201.0.0/20", true)
	ctx := context.Background()
	var nets []*Net
	for s := range 3 {
		n := mustCreate(t, m, s, Policy{Mode: ModeAllow})
		if _, err := serveIn(m.guestNS(s), ap(GuestAddr, 80), fmt.Sprintf("guest %d", s)); err != nil {
			t.Fatal(err)
		}
		nets = append(nets, n)
	}
	if _, err := m.Create(ctx, 1, Policy{Mode: ModeAllow}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("second create of slot 1: %v", err)
	}
	if got, err := m.List(ctx); err != nil || !slices.Equal(got, []int{0, 1, 2}) {
		t.Fatalf("List = %v, %v", got, err)
	}
	t.Run("host reaches each child", func(t *testing.T) {
		for s, n := range nets {
			expectGet(t, "", ap(n.ChildAddr, 80), fmt.Sprintf("guest %d", s))
		}
	})
	t.Run("child never reaches child", func(t *testing.T) {
		expectNoGet(t, m.guestNS(0), ap(nets[1].ChildAddr, 80), time.Second)
		expectNoGet(t, m.guestNS(2), ap(nets[0].ChildAddr, 80), time.Second)
		// Not even when the allowlist names it.
		if err := m.SetPolicy(ctx, 0, Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("10.0.0.0/8")}}}); err != nil {
			t.Fatal(err)
		}
		expectNoGet(t, m.guestNS(0), ap(nets[1].ChildAddr, 80), time.Second)
		expectNoGet(t, m.guestNS(0), ap(nets[1].HostAddr, 80), time.Second)
		if err := m.SetPolicy(ctx, 0, Policy{Mode: ModeAllow}); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("child never reaches the host", func(t *testing.T) {
		l, err := net.Listen("tcp4", ":28499")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "host") }))
		expectGet(t, "", ap(inetHostAddr, 28499), "host")
		// The host's public address passes the namespace's policy; the
		// host table drops it.
		expectNoGet(t, m.guestNS(0), ap(inetHostAddr, 28499), 500*time.Millisecond)
		expectNoGet(t, m.guestNS(0), ap(nets[0].HostAddr, 28499), 500*time.Millisecond)
	})
	t.Run("egress allow", func(t *testing.T) {
		expectGet(t, m.guestNS(1), ap(inetAddr, 80), inetNS)
		// Host-side private ranges are refused by default.
		expectNoGet(t, m.guestNS(1), ap(privAddr, 80), time.Second)
		expectGet(t, "", ap(privAddr, 80), privNS)
	})
	t.Run("SetPolicy flips a live slot", func(t *testing.T) {
		check := func(p Policy, inet, priv bool) {
			t.Helper()
			if err := m.SetPolicy(ctx, 2, p); err != nil {
				t.Fatal(err)
			}
			for _, c := range []struct {
				addr netip.Addr
				ok   bool
				body string
			}{{inetAddr, inet, inetNS}, {privAddr, priv, privNS}} {
				if c.ok {
					expectGet(t, m.guestNS(2), ap(c.addr, 80), c.body)
				} else {
					expectNoGet(t, m.guestNS(2), ap(c.addr, 80), time.Second)
				}
			}
			info, err := m.Info(ctx, 2)
			if err != nil || info.Policy == nil || info.Policy.Mode != p.Mode {
				t.Fatalf("Info = %+v, %v", info, err)
			}
		}
		inet := netip.PrefixFrom(inetAddr, 32)
		check(Policy{Mode: ModeAllow}, true, false)
		check(Policy{Mode: ModeDeny}, false, false)
		check(Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: inet}}}, true, false)
		check(Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: inet, Proto: "tcp", Ports: []PortRange{{80, 80}}}}}, true, false)
		check(Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: inet, Proto: "tcp", Ports: []PortRange{{81, 90}}}}}, false, false)
		check(Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: inet, Proto: "udp"}}}, false, false)
		check(Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("203.0.113.0/24")}}}, false, false)
		// A private range is reachable once named.
		check(Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: netip.MustParsePrefix("192.168.250.0/24")}}}, false, true)
		check(Policy{Mode: ModeAllow, Allow: []Rule{{CIDR: netip.PrefixFrom(privAddr, 32), Proto: "tcp", Ports: []PortRange{{80, 80}}}}}, true, true)
		check(Policy{Mode: ModeAllow}, true, false)
		// The other slots kept theirs.
		expectGet(t, m.guestNS(1), ap(inetAddr, 80), inetNS)
	})
	t.Run("SetPolicy cuts open connections", func(t *testing.T) {
		if err := m.SetPolicy(ctx, 1, Policy{Mode: ModeAllow}); err != nil {
			t.Fatal(err)
		}
		var conn net.Conn
		if err := inNetNS(m.guestNS(1), func() (err error) {
			conn, err = net.DialTimeout("tcp4", ap(inetAddr, 80).String(), 2*time.Second)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if err := m.SetPolicy(ctx, 1, Policy{Mode: ModeDeny}); err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(2 * time.Second))
		fmt.Fprintf(conn, "GET / HTTP/1.0\r\n\r\n")
		if b, err := bufio.NewReader(conn).ReadString('\n'); err == nil {
			t.Fatalf("open connection still answered %q after deny", b)
		}
		if err := m.SetPolicy(ctx, 1, Policy{Mode: ModeAllow}); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("publish", func(t *testing.T) {
		hp, err := m.Publish(ctx, 1, 80, "tcp")
		if err != nil {
			t.Fatal(err)
		}
		if hp2, err := m.Publish(ctx, 1, 80, "tcp"); err != nil || hp2 != hp {
			t.Fatalf("publish again: %d, %v; want %d", hp2, err, hp)
		}
		hp0, err := m.Publish(ctx, 0, 80, "tcp")
		if err != nil || hp0 == hp {
			t.Fatalf("publish slot 0: %d, %v", hp0, err)
		}
		lo := netip.MustParseAddr("127.0.0.1")
		expectGet(t, "", ap(lo, uint16(hp)), "guest 1")
		expectGet(t, "", ap(lo, uint16(hp0)), "guest 0")
		// From another machine, at the host's address.
		expectGet(t, "/run/netns/"+inetNS, ap(inetHostAddr, uint16(hp)), "guest 1")
		// Not from another child.
		expectNoGet(t, m.guestNS(2), ap(inetHostAddr, uint16(hp)), 500*time.Millisecond)
		info, err := m.Info(ctx, 1)
		if err != nil || len(info.Published) != 1 || info.Published[0] != (Published{Proto: "tcp", HostPort: hp, GuestPort: 80}) {
			t.Fatalf("Info = %+v, %v", info, err)
		}
		if err := m.Unpublish(ctx, 1, 80, "tcp"); err != nil {
			t.Fatal(err)
		}
		if err := m.Unpublish(ctx, 1, 80, "tcp"); err != nil {
			t.Fatalf("unpublish twice: %v", err)
		}
		expectNoGet(t, "", ap(lo, uint16(hp)), time.Second)
		expectGet(t, "", ap(lo, uint16(hp0)), "guest 0")
	})
	t.Run("destroy", func(t *testing.T) {
		if err := m.Destroy(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if err := m.Destroy(ctx, 0); err != nil {
			t.Fatalf("destroy twice: %v", err)
		}
		if _, err := m.Info(ctx, 0); !errdefs.IsNotFound(err) {
			t.Fatalf("Info after destroy: %v", err)
		}
		if _, err := m.Publish(ctx, 0, 80, "tcp"); !errdefs.IsNotFound(err) {
			t.Fatalf("Publish after destroy: %v", err)
		}
		// Its published port went with it.
		for _, p := range must(m.published()) {
			if p.slot == 0 {
				t.Fatalf("published port of slot 0 left: %+v", p)
			}
		}
		expectGet(t, "", ap(nets[1].ChildAddr, 80), "guest 1")
	})
	t.Run("reclaim keeps the live", func(t *testing.T) {
		if err := m.Reclaim(ctx, func(s int) bool { return s == 2 }); err != nil {
			t.Fatal(err)
		}
		if got, err := m.List(ctx); err != nil || !slices.Equal(got, []int{2}) {
			t.Fatalf("after reclaim: %v, %v", got, err)
		}
		expectGet(t, "", ap(nets[2].ChildAddr, 80), "guest 2")
	})
}

// TestRealTap checks the production tap: owned by the given user, in the
// namespace, addressed as the guest's gateway, with nothing leaking.
func TestRealTap(t *testing.T) {
	setupWorld(t)
	t.Parallel()
	m := testManager(t, "fdtb", "10.201.16.0/20", false)
	m.opts.TapUID, m.opts.TapGID = 4321, 4322
	n := mustCreate(t, m, 7, DefaultPolicy)
	ns, err := vnetns.GetFromPath(n.NetNSPath)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	l, err := h.LinkByName(TapName)
	if err != nil {
		t.Fatal(err)
	}
	tap, ok := l.(*netlink.Tuntap)
	if !ok || tap.Owner != 4321 || tap.Group != 4322 || tap.Mode != netlink.TUNTAP_MODE_TAP {
		t.Fatalf("tap = %#v", l)
	}
	if mac := l.Attrs().HardwareAddr.String(); mac != TapMAC {
		t.Fatalf("tap MAC %s, want the fixed %s", mac, TapMAC)
	}
	addrs, _ := h.AddrList(l, unix.AF_INET)
	if len(addrs) != 1 || addrs[0].IPNet.String() != "172.16.0.1/30" {
		t.Fatalf("tap addresses %v", addrs)
	}
	// The tap exists in the namespace only.
	if _, err := netlink.LinkByName(TapName); err == nil {
		t.Fatal("tap0 in the host namespace")
	}
	// The host table is rewritten by the next Create when it was lost
	// (say, to `nft flush ruleset`), and only then.
	c, _ := nftables.New()
	if ok, err := hostTableCurrent(c, m.opts.Prefix, m.opts.Network); !ok || err != nil {
		t.Fatalf("host table not current: %v", err)
	}
	c.DelTable(hostTable(m.opts.Prefix))
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	mustCreate(t, m, 8, DefaultPolicy)
	if ok, err := hostTableCurrent(c, m.opts.Prefix, m.opts.Network); !ok || err != nil {
		t.Fatalf("host table not restored: %v", err)
	}
	for _, s := range []int{7, 8} {
		if err := m.Destroy(context.Background(), s); err != nil {
			t.Fatal(err)
		}
	}
	assertNothingLeft(t, m)
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestStartIn starts a process in a slot's namespace and, through the
// extra step, in a cgroup, the way a VMM is started; the caller's own
// thread stays where it was.
func TestStartIn(t *testing.T) {
	setupWorld(t)
	t.Parallel()
	m := testManager(t, "fdtd", "10.201.64.0/20", false)
	n := mustCreate(t, m, 1, DefaultPolicy)
	cg, err := cgroup.New(cgroup.Options{Parent: fmt.Sprintf("forkd-netns-test-%d", os.Getpid())})
	if err != nil {
		t.Fatal(err)
	}
	g, err := cg.Create("vmm", cgroup.Limits{MemoryMiB: 64, PIDs: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := g.Destroy(); err != nil {
			t.Error(err)
		}
		for _, p := range g.Placement().Procs {
			os.Remove(filepath.Dir(filepath.Dir(p))) // the test's parent
		}
	}()
	pl := g.Placement()
	cmd := exec.Command("sleep", "30")
	if pl.CgroupFD >= 0 {
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: pl.CgroupFD}
	}
	before := nsInode(t, "/proc/thread-self/ns/net")
	if err := StartIn(n.NetNSPath, cmd, func() (func() error, error) { return cg.EnterProcs(pl.Procs) }); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	if got, want := nsInode(t, fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid)), nsInode(t, n.NetNSPath); got != want {
		t.Fatalf("process in netns %d, want %d", got, want)
	}
	if nsInode(t, "/proc/thread-self/ns/net") != before || nsInode(t, "/proc/self/ns/net") != before {
		t.Fatalf("caller left its namespace: before %d thread %d self %d", before, nsInode(t, "/proc/thread-self/ns/net"), nsInode(t, "/proc/self/ns/net"))
	}
	self, _ := os.ReadFile("/proc/self/cgroup")
	child, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", cmd.Process.Pid))
	if !strings.Contains(string(child), "/vmm\n") || strings.Contains(string(self), "/vmm\n") {
		t.Fatalf("child cgroups:\n%s\nours:\n%s", child, self)
	}
	// A failing step undoes the namespace and starts nothing.
	bad := exec.Command("true")
	if err := StartIn(n.NetNSPath, bad, func() (func() error, error) { return nil, errInjected }); !errors.Is(err, errInjected) || bad.Process != nil {
		t.Fatalf("StartIn with failing step: %v", err)
	}
	if err := StartIn("/nonexistent/netns", exec.Command("true")); !errdefs.IsNotFound(err) {
		t.Fatalf("StartIn in a missing netns: %v", err)
	}
	// The VMM can also be handed the tap instead of joining the namespace.
	tap, err := OpenTap(n.NetNSPath)
	if err != nil {
		t.Fatal(err)
	}
	defer tap.Close()
	h, err := netlink.NewHandleAt(must(vnetns.GetFromPath(n.NetNSPath)), unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	l, err := h.LinkByName(TapName)
	if err != nil || l.Attrs().RawFlags&unix.IFF_LOWER_UP == 0 {
		t.Fatalf("tap has no carrier with a queue attached: %v %v", l, err)
	}
}

func nsInode(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func TestProbe(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	if err := Probe(context.Background(), dir); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("probe left %v", ents)
	}
	// dir was made a shared mount point; undo it for TempDir's cleanup.
	unix.Unmount(dir, unix.MNT_DETACH)
}

// TestQEMUAttaches starts a real QEMU (paused, no guest) on a slot's tap:
// once inside the namespace through StartIn, once unprivileged and outside
// it, handed the tap with OpenTap. Both must attach (the tap's carrier
// comes up), which checks that the tap's flags suit QEMU.
func TestQEMUAttaches(t *testing.T) {
	setupWorld(t)
	qemu := testutil.RequireCommand(t, "qemu-system-x86_64")
	t.Parallel()
	m := testManager(t, "fdte", "10.201.80.0/20", false)
	n := mustCreate(t, m, 3, DefaultPolicy)
	ns := must(vnetns.GetFromPath(n.NetNSPath))
	defer ns.Close()
	h := must(netlink.NewHandleAt(ns, unix.NETLINK_ROUTE))
	defer h.Close()
	carrier := func() bool {
		l, err := h.LinkByName(TapName)
		return err == nil && l.Attrs().RawFlags&unix.IFF_LOWER_UP != 0
	}
	waitCarrier := func(cmd *exec.Cmd, log *strings.Builder) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if carrier() {
				return
			}
			if cmd.ProcessState != nil {
				break
			}
		}
		t.Fatalf("QEMU never attached to %s; its output: %s", TapName, log.String())
	}
	stop := func(cmd *exec.Cmd) {
		cmd.Process.Kill()
		cmd.Wait()
		for deadline := time.Now().Add(5 * time.Second); carrier() && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		if carrier() {
			t.Fatal("carrier stays up after QEMU exited")
		}
	}
	if carrier() {
		t.Fatal("tap has a carrier before any VMM attached")
	}
	args := []string{"-M", "q35", "-m", "64", "-nodefaults", "-no-user-config", "-display", "none", "-S", "-accel", "tcg",
		"-device", "virtio-net-pci,netdev=n0,mac=" + GuestMAC}

	var log1 strings.Builder
	inside := exec.Command(qemu, append(args, "-netdev", "tap,id=n0,ifname="+TapName+",script=no,downscript=no")...)
	inside.Stdout, inside.Stderr = &log1, &log1
	if err := StartIn(n.NetNSPath, inside); err != nil {
		t.Fatal(err)
	}
	waitCarrier(inside, &log1)
	stop(inside)

	tap, err := OpenTap(n.NetNSPath)
	if err != nil {
		t.Fatal(err)
	}
	var log2 strings.Builder
	outside := exec.Command(qemu, append(args, "-netdev", "tap,id=n0,fd=3")...)
	outside.ExtraFiles = []*os.File{tap}
	outside.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	outside.Stdout, outside.Stderr = &log2, &log2
	if err := outside.Start(); err != nil {
		t.Fatal(err)
	}
	tap.Close()
	waitCarrier(outside, &log2)
	time.Sleep(200 * time.Millisecond)
	if outside.ProcessState != nil || outside.Process.Signal(syscall.Signal(0)) != nil {
		t.Fatalf("unprivileged QEMU exited: %s", log2.String())
	}
	stop(outside)
}
