package sandbox_test

import (
	"context"
	"errors"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/testvm"
)

// TestWedgedGuestUnresponsive: a guest that stops answering (its VMM
// stopped with SIGSTOP: from the host, exactly a guest whose agent cannot
// run) fails calls at their timeout plus grace, turns the sandbox
// unresponsive and reports it; answering again turns it running. With
// the kill policy it is killed instead.
func TestWedgedGuestUnresponsive(t *testing.T) {
	var mu sync.Mutex
	var events []sandbox.Event
	e := testvm.EngineWith(t, func(c *sandbox.Config) {
		c.Daemon = true
		c.Liveness = agent.Options{Silence: time.Second, ProbeTimeout: 2 * time.Second, CallGrace: 2 * time.Second}
		c.OnEvent = func(ev sandbox.Event) {
			mu.Lock()
			events = append(events, ev)
			mu.Unlock()
		}
	})
	ctx := ctxT(t, 15*time.Minute)
	if _, err := e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: "wedge", Image: "minimal"}); err != nil {
		t.Fatal(err)
	}
	res, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "wedge", N: 2})
	if err != nil {
		t.Fatal(err)
	}
	keep, kill := res.Children[0].Sandbox, res.Children[1].Sandbox
	if _, err := e.State().Update(kill.ID, func(r *state.Sandbox) error { r.OnUnresponsive = sandbox.UnresponsiveKill; return nil }); err != nil {
		t.Fatal(err)
	}
	status := func(id string) string {
		sb, err := e.Get(ctx, id)
		if errdefs.IsNotFound(err) {
			return "gone"
		}
		if err != nil {
			t.Fatal(err)
		}
		return sb.Status
	}
	waitStatus := func(id, want string, within time.Duration) {
		t.Helper()
		for deadline := time.Now().Add(within); status(id) != want; time.Sleep(100 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s is %s after %v, want %s", id, status(id), within, want)
			}
		}
	}

	for _, sb := range []*state.Sandbox{keep, kill} {
		if err := syscall.Kill(sb.Handle.Process.PID, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { _ = syscall.Kill(keep.Handle.Process.PID, syscall.SIGCONT) })
	c, release, err := e.Agent(ctx, keep.ID)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	// An exec with a 3 s timeout fails on time: 3 s plus the 2 s grace.
	start := time.Now()
	_, err = c.Exec(context.Background(), agent.ExecRequest{Args: []string{"true"}, Timeout: 3 * time.Second})
	if d := time.Since(start); !errors.Is(err, context.DeadlineExceeded) || d < 5*time.Second || d > 10*time.Second {
		t.Fatalf("exec on a stopped guest: %v after %v, want a deadline error after 5 s", err, d)
	}
	// A call that waits (no timeout) lets the watch find it unresponsive.
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { _, _ = c.Exec(cctx, agent.ExecRequest{Args: []string{"true"}}) }()
	waitStatus(keep.ID, state.StatusUnresponsive, 30*time.Second)
	// The kill-policy sandbox goes once a call finds it unresponsive.
	kc, krelease, err := e.Agent(ctx, kill.ID)
	if err != nil {
		t.Fatal(err)
	}
	defer krelease()
	go func() { _, _ = kc.Exec(cctx, agent.ExecRequest{Args: []string{"true"}}) }()
	waitStatus(kill.ID, "gone", 60*time.Second)

	// Woken up, the guest answers: running again, and the waiting exec ends.
	if err := syscall.Kill(keep.Handle.Process.PID, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	waitStatus(keep.ID, state.StatusRunning, 30*time.Second)
	if out, code := run(t, e, keep.ID, "echo back"); code != 0 || out != "back\n" {
		t.Fatalf("after waking: %q, exit %d", out, code)
	}
	mu.Lock()
	defer mu.Unlock()
	kinds := map[string]int{}
	for _, ev := range events {
		kinds[ev.Sandbox+" "+ev.Kind]++
	}
	for _, want := range []string{keep.ID + " unresponsive", keep.ID + " responsive", kill.ID + " unresponsive", kill.ID + " killed"} {
		if kinds[want] == 0 {
			t.Errorf("no event %q in %v", want, events)
		}
	}
}
