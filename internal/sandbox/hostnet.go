package sandbox

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/cgroup"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/netns"
)

// HostNet is a data dir's share of the host's networking: every data dir on
// a host gets its own link-name prefix, address range and port range, so
// that several forkd instances (a daemon, tests) never touch each other's
// namespaces, links, nftables tables or cgroups.
type HostNet struct {
	Index   int    `json:"index"`
	Prefix  string `json:"prefix"`
	Network string `json:"network"`
	Ports   string `json:"ports"`
}

// hostNetClaims is where a host records which data dir holds which index
// (on /run: forgotten at reboot, like the namespaces themselves).
var hostNetClaims = "/run/forkd/net"

// hostNetNSDir is where named network namespaces live (netns.Options).
var hostNetNSDir = "/run/netns"

// namespacesLeft reports whether a namespace named with prefix is still on
// the host: an index whose claim went stale (its data dir is gone) may
// still have namespaces a crashed forkd left, and a new data dir given
// that index would fail to make its own ("netns fk17-1 exists").
func namespacesLeft(prefix string) bool {
	entries, err := os.ReadDir(hostNetNSDir)
	if err != nil {
		return false
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix+"-") {
			return true
		}
	}
	return false
}

const maxHostNets = 64

// hostNetFor returns dataDir's share, claiming a free one on first use.
func hostNetFor(dataDir string) (HostNet, error) {
	path := filepath.Join(dataDir, "network.json")
	var hn HostNet
	if b, err := os.ReadFile(path); err == nil {
		if err := json.Unmarshal(b, &hn); err != nil {
			return hn, fmt.Errorf("%s: %w", path, err)
		}
	} else {
		hn.Index = -1
	}
	if err := os.MkdirAll(hostNetClaims, 0o700); err != nil {
		return hn, err
	}
	lock, err := os.OpenFile(filepath.Join(hostNetClaims, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return hn, err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return hn, err
	}
	owner := func(i int) string {
		b, _ := os.ReadFile(filepath.Join(hostNetClaims, strconv.Itoa(i)))
		return string(b)
	}
	// Keep our index unless another live data dir holds it (after a
	// reboot claims are gone and another dir may have taken it).
	if hn.Index >= 0 {
		if o := owner(hn.Index); o == "" || o == dataDir || !claimLive(o, hn.Index) {
			return hn, claim(hn, dataDir, path)
		}
	}
	for i := 0; i < maxHostNets; i++ {
		if o := owner(i); (o == "" || !claimLive(o, i)) && !namespacesLeft(fmt.Sprintf("fk%02d", i)) {
			hn = HostNet{
				Index:   i,
				Prefix:  fmt.Sprintf("fk%02d", i),
				Network: fmt.Sprintf("10.%d.0.0/16", 192+i),
				Ports:   fmt.Sprintf("%d-%d", 20000+500*i, 20000+500*i+499),
			}
			return hn, claim(hn, dataDir, path)
		}
	}
	return hn, errdefs.ResourceExhausted("all %d host network ranges are claimed by other data dirs (see %s) or hold namespaces left behind (forkd cleanup in their data dir, or ip netns delete)", maxHostNets, hostNetClaims)
}

// claimLive reports whether the data dir that claimed index i still exists
// and still names i.
func claimLive(dataDir string, i int) bool {
	b, err := os.ReadFile(filepath.Join(dataDir, "network.json"))
	if err != nil {
		return false
	}
	var hn HostNet
	return json.Unmarshal(b, &hn) == nil && hn.Index == i
}

func claim(hn HostNet, dataDir, path string) error {
	if err := fsutil.WriteJSON(path, hn, 0o600); err != nil {
		return err
	}
	return fsutil.WriteFile(filepath.Join(hostNetClaims, strconv.Itoa(hn.Index)), []byte(dataDir), 0o600)
}

// HostIsolation returns the network and cgroup managers for dataDir's
// children, or nils (and no error) when not root: per-child namespaces and
// cgroups need it, and forkd then runs children without them.
func HostIsolation(dataDir string, log *slog.Logger) (*netns.Manager, *cgroup.Manager, error) {
	if os.Geteuid() != 0 {
		return nil, nil, nil
	}
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return nil, nil, err
	}
	hn, err := hostNetFor(dataDir)
	if err != nil {
		return nil, nil, err
	}
	network, err := netip.ParsePrefix(hn.Network)
	if err != nil {
		return nil, nil, err
	}
	ports, err := netns.ParsePortRange(hn.Ports)
	if err != nil {
		return nil, nil, err
	}
	nm, err := netns.New(netns.Options{Prefix: hn.Prefix, Network: network, Ports: ports, Logger: log})
	if err != nil {
		return nil, nil, err
	}
	cm, err := cgroup.New(cgroup.Options{Parent: "forkd-" + hn.Prefix})
	if err != nil {
		// Limits are optional; a host without usable cgroups still forks.
		log.Warn("cgroups unavailable; resource limits disabled", "err", err)
		return nm, nil, nil
	}
	return nm, cm, nil
}
