package proc

import (
	"context"
	"errors"
	"os/exec"
	"runtime"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

// policies returns the scheduling policy of every thread of pid.
func policies(t *testing.T, pid int) []uint32 {
	t.Helper()
	tids, err := tasks(pid)
	if err != nil {
		t.Fatal(err)
	}
	var out []uint32
	for _, tid := range tids {
		a, err := unix.SchedGetAttr(tid, 0)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, a.Policy)
	}
	return out
}

// A process started from a thread in the background class is in it with
// all its threads; SetSched moves every thread back; the starting thread
// gets its own class back. Leaving SCHED_IDLE needs root.
func TestSchedThreadAndSetSched(t *testing.T) {
	testutil.RequireRoot(t)
	var cmd *exec.Cmd
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		restore, err := SchedThread(Background)
		if err != nil {
			errc <- err
			return
		}
		// A Go binary has several threads: the test sees them all.
		cmd = exec.Command("sh", "-c", "sleep 60")
		err = cmd.Start()
		errc <- errors.Join(err, restore())
		if a, err := unix.SchedGetAttr(0, 0); err != nil || a.Policy != unix.SCHED_NORMAL {
			errc <- errors.Join(errors.New("the starting thread kept the background class"), err)
			return
		}
		errc <- nil
	}()
	if err := errors.Join(<-errc, <-errc); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
	}()
	id, err := Self(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range policies(t, id.PID) {
		if p != unix.SCHED_IDLE {
			t.Fatalf("started process has policy %d, want SCHED_IDLE", p)
		}
	}
	if err := SetSched(id, Normal); err != nil {
		t.Fatal(err)
	}
	for _, p := range policies(t, id.PID) {
		if p != unix.SCHED_NORMAL {
			t.Fatalf("after SetSched policy %d, want SCHED_NORMAL", p)
		}
	}
	// Stopped and continued through its identity; a process that is gone
	// is NotFound.
	if err := Signal(id, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitState(t, id.PID, 'T')
	if err := Signal(id, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	waitState(t, id.PID, 'S')
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := Kill(ctx, id); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	if err := Signal(id, syscall.SIGCONT); !errdefs.IsNotFound(err) {
		t.Fatalf("Signal to a process that is gone = %v, want NotFound", err)
	}
	if err := SetSched(id, Normal); !errdefs.IsNotFound(err) {
		t.Fatalf("SetSched of a process that is gone = %v, want NotFound", err)
	}
}

// waitState waits up to 5 s for pid's state letter to be want.
func waitState(t *testing.T, pid int, want byte) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		stat, err := readStat(pid)
		if err != nil {
			t.Fatal(err)
		}
		f, err := statFields(stat, 3)
		if err != nil {
			t.Fatal(err)
		}
		if f[0][0] == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d in state %s, want %c", pid, f[0], want)
		}
	}
}

func TestMemory(t *testing.T) {
	avail, total, err := Memory()
	if err != nil {
		t.Fatal(err)
	}
	if total == 0 || avail > total {
		t.Fatalf("Memory() = %d available of %d", avail, total)
	}
}
