package qemu_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
	"github.com/forkd/forkd/internal/vmm"
)

// qemuImg runs qemu-img and returns its output.
func qemuImg(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("qemu-img", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestDiskSnapshot freezes a running guest's writable qcow2 disk under a
// new overlay (SnapshotDisk), as a branch does, and grows it (ResizeDisk):
// the frozen image keeps what the guest wrote before, the overlay takes
// what it writes after, and its header still names the backing file it
// was made with; DiskSwitched finds the overlay on top. QEMU runs as the
// unprivileged VMM user in its chroot when the test runs as root, as
// forkd runs it.
func TestDiskSnapshot(t *testing.T) {
	be := testvm.Backend(t)
	testutil.RequireCommand(t, "qemu-img")
	img := testvm.Image(t, "minimal")
	dir := t.TempDir()
	ctx := testCtx(t, 5*time.Minute)
	base, top := filepath.Join(dir, "base.raw"), filepath.Join(dir, "top.qcow2")
	testutil.WriteFile(t, base, nil, 0o600)
	testutil.Check(t, os.Truncate(base, 8<<20))
	qemuImg(t, "create", "-q", "-f", "qcow2", "-F", "raw", "-b", base, "-u", top, "8M")
	ro := filepath.Join(dir, "ro.raw")
	testutil.WriteFile(t, ro, make([]byte, 1<<20), 0o600)
	m, err := be.Boot(ctx, vmm.BootSpec{
		Name: "disk" + strconv.Itoa(os.Getpid()), RunDir: filepath.Join(dir, "run"),
		Resources: vmm.Resources{MemoryMiB: 256, VCPUs: 1},
		Kernel:    img.Kernel, Initrd: img.Initrd, Cmdline: img.Cmdline,
		Disks: []vmm.Disk{
			{Path: top, Format: vmm.FormatQCOW2, Serial: "forkd-scratch"},
			{Path: ro, ReadOnly: true},
		},
		ConsoleLog: filepath.Join(dir, "console"),
		Launch:     vmm.Launch{User: testvm.VMMUser()},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stopMachine(t, m)
	c, err := sandbox.DialAgent(ctx, m, agent.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got := sh(t, c, "cat /sys/block/vda/serial"); got != "forkd-scratch" {
		t.Fatalf("vda's serial %q, want forkd-scratch (disks out of order?)", got)
	}
	// The guest writes 1 MiB, then freezes the disk.
	before := sh(t, c, "head -c 1048576 /dev/urandom > /tmp/a && dd if=/tmp/a of=/dev/vda bs=1048576 conv=fsync 2>/dev/null && md5sum < /tmp/a")
	ds := m.(vmm.DiskSnapshotter)
	layer, next := filepath.Join(dir, "layer.qcow2"), filepath.Join(dir, "next.qcow2")
	testutil.Link(t, top, layer)
	qemuImg(t, "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", layer, "-u", next, "8M")
	if err := ds.SnapshotDisk(ctx, 0, next); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("SnapshotDisk of a running machine = %v, want FailedPrecondition", err)
	}
	testutil.Check(t, m.Pause(ctx))
	for _, i := range []int{1, 2, -1} {
		if err := ds.SnapshotDisk(ctx, i, next); !errdefs.IsInvalidArgument(err) {
			t.Errorf("SnapshotDisk of disk %d (read-only or absent) = %v, want InvalidArgument", i, err)
		}
	}
	sw := m.(vmm.DiskSwitchChecker)
	if got, err := sw.DiskSwitched(ctx, 0, next); err != nil || got {
		t.Fatalf("DiskSwitched before SnapshotDisk = %v, %v; want false", got, err)
	}
	t0 := time.Now()
	if err := ds.SnapshotDisk(ctx, 0, next); err != nil {
		t.Fatalf("SnapshotDisk: %v", err)
	}
	t.Logf("SnapshotDisk took %v", time.Since(t0))
	// Asked as a later forkd would: the overlay is the disk's top, and
	// nothing else is.
	if got, err := sw.DiskSwitched(ctx, 0, next); err != nil || !got {
		t.Errorf("DiskSwitched(overlay) = %v, %v; want true", got, err)
	}
	if got, err := sw.DiskSwitched(ctx, 0, filepath.Join(dir, "other.qcow2")); err != nil || got {
		t.Errorf("DiskSwitched(another overlay) = %v, %v; want false", got, err)
	}
	testutil.Check(t, m.Resume(ctx))
	frozen := testutil.FileSHA256(t, layer)

	after := sh(t, c, "head -c 1048576 /dev/urandom > /tmp/b && dd if=/tmp/b of=/dev/vda bs=1048576 conv=fsync 2>/dev/null && md5sum < /tmp/b")
	if got := sh(t, c, "dd if=/dev/vda bs=1048576 count=1 2>/dev/null | md5sum"); got != after {
		t.Fatalf("the guest reads %s back, wrote %s", got, after)
	}
	if err := ds.ResizeDisk(ctx, 0, 16<<20); err != nil {
		t.Fatalf("ResizeDisk: %v", err)
	}
	for deadline := time.Now().Add(30 * time.Second); sh(t, c, "cat /sys/block/vda/size") != "32768"; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the guest sees %s sectors after ResizeDisk to 16 MiB", sh(t, c, "cat /sys/block/vda/size"))
		}
	}
	stopMachine(t, m)

	if testutil.FileSHA256(t, layer) != frozen {
		t.Error("the frozen image changed after SnapshotDisk")
	}
	if info := qemuImg(t, "info", next); !strings.Contains(info, "backing file: "+layer+"\n") {
		t.Errorf("the overlay's backing file was rewritten:\n%s", info)
	}
	for _, c := range []struct{ image, want string }{{layer, before}, {next, after}} {
		raw := c.image + ".raw"
		qemuImg(t, "convert", "-O", "raw", c.image, raw)
		if got := strings.TrimSpace(string(mustOutput(t, "sh", "-c", "head -c 1048576 "+raw+" | md5sum"))); got != c.want {
			t.Errorf("%s holds %s, want %s", filepath.Base(c.image), got, c.want)
		}
	}
}

func mustOutput(t *testing.T, name string, args ...string) []byte {
	t.Helper()
	out, err := exec.Command(name, args...).Output()
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return out
}
