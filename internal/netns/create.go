package netns

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/cleanup"
	"github.com/forkd/forkd/internal/errdefs"
)

// The steps of Create, in order; each can be made to fail in tests.
const (
	stepNetNS      = "netns"
	stepVeth       = "veth"
	stepHostAddr   = "host-addr"
	stepInsideLink = "inside-links"
	stepTap        = "tap"
	stepSysctl     = "sysctl"
	stepNSTable    = "netns-nft"
	stepHostTable  = "host-nft"
	stepCommit     = "commit"
)

// createSteps lists the steps for tests.
var createSteps = []string{stepNetNS, stepVeth, stepHostAddr, stepInsideLink, stepTap, stepSysctl, stepNSTable, stepHostTable, stepCommit}

// Create builds slot's network with egress policy p (see the package
// comment for what exists afterwards). It fails with an
// AlreadyExists-class error when the slot's namespace exists. On any error
// everything created so far is removed again; the returned error joins the
// failure and any rollback error, the failure first. ctx is checked
// between steps; rollback ignores it.
func (m *Manager) Create(ctx context.Context, slot int, p Policy) (_ *Net, err error) {
	if err := m.checkSlot(slot); err != nil {
		return nil, err
	}
	p, err = p.Validate()
	if err != nil {
		return nil, err
	}
	defer m.lockSlot(slot)()
	n := m.netFor(slot)

	var undo cleanup.Stack
	// Runs last on failure, once this slot's namespace is gone: the host
	// table goes too if no other slot is left.
	undo.Add(m.dropHostIfUnused)
	defer func() {
		if err != nil {
			err = errors.Join(err, undo.Run())
		}
	}()
	step := func(name string) error {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("create network of slot %d: %w", slot, err)
		}
		if m.failAt != nil {
			if err := m.failAt(slot, name); err != nil {
				return fmt.Errorf("create network of slot %d: %s: %w", slot, name, err)
			}
		}
		return nil
	}
	wrap := func(name string, err error) error {
		return fmt.Errorf("create network of slot %d: %s: %w", slot, name, err)
	}

	if err := step(stepNetNS); err != nil {
		return nil, err
	}
	if err := createNamed(n.NetNSPath); err != nil {
		return nil, wrap(stepNetNS, err)
	}
	undo.Add(func() error { return deleteNamed(n.NetNSPath) })
	ns, err := vnetns.GetFromPath(n.NetNSPath)
	if err != nil {
		return nil, wrap(stepNetNS, err)
	}
	defer ns.Close()
	inside, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, wrap(stepNetNS, err)
	}
	defer inside.Close()

	if err := step(stepVeth); err != nil {
		return nil, err
	}
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: n.HostLink},
		PeerName:      VethName,
		PeerNamespace: netlink.NsFd(ns),
	}
	if err := netlink.LinkAdd(veth); err != nil {
		if errors.Is(err, unix.EEXIST) {
			return nil, wrap(stepVeth, errdefs.AlreadyExists("link %s exists", n.HostLink))
		}
		return nil, wrap(stepVeth, err)
	}
	undo.Add(func() error { return deleteLink(n.HostLink) })

	if err := step(stepHostAddr); err != nil {
		return nil, err
	}
	if err := m.writeSysctl("net/ipv4/conf/"+n.HostLink+"/route_localnet", "1"); err != nil {
		return nil, wrap(stepHostAddr, err)
	}
	// IPv4 only, as inside: without IPv6 the host sends nothing of its
	// own on the link (router solicitations, MLD), so every packet it
	// sends there is traffic for the guest (Inbound).
	if err := m.writeSysctl("net/ipv6/conf/"+n.HostLink+"/disable_ipv6", "1"); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, wrap(stepHostAddr, err)
	}
	if err := addAddrUp(nil, n.HostLink, netip.PrefixFrom(n.HostAddr, 30)); err != nil {
		return nil, wrap(stepHostAddr, err)
	}

	if err := step(stepInsideLink); err != nil {
		return nil, err
	}
	mac, err := setupInside(inside, n)
	if err != nil {
		return nil, wrap(stepInsideLink, err)
	}
	// The host knows the namespace's end for good, so it never sends an
	// ARP request or probe on the link: every packet it sends there is
	// for the guest (Inbound), and a frozen guest is not woken by the
	// host checking its neighbour.
	host, err := netlink.LinkByName(n.HostLink)
	if err != nil {
		return nil, wrap(stepInsideLink, err)
	}
	if err := netlink.NeighSet(&netlink.Neigh{LinkIndex: host.Attrs().Index, IP: net.IP(n.ChildAddr.AsSlice()),
		HardwareAddr: mac, State: netlink.NUD_PERMANENT, Family: netlink.FAMILY_V4}); err != nil {
		return nil, wrap(stepInsideLink, fmt.Errorf("neighbour %s on %s: %w", n.ChildAddr, n.HostLink, err))
	}

	if err := step(stepTap); err != nil {
		return nil, err
	}
	makeTap := m.makeTap
	if makeTap == nil {
		makeTap = createTap
	}
	if err := makeTap(n.NetNSPath, slot, m.opts.TapUID, m.opts.TapGID); err != nil {
		return nil, wrap(stepTap, err)
	}
	if err := addAddrUp(inside, TapName, tapPrefix); err != nil {
		return nil, wrap(stepTap, err)
	}

	if err := step(stepSysctl); err != nil {
		return nil, err
	}
	if err := inNetNS(n.NetNSPath, func() error {
		if err := m.writeSysctl("net/ipv4/ip_forward", "1"); err != nil {
			return err
		}
		// The policy is IPv4 only: give IPv6 no chance.
		for _, k := range []string{"net/ipv6/conf/all/disable_ipv6", "net/ipv6/conf/default/disable_ipv6"} {
			if err := m.writeSysctl(k, "1"); err != nil && !errors.Is(err, os.ErrNotExist) {
				return err
			}
		}
		return nil
	}); err != nil {
		return nil, wrap(stepSysctl, err)
	}

	if err := step(stepNSTable); err != nil {
		return nil, err
	}
	nc, err := newNft(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		return nil, wrap(stepNSTable, err)
	}
	addNSTable(nc, m.opts.Prefix, n.ChildAddr, m.opts.Network, p)
	if err := nc.Flush(); err != nil {
		return nil, wrap(stepNSTable, err)
	}
	// With the table conntrack runs in the namespace; a TCP packet in the
	// middle of a connection it never saw must not start one ("loose").
	if err := inNetNS(n.NetNSPath, func() error {
		return m.writeSysctl("net/netfilter/nf_conntrack_tcp_loose", "0")
	}); err != nil {
		return nil, wrap(stepNSTable, err)
	}

	if err := step(stepHostTable); err != nil {
		return nil, err
	}
	if err := m.ensureHost(); err != nil {
		return nil, wrap(stepHostTable, err)
	}
	if err := step(stepCommit); err != nil {
		return nil, err
	}
	m.mu.Lock()
	m.policies[slot] = p
	m.mu.Unlock()
	undo.Release()
	return &n, nil
}

// setupInside configures the namespace's loopback and veth end, and its
// default route towards the host.
func setupInside(h *netlink.Handle, n Net) (net.HardwareAddr, error) {
	lo, err := h.LinkByName("lo")
	if err != nil {
		return nil, fmt.Errorf("lo: %w", err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		return nil, fmt.Errorf("lo up: %w", err)
	}
	if err := addAddrUp(h, VethName, netip.PrefixFrom(n.ChildAddr, 30)); err != nil {
		return nil, err
	}
	veth, err := h.LinkByName(VethName)
	if err != nil {
		return nil, err
	}
	gw := n.HostAddr.AsSlice()
	if err := h.RouteAdd(&netlink.Route{LinkIndex: veth.Attrs().Index, Gw: net.IP(gw)}); err != nil {
		return nil, fmt.Errorf("default route: %w", err)
	}
	return veth.Attrs().HardwareAddr, nil
}

// addAddrUp gives link name the address p and brings it up; h nil means
// the host namespace.
func addAddrUp(h *netlink.Handle, name string, p netip.Prefix) error {
	if h == nil {
		var err error
		if h, err = netlink.NewHandle(unix.NETLINK_ROUTE); err != nil {
			return err
		}
		defer h.Close()
	}
	l, err := h.LinkByName(name)
	if err != nil {
		return fmt.Errorf("link %s: %w", name, err)
	}
	if err := h.AddrAdd(l, &netlink.Addr{IPNet: ipnet(p)}); err != nil {
		return fmt.Errorf("address %s on %s: %w", p, name, err)
	}
	if err := h.LinkSetUp(l); err != nil {
		return fmt.Errorf("link %s up: %w", name, err)
	}
	return nil
}

// createTap creates the persistent tap TapName inside the namespace at
// nsPath, owned by uid/gid, with the flags QEMU asks for (no packet info,
// virtio-net header, single queue).
func createTap(nsPath string, slot int, uid, gid uint32) error {
	mac, err := net.ParseMAC(TapMAC)
	if err != nil {
		return err
	}
	return inNetNS(nsPath, func() error {
		tap := &netlink.Tuntap{
			LinkAttrs: netlink.LinkAttrs{Name: TapName},
			Mode:      netlink.TUNTAP_MODE_TAP,
			Flags:     netlink.TUNTAP_NO_PI | netlink.TUNTAP_VNET_HDR | netlink.TUNTAP_ONE_QUEUE,
			Owner:     uid,
			Group:     gid,
		}
		if err := netlink.LinkAdd(tap); err != nil {
			return err
		}
		return netlink.LinkSetHardwareAddr(tap, mac)
	})
}

// OpenTap attaches to the tap of the namespace at nsPath and returns the
// queue as a file, for a VMM that should neither join the namespace nor
// open /dev/net/tun itself (QEMU: ExtraFiles + -netdev tap,fd=N). The
// caller owns the file; the tap keeps existing when it is closed.
func OpenTap(nsPath string) (*os.File, error) {
	var f *os.File
	err := inNetNS(nsPath, func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open /dev/net/tun: %w", err)
		}
		ifr, err := unix.NewIfreq(TapName)
		if err != nil {
			unix.Close(fd)
			return err
		}
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			unix.Close(fd)
			return fmt.Errorf("attach to %s: %w", TapName, err)
		}
		f = os.NewFile(uintptr(fd), TapName)
		return nil
	})
	return f, err
}

// deleteLink removes the host link name; a missing link is not an error.
func deleteLink(name string) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		return fmt.Errorf("link %s: %w", name, err)
	}
	if err := netlink.LinkDel(l); err != nil && !errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("delete link %s: %w", name, err)
	}
	return nil
}

// ensureHost turns on forwarding and creates the host table, or rewrites
// it when it is not the one this code writes (a chain lost, an older
// version, another network).
func (m *Manager) ensureHost() error {
	m.hostMu.Lock()
	defer m.hostMu.Unlock()
	if err := m.ensureForwarding(); err != nil {
		return err
	}
	c, err := newNft()
	if err != nil {
		return err
	}
	if ok, err := hostTableCurrent(c, m.opts.Prefix, m.opts.Network); err != nil || ok {
		return err
	}
	if err := addHostTable(c, m.opts.Prefix, m.opts.Network); err != nil {
		return err
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("host table %s: %w", m.opts.Prefix, err)
	}
	return nil
}
