package netns

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Destroy removes slot's network: its published ports, its host link (and
// with it the veth pair), its namespace (and with it the tap and the
// namespace's nft table), and the host table when no slot is left. Stop
// the slot's VMM first: a namespace lives on, unnamed, while a process is
// inside. Idempotent: a slot with nothing left is not an error. ctx is not
// consulted; cleanup outlives cancellation.
func (m *Manager) Destroy(ctx context.Context, slot int) error {
	if err := m.checkSlot(slot); err != nil {
		return err
	}
	defer m.lockSlot(slot)()
	return m.destroy(slot)
}

// destroy does Destroy's work; the caller holds slot's lock.
func (m *Manager) destroy(slot int) error {
	n := m.netFor(slot)
	errs := []error{
		m.unpublishWhere(func(p pub) bool { return p.slot == slot }),
		deleteLink(n.HostLink),
		deleteNamed(n.NetNSPath),
		// The slot's address goes to the next child that takes the slot:
		// the host's conntrack must not carry this child's connections
		// over to it.
		forgetHostFlows(n.ChildAddr, true),
		m.dropHostIfUnused(),
	}
	m.mu.Lock()
	delete(m.policies, slot)
	m.mu.Unlock()
	m.countersMu.Lock()
	m.closeCounter(slot)
	m.countersMu.Unlock()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("destroy network of slot %d: %w", slot, err)
	}
	return nil
}

// Reclaim destroys every slot found on the host (namespace, host link or
// published port) for which live returns false, then the host table if no
// slot is left. It is crash recovery: call it at start-up with the slots
// the caller's persisted state still owns, before creating new slots (a
// slot being created meanwhile is not live to it). Errors are joined;
// Reclaim goes on past a slot it cannot remove.
func (m *Manager) Reclaim(ctx context.Context, live func(slot int) bool) error {
	slots, err := m.List(ctx)
	if err != nil {
		return err
	}
	pubs, err := m.published()
	if err != nil {
		return err
	}
	seen := map[int]bool{}
	for _, s := range slots {
		seen[s] = true
	}
	for _, p := range pubs {
		if p.slot >= 0 && !seen[p.slot] {
			seen[p.slot] = true
			slots = append(slots, p.slot)
		}
	}
	var errs []error
	for _, s := range slots {
		if live(s) {
			continue
		}
		unlock := m.lockSlot(s)
		errs = append(errs, m.destroy(s))
		unlock()
	}
	// Stray published ports not matching any slot address.
	errs = append(errs, m.unpublishWhere(func(p pub) bool { return p.slot < 0 }))
	errs = append(errs, m.dropHostIfUnused())
	return errors.Join(errs...)
}

// dropHostIfUnused deletes the host table when no namespace and no host
// link of this prefix is left.
func (m *Manager) dropHostIfUnused() error {
	m.hostMu.Lock()
	defer m.hostMu.Unlock()
	nss, err := m.listNetNS()
	if err != nil || len(nss) > 0 {
		return err
	}
	links, err := m.listHostLinks()
	if err != nil || len(links) > 0 {
		return err
	}
	c, err := newNft()
	if err != nil {
		return err
	}
	ok, err := hostTableExists(c, m.opts.Prefix)
	if err != nil || !ok {
		return err
	}
	c.DelTable(hostTable(m.opts.Prefix))
	if err := c.Flush(); err != nil {
		return fmt.Errorf("delete host table %s: %w", m.opts.Prefix, err)
	}
	return nil
}

// hostTableExists reports whether the host table of prefix exists.
func hostTableExists(c *nftables.Conn, prefix string) (bool, error) {
	ts, err := c.ListTablesOfFamily(nftables.TableFamilyIPv4)
	if err != nil {
		return false, fmt.Errorf("list nft tables: %w", err)
	}
	for _, t := range ts {
		if t.Name == prefix {
			return true, nil
		}
	}
	return false, nil
}

// forgetHostFlows deletes the host's conntrack entries of a child address:
// the connections it opened (original source; masqueraded on the host)
// and, with inbound, those made to it (reply source: published ports and
// the host reaching it). A packet of a forgotten connection is then new,
// and meets the rules for new packets.
func forgetHostFlows(child netip.Addr, inbound bool) error {
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("conntrack: %w", err)
	}
	defer h.Close()
	filters := []netlink.CustomConntrackFilter{}
	kinds := []netlink.ConntrackFilterType{netlink.ConntrackOrigSrcIP}
	if inbound {
		kinds = append(kinds, netlink.ConntrackReplySrcIP)
	}
	for _, k := range kinds {
		f := &netlink.ConntrackFilter{}
		if err := f.AddIP(k, child.AsSlice()); err != nil {
			return err
		}
		filters = append(filters, f)
	}
	if _, err := h.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, filters...); err != nil {
		return fmt.Errorf("forget connections of %s: %w", child, err)
	}
	return nil
}
