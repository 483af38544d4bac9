package e2b

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
)

// The E2B lifecycle verbs that keep a sandbox's state: pause (a branch,
// then the VM goes), resume and connect (a fork of that state), and fork.

func (s *Server) pause(w http.ResponseWriter, r *http.Request) error {
	var req pauseRequest
	if err := decode(r, &req); err != nil {
		return err
	}
	id := r.PathValue("id")
	unlock := s.ops.lock(id)
	defer unlock()
	rec, err := s.lookup(r.Context(), id)
	if err != nil {
		return err
	}
	if rec.State == statePaused {
		writeJSON(w, http.StatusConflict, apiError{Code: http.StatusConflict, Message: "sandbox " + id + " is already paused"})
		return nil
	}
	if err := s.pauseLocked(context.WithoutCancel(r.Context()), rec); err != nil {
		return err
	}
	noContent(w)
	return nil
}

// pauseLocked saves rec's sandbox (memory, devices, files) into a snapshot
// and stops it; the record keeps its id and tokens. Called with rec's op
// lock held. The work belongs to the daemon: a caller leaving does not cut
// it short.
func (s *Server) pauseLocked(ctx context.Context, rec *record) error {
	sb, err := s.sandboxOf(ctx, rec)
	if err != nil {
		return err
	}
	// A diff of the snapshot it came from, unless that chain grew long or
	// its snapshot goes with its sandboxes (a fork's): then one that
	// stands alone.
	mode := sandbox.BranchDiff
	if src, err := s.e.Snapshots().Get(sb.Snapshot); err != nil || src.Ephemeral ||
		src.Branch != nil && src.Branch.Depth >= snapshot.MaxDepth/2 {
		mode = sandbox.BranchFull
	}
	tag := fmt.Sprintf("e2b-%s-%d", rec.ID, time.Now().UnixMilli())
	// Recorded first: a crash meanwhile leaves the tag known, removed
	// with the sandbox.
	if _, err := s.store.update(rec.ID, func(cur *record) error {
		cur.States = append(cur.States, tag)
		return nil
	}); err != nil {
		return err
	}
	if _, err := s.e.Branch(ctx, sandbox.BranchSpec{ID: sb.ID, Tag: tag, Mode: mode}); err != nil {
		if _, rerr := s.e.RemoveSnapshotWith(tag, snapshot.RemoveOptions{Force: true}); rerr != nil && !errdefs.IsNotFound(rerr) {
			s.log.Warn("remove failed pause snapshot", "snapshot", tag, "err", rerr)
		}
		_, _ = s.store.update(rec.ID, func(cur *record) error {
			cur.States = slices.DeleteFunc(cur.States, func(t string) bool { return t == tag })
			return nil
		})
		return fmt.Errorf("pause %s: %w", rec.ID, err)
	}
	s.kill(sb.ID)
	s.procs.drop(sb.ID)
	s.users.drop(sb.ID)
	if _, err := s.store.update(rec.ID, func(cur *record) error {
		cur.State, cur.Paused, cur.Sandbox = statePaused, tag, ""
		return nil
	}); err != nil {
		return err
	}
	s.log.Info("e2b sandbox paused", "e2b", rec.ID, "sandbox", sb.ID, "snapshot", tag, "mode", mode)
	return nil
}

// resumeLocked starts a paused rec again from its pause snapshot, to live
// for timeout. Called with rec's op lock held.
func (s *Server) resumeLocked(ctx context.Context, rec *record, timeout time.Duration) (*record, error) {
	id, err := s.start(ctx, rec, rec.Paused, timeout)
	if err != nil {
		return nil, fmt.Errorf("resume %s: %w", rec.ID, err)
	}
	rec, err = s.store.update(rec.ID, func(cur *record) error {
		cur.State, cur.Paused, cur.Sandbox = stateRunning, "", id
		cur.EndAt = time.Now().UTC().Add(timeout)
		return nil
	})
	if err != nil {
		s.kill(id)
		return nil, err
	}
	s.poke()
	s.log.Info("e2b sandbox resumed", "e2b", rec.ID, "sandbox", id)
	return rec, nil
}

// openLocked decodes a connect or resume body into req (its timeout at
// *timeoutField), locks the sandbox the path names and looks up its
// record. On success the caller runs unlock.
func (s *Server) openLocked(r *http.Request, req any, timeoutField **int) (rec *record, timeout time.Duration, unlock func(), err error) {
	if err := decode(r, req); err != nil {
		return nil, 0, nil, err
	}
	if timeout, err = seconds(*timeoutField, DefaultTimeout); err != nil {
		return nil, 0, nil, err
	}
	id := r.PathValue("id")
	unlock = s.ops.lock(id)
	if rec, err = s.lookup(r.Context(), id); err != nil {
		unlock()
		return nil, 0, nil, err
	}
	return rec, timeout, unlock, nil
}

func (s *Server) connect(w http.ResponseWriter, r *http.Request) error {
	var req connectRequest
	rec, timeout, unlock, err := s.openLocked(r, &req, &req.Timeout)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return errdefs.NotFound("paused sandbox %s not found", errdefs.Quote(r.PathValue("id")))
		}
		return err
	}
	defer unlock()
	id := r.PathValue("id")
	if rec.State == stateRunning {
		if rec, err = s.extend(r.Context(), id, timeout, true); err != nil {
			return err
		}
		writeJSON(w, http.StatusOK, s.wire(rec))
		return nil
	}
	if rec, err = s.resumeLocked(r.Context(), rec, timeout); err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, s.wire(rec))
	return nil
}

func (s *Server) resume(w http.ResponseWriter, r *http.Request) error {
	var req struct {
		Timeout   *int  `json:"timeout,omitempty"`
		AutoPause *bool `json:"autoPause,omitempty"`
	}
	rec, timeout, unlock, err := s.openLocked(r, &req, &req.Timeout)
	if err != nil {
		return err
	}
	defer unlock()
	if rec.State == stateRunning {
		return errdefs.AlreadyExists("sandbox %s is already running", r.PathValue("id"))
	}
	if rec, err = s.resumeLocked(r.Context(), rec, timeout); err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, s.wire(rec))
	return nil
}

func (s *Server) fork(w http.ResponseWriter, r *http.Request) error {
	var req forkRequest
	if err := decode(r, &req); err != nil {
		return err
	}
	timeout, err := seconds(req.Timeout, DefaultForkTimeout)
	if err != nil {
		return err
	}
	count := 1
	if req.Count != nil {
		count = *req.Count
	}
	if most := s.e.Config().MaxChildren; count < 1 || count > most {
		return errdefs.InvalidArgument("count %d: want 1 to %d", count, most)
	}
	id := r.PathValue("id")
	unlock := s.ops.lock(id)
	defer unlock()
	src, err := s.lookup(r.Context(), id)
	if err != nil {
		return err
	}
	if src.State != stateRunning {
		return errdefs.FailedPrecondition("sandbox %s is paused: connect to it first", id)
	}
	snap, err := s.e.Snapshots().Get(src.Snapshot)
	if err != nil {
		snap = &snapshot.Snapshot{}
	}
	children := make([]*record, count)
	now := time.Now().UTC()
	for i := range children {
		c := src.clone()
		c.ID, c.Sandbox, c.AccessToken, c.TrafficToken = newSandboxID(), "", newToken(), newToken()
		c.State, c.Paused, c.States = stateRunning, "", nil
		c.StartedAt, c.EndAt, c.AutoPause = now, now.Add(timeout), false
		children[i] = c
	}
	spec := sandbox.ForkSpec{N: count, KeepPartial: true, Timeout: timeout,
		Metadata: map[string]string{"e2b.fork-of": id}, Net: netSpec(src, snap)}
	res, err := s.cfg.Admitter.ForkFrom(r.Context(), src.Sandbox, "", spec)
	if res == nil {
		return err
	}
	if cerr := r.Context().Err(); cerr != nil {
		for _, c := range res.Children {
			if c.Err == nil {
				s.kill(c.ID)
			}
		}
		return errdefs.Unavailable("the caller went away before the forks were ready: %v", cerr)
	}
	s.cfg.Expirer.Poke()
	out := make([]forkResult, 0, count)
	for i, c := range res.Children {
		if c.Err != nil {
			st := statusOf(c.Err)
			out = append(out, forkResult{Error: &apiError{Code: st, Message: c.Err.Error()}})
			continue
		}
		rec := children[i]
		rec.Sandbox = c.ID
		if err := s.store.put(rec); err != nil {
			s.kill(c.ID)
			out = append(out, forkResult{Error: &apiError{Code: http.StatusInternalServerError, Message: err.Error()}})
			continue
		}
		out = append(out, forkResult{Sandbox: s.wire(rec)})
	}
	s.log.Info("e2b sandbox forked", "e2b", id, "count", count)
	writeJSON(w, http.StatusCreated, out)
	return nil
}
