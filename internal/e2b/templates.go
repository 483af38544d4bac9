package e2b

import (
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
)

// E2B snapshots: create (a branch of a running sandbox, a template that
// sandboxes start from), list and delete.

func (s *Server) createSnapshot(w http.ResponseWriter, r *http.Request) error {
	var req snapshotRequest
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
	sb, err := s.sandboxOf(r.Context(), rec)
	if err != nil {
		return err
	}
	tag := fmt.Sprintf("e2b-snap-%s-%d", rec.ID, time.Now().UnixMilli())
	name := tag
	if req.Name != "" {
		name = req.Name
		t := strings.TrimSuffix(req.Name, ":default")
		if i := strings.LastIndexByte(t, '/'); i >= 0 {
			t = t[i+1:]
		}
		if err := snapshot.ValidateTag(t); err != nil {
			return fmt.Errorf("snapshot name: %w", err)
		}
		tag = t
	}
	// A persistent template: one that stands alone when its sandbox's
	// snapshot is a fork's, else a diff of it.
	mode := sandbox.BranchDiff
	if src, err := s.e.Snapshots().Get(sb.Snapshot); err != nil || src.Ephemeral || src.Branch != nil && src.Branch.Depth >= snapshot.MaxDepth/2 {
		mode = sandbox.BranchFull
	}
	if _, err := s.e.Branch(context.WithoutCancel(r.Context()), sandbox.BranchSpec{ID: sb.ID, Tag: tag, Mode: mode}); err != nil {
		return err
	}
	m := &snapMark{Tag: tag, Sandbox: rec.ID, Names: []string{name}, Created: time.Now().UTC()}
	if err := s.store.markSnapshot(m); err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, snapshotInfo{SnapshotID: tag, Names: m.Names})
	return nil
}

func (s *Server) listSnapshots(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	limit := 100
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 100 {
			return errdefs.InvalidArgument("limit %s: want 1 to 100", errdefs.Quote(v))
		}
		limit = n
	}
	var marks []snapMark
	for _, m := range s.store.snapshots() {
		if sid := q.Get("sandboxID"); sid != "" && m.Sandbox != sid {
			continue
		}
		if n := q.Get("name"); n != "" && !slices.Contains(m.Names, n) && m.Tag != n {
			continue
		}
		if _, err := s.e.Snapshots().Get(m.Tag); err != nil {
			continue // removed behind our back
		}
		marks = append(marks, m)
	}
	if tok := q.Get("nextToken"); tok != "" {
		after, err := base64.RawURLEncoding.DecodeString(tok)
		i := slices.IndexFunc(marks, func(m snapMark) bool { return m.Tag == string(after) })
		if err != nil || i < 0 {
			return errdefs.InvalidArgument("nextToken %s: not one this server made", errdefs.Quote(tok))
		}
		marks = marks[i+1:]
	}
	out := []snapshotInfo{}
	for _, m := range marks[:min(limit, len(marks))] {
		out = append(out, snapshotInfo{SnapshotID: m.Tag, Names: m.Names})
	}
	if len(marks) > limit {
		w.Header().Set("X-Next-Token", base64.RawURLEncoding.EncodeToString([]byte(marks[limit-1].Tag)))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *Server) deleteSnapshot(w http.ResponseWriter, r *http.Request) error {
	tag := r.PathValue("id")
	known := false
	for _, m := range s.store.snapshots() {
		if m.Tag == tag {
			known = true
		}
	}
	if !known {
		return errdefs.NotFound("snapshot %s not found", errdefs.Quote(tag))
	}
	if err := s.e.RemoveSnapshot(tag); err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	if _, err := s.store.unmarkSnapshot(tag); err != nil {
		return err
	}
	noContent(w)
	return nil
}
