package guest

import (
	"bufio"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// How the guest's RAM is shared between the agent and kernel, the
// workload's processes and the in-RAM file systems, so that no workload
// can starve the agent: a guest that fills its memory must still answer.
const (
	// minReserve is the least RAM kept from the workload for the agent and
	// the kernel (page tables, slabs, network and console buffers, the
	// atomic allocations of the virtio console's writes to the host).
	minReserve = 48 << 20
	// devSize caps devtmpfs (/dev), which holds device nodes and no data.
	devSize = 1 << 20
	// CgroupRoot is where PID 1 mounts cgroup2.
	CgroupRoot = "/sys/fs/cgroup"
	// WorkloadCgroup is the cgroup every process the agent starts is born
	// in (exec, background processes, the Python interpreter); the agent
	// itself stays in the root cgroup.
	WorkloadCgroup = CgroupRoot + "/workload"
)

// memBudget is the share-out of a guest's RAM.
type memBudget struct {
	// ram is MemTotal, the RAM the kernel manages.
	ram uint64
	// reserve is kept from the workload: max(48 MiB, 20 % of RAM), at most
	// half of it.
	reserve uint64
	// workload is the workload cgroup's memory.max: ram − reserve. The
	// memory cgroup's OOM killer acts inside it, never on the agent.
	workload uint64
	// files bounds all in-RAM file systems together: 5/8 of workload, so
	// that with every one of them full the workload's processes (the warm
	// interpreter included) still have 3/8 to run in.
	files uint64
	// shared is the one tmpfs that holds the overlay's upper layer (every
	// write to the root file system, /root included), /tmp, /run and
	// /dev/shm: files − devSize.
	shared uint64
	// minFree is vm.min_free_kbytes in bytes: RAM/64, at least the
	// kernel's own default and at most 16 MiB, so atomic allocations find
	// pages under pressure.
	minFree uint64
	// pids is the default pids.max of the workload: one task per 512 KiB
	// of workload, 64 to 4096, so that a fork bomb of shells (~170 KiB a
	// task) meets it long before the memory limit, beside a warm
	// interpreter.
	pids int
}

// newMemBudget shares out ram bytes; minFree0 is the kernel's default
// vm.min_free_kbytes in bytes.
func newMemBudget(ram, minFree0 uint64) memBudget {
	b := memBudget{ram: ram}
	b.reserve = min(max(minReserve, ram/5), ram/2)
	b.workload = ram - b.reserve
	b.files = b.workload / 8 * 5
	b.shared = b.files - min(devSize, b.files/2)
	b.minFree = max(minFree0, min(ram/64, 16<<20))
	b.pids = int(min(max(b.workload/(512<<10), 64), 4096))
	return b
}

// memTotal reads MemTotal from a meminfo file, in bytes.
func memTotal(path string) (uint64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "MemTotal:")
		if !ok {
			continue
		}
		kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%s: MemTotal %q: %w", path, rest, err)
		}
		return kb << 10, nil
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("%s: no MemTotal", path)
}

// bootBudget computes this machine's budget at boot.
func bootBudget() (memBudget, error) {
	ram, err := memTotal("/proc/meminfo")
	if err != nil {
		return memBudget{}, err
	}
	var minFree0 uint64
	if b, err := os.ReadFile("/proc/sys/vm/min_free_kbytes"); err == nil {
		if kb, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64); err == nil {
			minFree0 = kb << 10
		}
	}
	return newMemBudget(ram, minFree0), nil
}

// tmpfsSize is a tmpfs size= option for n bytes, in whole KiB; for 0 (no
// budget) it is empty, leaving the kernel's default.
func tmpfsSize(n uint64) string {
	if n>>10 == 0 {
		return ""
	}
	return "size=" + strconv.FormatUint(n>>10, 10) + "k"
}

// applyKernelBudget caps devtmpfs and raises vm.min_free_kbytes. Boot
// only, after /dev is mounted.
func applyKernelBudget(log *slog.Logger, b memBudget) {
	if b.ram == 0 {
		return
	}
	// Mount flags are replaced on remount: keep nosuid.
	if err := unix.Mount("", "/dev", "", unix.MS_REMOUNT|unix.MS_NOSUID, tmpfsSize(min(devSize, b.files/2))); err != nil {
		log.Warn("cap /dev", "err", err)
	}
	if err := os.WriteFile("/proc/sys/vm/min_free_kbytes", []byte(strconv.FormatUint(b.minFree>>10, 10)), 0o644); err != nil {
		log.Warn("vm.min_free_kbytes", "err", err)
	}
}

// setupWorkloadCgroup mounts cgroup2 (unless mounted), enables the memory,
// pids and cpu controllers for the root's children and makes
// WorkloadCgroup with memory.max = b.workload and pids.max = b.pids (init
// sets the sandbox's own). Under the cpu
// controller the workload as a whole weighs what the agent does, so a busy
// workload cannot starve the agent of CPU; without it (logged) the cgroup
// still caps memory and tasks. Boot only.
func setupWorkloadCgroup(log *slog.Logger, b memBudget) error {
	if b.ram == 0 {
		return errors.New("no memory budget")
	}
	if err := os.MkdirAll(CgroupRoot, 0o755); err != nil {
		return err
	}
	err := unix.Mount("cgroup2", CgroupRoot, "cgroup2", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "")
	if err != nil && !errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("mount cgroup2 on %s: %w", CgroupRoot, err)
	}
	ctl := filepath.Join(CgroupRoot, "cgroup.subtree_control")
	for _, c := range []string{"memory", "pids"} {
		if err := os.WriteFile(ctl, []byte("+"+c), 0o644); err != nil {
			return fmt.Errorf("enable the %s controller: %w", c, err)
		}
	}
	if err := os.WriteFile(ctl, []byte("+cpu"), 0o644); err != nil {
		log.Warn("cpu controller", "err", err)
	}
	if err := os.Mkdir(WorkloadCgroup, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	if err := os.WriteFile(filepath.Join(WorkloadCgroup, "memory.max"), []byte(strconv.FormatUint(b.workload, 10)), 0o644); err != nil {
		return fmt.Errorf("memory.max: %w", err)
	}
	return setPIDsMax(WorkloadCgroup, b.pids)
}

// setPIDsMax writes pids.max of cgroup dir.
func setPIDsMax(dir string, n int) error {
	if err := os.WriteFile(filepath.Join(dir, "pids.max"), []byte(strconv.Itoa(n)), 0o644); err != nil {
		return fmt.Errorf("pids.max: %w", err)
	}
	return nil
}
