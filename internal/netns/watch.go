package netns

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// InboundWatch waits for the first packet the host sends towards one
// slot's network (what Inbound counts) after the watch began. Made by
// WatchInbound.
type InboundWatch struct {
	f  *os.File
	rc syscall.RawConn
}

// WatchInbound starts watching slot's host link for the packets the host
// sends there: traffic for the guest. Unlike Inbound it needs no polling:
// a packet socket bound to the link gets the first byte of each packet the
// link sends, and nothing of what it receives (a filter the kernel runs
// on each packet drops the rest before any copy); Wait sleeps in the
// runtime's poller until one comes. The socket costs the link's traffic a
// filter run per packet while it is open: the idle watch keeps one per
// frozen sandbox, whose link is quiet. The caller closes the watch.
func (m *Manager) WatchInbound(slot int) (*InboundWatch, error) {
	if err := m.checkSlot(slot); err != nil {
		return nil, err
	}
	link := m.hostLink(slot)
	fail := func(what string, err error) (*InboundWatch, error) {
		return nil, fmt.Errorf("watch the traffic of slot %d (%s): %s: %w", slot, link, what, err)
	}
	// Protocol 0: the socket takes no packet before its filter is on and
	// it is bound to the link.
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fail("packet socket", err)
	}
	f := os.NewFile(uintptr(fd), "inbound "+link)
	ifr, err := unix.NewIfreq(link)
	if err == nil {
		err = unix.IoctlIfreq(fd, unix.SIOCGIFINDEX, ifr)
	}
	if err != nil {
		f.Close()
		return fail("its index", err)
	}
	prog := sentOnly()
	if err := unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER,
		&unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}); err != nil {
		f.Close()
		return fail("filter", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: int(ifr.Uint32())}); err != nil {
		f.Close()
		return fail("bind", err)
	}
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return fail("raw conn", err)
	}
	return &InboundWatch{f: f, rc: rc}, nil
}

// skfAdPktType is where a classic BPF program loads a packet's type from
// (linux/filter.h: SKF_AD_OFF + SKF_AD_PKTTYPE, an ancillary load).
const skfAdPktType = -0x1000 + 4

// sentOnly is a classic BPF program that keeps one byte of each packet
// its link sends and drops every other packet.
func sentOnly() []unix.SockFilter {
	pktType := int32(skfAdPktType)
	return []unix.SockFilter{
		{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: uint32(pktType)},
		{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: 1, K: unix.PACKET_OUTGOING},
		{Code: unix.BPF_RET | unix.BPF_K, K: 1},
		{Code: unix.BPF_RET | unix.BPF_K, K: 0},
	}
}

// htons returns v in network byte order, as the kernel reads it.
func htons(v uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], v)
	return binary.NativeEndian.Uint16(b[:])
}

// Wait blocks until the host has sent a packet towards the slot since the
// watch began, and returns true; or until the watch is closed, or fails
// (its link deleted), and returns false.
func (w *InboundWatch) Wait() bool {
	got := false
	err := w.rc.Read(func(fd uintptr) bool {
		var b [1]byte
		for {
			_, _, err := unix.Recvfrom(int(fd), b[:], unix.MSG_DONTWAIT)
			switch {
			case errors.Is(err, unix.EINTR):
				continue
			case errors.Is(err, unix.EAGAIN):
				return false // wait until readable
			}
			got = err == nil
			return true
		}
	})
	return err == nil && got
}

// Close ends the watch; a Wait returns false. Closing a nil watch does
// nothing.
func (w *InboundWatch) Close() error {
	if w == nil {
		return nil
	}
	return w.f.Close()
}
