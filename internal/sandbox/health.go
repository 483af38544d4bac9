package sandbox

import (
	"context"
	"errors"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/state"
)

// What happens to a sandbox whose agent stops answering
// (Config.Unresponsive, ForkSpec.OnUnresponsive).
const (
	// UnresponsiveKeep marks it unresponsive and keeps it for inspection;
	// it turns running again if its agent answers.
	UnresponsiveKeep = "keep"
	// UnresponsiveKill kills it.
	UnresponsiveKill = "kill"
)

// ValidateUnresponsive checks an unresponsive policy ("" is the default).
func ValidateUnresponsive(p string) error {
	switch p {
	case "", UnresponsiveKeep, UnresponsiveKill:
		return nil
	}
	return errdefs.InvalidArgument("unresponsive policy %q: want keep or kill", p)
}

// Event kinds.
const (
	EventUnresponsive = "unresponsive" // Detail says why
	EventResponsive   = "responsive"
	EventKilled       = "killed" // by the unresponsive policy; Detail says why
)

// Event is something that happened to a sandbox outside any request.
type Event struct {
	Time    time.Time `json:"time"`
	Sandbox string    `json:"sandbox"`
	Kind    string    `json:"kind"`
	Detail  string    `json:"detail,omitempty"`
}

// emit reports an event to Config.OnEvent and the log.
func (e *Engine) emit(ev Event) {
	ev.Time = time.Now().UTC()
	e.log.Warn("sandbox event", "sandbox", ev.Sandbox, "event", ev.Kind, "detail", ev.Detail)
	if e.cfg.OnEvent != nil {
		e.cfg.OnEvent(ev)
	}
}

// agentOptions are the options of sandbox id's agent clients: their
// liveness watch reports to health.
func (e *Engine) agentOptions(id string) agent.Options {
	l := e.cfg.Liveness
	return agent.Options{Silence: l.Silence, ProbeTimeout: l.ProbeTimeout, CallGrace: l.CallGrace,
		OnHealth: func(h agent.Health) { e.health(id, h) }}
}

var errNoChange = errors.New("no change")

// health records what the liveness watch of sandbox id's agent found: the
// status turns unresponsive (and the policy applies) or running again.
func (e *Engine) health(id string, h agent.Health) {
	sb, err := e.state.Update(id, func(r *state.Sandbox) error {
		switch {
		case !h.Responsive && r.Status == state.StatusRunning:
			r.Status = state.StatusUnresponsive
		case h.Responsive && r.Status == state.StatusUnresponsive:
			r.Status = state.StatusRunning
		default:
			return errNoChange // gone, dead or already so
		}
		return nil
	})
	if err != nil {
		if !errors.Is(err, errNoChange) && !errdefs.IsNotFound(err) {
			e.log.Warn("record sandbox health", "sandbox", id, "err", err)
		}
		return
	}
	if h.Responsive {
		e.emit(Event{Sandbox: id, Kind: EventResponsive})
		return
	}
	why := ""
	if h.Err != nil {
		why = h.Err.Error()
	}
	e.emit(Event{Sandbox: id, Kind: EventUnresponsive, Detail: why})
	policy := sb.OnUnresponsive
	if policy == "" {
		policy = e.cfg.Unresponsive
	}
	if policy != UnresponsiveKill {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := e.Kill(ctx, id); err != nil && !errdefs.IsNotFound(err) {
		e.log.Warn("kill unresponsive sandbox", "sandbox", id, "err", err)
		return
	}
	e.emit(Event{Sandbox: id, Kind: EventKilled, Detail: "unresponsive: " + why})
}
