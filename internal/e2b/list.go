package e2b

import (
	"context"
	"encoding/base64"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/netns"
)

// Listing sandboxes, their network and their logs.

func (s *Server) network(w http.ResponseWriter, r *http.Request) error {
	var req networkUpdate
	if err := decode(r, &req); err != nil {
		return err
	}
	if len(req.AllowOut) > 0 || len(req.DenyOut) > 0 || len(req.Rules) > 0 || len(req.EgressProxy) > 0 {
		return errdefs.InvalidArgument("network: only allow_internet_access is supported by forkd")
	}
	id := r.PathValue("id")
	unlock := s.ops.lock(id)
	defer unlock()
	rec, err := s.lookup(r.Context(), id)
	if err != nil {
		return err
	}
	if req.AllowInternetAccess == nil {
		noContent(w)
		return nil
	}
	deny := !*req.AllowInternetAccess
	if rec.State == stateRunning {
		pol := netns.Policy{Mode: netns.ModeAllow}
		if deny {
			pol = netns.Policy{Mode: netns.ModeDeny}
		}
		if _, err := s.e.SetPolicy(r.Context(), rec.Sandbox, pol); err != nil {
			return err
		}
	}
	if _, err := s.store.update(id, func(cur *record) error { cur.NoInternet = deny; return nil }); err != nil {
		return err
	}
	noContent(w)
	return nil
}

func (s *Server) logs(w http.ResponseWriter, r *http.Request) error {
	if _, err := s.lookup(r.Context(), r.PathValue("id")); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, map[string]any{"logs": []any{}, "logEntries": []any{}})
	return nil
}

// metadataFilter decodes the list's metadata parameter as E2B's API does:
// the query already decoded once, unescape the whole, split on & and =,
// unescape each key and value.
func metadataFilter(raw string) (map[string]string, error) {
	if raw == "" {
		return nil, nil
	}
	whole, err := url.QueryUnescape(raw)
	if err != nil {
		return nil, errdefs.InvalidArgument("metadata %s: %v", errdefs.Quote(raw), err)
	}
	out := map[string]string{}
	for _, kv := range strings.Split(whole, "&") {
		if kv == "" {
			continue
		}
		k, v, _ := strings.Cut(kv, "=")
		if k, err = url.QueryUnescape(k); err != nil {
			return nil, errdefs.InvalidArgument("metadata key %s: %v", errdefs.Quote(k), err)
		}
		if v, err = url.QueryUnescape(v); err != nil {
			return nil, errdefs.InvalidArgument("metadata value %s: %v", errdefs.Quote(v), err)
		}
		out[k] = v
	}
	return out, nil
}

// listFilter is what a list asks for.
type listFilter struct {
	metadata     map[string]string
	states       []string
	template     string
	startedAfter time.Time
}

func (f listFilter) match(rec *record) bool {
	if len(f.states) > 0 && !slices.Contains(f.states, rec.State) {
		return false
	}
	if f.template != "" && rec.Template != f.template {
		return false
	}
	if !f.startedAfter.IsZero() && rec.StartedAt.Before(f.startedAfter) {
		return false
	}
	for k, v := range f.metadata {
		if got, ok := rec.Metadata[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// live returns the records f matches, reaping the dead.
func (s *Server) live(ctx context.Context, f listFilter) []*record {
	var out []*record
	for _, rec := range s.store.list() {
		if rec.State == stateRunning && !s.alive(ctx, rec.Sandbox) {
			if cur, err := s.store.get(rec.ID); err == nil && cur.Sandbox == rec.Sandbox && cur.State == stateRunning {
				s.reap(rec)
			}
			continue
		}
		if f.match(rec) {
			out = append(out, rec)
		}
	}
	return out
}

func (s *Server) listSandboxes(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	var f listFilter
	var err error
	if f.metadata, err = metadataFilter(q.Get("metadata")); err != nil {
		return err
	}
	for _, st := range strings.Split(q.Get("state"), ",") {
		switch st {
		case "":
		case stateRunning, statePaused:
			f.states = append(f.states, st)
		default:
			return errdefs.InvalidArgument("state %s: want running or paused", errdefs.Quote(st))
		}
	}
	f.template = q.Get("template")
	if v := q.Get("startedAfter"); v != "" {
		if f.startedAfter, err = time.Parse(time.RFC3339Nano, v); err != nil {
			return errdefs.InvalidArgument("startedAfter %s: want RFC 3339", errdefs.Quote(v))
		}
	}
	limit := 100
	if v := q.Get("limit"); v != "" {
		if limit, err = strconv.Atoi(v); err != nil || limit < 1 || limit > 100 {
			return errdefs.InvalidArgument("limit %s: want 1 to 100", errdefs.Quote(v))
		}
	}
	recs := s.live(r.Context(), f)
	if q.Get("order") == "asc" {
		slices.Reverse(recs)
	} else if o := q.Get("order"); o != "" && o != "desc" {
		return errdefs.InvalidArgument("order %s: want asc or desc", errdefs.Quote(o))
	}
	if tok := q.Get("nextToken"); tok != "" {
		after, err := base64.RawURLEncoding.DecodeString(tok)
		if err != nil {
			return errdefs.InvalidArgument("nextToken %s: not one this server made", errdefs.Quote(tok))
		}
		i := slices.IndexFunc(recs, func(rec *record) bool { return rec.ID == string(after) })
		if i < 0 {
			return errdefs.InvalidArgument("nextToken %s: its sandbox is gone; list again", errdefs.Quote(tok))
		}
		recs = recs[i+1:]
	}
	out := make([]listedSandbox, 0, min(limit, len(recs)))
	for _, rec := range recs[:min(limit, len(recs))] {
		out = append(out, s.listed(rec))
	}
	if len(recs) > limit {
		w.Header().Set("X-Next-Token", base64.RawURLEncoding.EncodeToString([]byte(recs[limit-1].ID)))
	}
	w.Header().Set("X-Total-Running", strconv.Itoa(len(s.live(r.Context(), listFilter{states: []string{stateRunning}}))))
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *Server) listSandboxesV1(w http.ResponseWriter, r *http.Request) error {
	md, err := metadataFilter(r.URL.Query().Get("metadata"))
	if err != nil {
		return err
	}
	out := []listedSandbox{}
	for _, rec := range s.live(r.Context(), listFilter{metadata: md, states: []string{stateRunning}}) {
		out = append(out, s.listed(rec))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}
