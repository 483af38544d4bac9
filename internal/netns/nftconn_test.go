package netns

import (
	"os"
	"testing"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

func TestBigRecvBuf(t *testing.T) {
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := bigRecvBuf(c); err != nil {
		t.Fatal(err)
	}
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var got int
	rc.Control(func(fd uintptr) { got, err = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF) })
	if err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() == 0 && got < nftRecvBuf {
		t.Fatalf("receive buffer %d, want at least %d", got, nftRecvBuf)
	}
}
