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
// from the idle watch (a kill), is left alone.
func (e *Engine) wakeForTraffic(id string) {
	e.idle.mu.Lock()
	st := e.idle.m[id]
	frozen := st != nil && st.frozen
	if frozen {
		e.idle.stats.TrafficWakes++
	}
	e.idle.mu.Unlock()
	if !frozen {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, release, err := e.heldAgent(ctx, id, false); err != nil {
		e.log.Warn("idle watch: wake on traffic", "sandbox", id, "err", err)
	} else {
		release()
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
