package sandbox

import (
	"context"
	"os"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/state"
)

// MaxTimeout bounds a sandbox's time to live.
const MaxTimeout = 30 * 24 * time.Hour

// Expirer kills sandboxes whose ExpiresAt has passed and sweeps the
// remains of sandboxes whose VMM died on its own. Deadlines live in the
// state store, so they survive a daemon restart.
type Expirer struct {
	e    *Engine
	wake chan struct{}
	// Sweep is how often records are checked against the host even when
	// no deadline is due (default 10 s).
	Sweep time.Duration
	// OnKill, if set, is called for each sandbox the Expirer killed.
	OnKill func(id string)
}

// NewExpirer returns an Expirer for e; start it with Run.
func NewExpirer(e *Engine) *Expirer {
	return &Expirer{e: e, wake: make(chan struct{}, 1), Sweep: 10 * time.Second}
}

// Poke makes a running Expirer look at the deadlines again now (call it
// after setting one).
func (x *Expirer) Poke() {
	select {
	case x.wake <- struct{}{}:
	default:
	}
}

// SetTimeout sets sandbox id to expire d from now; d == 0 removes its
// deadline. The change is durable when SetTimeout returns.
func (x *Expirer) SetTimeout(ctx context.Context, id string, d time.Duration) (*state.Sandbox, error) {
	if err := ValidateID(id); err != nil {
		return nil, err
	}
	if d < 0 || d > MaxTimeout {
		return nil, errdefs.InvalidArgument("timeout %v: want 0 to %v", d, MaxTimeout)
	}
	sb, err := x.e.state.Update(id, func(sb *state.Sandbox) error {
		if d == 0 {
			sb.ExpiresAt = time.Time{}
		} else {
			sb.ExpiresAt = time.Now().Add(d).UTC()
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	x.Poke()
	return sb, nil
}

// Run kills expired sandboxes until ctx ends.
func (x *Expirer) Run(ctx context.Context) {
	for {
		next := x.pass(ctx)
		wait := x.Sweep
		if !next.IsZero() {
			// Not less than a tick: a kill that keeps failing must not spin.
			wait = min(wait, max(time.Until(next), 100*time.Millisecond))
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-x.wake:
		case <-t.C:
		}
		t.Stop()
	}
}

// pass kills what has expired, reclaims the run dirs of dead sandboxes
// and returns the next deadline (zero if none).
func (x *Expirer) pass(ctx context.Context) time.Time {
	list, err := x.e.List(ctx) // marks dead the ones whose VMM is gone
	if err != nil {
		x.e.log.Warn("expiry: list sandboxes", "err", err)
		return time.Time{}
	}
	now := time.Now()
	var next time.Time
	for _, sb := range list {
		if sb.ExpiresAt.IsZero() || sb.Status == state.StatusStarting {
			if sb.Status == state.StatusDead || sb.Status == state.StatusOOM {
				x.reclaim(sb)
			}
			continue
		}
		if sb.ExpiresAt.After(now) {
			if next.IsZero() || sb.ExpiresAt.Before(next) {
				next = sb.ExpiresAt
			}
			continue
		}
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		err := x.e.Kill(kctx, sb.ID)
		cancel()
		switch {
		case err == nil:
			x.e.log.Info("sandbox expired", "sandbox", sb.ID, "expires_at", sb.ExpiresAt)
			if x.OnKill != nil {
				x.OnKill(sb.ID)
			}
		case errdefs.IsNotFound(err): // killed meanwhile
		default:
			x.e.log.Warn("kill expired sandbox", "sandbox", sb.ID, "err", err)
		}
	}
	return next
}

// reclaim releases what a dead sandbox held (cgroup, network slot, run
// dir); its record stays, marked dead (or oom), until it is deleted.
func (x *Expirer) reclaim(stale *state.Sandbox) {
	// The record was read at the start of the pass; a kill may have
	// released it (and a new child taken its slot) since.
	defer x.e.ends.lock(stale.ID)()
	sb, err := x.e.state.Get(stale.ID)
	if err != nil || (sb.Status != state.StatusDead && sb.Status != state.StatusOOM) || sb.Handle.RunDir == "" {
		return
	}
	if _, err := os.Stat(sb.Handle.RunDir); err != nil {
		return
	}
	x.e.dropClient(sb.ID)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := x.e.release(ctx, sb); err != nil {
		x.e.log.Warn("reclaim dead sandbox", "sandbox", sb.ID, "err", err)
	}
	x.e.dropEphemeral(sb.Snapshot)
}
