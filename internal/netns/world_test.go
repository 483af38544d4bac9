package netns

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/mountinfo"
	"github.com/forkd/forkd/internal/testutil"
)

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
	// Each test's own 100 host ports, by its network (10.180.N.0/20):
	// their tables' DNAT rules all see the host's traffic, and the tests
	// run side by side. Below 20000, where the engines' host-network
	// shares (sandbox.hostNetOf) begin, which other packages' tests take
	// meanwhile, and below the kernel's ephemeral ports.
	pfx := netip.MustParsePrefix(network)
	first := 19000 + 100*uint16(pfx.Addr().As4()[2]/16)
	m, err := New(Options{Prefix: prefix, Network: pfx, Ports: PortRange{First: first, Last: first + 99}})
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
	mounts, err := mountinfo.ParseFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	for _, mt := range mounts {
		if strings.HasPrefix(mt.MountPoint, filepath.Join(m.opts.NetNSDir, m.opts.Prefix)) {
			out = append(out, "mount "+mt.MountPoint)
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

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func nsInode(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}
