package netns

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/cgroup"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/launch"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/testutil"
)

// TestRealTap checks the production tap: owned by the given user, in the
// namespace, addressed as the guest's gateway, with nothing leaking.
func TestRealTap(t *testing.T) {
	setupWorld(t)
	t.Parallel()
	m := testManager(t, "fdtb", "10.180.16.0/20", false)
	m.opts.TapUID, m.opts.TapGID = 4321, 4322
	n := mustCreate(t, m, 7, DefaultPolicy)
	ns, err := vnetns.GetFromPath(n.NetNSPath)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	l, err := h.LinkByName(TapName)
	if err != nil {
		t.Fatal(err)
	}
	tap, ok := l.(*netlink.Tuntap)
	if !ok || tap.Owner != 4321 || tap.Group != 4322 || tap.Mode != netlink.TUNTAP_MODE_TAP {
		t.Fatalf("tap = %#v", l)
	}
	if mac := l.Attrs().HardwareAddr.String(); mac != TapMAC {
		t.Fatalf("tap MAC %s, want the fixed %s", mac, TapMAC)
	}
	addrs, _ := h.AddrList(l, unix.AF_INET)
	if len(addrs) != 1 || addrs[0].IPNet.String() != "172.16.0.1/30" {
		t.Fatalf("tap addresses %v", addrs)
	}
	// The tap exists in the namespace only.
	if _, err := netlink.LinkByName(TapName); err == nil {
		t.Fatal("tap0 in the host namespace")
	}
	// The host table is rewritten by the next Create when it was lost
	// (say, to `nft flush ruleset`), and only then.
	c, _ := nftables.New()
	if ok, err := hostTableCurrent(c, m.opts.Prefix, m.opts.Network); !ok || err != nil {
		t.Fatalf("host table not current: %v", err)
	}
	c.DelTable(hostTable(m.opts.Prefix))
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	mustCreate(t, m, 8, DefaultPolicy)
	if ok, err := hostTableCurrent(c, m.opts.Prefix, m.opts.Network); !ok || err != nil {
		t.Fatalf("host table not restored: %v", err)
	}
	for _, s := range []int{7, 8} {
		if err := m.Destroy(context.Background(), s); err != nil {
			t.Fatal(err)
		}
	}
	assertNothingLeft(t, m)
}

// TestStartIn starts a process in a slot's namespace and, through the
// extra step, in a cgroup, the way a VMM is started; the caller's own
// thread stays where it was.
func TestStartIn(t *testing.T) {
	setupWorld(t)
	t.Parallel()
	m := testManager(t, "fdtd", "10.180.64.0/20", false)
	n := mustCreate(t, m, 1, DefaultPolicy)
	cg, err := cgroup.New(cgroup.Options{Parent: fmt.Sprintf("forkd-netns-test-%d", os.Getpid())})
	if err != nil {
		t.Fatal(err)
	}
	g, err := cg.Create("vmm", cgroup.Limits{MemoryMiB: 64, PIDs: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := g.Destroy(); err != nil {
			t.Error(err)
		}
		for _, p := range g.Placement().Procs {
			os.Remove(filepath.Dir(filepath.Dir(p))) // the test's parent
		}
	}()
	pl := g.Placement()
	cmd := exec.Command("sleep", "30")
	if pl.CgroupFD >= 0 {
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: pl.CgroupFD}
	}
	before := nsInode(t, "/proc/thread-self/ns/net")
	if err := launch.Start(n.NetNSPath, cmd, func() (func() error, error) { return cg.EnterProcs(pl.Procs) }); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	if got, want := nsInode(t, fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid)), nsInode(t, n.NetNSPath); got != want {
		t.Fatalf("process in netns %d, want %d", got, want)
	}
	if nsInode(t, "/proc/thread-self/ns/net") != before || nsInode(t, "/proc/self/ns/net") != before {
		t.Fatalf("caller left its namespace: before %d thread %d self %d", before, nsInode(t, "/proc/thread-self/ns/net"), nsInode(t, "/proc/self/ns/net"))
	}
	self, _ := os.ReadFile("/proc/self/cgroup")
	child, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", cmd.Process.Pid))
	if !strings.Contains(string(child), "/vmm\n") || strings.Contains(string(self), "/vmm\n") {
		t.Fatalf("child cgroups:\n%s\nours:\n%s", child, self)
	}
	// A failing step undoes the namespace and starts nothing.
	bad := exec.Command("true")
	if err := launch.Start(n.NetNSPath, bad, func() (func() error, error) { return nil, errInjected }); !errors.Is(err, errInjected) || bad.Process != nil {
		t.Fatalf("StartIn with failing step: %v", err)
	}
	if err := launch.Start("/nonexistent/netns", exec.Command("true")); !errdefs.IsNotFound(err) {
		t.Fatalf("StartIn in a missing netns: %v", err)
	}
	// The VMM can also be handed the tap instead of joining the namespace.
	tap, err := OpenTap(n.NetNSPath)
	if err != nil {
		t.Fatal(err)
	}
	defer tap.Close()
	h, err := netlink.NewHandleAt(must(vnetns.GetFromPath(n.NetNSPath)), unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	l, err := h.LinkByName(TapName)
	if err != nil || l.Attrs().RawFlags&unix.IFF_LOWER_UP == 0 {
		t.Fatalf("tap has no carrier with a queue attached: %v %v", l, err)
	}
}

func TestProbe(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	// Probe makes dir a shared mount point, and may have done so before it
	// fails; undo it whatever happens, before TempDir's cleanup (cleanups
	// run last registered first). Unmounting a dir that is not a mount
	// point fails harmlessly.
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	if err := Probe(context.Background(), dir); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("probe left %v", ents)
	}
}

// TestQEMUAttaches starts a real QEMU (paused, no guest) on a slot's tap:
// once inside the namespace through StartIn, once unprivileged and outside
// it, handed the tap with OpenTap. Both must attach (the tap's carrier
// comes up), which checks that the tap's flags suit QEMU.
func TestQEMUAttaches(t *testing.T) {
	setupWorld(t)
	qemu := testutil.RequireCommand(t, "qemu-system-x86_64")
	t.Parallel()
	m := testManager(t, "fdte", "10.180.80.0/20", false)
	n := mustCreate(t, m, 3, DefaultPolicy)
	ns := must(vnetns.GetFromPath(n.NetNSPath))
	defer ns.Close()
	h := must(netlink.NewHandleAt(ns, unix.NETLINK_ROUTE))
	defer h.Close()
	carrier := func() bool {
		l, err := h.LinkByName(TapName)
		return err == nil && l.Attrs().RawFlags&unix.IFF_LOWER_UP != 0
	}
	// running reports whether cmd's process still runs. Neither signal 0
	// nor ProcessState can tell: our unwaited child lingers as a zombie,
	// which signal 0 still reaches, and ProcessState is set only by Wait.
	// proc.Alive counts a zombie as exited.
	running := func(cmd *exec.Cmd) bool {
		id, err := proc.Self(cmd.Process.Pid)
		return err == nil && proc.Alive(id)
	}
	waitCarrier := func(cmd *exec.Cmd, log *strings.Builder) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if carrier() {
				return
			}
			if !running(cmd) {
				break
			}
		}
		t.Fatalf("QEMU never attached to %s; its output: %s", TapName, log.String())
	}
	stop := func(cmd *exec.Cmd) {
		cmd.Process.Kill()
		cmd.Wait()
		for deadline := time.Now().Add(5 * time.Second); carrier() && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		if carrier() {
			t.Fatal("carrier stays up after QEMU exited")
		}
	}
	if carrier() {
		t.Fatal("tap has a carrier before any VMM attached")
	}
	args := []string{"-M", "q35", "-m", "64", "-nodefaults", "-no-user-config", "-display", "none", "-S", "-accel", "tcg",
		"-device", "virtio-net-pci,netdev=n0,mac=" + GuestMAC}

	var log1 strings.Builder
	inside := exec.Command(qemu, append(args, "-netdev", "tap,id=n0,ifname="+TapName+",script=no,downscript=no")...)
	inside.Stdout, inside.Stderr = &log1, &log1
	if err := launch.Start(n.NetNSPath, inside); err != nil {
		t.Fatal(err)
	}
	waitCarrier(inside, &log1)
	stop(inside)

	tap, err := OpenTap(n.NetNSPath)
	if err != nil {
		t.Fatal(err)
	}
	var log2 strings.Builder
	outside := exec.Command(qemu, append(args, "-netdev", "tap,id=n0,fd=3")...)
	outside.ExtraFiles = []*os.File{tap}
	outside.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	outside.Stdout, outside.Stderr = &log2, &log2
	if err := outside.Start(); err != nil {
		t.Fatal(err)
	}
	tap.Close()
	waitCarrier(outside, &log2)
	time.Sleep(200 * time.Millisecond)
	if !running(outside) {
		t.Fatalf("unprivileged QEMU exited: %s", log2.String())
	}
	stop(outside)
}
