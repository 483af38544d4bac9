package sandbox

import (
	"context"
	"time"

	"github.com/forkd/forkd/internal/netns"
)

// Inbound traffic for a frozen sandbox: a freeze opens a watch on its
// host link (netns.InboundWatch), whose first packet wakes it; where none
// can be made the idle tick reads its counter (freeze.go).

// wakeForTraffic wakes frozen sandbox id for inbound traffic, through
// the agent's client, which thaws it and sets the guest's clock; the
// packets wait in its tap meanwhile. A sandbox no longer frozen, or gone
// from the idle watch (a kill), is left alone. It reports false if the
// wake failed.
func (e *Engine) wakeForTraffic(id string) bool {
	e.idle.mu.Lock()
	st := e.idle.m[id]
	frozen := st != nil && st.frozen
	if frozen {
		e.idle.stats.TrafficWakes++
	}
	e.idle.mu.Unlock()
	if !frozen {
		return true
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, release, err := e.heldAgent(ctx, id, false)
	if err != nil {
		e.log.Warn("idle watch: wake on traffic", "sandbox", id, "err", err)
		return false
	}
	release()
	return true
}

// countedWake is the wake the idle watch owes a frozen sandbox without a
// watch for the traffic its counter showed: waking while one runs,
// failedAt when the last one failed.
type countedWake struct {
	waking   bool
	failedAt time.Time
}

// trafficRetry is how long the idle watch waits after a failed wake for
// counted traffic before it tries again.
const trafficRetry = 2 * time.Second

// countInbound takes n, st's inbound counter read at now, which differs
// from the one st holds, and reports whether to wake st for it
// (wakeCounted). A frozen sandbox keeps its old count until it is awake,
// so a wake that fails leaves the traffic counted and is tried again,
// trafficRetry later, until one works or the sandbox goes. Called with
// e.idle.mu held.
func (st *idleState) countInbound(n uint64, now time.Time) (wake bool) {
	if !st.frozen {
		st.inbound = n
		return false
	}
	if st.counted.waking || now.Sub(st.counted.failedAt) < trafficRetry {
		return false
	}
	st.counted.waking = true
	return true
}

// wakeCounted wakes sandbox id for the traffic countInbound read, and
// records the outcome for the next reading.
func (e *Engine) wakeCounted(id string) {
	ok := e.wakeForTraffic(id)
	e.idle.mu.Lock()
	defer e.idle.mu.Unlock()
	if st := e.idle.m[id]; st != nil {
		st.counted.waking = false
		if !ok {
			st.counted.failedAt = time.Now()
		}
	}
}

// watchTraffic waits for w's first packet and wakes sandbox id (st) for
// it. w stays st's until the thaw takes and closes it, so that the idle
// watch does not read the counter meanwhile; a thaw for anything else
// ends the wait the same way. A watch still st's afterwards (the wake
// failed, or the watch ended by itself: its link gone) is closed and
// leaves the sandbox to the idle watch's reading of its counter.
func (e *Engine) watchTraffic(id string, st *idleState, w *netns.InboundWatch) {
	if w.Wait() {
		e.wakeForTraffic(id)
	}
	e.idle.mu.Lock()
	if st.watch == w {
		st.takeWatch()
	} else {
		w = nil // a thaw took and closed it
	}
	e.idle.mu.Unlock()
	w.Close()
}

// takeWatch removes st's watch and returns it (nil if none), for the
// caller to close once it has released e.idle.mu. Called with e.idle.mu
// held.
func (st *idleState) takeWatch() *netns.InboundWatch {
	w := st.watch
	st.watch = nil
	return w
}

// watchInbound starts a watch on the traffic towards the network of
// sandbox id (slot) before it is frozen; nil when it has none, or no watch
// can be made (the idle watch then reads its counter). busy reports
// traffic since the idle watch's last reading of the counter (seen),
// before the watch began: the sandbox is not idle.
func (e *Engine) watchInbound(id string, slot int, seen uint64) (w *netns.InboundWatch, busy bool) {
	e.idle.mu.Lock()
	unwatched := e.idle.unwatched
	e.idle.mu.Unlock()
	if slot < 0 || e.cfg.Net == nil || unwatched {
		return nil, false
	}
	w, err := e.cfg.Net.WatchInbound(slot)
	if err != nil {
		e.log.Debug("idle watch: its counter stands in for a watch on its traffic", "sandbox", id, "err", err)
		return nil, false
	}
	if n, err := e.cfg.Net.Inbound(slot); err == nil && n != seen {
		w.Close()
		return nil, true
	}
	return w, false
}

// SetTrafficWatch turns the watch on a frozen sandbox's traffic off or
// back on (on by default) for the freezes from now on: off, the idle tick
// reads the sandbox's counter instead, as on a host where no packet
// socket can be opened. For tests, which check that fallback.
func (e *Engine) SetTrafficWatch(on bool) {
	e.idle.mu.Lock()
	defer e.idle.mu.Unlock()
	e.idle.unwatched = !on
}
