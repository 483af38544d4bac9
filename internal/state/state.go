// Package state is forkd's durable record of sandboxes: an embedded bbolt
// database in the data dir. Every change is committed (fsynced) before the
// call returns.
//
// Two modes: a daemon keeps the database open (Open with Persistent); CLI
// commands open it per transaction, so that a long-running command (an exec
// streaming output) never holds the file lock that other commands need.
package state

import (
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/vmm"
)

// Sandbox statuses.
const (
	StatusStarting = "starting"
	// StatusBuilding is a snapshot's parent VM holding a network slot.
	StatusBuilding = "building"
	// StatusParked is a VMM started ahead of a fork, waiting in a pool.
	StatusParked  = "parked"
	StatusRunning = "running"
	// StatusUnresponsive is a running sandbox whose agent stopped
	// answering (a liveness ping went unanswered); it turns running again
	// when the agent answers.
	StatusUnresponsive = "unresponsive"
	// StatusFrozen is a running sandbox whose VMM the daemon froze while
	// nobody talked to it. It is never stored (the record says running):
	// the daemon's Get and List show it.
	StatusFrozen = "frozen"
	StatusDead   = "dead"
	StatusOOM    = "oom"
)

// Live reports whether a sandbox in status is up: running, or running but
// unresponsive or frozen.
func Live(status string) bool {
	return status == StatusRunning || status == StatusUnresponsive || status == StatusFrozen
}

// Sandbox is the persisted record of one sandbox.
type Sandbox struct {
	ID        string            `json:"id"`
	Snapshot  string            `json:"snapshot"`
	Status    string            `json:"status"`
	Handle    vmm.Handle        `json:"handle"`
	Created   time.Time         `json:"created"`
	ReadyMS   int64             `json:"ready_ms,omitempty"`
	ExpiresAt time.Time         `json:"expires_at,omitzero"`
	Metadata  map[string]string `json:"metadata,omitempty"`
	// Net is the sandbox's own network, when it has one.
	Net *Network `json:"net,omitempty"`
	// Limits are the sandbox's resource limits, when it has a cgroup.
	Limits *Limits `json:"limits,omitempty"`
	// Disk is the sandbox's writable disk, when it has one.
	Disk *Disk `json:"disk,omitempty"`
	// Starter is the forkd process making this record (while it is
	// starting, building or parked): such a record belongs to that process
	// while it lives, and is abandoned once it has gone.
	Starter *proc.Identity `json:"starter,omitempty"`
	// Batch names the fork batch that made the sandbox while that batch is
	// open (see Batch): a crash before it closes aborts the sandbox.
	Batch string `json:"batch,omitempty"`
	// OnUnresponsive is what happens when the agent stops answering:
	// "keep" (mark it, keep it for inspection) or "kill"; "" follows the
	// engine's default.
	OnUnresponsive string `json:"on_unresponsive,omitempty"`
	// IdleFreezeSecs is how long the sandbox may go without a request or
	// inbound traffic before the daemon freezes it: 0 follows the
	// daemon's --idle-freeze, -1 never.
	IdleFreezeSecs int `json:"idle_freeze_secs,omitempty"`
	// GuestPIDsLimit is the cap on tasks inside the guest its agent was
	// given at the fork (0: the agent's default); a later init (the
	// clock set after a wake) gives it again.
	GuestPIDsLimit int `json:"guest_pids_limit,omitempty"`
	// Extra holds records owned by other packages, keyed by package.
	Extra map[string]json.RawMessage `json:"extra,omitempty"`
}

// Network is a sandbox's network slot: a namespace holding its tap, joined
// to the host, with its egress policy and published ports.
type Network struct {
	Slot int `json:"slot"`
	// Address is where the host reaches the guest.
	Address string `json:"address"`
	NetNS   string `json:"netns"`
	// Policy is the egress policy (netns.Policy's JSON).
	Policy json.RawMessage `json:"policy,omitempty"`
	Ports  []Port          `json:"ports,omitempty"`
}

// Port is a guest port published on a host port.
type Port struct {
	Proto     string `json:"proto"`
	GuestPort int    `json:"guest_port"`
	HostPort  int    `json:"host_port"`
}

// Disk is a sandbox's writable disk: a qcow2 image in its run dir that
// its VMM writes to (the top of a chain of disk layers).
type Disk struct {
	MiB int `json:"mib"`
	// Image is the image the VMM writes to now, unless Next is set. An
	// older forkd left it "" when a branch failed in a way that left it
	// unknown (the sandbox runs on, and cannot be branched again).
	Image string `json:"image,omitempty"`
	// Next is the image a branch in progress switches the VMM to. Left
	// set by a crash, or by a branch that failed not knowing whether it
	// switched, it makes the image unknown: Image or Next, which the
	// next branch asks the VMM.
	Next string `json:"next,omitempty"`
}

// Limits are the resource limits of a sandbox's cgroup.
type Limits struct {
	MemoryMiB int64   `json:"memory_mib,omitempty"`
	CPUs      float64 `json:"cpus,omitempty"`
	PIDs      int64   `json:"pids,omitempty"`
	// IOWeight is the relative IO share (1–10000); IOReadBps and
	// IOWriteBps cap bytes per second on the disk holding the data dir.
	IOWeight   uint64 `json:"io_weight,omitempty"`
	IOReadBps  uint64 `json:"io_read_bps,omitempty"`
	IOWriteBps uint64 `json:"io_write_bps,omitempty"`
}

// Batch is an open fork batch: its children are recorded as its members
// (Sandbox.Batch) before they start, and the batch is deleted once its
// answer is given. A batch whose starter died before that was never
// answered, so reconcile aborts every member, running ones included.
type Batch struct {
	ID      string         `json:"id"`
	Starter *proc.Identity `json:"starter,omitempty"`
	Created time.Time      `json:"created"`
}

var (
	bucketSandboxes  = []byte("sandboxes")
	bucketBatches    = []byte("batches")
	bucketWorkspaces = []byte("workspaces")
)

// Workspace statuses.
const (
	WorkspaceRunning   = "running"
	WorkspaceSuspended = "suspended"
)

// Workspace is a named, long-lived sandbox: its current sandbox while it
// runs, and the state snapshots it was suspended to.
type Workspace struct {
	Name string `json:"name"`
	// Snapshot is what it was created from; never removed with it.
	Snapshot string `json:"snapshot"`
	Status   string `json:"status"`
	// Sandbox is its sandbox while running ("" when suspended).
	Sandbox string `json:"sandbox,omitempty"`
	// States are the snapshots it was suspended to, oldest first; the last
	// ready one is what it resumes from. Each is removed with it.
	States  []string  `json:"states,omitempty"`
	Created time.Time `json:"created"`
	Updated time.Time `json:"updated"`
	// Options are its sandboxes' options (limits, network...), as JSON of
	// the caller's choosing, reused at each resume.
	Options json.RawMessage `json:"options,omitempty"`
}

// Options configure Open.
type Options struct {
	// Persistent keeps the database open until Close (daemon mode).
	Persistent bool
	// LockTimeout bounds the wait for the file lock (default 10 s).
	LockTimeout time.Duration
}

// Store is the sandbox database.
type Store struct {
	path string
	opts Options

	mu sync.Mutex // guards db
	db *bolt.DB   // open in persistent mode only
}

// Open opens (creating if needed) the database at path.
func Open(path string, opts Options) (*Store, error) {
	if opts.LockTimeout == 0 {
		opts.LockTimeout = 10 * time.Second
	}
	s := &Store{path: path, opts: opts}
	db, err := s.open()
	if err != nil {
		return nil, err
	}
	if opts.Persistent {
		s.db = db
	} else {
		db.Close()
	}
	return s, nil
}

func (s *Store) open() (*bolt.DB, error) {
	db, err := bolt.Open(s.path, 0o600, &bolt.Options{Timeout: s.opts.LockTimeout})
	if err != nil {
		if errors.Is(err, bolterrors.ErrTimeout) {
			return nil, errdefs.Unavailable("state database %s is locked by another forkd process (is `forkd serve` running? then use it: set FORKD_URL or its socket)", s.path)
		}
		return nil, fmt.Errorf("open state database: %w", err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		if _, err := tx.CreateBucketIfNotExists(bucketSandboxes); err != nil {
			return err
		}
		if _, err := tx.CreateBucketIfNotExists(bucketBatches); err != nil {
			return err
		}
		_, err := tx.CreateBucketIfNotExists(bucketWorkspaces)
		return err
	})
	if err != nil {
		db.Close()
		return nil, err
	}
	return db, nil
}

// Close closes a persistent store.
func (s *Store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.db == nil {
		return nil
	}
	err := s.db.Close()
	s.db = nil
	return err
}

func (s *Store) with(write bool, fn func(b *bolt.Bucket) error) error {
	return s.withTx(write, func(tx *bolt.Tx) error { return fn(tx.Bucket(bucketSandboxes)) })
}

// withTx runs fn in a transaction over the whole database.
func (s *Store) withTx(write bool, fn func(*bolt.Tx) error) error {
	s.mu.Lock()
	db := s.db
	s.mu.Unlock()
	if db == nil {
		var err error
		if db, err = s.open(); err != nil {
			return err
		}
		defer db.Close()
	}
	if write {
		return db.Update(fn)
	}
	return db.View(fn)
}

// Put stores sb, replacing any record with the same ID.
func (s *Store) Put(sb *Sandbox) error {
	b, err := json.Marshal(sb)
	if err != nil {
		return err
	}
	return s.with(true, func(bk *bolt.Bucket) error { return bk.Put([]byte(sb.ID), b) })
}

// PutAll stores several records in one transaction.
func (s *Store) PutAll(sbs []*Sandbox) error {
	return s.with(true, func(bk *bolt.Bucket) error {
		for _, sb := range sbs {
			b, err := json.Marshal(sb)
			if err != nil {
				return err
			}
			if err := bk.Put([]byte(sb.ID), b); err != nil {
				return err
			}
		}
		return nil
	})
}

// Get returns the record of id.
func (s *Store) Get(id string) (*Sandbox, error) {
	var sb *Sandbox
	err := s.with(false, func(bk *bolt.Bucket) error {
		v := bk.Get([]byte(id))
		if v == nil {
			return errdefs.NotFound("sandbox %q not found", id)
		}
		sb = new(Sandbox)
		return json.Unmarshal(v, sb)
	})
	return sb, err
}

// Update applies fn to the record of id inside one transaction.
func (s *Store) Update(id string, fn func(*Sandbox) error) (*Sandbox, error) {
	var sb *Sandbox
	err := s.with(true, func(bk *bolt.Bucket) error {
		v := bk.Get([]byte(id))
		if v == nil {
			return errdefs.NotFound("sandbox %q not found", id)
		}
		sb = new(Sandbox)
		if err := json.Unmarshal(v, sb); err != nil {
			return err
		}
		if err := fn(sb); err != nil {
			return err
		}
		b, err := json.Marshal(sb)
		if err != nil {
			return err
		}
		return bk.Put([]byte(id), b)
	})
	return sb, err
}

// List returns every record, oldest first.
func (s *Store) List() ([]*Sandbox, error) {
	var out []*Sandbox
	err := s.with(false, func(bk *bolt.Bucket) error {
		return bk.ForEach(func(k, v []byte) error {
			sb := new(Sandbox)
			if err := json.Unmarshal(v, sb); err != nil {
				return fmt.Errorf("record %q: %w", k, err)
			}
			out = append(out, sb)
			return nil
		})
	})
	sort.SliceStable(out, func(i, j int) bool {
		if !out[i].Created.Equal(out[j].Created) {
			return out[i].Created.Before(out[j].Created)
		}
		return out[i].ID < out[j].ID
	})
	return out, err
}

// PutWithSlot stores sb after giving sb.Net the lowest network slot in
// [0, max) that no record holds, in one transaction, so concurrent
// processes never share a slot.
func (s *Store) PutWithSlot(sb *Sandbox, max int) error {
	return s.with(true, func(bk *bolt.Bucket) error {
		used := map[int]bool{}
		err := bk.ForEach(func(k, v []byte) error {
			var r Sandbox
			if json.Unmarshal(v, &r) == nil && r.Net != nil && r.ID != sb.ID {
				used[r.Net.Slot] = true
			}
			return nil
		})
		if err != nil {
			return err
		}
		slot := -1
		for i := 0; i < max; i++ {
			if !used[i] {
				slot = i
				break
			}
		}
		if slot < 0 {
			return errdefs.ResourceExhausted("all %d network slots are in use", max)
		}
		if sb.Net == nil {
			sb.Net = &Network{}
		}
		sb.Net.Slot = slot
		b, err := json.Marshal(sb)
		if err != nil {
			return err
		}
		return bk.Put([]byte(sb.ID), b)
	})
}

// Rename stores sb under its (new) ID in place of the record oldID, in one
// transaction.
func (s *Store) Rename(oldID string, sb *Sandbox) error {
	b, err := json.Marshal(sb)
	if err != nil {
		return err
	}
	return s.with(true, func(bk *bolt.Bucket) error {
		if bk.Get([]byte(oldID)) == nil {
			return errdefs.NotFound("sandbox %q not found", oldID)
		}
		if oldID != sb.ID && bk.Get([]byte(sb.ID)) != nil {
			return errdefs.AlreadyExists("sandbox %q exists", sb.ID)
		}
		if err := bk.Delete([]byte(oldID)); err != nil {
			return err
		}
		return bk.Put([]byte(sb.ID), b)
	})
}

// Delete removes the record of id. Deleting a missing record is not an
// error.
func (s *Store) Delete(id string) error {
	return s.with(true, func(bk *bolt.Bucket) error { return bk.Delete([]byte(id)) })
}

// PutBatch records an open batch.
func (s *Store) PutBatch(b *Batch) error {
	v, err := json.Marshal(b)
	if err != nil {
		return err
	}
	return s.withTx(true, func(tx *bolt.Tx) error { return tx.Bucket(bucketBatches).Put([]byte(b.ID), v) })
}

// DeleteBatch closes batch id. Deleting a missing batch is not an error.
func (s *Store) DeleteBatch(id string) error {
	return s.withTx(true, func(tx *bolt.Tx) error { return tx.Bucket(bucketBatches).Delete([]byte(id)) })
}

// Batches returns the open batches by id.
func (s *Store) Batches() (map[string]*Batch, error) {
	out := map[string]*Batch{}
	err := s.withTx(false, func(tx *bolt.Tx) error {
		return tx.Bucket(bucketBatches).ForEach(func(k, v []byte) error {
			b := new(Batch)
			if err := json.Unmarshal(v, b); err != nil {
				return fmt.Errorf("batch %q: %w", k, err)
			}
			out[b.ID] = b
			return nil
		})
	})
	return out, err
}

// PutWorkspace stores w; with create set it fails with AlreadyExists when
// the name is taken.
func (s *Store) PutWorkspace(w *Workspace, create bool) error {
	v, err := json.Marshal(w)
	if err != nil {
		return err
	}
	return s.withTx(true, func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketWorkspaces)
		if create && b.Get([]byte(w.Name)) != nil {
			return errdefs.AlreadyExists("workspace %q already exists", w.Name)
		}
		return b.Put([]byte(w.Name), v)
	})
}

// UpdateWorkspace applies fn to workspace name inside one transaction.
func (s *Store) UpdateWorkspace(name string, fn func(*Workspace) error) (*Workspace, error) {
	var w *Workspace
	err := s.withTx(true, func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketWorkspaces)
		v := b.Get([]byte(name))
		if v == nil {
			return errdefs.NotFound("workspace %q not found", name)
		}
		w = new(Workspace)
		if err := json.Unmarshal(v, w); err != nil {
			return err
		}
		if err := fn(w); err != nil {
			return err
		}
		nv, err := json.Marshal(w)
		if err != nil {
			return err
		}
		return b.Put([]byte(name), nv)
	})
	return w, err
}

// GetWorkspace returns workspace name.
func (s *Store) GetWorkspace(name string) (*Workspace, error) {
	var w *Workspace
	err := s.withTx(false, func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketWorkspaces).Get([]byte(name))
		if v == nil {
			return errdefs.NotFound("workspace %q not found", name)
		}
		w = new(Workspace)
		return json.Unmarshal(v, w)
	})
	return w, err
}

// Workspaces returns every workspace, by name.
func (s *Store) Workspaces() ([]*Workspace, error) {
	var out []*Workspace
	err := s.withTx(false, func(tx *bolt.Tx) error {
		return tx.Bucket(bucketWorkspaces).ForEach(func(k, v []byte) error {
			w := new(Workspace)
			if err := json.Unmarshal(v, w); err != nil {
				return fmt.Errorf("workspace %q: %w", k, err)
			}
			out = append(out, w)
			return nil
		})
	})
	return out, err
}

// DeleteWorkspace removes workspace name's record.
func (s *Store) DeleteWorkspace(name string) error {
	return s.withTx(true, func(tx *bolt.Tx) error { return tx.Bucket(bucketWorkspaces).Delete([]byte(name)) })
}
