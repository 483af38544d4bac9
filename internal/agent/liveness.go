package agent

import (
	"context"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
)

// Deadlines of calls to the guest, and of the liveness watch.
const (
	// DefaultCallTimeout bounds a call without a timeout of its own and
	// without data streams (ping, stat, list, mkdir, process control...)
	// when its context has no deadline.
	DefaultCallTimeout = time.Minute
	// DefaultCallGrace is added to a call's own timeout (an exec's or an
	// eval's) to make the host's deadline: the guest enforces the timeout,
	// the host gives it this long more to report before giving up on it.
	DefaultCallGrace = 10 * time.Second
	// DefaultSilence is how long a call may wait with nothing at all
	// arriving from the agent before the client asks it for a ping.
	DefaultSilence = 15 * time.Second
	// DefaultProbeTimeout is how long that ping may take before the agent
	// is reported unresponsive.
	DefaultProbeTimeout = 30 * time.Second
)

// Health is what the liveness watch reports (Options.OnHealth).
type Health struct {
	// Responsive is false once a ping went unanswered for ProbeTimeout
	// while calls waited, and true again at the next frame the agent
	// sends.
	Responsive bool
	// Err says why the agent was found unresponsive.
	Err error
}

// withDeadline returns ctx bounded by d from now when ctx has no deadline
// of its own.
func withDeadline(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok || d <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, d)
}

// callDeadline bounds a call whose guest-side timeout is timeout: that
// plus the call grace, or nothing more than ctx when timeout is zero (the
// call may run for as long as its caller waits; the liveness watch
// reports a guest that stops answering meanwhile).
func (c *Client) callDeadline(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	if timeout <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, timeout+c.callGrace)
}

// Responsive reports whether the agent answered its last liveness ping (or
// was never asked one).
func (c *Client) Responsive() bool { return !c.unresponsive.Load() }

// nudgeAfter is how long a call may wait with nothing arriving before the
// client asks the agent to resend what it has in flight (protocol 2): a
// frame lost whole leaves nothing torn to notice.
const nudgeAfter = 2 * time.Second

// watch is the liveness watch: while calls are pending and the agent has
// sent nothing for nudgeAfter, it asks for a resend of what may have been
// lost; for the silence interval, it pings, and an unanswered ping
// reports the agent unresponsive (a later frame, responsive again). With
// no call pending it sleeps, so an idle client costs nothing.
func (c *Client) watch() {
	for {
		select {
		case <-c.busy:
		case <-c.done:
			return
		}
		if !c.watchBusy() {
			return
		}
	}
}

// watchBusy watches while calls are pending; it returns false once the
// client stopped.
func (c *Client) watchBusy() bool {
	tick := time.NewTicker(min(time.Second, c.silence/3))
	defer tick.Stop()
	for {
		select {
		case <-c.done:
			return false
		case <-tick.C:
		}
		c.mu.Lock()
		pending := len(c.calls)
		c.mu.Unlock()
		if pending == 0 {
			return true
		}
		silent := time.Since(time.Unix(0, c.lastRecv.Load()))
		if silent >= nudgeAfter && c.ack.Version >= 2 {
			c.askResend(c.nextSeq.Load())
		}
		if silent < c.silence {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), c.probeTimeout)
		_, err := c.Ping(ctx)
		cancel()
		select {
		case <-c.done:
			return false
		default:
		}
		if err != nil && time.Since(time.Unix(0, c.lastRecv.Load())) >= c.probeTimeout {
			if !c.unresponsive.Swap(true) {
				c.report(Health{Responsive: false, Err: errdefs.Unavailable(
					"agent unresponsive: nothing received for %s, a ping unanswered for %s",
					silent.Round(time.Second), c.probeTimeout)})
			}
		}
	}
}

// heard records that the agent sent a frame, and reports it responsive
// again when it had been found unresponsive.
func (c *Client) heard() {
	c.lastRecv.Store(time.Now().UnixNano())
	if c.unresponsive.Load() && c.unresponsive.Swap(false) {
		c.report(Health{Responsive: true})
	}
}

// report calls OnHealth, outside the read loop (it may block).
func (c *Client) report(h Health) {
	if c.onHealth != nil {
		go c.onHealth(h)
	}
}
