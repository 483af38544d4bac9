package proc

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// Background and Normal are the scheduling classes SetSched and
// SchedThread give: SCHED_IDLE (a thread runs only on CPU nothing else
// wants, and any other thread that wakes preempts it) and SCHED_OTHER at
// nice 0.
var (
	Background = unix.SchedAttr{Policy: unix.SCHED_IDLE}
	Normal     = unix.SchedAttr{Policy: unix.SCHED_NORMAL}
)

// SetSched gives every thread of the process named by id the scheduling
// class attr (Linux keeps one per thread; threads it starts later inherit
// their starter's). Leaving SCHED_IDLE needs CAP_SYS_NICE. A thread that
// exits meanwhile is skipped.
func SetSched(id Identity, attr unix.SchedAttr) error {
	p, err := Open(id)
	if err != nil {
		return err
	}
	defer p.Close()
	tids, err := tasks(id.PID)
	if err != nil {
		return err
	}
	for _, tid := range tids {
		a := attr
		if err := unix.SchedSetAttr(tid, &a, 0); err != nil && !errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("scheduling class of thread %d: %w", tid, err)
		}
	}
	return nil
}

// tasks returns the thread ids of pid.
func tasks(pid int) ([]int, error) {
	ents, err := os.ReadDir(filepath.Join(Root, strconv.Itoa(pid), "task"))
	if err != nil {
		return nil, fmt.Errorf("threads of %d: %w", pid, err)
	}
	var tids []int
	for _, e := range ents {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, tid)
		}
	}
	return tids, nil
}

// SchedThread gives the calling OS thread (locked to its goroutine by
// the caller) the scheduling class attr, which a process it forks
// inherits, and returns how to give the thread its old class back (which
// needs CAP_SYS_NICE after SCHED_IDLE).
func SchedThread(attr unix.SchedAttr) (restore func() error, err error) {
	old, err := unix.SchedGetAttr(0, 0)
	if err != nil {
		return nil, fmt.Errorf("scheduling class of this thread: %w", err)
	}
	if err := unix.SchedSetAttr(0, &attr, 0); err != nil {
		return nil, fmt.Errorf("scheduling class: %w", err)
	}
	return func() error { return unix.SchedSetAttr(0, old, 0) }, nil
}

// Signal sends sig to the process named by id; it fails with a
// NotFound-class error when that process has exited.
func Signal(id Identity, sig syscall.Signal) error {
	p, err := Open(id)
	if err != nil {
		return err
	}
	defer p.Close()
	return p.Signal(sig)
}

// Memory returns the host's MemAvailable and MemTotal in bytes, from
// meminfo.
func Memory() (avail, total uint64, err error) {
	kv, err := meminfo("MemAvailable:", "MemTotal:")
	if err == nil && kv[1] == 0 {
		err = fmt.Errorf("%s/meminfo: no MemTotal", Root)
	}
	return kv[0], kv[1], err
}

// meminfo returns the named fields of /proc/meminfo (with their colons),
// in bytes; a field not there is 0.
func meminfo(names ...string) ([]uint64, error) {
	out := make([]uint64, len(names))
	b, err := os.ReadFile(filepath.Join(Root, "meminfo"))
	if err != nil {
		return out, err
	}
	for line := range bytes.Lines(b) {
		f := bytes.Fields(line)
		if len(f) < 2 {
			continue
		}
		i := slices.Index(names, string(f[0]))
		if i < 0 {
			continue
		}
		if n, err := strconv.ParseUint(string(f[1]), 10, 64); err == nil {
			out[i] = n << 10
		}
	}
	return out, nil
}
