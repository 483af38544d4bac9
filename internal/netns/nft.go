package netns

import (
	"encoding/binary"
	"net/netip"
	"slices"
	"sync"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Chain names. The namespace table and the host table are both called
// after the prefix; each lives in its own network namespace.
const (
	chainPre     = "prerouting"
	chainOut     = "output"
	chainPost    = "postrouting"
	chainForward = "forward"
	chainInput   = "input"
	chainOutput  = "output"
	chainEgress  = "egress" // namespace: the policy; rewritten by SetPolicy
	chainRefuse  = "refuse" // namespace: reject quickly (tcp reset / icmp)
)

// Published-port maps in the host table: host port -> child address, and
// host port -> guest port, per protocol.
func addrMap(proto string) string { return "pub_" + proto + "_addr" }
func portMap(proto string) string { return "pub_" + proto + "_port" }

var protos = []string{"tcp", "udp"}

func protoNum(p string) byte {
	switch p {
	case "tcp":
		return unix.IPPROTO_TCP
	case "udp":
		return unix.IPPROTO_UDP
	case "icmp":
		return unix.IPPROTO_ICMP
	}
	panic("netns: unknown protocol " + p)
}

// --- expression builders; all load into register 1 unless said otherwise.

func ifname(name string) []byte {
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, name)
	return b
}

// matchIf matches the input (in) or output interface name exactly, or by
// prefix when prefix is set; neq inverts.
func matchIf(in bool, name string, prefix, neq bool) []expr.Any {
	key := expr.MetaKeyOIFNAME
	if in {
		key = expr.MetaKeyIIFNAME
	}
	data := ifname(name)
	if prefix {
		data = []byte(name)
	}
	op := expr.CmpOpEq
	if neq {
		op = expr.CmpOpNeq
	}
	return []expr.Any{
		&expr.Meta{Key: key, Register: 1},
		&expr.Cmp{Op: op, Register: 1, Data: data},
	}
}

// matchAddr matches the IPv4 source (src) or destination address against
// prefix p; a /0 matches everything and yields nothing.
func matchAddr(src bool, p netip.Prefix) []expr.Any {
	if p.Bits() == 0 {
		return nil
	}
	off := uint32(16)
	if src {
		off = 12
	}
	a := p.Masked().Addr().As4()
	out := []expr.Any{&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: 4}}
	if p.Bits() < 32 {
		mask := binary.BigEndian.AppendUint32(nil, ^uint32(0)<<(32-p.Bits()))
		out = append(out, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: make([]byte, 4)})
	}
	return append(out, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: a[:]})
}

func matchL4(proto byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
	}
}

// matchDport matches the transport destination port; the protocol must
// already be matched.
func matchDport(r PortRange) []expr.Any {
	load := &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2}
	if r.First == r.Last {
		return []expr.Any{load, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(r.First)}}
	}
	return []expr.Any{load, &expr.Range{Op: expr.CmpOpEq, Register: 1,
		FromData: binaryutil.BigEndian.PutUint16(r.First), ToData: binaryutil.BigEndian.PutUint16(r.Last)}}
}

// matchCtState matches when any of the conntrack state bits is set.
func matchCtState(bits uint32) []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(bits), Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: make([]byte, 4)},
	}
}

// matchCtDNAT matches connections whose destination was translated.
func matchCtDNAT() []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATUS},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(ipsDstNAT), Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: make([]byte, 4)},
	}
}

// matchLocalDst matches packets addressed to one of this host's addresses.
func matchLocalDst() []expr.Any {
	return []expr.Any{
		&expr.Fib{Register: 1, FlagDADDR: true, ResultADDRTYPE: true},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(unix.RTN_LOCAL)},
	}
}

const establishedOrRelated = expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED

func verdict(k expr.VerdictKind, chain string) expr.Any {
	return &expr.Verdict{Kind: k, Chain: chain}
}

func accept() expr.Any           { return verdict(expr.VerdictAccept, "") }
func drop() expr.Any             { return verdict(expr.VerdictDrop, "") }
func jump(chain string) expr.Any { return verdict(expr.VerdictJump, chain) }
func goTo(chain string) expr.Any { return verdict(expr.VerdictGoto, chain) }
func cat(parts ...[]expr.Any) []expr.Any {
	var out []expr.Any
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// --- the namespace table

func nsTable(prefix string) *nftables.Table {
	return &nftables.Table{Name: prefix, Family: nftables.TableFamilyIPv4}
}

// addNSTable queues, on c, the whole table of a child namespace whose
// child address is child, with egress policy p. The table must not exist.
func addNSTable(c *nftables.Conn, prefix string, child netip.Addr, children netip.Prefix, p Policy) {
	t := c.AddTable(nsTable(prefix))
	pol := func(v nftables.ChainPolicy) *nftables.ChainPolicy { return &v }
	pre := c.AddChain(&nftables.Chain{Name: chainPre, Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest})
	post := c.AddChain(&nftables.Chain{Name: chainPost, Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	fwd := c.AddChain(&nftables.Chain{Name: chainForward, Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: pol(nftables.ChainPolicyDrop)})
	in := c.AddChain(&nftables.Chain{Name: chainInput, Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: pol(nftables.ChainPolicyAccept)})
	out := c.AddChain(&nftables.Chain{Name: chainOutput, Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityFilter, Policy: pol(nftables.ChainPolicyAccept)})
	refuse := c.AddChain(&nftables.Chain{Name: chainRefuse, Table: t})
	c.AddChain(&nftables.Chain{Name: chainEgress, Table: t})

	guest := netip.PrefixFrom(GuestAddr, 32)
	gw := GuestAddr.As4()
	rule := func(ch *nftables.Chain, e ...[]expr.Any) {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: cat(e...)})
	}

	// Everything addressed to the child address goes to the guest.
	rule(pre, matchIf(true, VethName, false, false), matchAddr(false, netip.PrefixFrom(child, 32)),
		[]expr.Any{
			&expr.Immediate{Register: 1, Data: gw[:]},
			&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegAddrMax: 1},
		})
	// The guest's connections leave as the child address.
	rule(post, matchIf(false, VethName, false, false), matchAddr(true, guest), []expr.Any{&expr.Masq{}})

	rule(fwd, matchCtState(establishedOrRelated), []expr.Any{accept()})
	rule(fwd, matchIf(true, VethName, false, false), matchIf(false, TapName, false, false), matchCtDNAT(), []expr.Any{accept()})
	rule(fwd, matchIf(true, TapName, false, false), matchIf(false, VethName, false, false), matchAddr(true, guest), []expr.Any{jump(chainEgress)})
	rule(fwd, matchIf(true, TapName, false, false), []expr.Any{goTo(chainRefuse)})

	// The namespace itself offers the guest nothing but ICMP.
	rule(in, matchIf(true, TapName, false, false), matchCtState(establishedOrRelated), []expr.Any{accept()})
	rule(in, matchIf(true, TapName, false, false), matchL4(unix.IPPROTO_ICMP), []expr.Any{accept()})
	rule(in, matchIf(true, TapName, false, false), []expr.Any{goTo(chainRefuse)})

	// The VMM runs in the namespace but needs no network of its own (the
	// tap is an fd): a process of the namespace may answer and talk to
	// the guest, never start connections out of the veth, which would pass
	// the egress policy by (a QEMU taken over by its guest).
	rule(out, matchCtState(establishedOrRelated), []expr.Any{accept()})
	rule(out, matchIf(false, TapName, false, false), []expr.Any{accept()})
	rule(out, matchIf(false, "lo", false, false), []expr.Any{accept()})
	rule(out, []expr.Any{&expr.Verdict{Kind: expr.VerdictDrop}})

	rule(refuse, matchL4(unix.IPPROTO_TCP), []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_TCP_RST}})
	rule(refuse, []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_ICMP_UNREACH, Code: 13}}) // ICMP_PKT_FILTERED: admin-prohibited

	addEgressRules(c, t, children, p)
}

// addEgressRules queues the rules of the egress chain for policy p; the
// chain must be empty (new or flushed in the same batch).
func addEgressRules(c *nftables.Conn, t *nftables.Table, children netip.Prefix, p Policy) {
	ch := &nftables.Chain{Name: chainEgress, Table: t}
	rule := func(e ...[]expr.Any) {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: cat(e...)})
	}
	// Never another child, whatever the allow rules say (the host table
	// enforces it again).
	rule(matchAddr(false, children), []expr.Any{goTo(chainRefuse)})
	// In every mode the Blocked ranges are refused unless a rule names
	// them, that is lies inside one: "0.0.0.0/0:tcp:443" allows the web,
	// not the metadata service or the LAN. So the rules naming blocked
	// networks come first, then the refusal of the blocked ranges, then
	// the other rules.
	named, rest := splitNamed(p.Allow)
	for _, r := range slices.Concat(named, []Rule{{}}, rest) {
		if !r.CIDR.IsValid() {
			for _, b := range Blocked {
				rule(matchAddr(false, b), []expr.Any{goTo(chainRefuse)})
			}
			continue
		}
		dst := matchAddr(false, r.CIDR)
		var ps []string
		switch {
		case r.Proto != "":
			ps = []string{r.Proto}
		case len(r.Ports) > 0:
			ps = protos
		}
		if len(ps) == 0 {
			rule(dst, []expr.Any{accept()})
			continue
		}
		for _, proto := range ps {
			l4 := matchL4(protoNum(proto))
			if len(r.Ports) == 0 {
				rule(dst, l4, []expr.Any{accept()})
				continue
			}
			for _, pr := range r.Ports {
				rule(dst, l4, matchDport(pr), []expr.Any{accept()})
			}
		}
	}
	if p.Mode == ModeAllow {
		rule([]expr.Any{accept()})
		return
	}
	rule([]expr.Any{goTo(chainRefuse)})
}

// splitNamed separates the rules that name a blocked network (lie inside
// one of Blocked) from the others.
func splitNamed(rules []Rule) (named, rest []Rule) {
	for _, r := range rules {
		if slices.ContainsFunc(Blocked, func(b netip.Prefix) bool {
			return b.Overlaps(r.CIDR) && r.CIDR.Bits() >= b.Bits()
		}) {
			named = append(named, r)
		} else {
			rest = append(rest, r)
		}
	}
	return named, rest
}

// --- the host table

func hostTable(prefix string) *nftables.Table {
	return &nftables.Table{Name: prefix, Family: nftables.TableFamilyIPv4}
}

// setIDMu serialises Conn.AddSet: the library numbers sets from an
// unsynchronised package-level counter.
var setIDMu sync.Mutex

func addSet(c *nftables.Conn, s *nftables.Set) error {
	setIDMu.Lock()
	defer setIDMu.Unlock()
	return c.AddSet(s, nil)
}

func pubSets(t *nftables.Table, proto string) (addrs, ports *nftables.Set) {
	addrs = &nftables.Set{Table: t, Name: addrMap(proto), IsMap: true,
		KeyType: nftables.TypeInetService, DataType: nftables.TypeIPAddr}
	ports = &nftables.Set{Table: t, Name: portMap(proto), IsMap: true,
		KeyType: nftables.TypeInetService, DataType: nftables.TypeInetService}
	return addrs, ports
}

// hostTag identifies the content of a host table: a table whose first
// forward rule carries the tag of the running code needs no rewrite.
func hostTag(network netip.Prefix) string { return "forkd host table v1 " + network.String() }

// hostTableCurrent reports whether the host table of prefix exists with
// the content addHostTable writes for network.
func hostTableCurrent(c *nftables.Conn, prefix string, network netip.Prefix) (bool, error) {
	ok, err := hostTableExists(c, prefix)
	if err != nil || !ok {
		return false, err
	}
	t := hostTable(prefix)
	// A chain that cannot be read is missing: the table is not current,
	// and rewriting it repairs it (a real netlink failure shows when the
	// rewrite is flushed).
	rules, err := c.GetRules(t, &nftables.Chain{Name: chainForward, Table: t})
	current := err == nil && len(rules) > 0 && string(rules[0].UserData) == hostTag(network)
	return current, nil
}

// addHostTable queues, on c, the host table: created if missing, its base
// chains flushed and rewritten, its maps (and their elements) kept. The
// result is the same whether or not the table existed.
func addHostTable(c *nftables.Conn, prefix string, network netip.Prefix) error {
	t := c.AddTable(hostTable(prefix))
	linkPrefix := prefix + "h"
	chain := func(name string, typ nftables.ChainType, hook *nftables.ChainHook, prio *nftables.ChainPriority) *nftables.Chain {
		ch := c.AddChain(&nftables.Chain{Name: name, Table: t, Type: typ, Hooknum: hook, Priority: prio})
		c.FlushChain(ch)
		return ch
	}
	pre := chain(chainPre, nftables.ChainTypeNAT, nftables.ChainHookPrerouting, nftables.ChainPriorityNATDest)
	out := chain(chainOut, nftables.ChainTypeNAT, nftables.ChainHookOutput, nftables.ChainPriorityNATDest)
	post := chain(chainPost, nftables.ChainTypeNAT, nftables.ChainHookPostrouting, nftables.ChainPriorityNATSource)
	fwd := chain(chainForward, nftables.ChainTypeFilter, nftables.ChainHookForward, nftables.ChainPriorityFilter)
	in := chain(chainInput, nftables.ChainTypeFilter, nftables.ChainHookInput, nftables.ChainPriorityFilter)
	rule := func(ch *nftables.Chain, e ...[]expr.Any) {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: cat(e...)})
	}

	for _, proto := range protos {
		addrs, ports := pubSets(t, proto)
		if err := addSet(c, addrs); err != nil {
			return err
		}
		if err := addSet(c, ports); err != nil {
			return err
		}
		// fib daddr type local meta l4proto P
		//   dnat to P dport map @addr : P dport map @port
		dnat := cat(matchLocalDst(), matchL4(protoNum(proto)), []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
			&expr.Lookup{SourceRegister: 1, DestRegister: 2, IsDestRegSet: true, SetName: addrs.Name, SetID: addrs.ID},
			&expr.Lookup{SourceRegister: 1, DestRegister: 3, IsDestRegSet: true, SetName: ports.Name, SetID: ports.ID},
			&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4,
				RegAddrMin: 2, RegAddrMax: 2, RegProtoMin: 3, RegProtoMax: 3, Specified: true},
		})
		rule(pre, dnat)
		rule(out, dnat)
	}

	// Published ports reached from 127.0.0.1 leave as the host's veth
	// address (the links have route_localnet=1 so such packets route).
	rule(post, matchAddr(true, netip.MustParsePrefix("127.0.0.0/8")), matchIf(false, linkPrefix, true, false), []expr.Any{&expr.Masq{}})
	// Children's connections leave the host's uplinks as the host.
	rule(post, matchAddr(true, network), matchIf(false, linkPrefix, true, true), []expr.Any{&expr.Masq{}})

	// Child to child: never. The rule carries the table's version tag.
	c.AddRule(&nftables.Rule{Table: t, Chain: fwd, UserData: []byte(hostTag(network)),
		Exprs: cat(matchIf(true, linkPrefix, true, false), matchIf(false, linkPrefix, true, false), []expr.Any{drop()})})
	// Towards a child: replies, and published ports; nothing else.
	rule(fwd, matchIf(false, linkPrefix, true, false), matchCtState(establishedOrRelated), []expr.Any{accept()})
	rule(fwd, matchIf(false, linkPrefix, true, false), matchCtDNAT(), []expr.Any{accept()})
	rule(fwd, matchIf(false, linkPrefix, true, false), []expr.Any{drop()})

	// A child never reaches the host's own services, on any address.
	rule(in, matchIf(true, linkPrefix, true, false), matchCtState(establishedOrRelated), []expr.Any{accept()})
	rule(in, matchIf(true, linkPrefix, true, false), []expr.Any{drop()})
	return nil
}

// ipsDstNAT is IPS_DST_NAT from linux/netfilter/nf_conntrack_common.h.
const ipsDstNAT = 1 << 5
