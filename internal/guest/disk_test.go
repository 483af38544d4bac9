package guest

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

func TestTopMounts(t *testing.T) {
	// The mount table of a guest whose root is an overlay: the initramfs
	// is not in it (outside the agent's root), cgroup2 sits on /sys, two
	// mounts share /dev, and the disk's staging tmpfs is to be left.
	table := `25 1 0:23 / / rw,relatime - overlay overlay rw,lowerdir=/mnt/lower
26 25 0:5 / /proc rw - proc proc rw
27 25 0:20 / /sys rw - sysfs sysfs rw
28 25 0:6 / /dev rw - devtmpfs devtmpfs rw,size=1024k
29 28 0:24 / /dev/pts rw - devpts devpts rw
30 25 0:22 /tmp /tmp rw - tmpfs tmpfs rw
31 25 0:22 /run /run rw - tmpfs tmpfs rw
32 28 0:22 /shm /dev/shm rw - tmpfs tmpfs rw
33 27 0:25 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw
34 25 0:26 / /dev-extra rw - tmpfs tmpfs rw
35 28 0:27 / /dev rw - tmpfs tmpfs rw
36 25 0:28 / /.forkd-disk-1 rw - tmpfs tmpfs rw
37 36 254:16 / /.forkd-disk-1/disk rw - ext4 /dev/vdb rw
`
	p := filepath.Join(t.TempDir(), "mountinfo")
	testutil.WriteFile(t, p, []byte(table), 0o600)
	got, err := topMounts(p, "/.forkd-disk-1")
	testutil.Check(t, err)
	want := []string{"/dev", "/dev-extra", "/proc", "/run", "/sys", "/tmp"}
	if !slices.Equal(got, want) {
		t.Fatalf("topMounts = %v, want %v", got, want)
	}
	testutil.WriteFile(t, p, []byte("25 1 0:23 / / rw - overlay overlay rw\n"), 0o600)
	if _, err := topMounts(p, "/x"); err == nil {
		t.Fatal("a root with no mounts on it accepted")
	}
}

func TestFindDisk(t *testing.T) {
	sys := t.TempDir()
	for name, serial := range map[string]string{"vda": "", "vdb": "forkd-scratch\n", "loop0": "x"} {
		testutil.MkdirAll(t, filepath.Join(sys, name), 0o755)
		if serial != "" {
			testutil.WriteFile(t, filepath.Join(sys, name, "serial"), []byte(serial), 0o644)
		}
		testutil.WriteFile(t, filepath.Join(sys, name, "size"), []byte("2048\n"), 0o644)
	}
	if got, err := findDisk(sys, "forkd-scratch"); err != nil || got != "vdb" {
		t.Fatalf("findDisk = %q, %v", got, err)
	}
	if _, err := findDisk(sys, "nope"); !errdefs.IsNotFound(err) {
		t.Fatalf("findDisk of a missing serial = %v", err)
	}
	size := filepath.Join(sys, "vdb", "size")
	if err := waitCapacity(size, 1<<20, time.Second); err != nil {
		t.Fatalf("waitCapacity of 1 MiB on 2048 sectors: %v", err)
	}
	go func() {
		time.Sleep(50 * time.Millisecond)
		// Whole at once, as sysfs shows it: a rewrite in place could be
		// read empty between its truncation and its write.
		_ = os.WriteFile(size+".new", []byte("131072\n"), 0o644)
		_ = os.Rename(size+".new", size)
	}()
	if err := waitCapacity(size, 64<<20, 5*time.Second); err != nil {
		t.Fatalf("waitCapacity after a resize: %v", err)
	}
	if err := waitCapacity(size, 128<<20, 50*time.Millisecond); err == nil {
		t.Fatal("waitCapacity beyond the size returned")
	}
}
