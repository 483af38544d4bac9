package guest

import (
	"syscall"
	"testing"
	"time"
)

// awaitGroupGone reports a group gone once its last member is reaped, and
// gives up on a live one at its limit or on cancel.
func TestAwaitGroupGone(t *testing.T) {
	never := make(chan struct{})
	// `sleep 60` leads a new process group.
	pid, err := syscall.ForkExec("/bin/sleep", []string{"sleep", "60"}, &syscall.ProcAttr{Sys: &syscall.SysProcAttr{Setpgid: true}})
	if err != nil {
		t.Fatal(err)
	}
	reaped := false
	t.Cleanup(func() {
		if !reaped {
			syscall.Kill(-pid, syscall.SIGKILL)
			syscall.Wait4(pid, nil, 0, nil)
		}
	})
	if awaitGroupGone(pid, 50*time.Millisecond, never) {
		t.Error("a live group reported gone")
	}
	cancelled := make(chan struct{})
	close(cancelled)
	if awaitGroupGone(pid, time.Hour, cancelled) {
		t.Error("a live group reported gone on cancel")
	}
	// Killed but not reaped, the leader stays in its group (a zombie).
	if err := syscall.Kill(-pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if awaitGroupGone(pid, 50*time.Millisecond, never) {
		t.Error("a killed group reported gone before it was reaped")
	}
	var ws syscall.WaitStatus
	if _, err := syscall.Wait4(pid, &ws, 0, nil); err != nil {
		t.Fatal(err)
	}
	reaped = true
	if !awaitGroupGone(pid, time.Minute, never) {
		t.Error("a reaped group not reported gone")
	}
}
