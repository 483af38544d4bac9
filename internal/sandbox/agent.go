package sandbox

import (
	"context"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/state"
)

// Agent returns a client for sandbox id's guest agent. In daemon mode the
// client is shared and stays open; otherwise the caller gets its own
// session and must call release when done.
func (e *Engine) Agent(ctx context.Context, id string) (c *agent.Client, release func(), err error) {
	return e.heldAgent(ctx, id, true)
}

// heldAgent is Agent; request is the idle watch's hold's (false: a wake
// for inbound traffic).
func (e *Engine) heldAgent(ctx context.Context, id string, request bool) (c *agent.Client, release func(), err error) {
	if err := ValidateID(id); err != nil {
		return nil, nil, err
	}
	if e.cfg.Daemon {
		start := time.Now()
		hold, clock, err := e.hold(id, request)
		if err != nil {
			return nil, nil, err
		}
		c, _, err := e.agent(ctx, id)
		if err != nil {
			e.clockDone(id, clock, false)
			hold()
			return nil, nil, err
		}
		if err := e.settleClock(ctx, id, c, clock, start); err != nil {
			hold()
			return nil, nil, err
		}
		return c, hold, nil
	}
	return e.agent(ctx, id)
}

// agent is Agent without the idle watch's hold.
func (e *Engine) agent(ctx context.Context, id string) (c *agent.Client, release func(), err error) {
	if e.cfg.Daemon {
		if c := e.cachedClient(id); c != nil {
			return c, func() {}, nil
		}
		// One dial per sandbox at a time: a second session would cancel
		// the first one's calls in the guest.
		defer e.dials.lock(id)()
		if c := e.cachedClient(id); c != nil {
			return c, func() {}, nil
		}
	}
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	if !state.Live(sb.Status) {
		return nil, nil, errdefs.FailedPrecondition("sandbox %s is %s", id, sb.Status)
	}
	m, err := e.cfg.Backend.Attach(ctx, sb.Handle)
	if err != nil {
		return nil, nil, err
	}
	dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	c, err = DialAgent(dctx, m, e.agentOptions(id))
	if err != nil {
		return nil, nil, err
	}
	if e.cfg.Daemon {
		e.keepClient(id, c)
		// A Kill that ran meanwhile dropped what was cached before this
		// dial; drop this one too rather than keep it for a gone sandbox.
		if _, err := e.state.Get(id); err != nil {
			e.dropClient(id)
			return nil, nil, err
		}
		return c, func() {}, nil
	}
	return c, func() { c.Close() }, nil
}

// cachedClient returns the daemon's live client of sandbox id, or nil.
func (e *Engine) cachedClient(id string) *agent.Client {
	e.mu.Lock()
	c := e.conns[id]
	e.mu.Unlock()
	if c != nil && alive(c) {
		return c
	}
	return nil
}

// keepClient caches a client in daemon mode and closes it otherwise.
func (e *Engine) keepClient(id string, c *agent.Client) {
	if !e.cfg.Daemon {
		c.Close()
		return
	}
	e.mu.Lock()
	old := e.conns[id]
	e.conns[id] = c
	e.mu.Unlock()
	if old != nil && old != c {
		old.Close()
	}
}

func (e *Engine) dropClient(id string) {
	e.mu.Lock()
	c := e.conns[id]
	delete(e.conns, id)
	e.mu.Unlock()
	if c != nil {
		c.Close()
	}
}

// alive reports whether a client's session is still open.
func alive(c *agent.Client) bool {
	select {
	case <-c.Done():
		return false
	default:
		return true
	}
}
