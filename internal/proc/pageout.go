package proc

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"unsafe"

	"github.com/forkd/forkd/internal/errdefs"
	"golang.org/x/sys/unix"
)

// PageOut asks the kernel to reclaim the private memory of the process
// named by id now (process_madvise MADV_PAGEOUT over each of its private
// mappings): its anonymous pages go to swap, its file pages mapped by it
// alone are dropped; pages it shares are left alone. The process need not
// run (a frozen one is fine) and loses nothing: what it touches again
// faults back in. Without swap only file pages go. It returns how much of
// the process is in swap afterwards, in bytes. The caller needs
// CAP_SYS_NICE and ptrace read access to the process (root).
func PageOut(id Identity) (swapped int64, err error) {
	p, err := Open(id)
	if err != nil {
		return 0, err
	}
	defer p.Close()
	// The pidfd pins the pid: the maps read below are this process's.
	maps, err := os.ReadFile(filepath.Join(Root, strconv.Itoa(id.PID), "maps"))
	if err != nil {
		return 0, err
	}
	var errs []error
	for _, m := range privateMappings(maps) {
		// An address in the other process: a struct iovec of plain
		// integers, never a Go pointer.
		iov := [2]uint64{m.start, m.end - m.start}
		// Each mapping alone: the kernel stops a vector at the first
		// range it cannot advise (one unmapped meanwhile).
		_, _, e := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(p.fd), uintptr(unsafe.Pointer(&iov)), 1, unix.MADV_PAGEOUT, 0, 0)
		switch e {
		case 0, unix.EINVAL, unix.ENOMEM:
			// EINVAL: a mapping the advice does not apply to (locked,
			// PFN maps); ENOMEM: unmapped since maps was read.
		case unix.ESRCH:
			return 0, errdefs.NotFound("process %d has exited", id.PID)
		default:
			errs = append(errs, fmt.Errorf("page out %d %#x-%#x: %w", id.PID, m.start, m.end, e))
			if len(errs) >= 3 {
				return 0, errors.Join(errs...)
			}
		}
	}
	if len(errs) > 0 {
		return 0, errors.Join(errs...)
	}
	return SwapBytes(id.PID)
}

// SwapBytes returns how much of process pid is in swap (VmSwap).
func SwapBytes(pid int) (int64, error) { return statusKiB(pid, "VmSwap:") }

// mapping is one line of /proc/PID/maps.
type mapping struct{ start, end uint64 }

// privateMappings returns the private (copy-on-write) mappings in a
// /proc/PID/maps text.
func privateMappings(maps []byte) []mapping {
	var out []mapping
	for line := range bytes.Lines(maps) {
		f := bytes.Fields(line)
		if len(f) < 2 || len(f[1]) != 4 || f[1][3] != 'p' {
			continue
		}
		lo, hi, ok := bytes.Cut(f[0], []byte("-"))
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(string(lo), 16, 64)
		end, err2 := strconv.ParseUint(string(hi), 16, 64)
		// The top half is the kernel's ([vsyscall]).
		if err1 != nil || err2 != nil || end <= start || end > 1<<63 {
			continue
		}
		out = append(out, mapping{start, end})
	}
	return out
}

// statusKiB returns a "Name:  N kB" field of /proc/PID/status, in bytes.
func statusKiB(pid int, name string) (int64, error) {
	f, err := os.Open(filepath.Join(Root, strconv.Itoa(pid), "status"))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		rest, ok := bytes.CutPrefix(s.Bytes(), []byte(name))
		if !ok {
			continue
		}
		fs := bytes.Fields(rest)
		if len(fs) == 0 {
			break
		}
		n, err := strconv.ParseInt(string(fs[0]), 10, 64)
		if err != nil {
			break
		}
		return n << 10, nil
	}
	return 0, fmt.Errorf("%s/%d/status: no %s", Root, pid, name)
}

// Swap returns the host's SwapTotal and SwapFree in bytes, from meminfo.
func Swap() (total, free uint64, err error) {
	kv, err := meminfo("SwapTotal:", "SwapFree:")
	return kv[0], kv[1], err
}
