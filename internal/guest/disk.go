package guest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/mountinfo"
)

// attachDisk moves the root's writable layer onto disk d (InitRequest.Disk)
// unless it is there already, and takes the warm interpreter along. A
// restored guest whose memory says its root is on d already (a child of a
// branch of a sandbox with a disk) has nothing to do: its disk holds, copy
// on write, what the branched guest's held.
func (a *Agent) attachDisk(ctx context.Context, d proto.Disk) error {
	if d.Serial == "" || d.MiB <= 0 {
		return errdefs.InvalidArgument("init: disk %+v: want a serial and a size", d)
	}
	a.diskMu.Lock()
	defer a.diskMu.Unlock()
	if a.disk != nil {
		if *a.disk == d {
			return nil
		}
		return errdefs.FailedPrecondition("init: the root is on disk %s of %d MiB already, not %s of %d MiB", a.disk.Serial, a.disk.MiB, d.Serial, d.MiB)
	}
	// The interpreter's working directory is on the old root: pivot_root
	// moves only processes whose working directory is the root itself.
	pyDir := a.py.workDir()
	if err := a.sys.AttachDisk(d); err != nil {
		return sysError("attach disk", err)
	}
	a.disk = &d
	if pyDir != "" {
		if err := a.py.chdir(ctx, pyDir); err != nil {
			a.log.Warn("the interpreter stays in the old root's directory", "dir", pyDir, "err", err)
		}
	}
	a.log.Info("root on disk", "serial", d.Serial, "mib", d.MiB)
	return nil
}

// sysBlock is where the kernel lists block devices.
const sysBlock = "/sys/block"

// attachDiskRoot is the real System.AttachDisk: find the disk by its
// serial, wait until the kernel knows its full size (the host resizes it
// after a restore, and the guest learns it from a configuration change),
// drop what the kernel cached of it while it was a placeholder, and make
// it the upper layer of a new overlay over the current root.
func attachDiskRoot(d proto.Disk) error {
	name, err := findDisk(sysBlock, d.Serial)
	if err != nil {
		return err
	}
	if err := waitCapacity(filepath.Join(sysBlock, name, "size"), uint64(d.MiB)<<20, 10*time.Second); err != nil {
		return err
	}
	dev := "/dev/" + name
	if err := flushBuffers(dev); err != nil {
		return err
	}
	return moveRootOnto(dev)
}

// findDisk returns the name (vdb) of the block device whose serial is
// serial.
func findDisk(sysBlock, serial string) (string, error) {
	entries, err := os.ReadDir(sysBlock)
	if err != nil {
		return "", err
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(sysBlock, e.Name(), "serial"))
		if err == nil && strings.TrimSpace(string(b)) == serial {
			return e.Name(), nil
		}
	}
	return "", errdefs.NotFound("no disk with serial %q", serial)
}

// waitCapacity polls a /sys/block/<dev>/size file (512-byte sectors)
// until it says at least bytes, for up to timeout.
func waitCapacity(sizeFile string, bytes uint64, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		b, err := os.ReadFile(sizeFile)
		if err != nil {
			return err
		}
		sectors, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			return fmt.Errorf("%s: %w", sizeFile, err)
		}
		if sectors*512 >= bytes {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("disk %s: %d bytes after %v, want %d", sizeFile, sectors*512, timeout, bytes)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// flushBuffers drops the kernel's cache of a block device (BLKFLSBUF):
// the guest read the placeholder's blocks when it booted, and would read
// them again instead of the file system now behind the device.
func flushBuffers(dev string) error {
	f, err := os.Open(dev)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), unix.BLKFLSBUF, 0); err != nil {
		return fmt.Errorf("flush %s: %w", dev, err)
	}
	return nil
}

// moveRootOnto mounts the ext4 file system on dev, stacks a new overlay
// over the current root with its upper layer on that file system, moves
// every mount of the current root into it, and pivots into it: every
// process whose root or working directory is the root moves along, and
// from then on writes to the root file system go to dev. The mounts of
// the current root (/proc, /sys, /dev, /tmp, /run, ...) keep what they
// hold: /tmp, /run and /dev/shm stay in RAM.
func moveRootOnto(dev string) (err error) {
	stage, err := os.MkdirTemp("/", ".forkd-disk-")
	if err != nil {
		return err
	}
	var mounted []string // to undo, last first
	defer func() {
		if err == nil {
			return
		}
		for i := len(mounted) - 1; i >= 0; i-- {
			_ = unix.Unmount(mounted[i], unix.MNT_DETACH)
		}
		os.Remove(stage)
	}()
	if err := unix.Mount("tmpfs", stage, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=64k,mode=0700"); err != nil {
		return fmt.Errorf("mount a staging tmpfs: %w", err)
	}
	mounted = append(mounted, stage)
	disk, root := stage+"/disk", stage+"/root"
	for _, d := range []string{disk, root} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return err
		}
	}
	// noinit_itable: the image was made from zeros; nothing to initialise.
	if err := unix.Mount(dev, disk, "ext4", unix.MS_NOATIME, "noinit_itable"); err != nil {
		return fmt.Errorf("mount %s: %w", dev, err)
	}
	mounted = append(mounted, disk)
	for _, d := range []string{disk + "/upper", disk + "/work"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	opts := "lowerdir=/,upperdir=" + disk + "/upper,workdir=" + disk + "/work"
	if err := unix.Mount("overlay", root, "overlay", 0, opts); err != nil {
		return fmt.Errorf("mount overlay over the root: %w", err)
	}
	mounted = append(mounted, root)
	tops, err := topMounts("/proc/self/mountinfo", stage)
	if err != nil {
		return err
	}
	var moved []string
	for _, m := range tops {
		if err := os.MkdirAll(root+m, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m, root+m, "", unix.MS_MOVE, ""); err != nil {
			for i := len(moved) - 1; i >= 0; i-- {
				_ = unix.Mount(root+moved[i], moved[i], "", unix.MS_MOVE, "")
			}
			return fmt.Errorf("move %s into the new root: %w", m, err)
		}
		moved = append(moved, m)
	}
	if err := os.Chdir(root); err != nil {
		return err
	}
	// pivot_root(".", "."): the old root ends up over the new one, and is
	// detached from there. Past this point there is no way back.
	if err := unix.PivotRoot(".", "."); err != nil {
		for i := len(moved) - 1; i >= 0; i-- {
			_ = unix.Mount(root+moved[i], moved[i], "", unix.MS_MOVE, "")
		}
		_ = os.Chdir("/")
		return fmt.Errorf("pivot_root: %w", err)
	}
	mounted = nil
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the old root: %w", err)
	}
	if err := os.Chdir("/"); err != nil {
		return err
	}
	// The staging directory shows through from the lower layer: hide it.
	_ = os.Remove("/" + filepath.Base(stage))
	return nil
}

// topMounts returns the mount points of the mount table at path that sit
// directly on the root, not on another of them, but for skip and what is
// below it.
func topMounts(path, skip string) ([]string, error) {
	ms, err := mountinfo.ParseFile(path)
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	var all []string
	for _, m := range ms {
		p := m.MountPoint
		if p == "/" || p == skip || strings.HasPrefix(p, skip+"/") || seen[p] {
			continue
		}
		seen[p] = true
		all = append(all, p)
	}
	sort.Strings(all) // a mount point sorts before those below it
	kept := map[string]bool{}
	var out []string
	for _, p := range all {
		below := false
		for d := filepath.Dir(p); d != "/" && d != "."; d = filepath.Dir(d) {
			below = below || kept[d]
		}
		if below {
			continue // it moves with the mount it is on
		}
		kept[p] = true
		out = append(out, p)
	}
	if len(out) == 0 {
		return nil, errors.New("no mounts on the root: not the agent's root")
	}
	return out, nil
}
