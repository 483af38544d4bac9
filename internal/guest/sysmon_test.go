package guest

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/testutil"
)

// sysmonChildEnv makes the test binary run TestRelaxSysmon's checks itself:
// they change its threads' slack, so they run in a process of their own.
const sysmonChildEnv = "FORKD_TEST_RELAX_SYSMON"

func threadSlack(tid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/timerslack_ns", tid))
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

// relaxSysmon changes the slack of the runtime's first thread only. Another
// thread's slack takes CAP_SYS_NICE to read or write: root tier.
func TestRelaxSysmon(t *testing.T) {
	if os.Getenv(sysmonChildEnv) == "1" {
		relaxSysmonChild(t)
		return
	}
	testutil.RequireRoot(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestRelaxSysmon$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), sysmonChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestRelaxSysmon") {
		t.Fatalf("the test in a process of its own: %v\n%s", err, out)
	}
}

func relaxSysmonChild(t *testing.T) {
	tid, err := sysmonThread()
	if err != nil {
		t.Fatal(err)
	}
	leader, err := threadSlack(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if got, err := relaxSysmon(3 * time.Millisecond); err != nil || got != tid {
		t.Fatalf("relaxSysmon = %d, %v; want thread %d", got, err, tid)
	}
	if s, err := threadSlack(tid); err != nil || s != 3e6 {
		t.Errorf("sysmon's slack %d ns, %v; want 3e6", s, err)
	}
	if s, err := threadSlack(os.Getpid()); err != nil || s != leader {
		t.Errorf("the main thread's slack went from %d to %d ns (%v)", leader, s, err)
	}
}

// A child inherits the slack of the thread that forks it; forkWithSlack
// gives it the one asked for instead.
func TestForkWithSlack(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	was, err := unix.PrctlRetInt(unix.PR_GET_TIMERSLACK, 0, 0, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Prctl(unix.PR_SET_TIMERSLACK, uintptr(was), 0, 0, 0)
	// This thread stands for one that sysmon started: a relaxed slack.
	if err := unix.Prctl(unix.PR_SET_TIMERSLACK, 3e6, 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	childSlack := func(slackNS int64) string {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		attr := &syscall.ProcAttr{Files: []uintptr{0, w.Fd(), 2}}
		pid, err := forkWithSlack(processReaper().log, func() (int, error) {
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
