package netns

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/vishvananda/netlink"
)

// Probe checks that this host can give a sandbox its network: it creates a
// scratch namespace under nsDir ("" means /run/netns) holding a tap, then
// removes both. It needs CAP_SYS_ADMIN and CAP_NET_ADMIN.
func Probe(ctx context.Context, nsDir string) (err error) {
	if nsDir == "" {
		nsDir = "/run/netns"
	}
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		return fmt.Errorf("tap devices: %w", err)
	}
	path := filepath.Join(nsDir, "forkd-probe-"+strconv.Itoa(os.Getpid()))
	// A leftover of a crashed probe; one that cannot go would only make
	// createNamed fail, less clearly.
	if err := deleteNamed(path); err != nil {
		return err
	}
	if err := createNamed(path); err != nil {
		return err
	}
	defer func() { err = errors.Join(err, deleteNamed(path)) }()
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := createTap(path, 0, 0, 0); err != nil {
		return fmt.Errorf("tap in a namespace: %w", err)
	}
	return inNetNS(path, func() error {
		l, err := netlink.LinkByName(TapName)
		if err != nil {
			return err
		}
		return netlink.LinkSetUp(l)
	})
}
