package sandbox

import (
	"context"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
)

// The guest's clock after a wake: a guest whose clocksource does not
// follow the host's (proto.ClockFollowsHost) lost the time it was frozen,
// and the first client after the thaw tells it the time before its
// request; the clients that come while it does wait for it.

// wakeClock is what a hold owes the guest's clock after a thaw. A hold
// with set tells the guest the time (or finds it need not), then closes
// set through clockDone; a hold with wait waits for another's to close.
type wakeClock struct {
	set  chan struct{}
	wait <-chan struct{}
}

// takeClock hands the clock's setting to the first hold after a thaw,
// and to the holds after it what to wait for while that one sets it.
// Called with e.idle.mu held.
func (st *idleState) takeClock() wakeClock {
	switch {
	case st.resync:
		st.resync, st.setting = false, make(chan struct{})
		return wakeClock{set: st.setting}
	case st.setting != nil:
		return wakeClock{wait: st.setting}
	}
	return wakeClock{}
}

// clockDone ends the clock's setting c.set for sandbox id: set (or not
// needed), or else left to its next client. A no-op without c.set.
func (e *Engine) clockDone(id string, c wakeClock, set bool) {
	if c.set == nil {
		return
	}
	e.idle.mu.Lock()
	if st := e.idle.m[id]; st != nil && st.setting == c.set {
		st.setting = nil
		st.resync = st.resync || !set
	}
	e.idle.mu.Unlock()
	close(c.set)
}

// settleClock pays what a hold owes the guest's clock (c is sandbox id's
// client; start is when the request came): it tells the guest the time
// if the hold took that on, or waits until the client that did has, and
// takes it on if that one failed. Only ctx ending while it waits fails it.
func (e *Engine) settleClock(ctx context.Context, id string, c *agent.Client, clock wakeClock, start time.Time) error {
	for {
		switch {
		case clock.set != nil:
			e.clockDone(id, clock, e.woken(ctx, id, c, start))
			return nil
		case clock.wait != nil:
			select {
			case <-clock.wait:
			case <-ctx.Done():
				return ctx.Err()
			}
			e.idle.mu.Lock()
			clock = wakeClock{}
			if st := e.idle.m[id]; st != nil {
				clock = st.takeClock()
			}
			e.idle.mu.Unlock()
		default:
			return nil
		}
	}
}

// woken tells a guest that was frozen the time, unless its clock kept
// counting while it was frozen, counts the wake's latency, from start
// (the request's arrival) to now, and reports whether the guest's clock
// is right.
func (e *Engine) woken(ctx context.Context, id string, c *agent.Client, start time.Time) (ok bool) {
	e.idle.mu.Lock()
	set := e.idle.setClock || !proto.ClockFollowsHost(c.Clocksource())
	e.idle.mu.Unlock()
	ok = true
	if set {
		ictx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		// An init applies a pids limit too (0: the agent's default):
		// the one the sandbox was forked with.
		sb, err := e.state.Get(id)
		if err == nil {
			err = c.Init(ictx, proto.InitRequest{Time: time.Now(), PIDsLimit: sb.GuestPIDsLimit})
		}
		if err != nil {
			e.log.Warn("set the clock of a woken sandbox", "sandbox", id, "err", err)
			ok = false
		}
	}
	d := time.Since(start)
	e.idle.mu.Lock()
	e.idle.stats.WakeSeconds += d.Seconds()
	if set && ok {
		e.idle.stats.ClockSets++
	}
	e.idle.mu.Unlock()
	e.log.Debug("sandbox woken", "sandbox", id, "ms", d.Milliseconds(), "clock_set", set)
	return ok
}

// SetClockAfterWake makes every wake from now on tell the guest the time,
// as for a guest whose clocksource does not follow the host's (true), or
// only those (false, the default). For tests, whose guests keep time by
// the TSC.
func (e *Engine) SetClockAfterWake(always bool) {
	e.idle.mu.Lock()
	defer e.idle.mu.Unlock()
	e.idle.setClock = always
}
