package sandbox

import (
	"context"
	"sync"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/state"
)

// Admission bounds what a daemon admits. Zero fields mean no limit.
type Admission struct {
	// MaxSandboxes bounds live sandboxes (starting or running) in total.
	MaxSandboxes int
	// MaxPending bounds children admitted but not yet ready, across all
	// requests: restores beyond Config.MaxParallel wait for a slot, and
	// this caps how many may wait.
	MaxPending int
}

// Admitter forks batches within its Admission bounds. Admission is atomic: a batch's ids
// are reserved under one lock before any restore starts, so concurrent
// requests can never together exceed MaxSandboxes, and a refused batch
// starts nothing. Live sandboxes are counted from the state store (the
// truth, whoever wrote it) united with the reserved ids, so a child is
// never counted twice while its batch runs.
type Admitter struct {
	e      *Engine
	limits Admission

	mu       sync.Mutex          // guards reserved, and serialises admission
	reserved map[string]struct{} // ids of children whose batch is running
}

// NewAdmitter returns an Admitter forking through e.
func NewAdmitter(e *Engine, l Admission) *Admitter {
	return &Admitter{e: e, limits: l, reserved: map[string]struct{}{}}
}

// Admission returns the admitter's bounds.
func (a *Admitter) Admission() Admission { return a.limits }

// Fork admits spec (ResourceExhausted when a limit would be passed,
// InvalidArgument when the batch alone is over MaxSandboxes), then forks
// it with reserved ids. spec.IDs must be empty.
func (a *Admitter) Fork(ctx context.Context, spec ForkSpec) (*ForkResult, error) {
	if spec.IDs != nil {
		return nil, errdefs.InvalidArgument("ids are chosen by the admitter")
	}
	if spec.N < 1 {
		return nil, errdefs.InvalidArgument("n = %d: want at least 1", spec.N)
	}
	ids, err := a.reserve(spec.N)
	if err != nil {
		return nil, err
	}
	defer a.release(ids)
	spec.IDs = ids
	return a.e.Fork(ctx, spec)
}

// ForkFrom admits spec as Fork does, then forks it from the running
// sandbox id's current state (Engine.ForkFrom).
func (a *Admitter) ForkFrom(ctx context.Context, id, mode string, spec ForkSpec) (*ForkResult, error) {
	if spec.IDs != nil {
		return nil, errdefs.InvalidArgument("ids are chosen by the admitter")
	}
	if spec.N < 1 {
		return nil, errdefs.InvalidArgument("n = %d: want at least 1", spec.N)
	}
	ids, err := a.reserve(spec.N)
	if err != nil {
		return nil, err
	}
	defer a.release(ids)
	spec.IDs = ids
	return a.e.ForkFrom(ctx, id, mode, spec)
}

// Live returns the number of live sandboxes: records starting or running
// (with their VMM alive) and reserved ids.
func (a *Admitter) Live() (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.liveLocked()
}

func (a *Admitter) liveLocked() (int, error) {
	list, err := a.e.state.List()
	if err != nil {
		return 0, err
	}
	n := len(a.reserved)
	for _, sb := range list {
		if _, ok := a.reserved[sb.ID]; ok {
			continue
		}
		switch sb.Status {
		case state.StatusStarting:
			n++
		case state.StatusRunning, state.StatusUnresponsive:
			if proc.Alive(sb.Handle.Process) {
				n++
			}
		}
	}
	return n, nil
}

func (a *Admitter) reserve(n int) ([]string, error) {
	l := a.limits
	if l.MaxSandboxes > 0 && n > l.MaxSandboxes {
		return nil, errdefs.InvalidArgument("n = %d is over the daemon's limit of %d live sandboxes", n, l.MaxSandboxes)
	}
	if l.MaxPending > 0 && n > l.MaxPending {
		// Never satisfiable: a 429 would invite retries that cannot succeed.
		return nil, errdefs.InvalidArgument("n = %d is over the daemon's limit of %d restores in progress (--max-pending-restores)", n, l.MaxPending)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if l.MaxPending > 0 && len(a.reserved)+n > l.MaxPending {
		return nil, errdefs.ResourceExhausted("%d children are being restored and %d more would pass the limit of %d in progress; retry shortly",
			len(a.reserved), n, l.MaxPending)
	}
	if l.MaxSandboxes > 0 {
		live, err := a.liveLocked()
		if err != nil {
			return nil, err
		}
		if live+n > l.MaxSandboxes {
			return nil, errdefs.ResourceExhausted("%d live sandboxes and %d more would pass the limit of %d; kill some or raise --max-sandboxes",
				live, n, l.MaxSandboxes)
		}
	}
	ids := make([]string, n)
	for i := range ids {
		for {
			ids[i] = newID()
			if _, dup := a.reserved[ids[i]]; !dup {
				break
			}
		}
		a.reserved[ids[i]] = struct{}{}
	}
	return ids, nil
}

func (a *Admitter) release(ids []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, id := range ids {
		delete(a.reserved, id)
	}
}
