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

	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/cgroup"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

// TestStartIn starts a process in a slot's namespace and, through the
// extra step, in a cgroup, the way a VMM is started; the caller's own
// thread stays where it was.
func TestStartIn(t *testing.T) {
	setupWorld(t)
	t.Parallel()
	m := testManager(t, "fdtd", "10.201.64.0/20", false)
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
	if err := StartIn(n.NetNSPath, cmd, func() (func() error, error) { return cg.EnterProcs(pl.Procs) }); err != nil {
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
	if err := StartIn(n.NetNSPath, bad, func() (func() error, error) { return nil, errInjected }); !errors.Is(err, errInjected) || bad.Process != nil {
		t.Fatalf("StartIn with failing step: %v", err)
	}
	if err := StartIn("/nonexistent/netns", exec.Command("true")); !errdefs.IsNotFound(err) {
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
	if err := Probe(context.Background(), dir); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("probe left %v", ents)
	}
	// dir was made a shared mount point; undo it for TempDir's cleanup.
	unix.Unmount(dir, unix.MNT_DETACH)
}
