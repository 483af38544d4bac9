package e2b

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
)

// Sandbox states as E2B names them.
const (
	stateRunning = "running"
	statePaused  = "paused"
)

// record is one E2B sandbox: an id that outlives the forkd sandboxes that
// carry it (a pause ends one, the resume starts another), kept in a file
// of its own so that it survives daemon restarts.
type record struct {
	ID string `json:"id"`
	// Sandbox is the forkd sandbox running it; "" while paused.
	Sandbox string `json:"sandbox,omitempty"`
	// Template is the templateID asked for, Snapshot the forkd tag it
	// named.
	Template string `json:"template"`
	Snapshot string `json:"snapshot"`
	// State is stateRunning or statePaused; Paused, while paused, is the
	// snapshot holding its state.
	State  string `json:"state"`
	Paused string `json:"paused,omitempty"`
	// States are the snapshots its pauses made, oldest first: they go
	// with it.
	States []string `json:"states,omitempty"`

	Metadata     map[string]string `json:"metadata,omitempty"`
	EnvVars      map[string]string `json:"env_vars,omitempty"`
	AccessToken  string            `json:"access_token"`
	TrafficToken string            `json:"traffic_token"`
	// Private: its ports need the traffic token (allowPublicTraffic
	// false). NoInternet: egress denied (allow_internet_access false).
	Private    bool `json:"private,omitempty"`
	NoInternet bool `json:"no_internet,omitempty"`

	StartedAt time.Time `json:"started_at"`
	EndAt     time.Time `json:"end_at"`
	// AutoPause pauses at EndAt instead of killing; AutoResume resumes a
	// paused sandbox when traffic comes for it.
	AutoPause  bool `json:"auto_pause,omitempty"`
	AutoResume bool `json:"auto_resume,omitempty"`

	CPUCount int `json:"cpu_count"`
	MemoryMB int `json:"memory_mb"`

	// Contexts are the code interpreter's contexts besides the default.
	Contexts []codeContext `json:"contexts,omitempty"`
}

// codeContext is a code interpreter context: a namespace of the warm
// interpreter.
type codeContext struct {
	ID       string `json:"id"`
	Language string `json:"language"`
	Cwd      string `json:"cwd"`
}

func (r *record) clone() *record {
	c := *r
	c.States = slices.Clone(r.States)
	c.Contexts = slices.Clone(r.Contexts)
	c.Metadata = cloneMap(r.Metadata)
	c.EnvVars = cloneMap(r.EnvVars)
	return &c
}

func cloneMap(m map[string]string) map[string]string {
	if m == nil {
		return nil
	}
	c := make(map[string]string, len(m))
	for k, v := range m {
		c[k] = v
	}
	return c
}

// store keeps the records, one JSON file each under dir, and the
// snapshots made through E2B in one more file. Safe for concurrent use;
// a record's changes are durable when put returns.
type store struct {
	dir string

	mu    sync.Mutex
	recs  map[string]*record   // guarded by mu
	snaps map[string]*snapMark // guarded by mu; by tag
}

// snapMark is a snapshot made with POST /sandboxes/{id}/snapshots.
type snapMark struct {
	Tag     string    `json:"tag"`
	Sandbox string    `json:"sandbox"`
	Names   []string  `json:"names"`
	Created time.Time `json:"created"`
}

const snapsFile = "snapshots.json"

func openStore(dir string) (*store, error) {
	if err := os.MkdirAll(filepath.Join(dir, "sandboxes"), 0o700); err != nil {
		return nil, err
	}
	s := &store{dir: dir, recs: map[string]*record{}, snaps: map[string]*snapMark{}}
	ents, err := os.ReadDir(filepath.Join(dir, "sandboxes"))
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		name := e.Name()
		if !strings.HasSuffix(name, ".json") || strings.HasPrefix(name, ".") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, "sandboxes", name))
		if err != nil {
			return nil, err
		}
		var r record
		if err := json.Unmarshal(b, &r); err != nil || r.ID+".json" != name {
			return nil, fmt.Errorf("e2b sandbox record %s: unreadable (%v)", name, err)
		}
		s.recs[r.ID] = &r
	}
	b, err := os.ReadFile(filepath.Join(dir, snapsFile))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	if err == nil {
		var marks []*snapMark
		if err := json.Unmarshal(b, &marks); err != nil {
			return nil, fmt.Errorf("e2b %s: %w", snapsFile, err)
		}
		for _, m := range marks {
			s.snaps[m.Tag] = m
		}
	}
	return s, nil
}

// get returns a copy of record id.
func (s *store) get(id string) (*record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.recs[id]
	if r == nil {
		return nil, errdefs.NotFound("sandbox %s not found", errdefs.Quote(id))
	}
	return r.clone(), nil
}

// put writes r, new or changed.
func (s *store) put(r *record) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := fsutil.WriteJSON(filepath.Join(s.dir, "sandboxes", r.ID+".json"), r, 0o600); err != nil {
		return err
	}
	s.recs[r.ID] = r.clone()
	return nil
}

// update changes record id with fn and writes it.
func (s *store) update(id string, fn func(r *record) error) (*record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	cur := s.recs[id]
	if cur == nil {
		return nil, errdefs.NotFound("sandbox %s not found", errdefs.Quote(id))
	}
	r := cur.clone()
	if err := fn(r); err != nil {
		return nil, err
	}
	if err := fsutil.WriteJSON(filepath.Join(s.dir, "sandboxes", r.ID+".json"), r, 0o600); err != nil {
		return nil, err
	}
	s.recs[id] = r
	return r.clone(), nil
}

// remove forgets record id.
func (s *store) remove(id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := os.Remove(filepath.Join(s.dir, "sandboxes", id+".json")); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	delete(s.recs, id)
	return nil
}

// list returns copies of every record, newest first.
func (s *store) list() []*record {
	s.mu.Lock()
	out := make([]*record, 0, len(s.recs))
	for _, r := range s.recs {
		out = append(out, r.clone())
	}
	s.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if !out[i].StartedAt.Equal(out[j].StartedAt) {
			return out[i].StartedAt.After(out[j].StartedAt)
		}
		return out[i].ID < out[j].ID
	})
	return out
}

// markSnapshot records a snapshot made through E2B.
func (s *store) markSnapshot(m *snapMark) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.snaps[m.Tag] = m
	return s.saveSnapsLocked()
}

// unmarkSnapshot forgets one; it reports whether it was there.
func (s *store) unmarkSnapshot(tag string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.snaps[tag] == nil {
		return false, nil
	}
	delete(s.snaps, tag)
	return true, s.saveSnapsLocked()
}

// snapshots returns the snapshots made through E2B, newest first.
func (s *store) snapshots() []snapMark {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]snapMark, 0, len(s.snaps))
	for _, m := range s.snaps {
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.After(out[j].Created) })
	return out
}

func (s *store) saveSnapsLocked() error {
	marks := make([]*snapMark, 0, len(s.snaps))
	for _, m := range s.snaps {
		marks = append(marks, m)
	}
	sort.Slice(marks, func(i, j int) bool { return marks[i].Tag < marks[j].Tag })
	return fsutil.WriteJSON(filepath.Join(s.dir, snapsFile), marks, 0o600)
}
