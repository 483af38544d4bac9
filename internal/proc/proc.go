// Package proc identifies host processes without trusting a pid alone.
//
// A pid is reused by the kernel once its process is reaped, so forkd records
// every VMM as an Identity: pid plus the process start time (field 22 of
// /proc/PID/stat, in clock ticks since boot). Open turns an Identity into a
// pidfd after checking the start time, so a signal sent through the returned
// Process can only reach the process that was recorded.
package proc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
)

// Identity names one process for its whole life.
type Identity struct {
	PID       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
}

// Root is the proc filesystem to read; tests may point it elsewhere.
var Root = "/proc"

// StartTime returns the start time of pid in clock ticks since boot.
// It fails with a NotFound-class error when the process does not exist.
func StartTime(pid int) (uint64, error) {
	data, err := readStat(pid)
	if err != nil {
		return 0, err
	}
	return parseStartTime(data)
}

// userHZ is the unit of /proc's CPU times: USER_HZ, 100 on every Linux
// architecture's ABI.
const userHZ = 100

// CPUTime returns the CPU time (user and system, all threads) the process
// named by id has used, to 1/100 s. It fails with a NotFound-class error
// when that process has exited, even if its pid now names another.
func CPUTime(id Identity) (time.Duration, error) {
	data, err := readStat(id.PID)
	if err != nil {
		return 0, err
	}
	f, err := statFields(data, 22)
	if err != nil {
		return 0, err
	}
	if st, err := strconv.ParseUint(string(f[22-3]), 10, 64); err != nil || st != id.StartTime {
		return 0, errExited(id.PID)
	}
	// utime and stime are fields 14 and 15.
	u, err1 := strconv.ParseUint(string(f[14-3]), 10, 64)
	s, err2 := strconv.ParseUint(string(f[15-3]), 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, fmt.Errorf("malformed stat line: %w", err)
	}
	return time.Duration(u+s) * (time.Second / userHZ), nil
}

// readStat reads /proc/PID/stat.
func readStat(pid int) ([]byte, error) {
	data, err := os.ReadFile(filepath.Join(Root, strconv.Itoa(pid), "stat"))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
			return nil, errdefs.NotFound("process %d does not exist", pid)
		}
		return nil, err
	}
	return data, nil
}

// statFields splits a /proc/PID/stat line from field 3 (state) on, and
// checks that it reaches field last. The command name (field 2) may hold
// spaces and parentheses, so fields are counted from the last ')'.
func statFields(stat []byte, last int) ([][]byte, error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return nil, fmt.Errorf("malformed stat line")
	}
	fields := bytes.Fields(stat[i+1:])
	if len(fields) <= last-3 {
		return nil, fmt.Errorf("malformed stat line: %d fields", len(fields))
	}
	return fields, nil
}

// parseStartTime extracts field 22 of a /proc/PID/stat line.
func parseStartTime(stat []byte) (uint64, error) {
	f, err := statFields(stat, 22)
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(string(f[22-3]), 10, 64)
}

// Self returns the identity of pid as it is now.
func Self(pid int) (Identity, error) {
	st, err := StartTime(pid)
	if err != nil {
		return Identity{}, err
	}
	return Identity{PID: pid, StartTime: st}, nil
}

// Process is an open handle on a live process. It must be closed.
type Process struct {
	id Identity
	fd int
}

// Open returns a handle on the process named by id. It fails with a
// NotFound-class error when that process has exited (even if its pid now
// belongs to another process).
func Open(id Identity) (*Process, error) {
	if id.PID <= 0 {
		return nil, errdefs.InvalidArgument("invalid pid %d", id.PID)
	}
	fd, err := unix.PidfdOpen(id.PID, 0)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return nil, errExited(id.PID)
		}
		return nil, fmt.Errorf("pidfd_open %d: %w", id.PID, err)
	}
	// The pidfd now pins this pid to one process; check it is ours.
	st, err := StartTime(id.PID)
	if err != nil || st != id.StartTime {
		unix.Close(fd)
		return nil, errExited(id.PID)
	}
	if exited(fd) {
		unix.Close(fd)
		return nil, errExited(id.PID)
	}
	return &Process{id: id, fd: fd}, nil
}

// Alive reports whether the process named by id is still running (a zombie
// counts as exited).
func Alive(id Identity) bool {
	p, err := Open(id)
	if err != nil {
		return false
	}
	p.Close()
	return true
}

// Identity returns the identity the handle was opened for.
func (p *Process) Identity() Identity { return p.id }

// Signal sends sig to the process. Signalling an exited process is not an
// error.
func (p *Process) Signal(sig syscall.Signal) error {
	err := unix.PidfdSendSignal(p.fd, sig, nil, 0)
	if errors.Is(err, unix.ESRCH) {
		return nil
	}
	return err
}

// Wait blocks until the process exits or ctx ends. It does not reap: the
// parent (if it is us) reaps separately.
func (p *Process) Wait(ctx context.Context) error {
	for {
		if exited(p.fd) {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		fds := []unix.PollFd{{Fd: int32(p.fd), Events: unix.POLLIN}}
		_, err := unix.Poll(fds, 50)
		if err != nil && !errors.Is(err, unix.EINTR) {
			return fmt.Errorf("poll pidfd: %w", err)
		}
	}
}

// Close releases the handle.
func (p *Process) Close() error { return unix.Close(p.fd) }

// errExited is the NotFound-class error of an operation on process pid
// once it has exited.
func errExited(pid int) error { return errdefs.NotFound("process %d has exited", pid) }

// gone returns err, or errExited if the process has exited meanwhile (and
// so caused err).
func (p *Process) gone(err error) error {
	if exited(p.fd) {
		return errExited(p.id.PID)
	}
	return err
}

// exited reports whether the pidfd is readable, which it becomes when the
// process exits (zombies included).
func exited(fd int) bool {
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n > 0 && fds[0].Revents&unix.POLLIN != 0
}

// Kill sends SIGKILL to the process named by id and waits until it has
// exited. A process that is already gone is not an error. If the process is
// our child, the caller still has to reap it.
func Kill(ctx context.Context, id Identity) error {
	p, err := Open(id)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return nil
		}
		return err
	}
	defer p.Close()
	if err := p.Signal(syscall.SIGKILL); err != nil {
		return fmt.Errorf("kill %d: %w", id.PID, err)
	}
	return p.Wait(ctx)
}
