package guest

import (
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func threadSlack(t *testing.T, tid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/timerslack_ns", tid))
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// relaxSysmon changes the slack of the runtime's first thread only.
func TestRelaxSysmon(t *testing.T) {
	tid, err := sysmonThread()
	if err != nil {
		t.Fatal(err)
	}
	before, main := threadSlack(t, tid), threadSlack(t, os.Getpid())
	t.Cleanup(func() {
		os.WriteFile(fmt.Sprintf("/proc/%d/timerslack_ns", tid), []byte(strconv.FormatInt(before, 10)), 0)
	})
	got, err := relaxSysmon(3 * time.Millisecond)
	if err != nil || got != tid {
		t.Fatalf("relaxSysmon = %d, %v; want thread %d", got, err, tid)
	}
	if s := threadSlack(t, tid); s != 3e6 {
		t.Errorf("sysmon's slack %d ns, want 3e6", s)
	}
	if s := threadSlack(t, os.Getpid()); s != main {
		t.Errorf("the main thread's slack went from %d to %d ns", main, s)
	}
}

// A child inherits the slack of the thread that forks it; forkWithSlack
// gives it the one asked for instead.
func TestForkWithSlack(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	// This thread stands for one that sysmon started: a relaxed slack.
	if err := unix.Prctl(unix.PR_SET_TIMERSLACK, 3e6, 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	defer unix.Prctl(unix.PR_SET_TIMERSLACK, uintptr(defaultTimerSlack.Nanoseconds()), 0, 0, 0)
	childSlack := func(slackNS int64) string {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		attr := &syscall.ProcAttr{Files: []uintptr{0, w.Fd(), 2}}
		pid, err := forkWithSlack(func() (int, error) {
			return syscall.ForkExec("/bin/cat", []string{"cat", "/proc/self/timerslack_ns"}, attr)
		}, slackNS)
		w.Close()
		if err != nil {
			t.Fatal(err)
		}
		out, _ := io.ReadAll(r)
		var ws syscall.WaitStatus
		syscall.Wait4(pid, &ws, 0, nil)
		return strings.TrimSpace(string(out))
	}
	if got := childSlack(0); got != "3000000" {
		t.Errorf("child forked as it is: slack %q, want the thread's 3000000", got)
	}
	if got := childSlack(defaultTimerSlack.Nanoseconds()); got != "50000" {
		t.Errorf("child forked with the default: slack %q, want 50000", got)
	}
}
