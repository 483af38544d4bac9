package cgroup

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// DeviceOf returns the whole-disk block device (major, minor) that holds
// path, the device IO limits name: for a file system on a partition, the
// disk the partition is on (blkio throttling applies to disks).
func DeviceOf(path string) (major, minor uint32, err error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, 0, fmt.Errorf("device of %s: %w", path, err)
	}
	major, minor = unix.Major(st.Dev), unix.Minor(st.Dev)
	sys := fmt.Sprintf("/sys/dev/block/%d:%d", major, minor)
	if _, err := os.Stat(sys); err != nil {
		return 0, 0, fmt.Errorf("device of %s: %d:%d is not a block device (a virtual file system?)", path, major, minor)
	}
	if !exists(sys, "partition") {
		return major, minor, nil // a whole disk
	}
	// /sys/dev/block/M:m links to the partition's dir inside its disk's.
	part, err := filepath.EvalSymlinks(sys)
	if err != nil {
		return 0, 0, fmt.Errorf("disk of partition %d:%d: %w", major, minor, err)
	}
	b, err := os.ReadFile(filepath.Join(filepath.Dir(part), "dev"))
	if err != nil {
		return 0, 0, fmt.Errorf("disk of partition %d:%d: %w", major, minor, err)
	}
	if _, err := fmt.Sscanf(strings.TrimSpace(string(b)), "%d:%d", &major, &minor); err != nil {
		return 0, 0, fmt.Errorf("disk of partition: %q: %w", b, err)
	}
	return major, minor, nil
}
