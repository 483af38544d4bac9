package netns

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sort"
	"strconv"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
)

// pub is one element pair of the published-port maps.
type pub struct {
	Published
	child netip.Addr
	slot  int // -1 when child is not a slot's address
}

// ErrPortLimit is wrapped by PublishAtMost's refusal of a port over its
// slot's limit.
var ErrPortLimit = errors.New("the slot's published ports are at their limit")

// Publish makes the guest's guestPort (proto "tcp" or "udp") reachable on
// a host port from Options.Ports, at 127.0.0.1 and at every address of the
// host, and returns that port. Publishing a guest port twice returns the
// same host port. A host port with a listening socket is skipped, but a
// socket bound later to a published port is shadowed: keep the range to
// forkd. The guest port is always reachable at the slot's ChildAddr too. It
// fails with a NotFound-class error when the slot has no network and a
// ResourceExhausted-class one when the range is full.
func (m *Manager) Publish(ctx context.Context, slot, guestPort int, proto string) (int, error) {
	return m.PublishAtMost(ctx, slot, guestPort, proto, 0)
}

// PublishAtMost is Publish that lets slot hold at most limit published
// ports, all protocols together (0: no limit): a new one beyond it is
// refused with a ResourceExhausted-class error wrapping ErrPortLimit,
// while a port already published is still answered. The slot's ports are
// counted and the new one added under the locks that serialise publishing,
// so concurrent calls never pass the limit together.
func (m *Manager) PublishAtMost(ctx context.Context, slot, guestPort int, proto string, limit int) (int, error) {
	if err := checkPub(slot, guestPort, proto, m); err != nil {
		return 0, err
	}
	defer m.lockSlot(slot)()
	n := m.netFor(slot)
	if _, err := os.Lstat(n.NetNSPath); err != nil {
		return 0, errdefs.NotFound("network of slot %d does not exist", slot)
	}
	m.hostMu.Lock()
	defer m.hostMu.Unlock()
	pubs, err := m.publishedLocked()
	if err != nil {
		return 0, err
	}
	used := map[int]bool{}
	mine := 0
	for _, p := range pubs {
		if p.child == n.ChildAddr {
			mine++
		}
		if p.Proto != proto {
			continue
		}
		if p.child == n.ChildAddr && p.GuestPort == guestPort {
			return p.HostPort, nil
		}
		used[p.HostPort] = true
	}
	if limit > 0 && mine >= limit {
		return 0, errdefs.ResourceExhausted("slot %d publishes %d ports: %w", slot, mine, ErrPortLimit)
	}
	for hp := int(m.opts.Ports.First); hp <= int(m.opts.Ports.Last); hp++ {
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		if used[hp] || !portFree(proto, hp) {
			continue
		}
		c, err := newNft()
		if err != nil {
			return 0, err
		}
		addrs, ports := pubSets(hostTable(m.opts.Prefix), proto)
		key := binary.BigEndian.AppendUint16(nil, uint16(hp))
		child := n.ChildAddr.As4()
		if err := c.SetAddElements(addrs, []nftables.SetElement{{Key: key, Val: child[:]}}); err != nil {
			return 0, err
		}
		if err := c.SetAddElements(ports, []nftables.SetElement{{Key: key, Val: binary.BigEndian.AppendUint16(nil, uint16(guestPort))}}); err != nil {
			return 0, err
		}
		if err := c.Flush(); err != nil {
			return 0, fmt.Errorf("publish %s port %d of slot %d: %w", proto, guestPort, slot, err)
		}
		return hp, nil
	}
	return 0, errdefs.ResourceExhausted("no free host port in %s for %s", m.opts.Ports, proto)
}

// Unpublish withdraws the host port that publishes guestPort of slot.
// Idempotent. Connections already open stay open.
func (m *Manager) Unpublish(ctx context.Context, slot, guestPort int, proto string) error {
	if err := checkPub(slot, guestPort, proto, m); err != nil {
		return err
	}
	defer m.lockSlot(slot)()
	return m.unpublishWhere(func(p pub) bool {
		return p.slot == slot && p.GuestPort == guestPort && p.Proto == proto
	})
}

func checkPub(slot, guestPort int, proto string, m *Manager) error {
	if err := m.checkSlot(slot); err != nil {
		return err
	}
	if proto != "tcp" && proto != "udp" {
		return errdefs.InvalidArgument("protocol %s: want tcp or udp", errdefs.Quote(proto))
	}
	if guestPort < 1 || guestPort > 65535 {
		return errdefs.InvalidArgument("guest port %d out of range", guestPort)
	}
	return nil
}

// portFree reports whether nothing on the host listens on port.
func portFree(proto string, port int) bool {
	addr := ":" + strconv.Itoa(port)
	if proto == "udp" {
		c, err := net.ListenPacket("udp4", addr)
		if err != nil {
			return false
		}
		c.Close()
		return true
	}
	l, err := net.Listen("tcp4", addr)
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// unpublishWhere deletes, in one transaction, every published port for
// which match returns true.
func (m *Manager) unpublishWhere(match func(pub) bool) error {
	m.hostMu.Lock()
	defer m.hostMu.Unlock()
	pubs, err := m.publishedLocked()
	if err != nil || len(pubs) == 0 {
		return err
	}
	c, err := newNft()
	if err != nil {
		return err
	}
	any := false
	for _, p := range pubs {
		if !match(p) {
			continue
		}
		addrs, ports := pubSets(hostTable(m.opts.Prefix), p.Proto)
		key := []nftables.SetElement{{Key: binary.BigEndian.AppendUint16(nil, uint16(p.HostPort))}}
		if err := c.SetDeleteElements(addrs, key); err != nil {
			return err
		}
		if err := c.SetDeleteElements(ports, key); err != nil {
			return err
		}
		any = true
	}
	if !any {
		return nil
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("unpublish: %w", err)
	}
	return nil
}

// published lists the published ports of every slot.
func (m *Manager) published() ([]pub, error) {
	m.hostMu.Lock()
	defer m.hostMu.Unlock()
	return m.publishedLocked()
}

// publishedLocked is published with hostMu held. A missing host table
// means nothing is published.
func (m *Manager) publishedLocked() ([]pub, error) {
	c, err := newNft()
	if err != nil {
		return nil, err
	}
	ok, err := hostTableExists(c, m.opts.Prefix)
	if err != nil || !ok {
		return nil, err
	}
	var out []pub
	for _, proto := range protos {
		addrs, ports := pubSets(hostTable(m.opts.Prefix), proto)
		ae, err := c.GetSetElements(addrs)
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", addrs.Name, err)
		}
		pe, err := c.GetSetElements(ports)
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", ports.Name, err)
		}
		guest := map[uint16]uint16{}
		for _, e := range pe {
			if len(e.Key) == 2 && len(e.Val) == 2 {
				guest[binary.BigEndian.Uint16(e.Key)] = binary.BigEndian.Uint16(e.Val)
			}
		}
		for _, e := range ae {
			if len(e.Key) != 2 || len(e.Val) != 4 {
				continue
			}
			hp := binary.BigEndian.Uint16(e.Key)
			child := netip.AddrFrom4([4]byte(e.Val))
			out = append(out, pub{
				Published: Published{Proto: proto, HostPort: int(hp), GuestPort: int(guest[hp])},
				child:     child,
				slot:      m.slotOf(child),
			})
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Proto != out[j].Proto {
			return out[i].Proto < out[j].Proto
		}
		return out[i].HostPort < out[j].HostPort
	})
	return out, nil
}

// SetPolicy replaces slot's egress policy in one nft transaction: no
// packet sees a mix of the old and the new rules. Connections the guest
// opened earlier are then forgotten by conntrack, so the new policy
// applies to them too from their next packet. It fails with a
// NotFound-class error when the slot has no network.
func (m *Manager) SetPolicy(ctx context.Context, slot int, p Policy) error {
	if err := m.checkSlot(slot); err != nil {
		return err
	}
	p, err := p.Validate()
	if err != nil {
		return err
	}
	defer m.lockSlot(slot)()
	n := m.netFor(slot)
	ns, err := vnetns.GetFromPath(n.NetNSPath)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return errdefs.NotFound("network of slot %d does not exist", slot)
		}
		return err
	}
	defer ns.Close()
	c, err := newNft(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		return err
	}
	t := nsTable(m.opts.Prefix)
	c.FlushChain(&nftables.Chain{Name: chainEgress, Table: t})
	addEgressRules(c, t, m.opts.Network, p)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("set policy of slot %d: %w", slot, err)
	}
	m.mu.Lock()
	m.policies[slot] = p
	m.mu.Unlock()

	h, err := netlink.NewHandleAt(ns, unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("set policy of slot %d: conntrack: %w", slot, err)
	}
	defer h.Close()
	f := &netlink.ConntrackFilter{}
	if err := f.AddIP(netlink.ConntrackOrigSrcIP, GuestAddr.AsSlice()); err != nil {
		return err
	}
	if _, err := h.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, f); err != nil {
		return fmt.Errorf("set policy of slot %d: forget guest connections: %w", slot, err)
	}
	// And on the host, where the guest's connections are masqueraded: a
	// remote peer that speaks first must not find its entry still there.
	if err := forgetHostFlows(m.netFor(slot).ChildAddr, false); err != nil {
		return fmt.Errorf("set policy of slot %d: %w", slot, err)
	}
	return nil
}
