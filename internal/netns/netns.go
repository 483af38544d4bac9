// Package netns gives every sandbox its own network: a named network
// namespace holding the tap its VMM attaches to, joined to the host by a veth
// pair, with nftables doing the address translation and the egress policy.
//
// Every guest has the same address (GuestAddr, MAC GuestMAC) because they are
// clones of one snapshot; the namespace makes that harmless. Per slot N the
// manager creates:
//
//	host ns:   veth <prefix>h<N>  HostAddr(N)/30   route_localnet=1
//	netns <prefix>-<N> (bind-mounted at <NetNSDir>/<prefix>-<N>):
//	           veth0  ChildAddr(N)/30, default via HostAddr(N)
//	           tap0   172.16.0.1/30, owned by Options.TapUID/TapGID
//	           nft table ip <prefix>: DNAT ChildAddr -> 172.16.0.2,
//	           masquerade out of veth0, the egress Policy
//
// and one host table "ip <prefix>", shared by all slots, which masquerades
// the children towards the host's uplinks, forwards published host ports to
// children, drops child-to-child traffic and keeps children away from the
// host's own services. The host table exists while any slot exists.
//
// The host reaches a child at ChildAddr(N) (any port, DNATed to the guest);
// a guest port can also be published on a host port (Publish), reachable at
// 127.0.0.1 and at the host's own addresses. The manager sets
// net.ipv4.ip_forward=1 on the host when it is 0 (and logs that it did);
// it never sets it back.
//
// One Manager owns one prefix on a host; two managers with the same prefix
// would tear down each other's host table. Slot ownership is the caller's
// to persist; the host is the source of truth for what exists (List,
// Reclaim).
package netns

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/vishvananda/netlink"

	"github.com/forkd/forkd/internal/errdefs"
)

// What every guest sees. The guest is configured with these before the
// parent snapshot is taken, so every child has them too.
const (
	// TapName is the tap device in every child namespace.
	TapName = "tap0"
	// VethName is the namespace's end of the veth pair.
	VethName = "veth0"
	// GuestMAC is the MAC of every guest's NIC.
	GuestMAC = "52:54:00:00:00:01"
	// TapMAC is the MAC of every namespace's tap, the guest's gateway. It
	// is fixed because a restored guest's ARP cache still holds the
	// parent's gateway: a tap with another MAC would drop its frames.
	TapMAC = "52:54:00:00:00:02"
)

var (
	// GuestAddr is every guest's address on its tap.
	GuestAddr = netip.MustParseAddr("172.16.0.2")
	// GatewayAddr is the namespace's address on the tap, the guest's gateway.
	GatewayAddr = netip.MustParseAddr("172.16.0.1")
	// tapPrefix is the tap's network.
	tapPrefix = netip.PrefixFrom(GatewayAddr, 30)
)

// DefaultPrefix names netns, links and nft tables when Options.Prefix is
// empty.
const DefaultPrefix = "forkd"

// DefaultNetwork is split into one /30 per slot when Options.Network is
// unset.
var DefaultNetwork = netip.MustParsePrefix("10.200.0.0/16")

// DefaultPorts is the host port range Publish draws from.
var DefaultPorts = PortRange{First: 28000, Last: 28999}

// Options configure a Manager. Zero values take the defaults.
type Options struct {
	// Prefix names everything the manager creates: netns "<prefix>-N",
	// host link "<prefix>hN", nft table "<prefix>". Lowercase letters and
	// digits, starting with a letter; short enough that "<prefix>h" plus
	// the largest slot fits in 15 bytes.
	Prefix string
	// Network is split into /30s, one per slot: .1 host side, .2 child.
	// It must be IPv4, at most /29, and not overlap the host's networks.
	Network netip.Prefix
	// NetNSDir is where named namespaces are bind-mounted (/run/netns, as
	// with `ip netns`).
	NetNSDir string
	// ProcSys is the sysctl tree (/proc/sys).
	ProcSys string
	// TapUID and TapGID own every tap, so a VMM running as that user can
	// open it.
	TapUID, TapGID uint32
	// Ports is the host port range for Publish.
	Ports PortRange
	// Logger receives what the manager changes on the host beyond its own
	// objects (ip_forward). Nil discards.
	Logger *slog.Logger
}

// Manager creates and removes per-slot networks. Its methods are safe for
// concurrent use; operations on one slot are serialised.
type Manager struct {
	opts     Options
	maxSlots int
	log      *slog.Logger

	slotMu [64]sync.Mutex // slotMu[slot%64] serialises Create/Destroy/SetPolicy/Publish of a slot

	mu       sync.Mutex // guards the fields below
	alloc    map[int]bool
	next     int // next slot Alloc tries first (next-fit, to delay reuse)
	policies map[int]Policy

	hostMu sync.Mutex // serialises changes to the host table and its maps

	// counters holds, by slot, the open tx_packets file of the slot's
	// host link, which Inbound reads again and again (an open costs ten
	// times a read); closed by destroy. Guarded by countersMu.
	countersMu sync.Mutex
	counters   map[int]*os.File

	// Test hooks; nil in production.
	failAt  func(slot int, step string) error                    // called before each Create step
	makeTap func(nsPath string, slot int, uid, gid uint32) error // creates TapName inside the netns
}

var prefixRE = regexp.MustCompile(`^[a-z][a-z0-9]*$`)

// New checks opts and returns a Manager. It touches nothing on the host.
func New(opts Options) (*Manager, error) {
	if opts.Prefix == "" {
		opts.Prefix = DefaultPrefix
	}
	if !opts.Network.IsValid() {
		opts.Network = DefaultNetwork
	}
	if opts.NetNSDir == "" {
		opts.NetNSDir = "/run/netns"
	}
	if opts.ProcSys == "" {
		opts.ProcSys = "/proc/sys"
	}
	if opts.Ports == (PortRange{}) {
		opts.Ports = DefaultPorts
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	n := opts.Network.Masked()
	if !n.Addr().Is4() || n.Bits() > 29 || n.Bits() < 8 {
		return nil, errdefs.InvalidArgument("network %s: want an IPv4 prefix between /8 and /29", opts.Network)
	}
	if n.Overlaps(tapPrefix) {
		return nil, errdefs.InvalidArgument("network %s overlaps the guest network %s", n, tapPrefix)
	}
	opts.Network = n
	maxSlots := 1 << (32 - n.Bits() - 2)
	if !prefixRE.MatchString(opts.Prefix) {
		return nil, errdefs.InvalidArgument("prefix %q: want lowercase letters and digits, starting with a letter", opts.Prefix)
	}
	if l := len(opts.Prefix) + 1 + len(strconv.Itoa(maxSlots-1)); l > 15 {
		return nil, errdefs.InvalidArgument("prefix %q with %d slots makes %d-byte link names (max 15)", opts.Prefix, maxSlots, l)
	}
	if err := opts.Ports.validate(); err != nil {
		return nil, err
	}
	return &Manager{
		opts:     opts,
		maxSlots: maxSlots,
		log:      opts.Logger,
		alloc:    map[int]bool{},
		policies: map[int]Policy{},
		counters: map[int]*os.File{},
	}, nil
}

// MaxSlots is the number of slots the network holds.
func (m *Manager) MaxSlots() int { return m.maxSlots }

// Prefix is the name prefix of everything the manager creates.
func (m *Manager) Prefix() string { return m.opts.Prefix }

// Net describes one slot's network.
type Net struct {
	Slot int `json:"slot"`
	// NetNS is the namespace's name; NetNSPath the file a VMM joins
	// (vmm.Launch.NetNS).
	NetNS     string `json:"netns"`
	NetNSPath string `json:"netns_path"`
	// Tap is the tap device inside the namespace (vmm.NIC.Tap).
	Tap string `json:"tap"`
	// GuestMAC and GuestAddr are what every guest has.
	GuestMAC  string     `json:"guest_mac"`
	GuestAddr netip.Addr `json:"guest_addr"`
	// HostLink is the host end of the veth pair, HostAddr its address.
	HostLink string     `json:"host_link"`
	HostAddr netip.Addr `json:"host_addr"`
	// ChildAddr is where the host reaches this guest: every port is
	// forwarded to GuestAddr.
	ChildAddr netip.Addr `json:"child_addr"`
}

// Info is a slot's network with its current policy and published ports.
type Info struct {
	Net
	// Policy is the egress policy set by this Manager, nil when unknown
	// (the slot was created by an earlier process: the caller persists
	// policies).
	Policy *Policy `json:"policy,omitempty"`
	// Published lists the slot's published ports, by host port.
	Published []Published `json:"published,omitempty"`
}

// Published is one guest port reachable on a host port.
type Published struct {
	Proto     string `json:"proto"`
	HostPort  int    `json:"host_port"`
	GuestPort int    `json:"guest_port"`
}

// netFor returns slot's names and addresses; slot must be valid.
func (m *Manager) netFor(slot int) Net {
	base := m.opts.Network.Addr().As4()
	v := uint32(base[0])<<24 | uint32(base[1])<<16 | uint32(base[2])<<8 | uint32(base[3])
	v += uint32(slot) * 4
	host := netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v + 1)})
	child := netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v + 2)})
	name := m.nsName(slot)
	return Net{
		Slot:      slot,
		NetNS:     name,
		NetNSPath: filepath.Join(m.opts.NetNSDir, name),
		Tap:       TapName,
		GuestMAC:  GuestMAC,
		GuestAddr: GuestAddr,
		HostLink:  m.hostLink(slot),
		HostAddr:  host,
		ChildAddr: child,
	}
}

func (m *Manager) nsName(slot int) string   { return m.opts.Prefix + "-" + strconv.Itoa(slot) }
func (m *Manager) hostLink(slot int) string { return m.opts.Prefix + "h" + strconv.Itoa(slot) }

// slotOf returns the slot a child address belongs to, or -1.
func (m *Manager) slotOf(a netip.Addr) int {
	if !a.Is4() || !m.opts.Network.Contains(a) {
		return -1
	}
	b, n := a.As4(), m.opts.Network.Addr().As4()
	d := (uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])) -
		(uint32(n[0])<<24 | uint32(n[1])<<16 | uint32(n[2])<<8 | uint32(n[3]))
	if d%4 != 2 {
		return -1
	}
	return int(d / 4)
}

// parseSlot returns N when name is prefix+sep+N in canonical decimal within
// range, else -1.
func (m *Manager) parseSlot(name, sep string) int {
	rest, ok := strings.CutPrefix(name, m.opts.Prefix+sep)
	if !ok || rest == "" || (len(rest) > 1 && rest[0] == '0') {
		return -1
	}
	n, err := strconv.Atoi(rest)
	if err != nil || n < 0 || n >= m.maxSlots || strconv.Itoa(n) != rest {
		return -1
	}
	return n
}

func (m *Manager) checkSlot(slot int) error {
	if slot < 0 || slot >= m.maxSlots {
		return errdefs.InvalidArgument("slot %d out of range [0,%d)", slot, m.maxSlots)
	}
	return nil
}

// lockSlot serialises work on slot; call the returned func to unlock.
func (m *Manager) lockSlot(slot int) func() {
	mu := &m.slotMu[slot%len(m.slotMu)]
	mu.Lock()
	return mu.Unlock
}

// Alloc reserves the next free slot: not reserved in this Manager and with
// no namespace of that slot on the host. Slots are handed out next-fit, so a
// released slot is reused as late as possible. It fails with a
// ResourceExhausted-class error when every slot is taken.
func (m *Manager) Alloc() (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for i := 0; i < m.maxSlots; i++ {
		s := (m.next + i) % m.maxSlots
		if m.alloc[s] {
			continue
		}
		if _, err := os.Lstat(filepath.Join(m.opts.NetNSDir, m.nsName(s))); err == nil {
			continue
		}
		m.alloc[s] = true
		m.next = (s + 1) % m.maxSlots
		return s, nil
	}
	return -1, errdefs.ResourceExhausted("all %d network slots are in use", m.maxSlots)
}

// Reserve marks slot as taken (a slot the caller persisted, after a
// restart). It fails with an AlreadyExists-class error if it is reserved.
func (m *Manager) Reserve(slot int) error {
	if err := m.checkSlot(slot); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.alloc[slot] {
		return errdefs.AlreadyExists("slot %d is reserved", slot)
	}
	m.alloc[slot] = true
	return nil
}

// Release returns slot to the pool. It does not touch the host: Destroy
// first. Idempotent.
func (m *Manager) Release(slot int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.alloc, slot)
}

// List returns the slots that have a namespace or a host link on this
// host, whoever created them, in ascending order.
func (m *Manager) List(ctx context.Context) ([]int, error) {
	seen := map[int]bool{}
	nss, err := m.listNetNS()
	if err != nil {
		return nil, err
	}
	for _, s := range nss {
		seen[s] = true
	}
	links, err := m.listHostLinks()
	if err != nil {
		return nil, err
	}
	for s := range links {
		seen[s] = true
	}
	out := make([]int, 0, len(seen))
	for s := range seen {
		out = append(out, s)
	}
	sort.Ints(out)
	return out, nil
}

// listNetNS returns the slots with a namespace file in NetNSDir.
func (m *Manager) listNetNS() ([]int, error) {
	ents, err := os.ReadDir(m.opts.NetNSDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list netns: %w", err)
	}
	var out []int
	for _, e := range ents {
		if s := m.parseSlot(e.Name(), "-"); s >= 0 {
			out = append(out, s)
		}
	}
	return out, nil
}

// listHostLinks returns the host links named like ours, by slot.
func (m *Manager) listHostLinks() (map[int]netlink.Link, error) {
	var links []netlink.Link
	var err error
	// A dump is interrupted when links change meanwhile; retry for a
	// consistent list.
	for range 20 {
		if links, err = netlink.LinkList(); !errors.Is(err, netlink.ErrDumpInterrupted) {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("list links: %w", err)
	}
	out := map[int]netlink.Link{}
	for _, l := range links {
		if s := m.parseSlot(l.Attrs().Name, "h"); s >= 0 {
			out[s] = l
		}
	}
	return out, nil
}

// Info reports slot's network. It fails with a NotFound-class error when
// the slot's namespace does not exist.
func (m *Manager) Info(ctx context.Context, slot int) (Info, error) {
	if err := m.checkSlot(slot); err != nil {
		return Info{}, err
	}
	n := m.netFor(slot)
	if _, err := os.Lstat(n.NetNSPath); err != nil {
		return Info{}, errdefs.NotFound("network of slot %d: netns %s does not exist", slot, n.NetNS)
	}
	info := Info{Net: n}
	m.mu.Lock()
	if p, ok := m.policies[slot]; ok {
		p := p.clone()
		info.Policy = &p
	}
	m.mu.Unlock()
	pubs, err := m.published()
	if err != nil {
		return info, err
	}
	for _, p := range pubs {
		if p.slot == slot {
			info.Published = append(info.Published, p.Published)
		}
	}
	return info, nil
}

// writeSysctl writes value to the sysctl key (dotted or slashed) in the
// network namespace of the calling OS thread.
func (m *Manager) writeSysctl(key, value string) error {
	p := filepath.Join(m.opts.ProcSys, strings.ReplaceAll(key, ".", "/"))
	if err := os.WriteFile(p, []byte(value), 0); err != nil {
		return fmt.Errorf("sysctl %s=%s: %w", key, value, err)
	}
	return nil
}

func (m *Manager) readSysctl(key string) (string, error) {
	b, err := os.ReadFile(filepath.Join(m.opts.ProcSys, strings.ReplaceAll(key, ".", "/")))
	if err != nil {
		return "", fmt.Errorf("sysctl %s: %w", key, err)
	}
	return strings.TrimSpace(string(b)), nil
}

// ensureForwarding turns on IPv4 forwarding on the host if it is off.
func (m *Manager) ensureForwarding() error {
	v, err := m.readSysctl("net/ipv4/ip_forward")
	if err != nil {
		return err
	}
	if v == "1" {
		return nil
	}
	if err := m.writeSysctl("net/ipv4/ip_forward", "1"); err != nil {
		return err
	}
	m.log.Info("enabled IPv4 forwarding on the host for sandbox networking", "sysctl", "net.ipv4.ip_forward", "value", 1)
	return nil
}

func ipnet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// sysClassNet is where the kernel shows network devices' counters.
var sysClassNet = "/sys/class/net"

// Inbound returns how many packets the host has sent towards slot's
// network since its link was made: traffic for the guest (published
// ports, replies to it). The count only grows while the slot lives; it is
// read from the host end of the slot's veth, so reading it costs one small
// file read and touches no namespace. The file stays open for the next
// call: the idle watch asks for every running slot (and a frozen one with
// no WatchInbound) ten times a second, and here an open and close cost
// 35 µs against 4 µs for a read (100 frozen children took the daemon 0.05
// cores in opens). A file of a link since deleted fails to read, and is
// opened afresh once.
func (m *Manager) Inbound(slot int) (uint64, error) {
	if err := m.checkSlot(slot); err != nil {
		return 0, err
	}
	m.countersMu.Lock()
	defer m.countersMu.Unlock()
	var buf [32]byte
	for try := 0; ; try++ {
		f := m.counters[slot]
		if f == nil {
			var err error
			if f, err = os.Open(filepath.Join(sysClassNet, m.hostLink(slot), "statistics", "tx_packets")); err != nil {
				return 0, err
			}
			m.counters[slot] = f
		}
		n, err := f.ReadAt(buf[:], 0)
		if n > 0 {
			return strconv.ParseUint(strings.TrimSpace(string(buf[:n])), 10, 64)
		}
		m.closeCounter(slot)
		if try > 0 {
			return 0, fmt.Errorf("read the traffic counter of slot %d: %w", slot, err)
		}
	}
}

// closeCounter closes slot's counter file, if open. The caller holds
// countersMu.
func (m *Manager) closeCounter(slot int) {
	if f := m.counters[slot]; f != nil {
		f.Close()
		delete(m.counters, slot)
	}
}
