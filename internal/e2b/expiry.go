package e2b

import (
	"context"
	"time"
)

// poke wakes the expiry loop.
func (s *Server) poke() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Start starts the server's background work until ctx or the server
// ends: pausing the sandboxes that asked to be paused at their timeout, and
// forgetting those whose forkd sandbox ended (the engine's expirer kills
// the others at theirs).
func (s *Server) Start(ctx context.Context) {
	s.work.Add(1)
	go func() {
		defer s.work.Done()
		s.run(ctx)
	}()
}

func (s *Server) run(ctx context.Context) {
	for {
		next := s.pass(ctx)
		wait := 10 * time.Second
		if !next.IsZero() {
			wait = min(wait, max(time.Until(next), 10*time.Millisecond))
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-s.base.Done():
			t.Stop()
			return
		case <-s.wake:
			t.Stop()
		case <-t.C:
		}
	}
}

// pass does one round of run and returns the next auto-pause deadline.
func (s *Server) pass(ctx context.Context) time.Time {
	var next time.Time
	now := time.Now()
	for _, rec := range s.live(ctx, listFilter{states: []string{stateRunning}}) {
		if !rec.AutoPause {
			continue
		}
		if rec.EndAt.After(now) {
			if next.IsZero() || rec.EndAt.Before(next) {
				next = rec.EndAt
			}
			continue
		}
		unlock := s.ops.lock(rec.ID)
		cur, err := s.store.get(rec.ID)
		if err == nil && cur.State == stateRunning && !cur.EndAt.After(time.Now()) {
			if err := s.pauseLocked(ctx, cur); err != nil {
				s.log.Warn("auto-pause", "e2b", rec.ID, "err", err)
				// Kill rather than run on forever past its end.
				s.kill(cur.Sandbox)
			}
		}
		unlock()
	}
	return next
}
