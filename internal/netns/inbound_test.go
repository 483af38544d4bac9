package netns

import (
	"context"
	"net"
	"net/netip"
	"path/filepath"
	"testing"
	"time"
)

// Inbound keeps each slot's counter file open: it must never read a link
// that is gone (a stale file fails, and is opened afresh), and Destroy
// closes it.
func TestInboundFollowsTheLink(t *testing.T) {
	setupWorld(t)
	t.Parallel()
	m := testManager(t, "fdtf", "10.180.96.0/20", false)
	ctx := context.Background()
	n := mustCreate(t, m, 5, DefaultPolicy)
	if _, err := m.Inbound(5); err != nil {
		t.Fatal(err)
	}
	if m.counters[5] == nil {
		t.Fatal("no counter file kept open")
	}
	// The link goes behind the manager's back: its open file fails, and
	// the open afresh finds no link.
	if err := deleteLink(n.HostLink); err != nil {
		t.Fatal(err)
	}
	if c, err := m.Inbound(5); err == nil {
		t.Fatalf("Inbound of a deleted link: %d, no error", c)
	}
	if err := m.Destroy(ctx, 5); err != nil {
		t.Fatal(err)
	}
	mustCreate(t, m, 5, DefaultPolicy)
	if _, err := m.Inbound(5); err != nil {
		t.Fatalf("Inbound of the slot made again: %v", err)
	}
	if err := m.Destroy(ctx, 5); err != nil {
		t.Fatal(err)
	}
	if len(m.counters) != 0 {
		t.Fatalf("counter files left open after Destroy: %v", m.counters)
	}
	assertNothingLeft(t, m)
}

// WatchInbound's Wait returns on a packet the host sends towards the slot
// and not on one it receives from there; Close and a deleted link end it.
func TestWatchInbound(t *testing.T) {
	setupWorld(t)
	t.Parallel()
	m := testManager(t, "fdtw", "10.180.32.0/20", true)
	ctx := context.Background()
	n := mustCreate(t, m, 2, Policy{Mode: ModeAllow})
	if _, err := serveIn(m.guestNS(2), ap(GuestAddr, 80), "guest 2"); err != nil {
		t.Fatal(err)
	}
	wait := func(w *InboundWatch) <-chan bool {
		c := make(chan bool, 1)
		go func() { c <- w.Wait() }()
		return c
	}
	ended := func(c <-chan bool, want bool, what string) {
		t.Helper()
		select {
		case got := <-c:
			if got != want {
				t.Fatalf("%s: Wait = %v, want %v", what, got, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: Wait still blocked after 5 s", what)
		}
	}
	// send sends a datagram from the guest to "the internet", which
	// receives it and does not answer: it leaves the slot through the
	// host link, and nothing comes back.
	sink, err := listenUDPIn(filepath.Join("/run/netns", inetNS), netip.AddrPortFrom(inetAddr, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close()
	send := func() {
		t.Helper()
		if err := inNetNS(m.guestNS(2), func() error {
			c, err := net.Dial("udp4", sink.LocalAddr().String())
			if err != nil {
				return err
			}
			defer c.Close()
			_, err = c.Write([]byte("from the guest"))
			return err
		}); err != nil {
			t.Fatal(err)
		}
		sink.SetReadDeadline(time.Now().Add(5 * time.Second))
		var b [64]byte
		if _, _, err := sink.ReadFrom(b[:]); err != nil {
			t.Fatalf("the guest's datagram never arrived: %v", err)
		}
	}
	// The namespace asks for the host's address once: the answer leaves
	// the host link, before any watch.
	send()

	w, err := m.WatchInbound(2)
	if err != nil {
		t.Fatal(err)
	}
	c := wait(w)
	send()
	select {
	case got := <-c:
		t.Fatalf("Wait returned %v on a packet the host received", got)
	case <-time.After(500 * time.Millisecond):
	}
	expectGet(t, "", ap(n.ChildAddr, 80), "guest 2")
	ended(c, true, "a request to the guest")
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}

	w = must(m.WatchInbound(2))
	c = wait(w)
	w.Close()
	ended(c, false, "Close")

	w = must(m.WatchInbound(2))
	c = wait(w)
	if err := deleteLink(n.HostLink); err != nil {
		t.Fatal(err)
	}
	ended(c, false, "the link deleted")
	w.Close()
	if err := m.Destroy(ctx, 2); err != nil {
		t.Fatal(err)
	}
	if w, err := m.WatchInbound(2); err == nil {
		w.Close()
		t.Fatal("WatchInbound of a slot with no link: no error")
	}
}

// listenUDPIn listens for UDP on addr inside the namespace at nsPath.
func listenUDPIn(nsPath string, addr netip.AddrPort) (*net.UDPConn, error) {
	var c *net.UDPConn
	err := inNetNS(nsPath, func() error {
		var err error
		c, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(addr))
		return err
	})
	return c, err
}
