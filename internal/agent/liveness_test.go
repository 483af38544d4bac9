package agent_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

// A guest that stops answering: a call with a timeout of its own fails on
// time (timeout plus grace), and the liveness watch reports the agent
// unresponsive; its next frame reports it responsive again.
func TestWedgedGuestTimesOutAndIsReported(t *testing.T) {
	var answer atomic.Bool // the guest answers pings only once set
	conn := fakeGuest(t, func(w *proto.Writer, id uint32, req proto.Request) {
		if req.Op == proto.OpPing && answer.Load() {
			_ = w.WriteJSON(proto.TypeResult, id, proto.Result{Result: []byte(`{}`)})
		}
		// Anything else: silence, as a guest whose agent cannot run.
	})
	health := make(chan agent.Health, 4)
	c, err := agent.Dial(testCtx(t), conn, agent.Options{
		Silence: 200 * time.Millisecond, ProbeTimeout: 400 * time.Millisecond, CallGrace: 300 * time.Millisecond,
		OnHealth: func(h agent.Health) { health <- h },
	})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	// Its own timeout (1 s) plus the grace: the host gives up at 1.3 s.
	start := time.Now()
	_, err = c.Exec(context.Background(), agent.ExecRequest{Args: []string{"true"}, Timeout: time.Second})
	if d := time.Since(start); !errdefs.IsDeadlineExceeded(err) || !errors.Is(err, context.DeadlineExceeded) || d < 1300*time.Millisecond || d > 3*time.Second {
		t.Fatalf("exec on a wedged guest: %v after %v, want a deadline error after 1.3 s", err, d)
	}

	// A call without a timeout waits; meanwhile the watch pings, and the
	// unanswered ping reports the agent unresponsive.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _, _ = c.Exec(ctx, agent.ExecRequest{Args: []string{"sleep", "infinity"}}) }()
	select {
	case h := <-health:
		if h.Responsive || !errdefs.IsUnavailable(h.Err) {
			t.Fatalf("first report %+v, want unresponsive", h)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no unresponsive report within 5 s")
	}
	if c.Responsive() {
		t.Fatal("Responsive() after the report")
	}
	// The guest recovers: the next ping is answered, and that frame
	// reports it responsive.
	answer.Store(true)
	select {
	case h := <-health:
		if !h.Responsive {
			t.Fatalf("second report %+v, want responsive", h)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no responsive report within 5 s of the guest answering")
	}
	if !c.Responsive() {
		t.Fatal("not Responsive() after the guest answered")
	}
}

// An idle client sends nothing: no call pending, no liveness ping.
func TestIdleClientDoesNotPing(t *testing.T) {
	var pings atomic.Int32
	conn := fakeGuest(t, func(w *proto.Writer, id uint32, req proto.Request) {
		if req.Op == proto.OpPing {
			pings.Add(1)
			_ = w.WriteJSON(proto.TypeResult, id, proto.Result{Result: []byte(`{}`)})
		}
	})
	c, err := agent.Dial(testCtx(t), conn, agent.Options{Silence: 50 * time.Millisecond, ProbeTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	time.Sleep(500 * time.Millisecond)
	if n := pings.Load(); n != 0 {
		t.Fatalf("%d pings from an idle client", n)
	}
}
