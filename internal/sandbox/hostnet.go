package sandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/cgroup"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/proc"
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

// hostNetOf is index i's share.
func hostNetOf(i int) HostNet {
	return HostNet{
		Index:   i,
		Prefix:  fmt.Sprintf("fk%02d", i),
		Network: fmt.Sprintf("10.%d.0.0/16", 192+i),
		Ports:   fmt.Sprintf("%d-%d", 20000+500*i, 20000+500*i+499),
	}
}

// netManager returns the network manager of hn's prefix.
func (hn HostNet) netManager(log *slog.Logger) (*netns.Manager, error) {
	network, err := netip.ParsePrefix(hn.Network)
	if err != nil {
		return nil, err
	}
	ports, err := netns.ParsePortRange(hn.Ports)
	if err != nil {
		return nil, err
	}
	return netns.New(netns.Options{Prefix: hn.Prefix, Network: network, NetNSDir: hostNetNSDir, Ports: ports, Logger: log})
}

// reclaimHostNet is reclaimLeft; unit tests replace it, since it changes
// the host.
var reclaimHostNet = reclaimLeft

// reclaimLeft removes what the forkd processes of a removed data dir left
// under hn's prefix: the VMMs still running in its namespaces (a daemon
// SIGKILLed with VMMs parked for its pool, then its data dir deleted),
// then its namespaces, host links, nftables tables and cgroups. The data
// dir's records went with it, so no daemon will ever reconcile them. It
// removes nothing, and fails, while any other process is in one of the
// namespaces: a VMM whose run dir still exists (a data dir moved elsewhere
// may come back for it), or someone's shell.
func reclaimLeft(hn HostNet, log *slog.Logger) error {
	nm, err := hn.netManager(log)
	if err != nil {
		return err
	}
	vmms, err := leftVMMs(hn.Prefix)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var errs []error
	for _, id := range vmms {
		if err := proc.Kill(ctx, id); err != nil {
			errs = append(errs, fmt.Errorf("kill VMM %d: %w", id.PID, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	errs = append(errs, nm.Reclaim(ctx, func(int) bool { return false }))
	if cm, err := cgroup.New(cgroup.Options{Parent: "forkd-" + hn.Prefix}); err == nil {
		errs = append(errs, cm.Reclaim(func(string) bool { return false }))
	}
	return errors.Join(errs...)
}

// leftVMMs returns the processes in prefix's namespaces, failing unless
// every one is a VMM (QEMU's -name ...,process=forkd-<name>) whose working
// directory, in its run dir, was deleted.
func leftVMMs(prefix string) ([]proc.Identity, error) {
	type nsID struct{ dev, ino uint64 }
	names := map[nsID]string{}
	entries, err := os.ReadDir(hostNetNSDir)
	if err != nil {
		return nil, err
	}
	for _, e := range entries {
		var st unix.Stat_t
		if strings.HasPrefix(e.Name(), prefix+"-") && unix.Stat(filepath.Join(hostNetNSDir, e.Name()), &st) == nil {
			names[nsID{st.Dev, st.Ino}] = e.Name()
		}
	}
	pids, err := os.ReadDir(proc.Root)
	if err != nil {
		return nil, err
	}
	var out []proc.Identity
	for _, p := range pids {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		// Identity first, checked again after the reads: a pid reused in
		// between must not be taken for the VMM.
		id, err := proc.Self(pid)
		if err != nil {
			continue
		}
		base := filepath.Join(proc.Root, p.Name())
		var st unix.Stat_t
		if unix.Stat(filepath.Join(base, "ns", "net"), &st) != nil {
			continue
		}
		ns, ok := names[nsID{st.Dev, st.Ino}]
		if !ok {
			continue
		}
		cwd, _ := os.Readlink(filepath.Join(base, "cwd"))
		if vmmName(base) == "" || !strings.HasSuffix(cwd, " (deleted)") {
			if now, err := proc.Self(pid); err != nil || now != id {
				continue // exited meanwhile
			}
			return nil, errdefs.FailedPrecondition("process %d in namespace %s is not a VMM of a removed data dir", pid, ns)
		}
		if now, err := proc.Self(pid); err == nil && now == id {
			out = append(out, id)
		}
	}
	return out, nil
}

// reclaimStale reclaims what is left on the host under every index but
// own whose claim went stale (its data dir is gone); the caller holds the
// claims' lock.
func reclaimStale(owner func(int) string, own int, log *slog.Logger) {
	for i := 0; i < maxHostNets; i++ {
		hn := hostNetOf(i)
		if o := owner(i); i == own || (o != "" && claimLive(o, i)) || !namespacesLeft(hn.Prefix) {
			continue
		}
		if err := reclaimHostNet(hn, log); err != nil {
			log.Warn("keep what a removed data dir left on the host", "prefix", hn.Prefix, "err", err)
			continue
		}
		log.Warn("reclaimed the namespaces, VMMs and cgroups a removed data dir left on the host", "prefix", hn.Prefix)
	}
}

// hostNetFor returns dataDir's share, claiming a free one on first use.
// It first reclaims what removed data dirs left on the host.
func hostNetFor(dataDir string, log *slog.Logger) (HostNet, error) {
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
	reclaimStale(owner, hn.Index, log)
	// Keep our index unless another live data dir holds it (after a
	// reboot claims are gone and another dir may have taken it).
	if hn.Index >= 0 {
		if o := owner(hn.Index); o == "" || o == dataDir || !claimLive(o, hn.Index) {
			return hn, claim(hn, dataDir, path)
		}
	}
	for i := 0; i < maxHostNets; i++ {
		if o := owner(i); (o == "" || !claimLive(o, i)) && !namespacesLeft(fmt.Sprintf("fk%02d", i)) {
			hn = hostNetOf(i)
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
	hn, err := hostNetFor(dataDir, log)
	if err != nil {
		return nil, nil, err
	}
	nm, err := hn.netManager(log)
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
