package guest

import (
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

const (
	// sysmonSlack is the timer slack of the Go runtime's monitor thread
	// in the agent: how much later than asked the kernel may wake it.
	sysmonSlack = 2 * time.Millisecond
	// defaultTimerSlack is the kernel's default, which init, and so the
	// agent as PID 1, starts with.
	defaultTimerSlack = 50 * time.Microsecond
)

// relaxSysmon gives the Go runtime's monitor thread (sysmon) a timer slack
// of slack, so that the kernel may defer its wake-ups by that much, and
// returns that thread's ID.
//
// While any goroutine runs, sysmon sleeps 20 µs between its rounds (it
// retakes processors from blocking system calls and preempts long-running
// goroutines). Each round is a timer interrupt and two context switches:
// next to nothing on hardware, but an emulated guest (TCG) pays tens of
// microseconds of CPU for each. An exec of `true` took some 85 rounds, the
// agent's own threads interleaved with them. Its duties tolerate a 2 ms
// delay: it preempts after 10 ms and polls the network after 10 ms anyway.
//
// The runtime starts sysmon as its first thread, before any package's init,
// so it has the lowest thread ID after the main thread's. Threads it starts
// later inherit its slack, and so would the processes they fork: every
// child of the agent is therefore forked with the default slack
// (forkWithSlack).
func relaxSysmon(slack time.Duration) (tid int, err error) {
	tid, err = sysmonThread()
	if err != nil {
		return 0, err
	}
	path := fmt.Sprintf("/proc/%d/timerslack_ns", tid)
	if err := os.WriteFile(path, []byte(strconv.FormatInt(slack.Nanoseconds(), 10)), 0); err != nil {
		return 0, err
	}
	return tid, nil
}

// sysmonThread returns the ID of the first thread the runtime started: the
// lowest in /proc/self/task other than the main thread's.
func sysmonThread() (int, error) {
	d, err := os.Open("/proc/self/task")
	if err != nil {
		return 0, err
	}
	defer d.Close()
	names, err := d.Readdirnames(-1)
	if err != nil {
		return 0, err
	}
	leader, first := os.Getpid(), 0
	for _, n := range names {
		tid, err := strconv.Atoi(n)
		if err != nil || tid == leader {
			continue
		}
		if first == 0 || tid < first {
			first = tid
		}
	}
	if first == 0 {
		return 0, fmt.Errorf("sysmon: no thread besides the main one in /proc/self/task")
	}
	return first, nil
}

// forkWithSlack runs fork on a thread whose timer slack is slackNS (when
// positive): a child inherits the slack of the thread that forks it. A
// slack that cannot be set is logged, and the child forked all the same.
func forkWithSlack(log *slog.Logger, fork func() (int, error), slackNS int64) (int, error) {
	if slackNS <= 0 {
		return fork()
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.Prctl(unix.PR_SET_TIMERSLACK, uintptr(slackNS), 0, 0, 0); err != nil {
		log.Warn("timer slack of a child", "err", err)
	}
	return fork()
}
