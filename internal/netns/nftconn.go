package netns

import (
	"github.com/google/nftables"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// nftRecvBuf is the receive buffer of our nftables sockets. A batch is
// acknowledged message by message; with the default buffer (rmem_default)
// a large batch, or several batches on a busy host, can overflow it and
// the kernel drops acknowledgements (ENOBUFS).
const nftRecvBuf = 8 << 20

// newNft returns an nftables connection with a receive buffer large
// enough for our batches (SO_RCVBUFFORCE: we are root; SO_RCVBUF, capped
// by net.core.rmem_max, otherwise).
func newNft(opts ...nftables.ConnOption) (*nftables.Conn, error) {
	return nftables.New(append(opts, nftables.WithSockOptions(bigRecvBuf))...)
}

func bigRecvBuf(c *netlink.Conn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, nftRecvBuf)
		if serr != nil {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, nftRecvBuf)
		}
	}); err != nil {
		return err
	}
	return serr
}
