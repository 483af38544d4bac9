package netns

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/vishvananda/netlink"
)

// TestChildren: three children with the same guest address, each reached
// at its own address with its own answer, isolated from each other and
// from the host's services, egress per policy.
func TestChildren(t *testing.T) {
	setupWorld(t)
	t.Parallel()
	m := testManager(t, "fdta", "10.180.0.0/20", true)
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
	// The host knows each child's end for good (no ARP on the link), and
	// counts what it sends there.
	t.Run("host counts traffic for the child", func(t *testing.T) {
		l, err := netlink.LinkByName(m.hostLink(0))
		if err != nil {
			t.Fatal(err)
		}
		neighs, err := netlink.NeighList(l.Attrs().Index, netlink.FAMILY_V4)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.ContainsFunc(neighs, func(n netlink.Neigh) bool {
			return n.IP.Equal(net.IP(nets[0].ChildAddr.AsSlice())) && n.State&netlink.NUD_PERMANENT != 0
		}) {
			t.Errorf("no permanent neighbour %s on %s: %+v", nets[0].ChildAddr, m.hostLink(0), neighs)
		}
		before, err := m.Inbound(0)
		if err != nil {
			t.Fatal(err)
		}
		expectGet(t, "", ap(nets[0].ChildAddr, 80), "guest 0")
		if after, err := m.Inbound(0); err != nil || after <= before {
			t.Errorf("Inbound: %d before a request, %d (%v) after", before, after, err)
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
		l, err := net.Listen("tcp4", ":19999")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "host") }))
		expectGet(t, "", ap(inetHostAddr, 19999), "host")
		// The host's public address passes the namespace's policy; the
		// host table drops it.
		expectNoGet(t, m.guestNS(0), ap(inetHostAddr, 19999), 500*time.Millisecond)
		expectNoGet(t, m.guestNS(0), ap(nets[0].HostAddr, 19999), 500*time.Millisecond)
	})
	t.Run("egress allow", func(t *testing.T) {
		expectGet(t, m.guestNS(1), ap(inetAddr, 80), inetNS)
		// A process of the child's namespace itself (where the VMM runs)
		// starts nothing out of it, whatever the guest may.
		expectNoGet(t, m.netFor(1).NetNSPath, ap(inetAddr, 80), time.Second)
		expectNoGet(t, m.netFor(1).NetNSPath, ap(privAddr, 80), time.Second)
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
		// A rule wider than a blocked range does not name it: "anything
		// on port 80" is not the LAN (nor the metadata service).
		anywhere := netip.MustParsePrefix("0.0.0.0/0")
		check(Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: anywhere}}}, true, false)
		check(Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: anywhere, Proto: "tcp", Ports: []PortRange{{80, 80}}}}}, true, false)
		check(Policy{Mode: ModeAllow, Allow: []Rule{{CIDR: anywhere}}}, true, false)
		check(Policy{Mode: ModeAllowlist, Allow: []Rule{{CIDR: anywhere}, {CIDR: netip.MustParsePrefix("192.168.0.0/16")}}}, true, true)
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

		// A peer that speaks first (keep-alives, a C2 server) is cut too:
		// its packets must not find the host's masquerade entry.
		var l net.Listener
		if err := inNetNS("/run/netns/"+inetNS, func() (err error) {
			l, err = net.Listen("tcp4", ap(inetAddr, 81).String())
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		var sent atomic.Int64 // ticks the peer has sent
		go func() {
			c, err := l.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			for i := 0; i < 50; i++ {
				if _, err := fmt.Fprintf(c, "tick %d\n", i); err != nil {
					return
				}
				sent.Add(1)
				time.Sleep(100 * time.Millisecond)
			}
		}()
		var push net.Conn
		if err := inNetNS(m.guestNS(1), func() (err error) {
			push, err = net.DialTimeout("tcp4", ap(inetAddr, 81).String(), 2*time.Second)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer push.Close()
		rd := bufio.NewReader(push)
		push.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := rd.ReadString('\n'); err != nil {
			t.Fatalf("first push: %v", err)
		}
		if err := m.SetPolicy(ctx, 1, Policy{Mode: ModeDeny}); err != nil {
			t.Fatal(err)
		}
		// Ticks are counted by the peer, not by when this reader gets
		// to them: what was in flight at the switch (the peer sends one
		// every 100 ms) may still land; nothing sent later.
		atCut := sent.Load()
		push.SetDeadline(time.Now().Add(2 * time.Second))
		for {
			line, err := rd.ReadString('\n')
			if err != nil {
				break
			}
			var n int64
			if _, err := fmt.Sscanf(line, "tick %d", &n); err != nil {
				t.Fatalf("peer sent %q", line)
			}
			if n >= atCut+3 {
				t.Fatalf("tick %d from the peer arrived after deny; %d had been sent at the switch", n, atCut)
			}
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
