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

	"golang.org/x/sys/unix"
)

// ErrStopped is PageOut's error when its keep function said stop.
var ErrStopped = errors.New("page-out stopped")

// pageOutChunk is the most one process_madvise call is given: the kernel
// advises at most about 2 GiB a call and returns how much it did.
const pageOutChunk = 1 << 30

// PageOut asks the kernel to reclaim the private memory of the process
// named by id now (process_madvise MADV_PAGEOUT over each of its private
// mappings, through a pidfd): its anonymous pages go to swap, and its
// file pages no other process maps leave the page cache. Pages mapped by
// several processes stay. The process need not run (a frozen one is
// fine) and loses nothing: what it touches again faults back in. Without
// swap (or with a cgroup that allows it none) only file pages go.
//
// keep, if not nil, is asked before each mapping and each GiB of one:
// once it returns false PageOut stops with ErrStopped. It returns how
// many bytes of the process went to swap (its VmSwap after, less
// before). It fails with a NotFound-class error once the process has
// exited. The caller needs CAP_SYS_NICE and ptrace read access to the
// process (root); without them, or on a kernel before 5.10, the error
// wraps EPERM or ENOSYS.
func PageOut(id Identity, keep func() bool) (moved int64, err error) {
	p, err := Open(id)
	if err != nil {
		return 0, err
	}
	defer p.Close()
	// Read through the pid: the start time checked by Open says these
	// are the process's until it exits, and then the pidfd calls below
	// fail with ESRCH.
	before, err := SwapBytes(id.PID)
	if err != nil {
		return 0, p.gone(err)
	}
	maps, err := os.ReadFile(filepath.Join(Root, strconv.Itoa(id.PID), "maps"))
	if err != nil {
		return 0, p.gone(err)
	}
	var errs []error
	for _, m := range privateMappings(maps) {
		for off := m.start; off < m.end; {
			if keep != nil && !keep() {
				return 0, ErrStopped
			}
			n := min(m.end-off, pageOutChunk)
			// An address in the other process: a struct iovec of plain
			// integers, never a Go pointer.
			iov := [2]uint64{off, n}
			done, _, e := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(p.fd), uintptr(unsafe.Pointer(&iov)), 1, unix.MADV_PAGEOUT, 0, 0)
			switch e {
			case 0:
				if done > 0 && uint64(done) < n {
					n = uint64(done)
				}
				off += n
				continue
			case unix.EINVAL, unix.ENOMEM:
				// EINVAL: a mapping the advice does not apply to
				// (locked, PFN maps); ENOMEM: unmapped since maps was
				// read.
			case unix.ESRCH:
				return 0, errExited(id.PID)
			case unix.ENOSYS, unix.EPERM, unix.EACCES:
				return 0, fmt.Errorf("page out %d: process_madvise: %w", id.PID, e)
			default:
				errs = append(errs, fmt.Errorf("page out %d %#x-%#x: %w", id.PID, m.start, m.end, e))
				if len(errs) >= 3 {
					return 0, errors.Join(errs...)
				}
			}
			break
		}
	}
	if len(errs) > 0 {
		return 0, errors.Join(errs...)
	}
	after, err := SwapBytes(id.PID)
	if err != nil {
		return 0, p.gone(err)
	}
	return max(after-before, 0), nil
}

// mapping is one line of /proc/PID/maps.
type mapping struct{ start, end uint64 }

// privateMappings returns the private (copy-on-write) mappings in a
// /proc/PID/maps text.
func privateMappings(maps []byte) []mapping {
	var out []mapping
	for _, d := range privateLayout(maps) {
		out = append(out, mapping{d.start, d.start + d.size})
	}
	return out
}

// SwapBytes returns how much of process pid is in swap (VmSwap).
func SwapBytes(pid int) (int64, error) { return statusKiB(pid, "VmSwap:") }

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
