package server

import (
	"bytes"
	"crypto/rand"
	"encoding/base32"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
)

// keepOperations is how many finished operations are kept.
const keepOperations = 200

// maxRunningOperations bounds the operations running or queued at once
// (snapshot builds run two at a time; the rest wait): beyond it a new one
// is refused, so that callers cannot pile up unbounded work.
const maxRunningOperations = 32

// operations keeps long-running operations, one JSON file each in dir,
// each change written atomically before it is visible; with no dir they
// live in memory only (a server local to one CLI process). Progress
// lines are kept in memory and written with the operation's end.
type operations struct {
	dir string

	mu  sync.Mutex                  // guards ops
	ops map[string]*apiv1.Operation // by id
}

// openOperations loads dir. An operation still running in it was cut short
// by a daemon stop; it is marked failed.
func openOperations(dir string) (*operations, error) {
	if dir == "" {
		return &operations{ops: map[string]*apiv1.Operation{}}, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("operations dir: %w", err)
	}
	o := &operations{dir: dir, ops: map[string]*apiv1.Operation{}}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	for _, e := range entries {
		name := e.Name()
		if strings.HasPrefix(name, ".") {
			os.Remove(filepath.Join(dir, name)) // a write cut short
			continue
		}
		if !strings.HasSuffix(name, ".json") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return nil, err
		}
		var op apiv1.Operation
		if err := json.Unmarshal(b, &op); err != nil || op.ID+".json" != name {
			os.Remove(filepath.Join(dir, name))
			continue
		}
		if op.Status == apiv1.OperationRunning {
			op.Status = apiv1.OperationFailed
			op.Error = &apiv1.Error{Code: apiv1.CodeUnavailable, Message: "the daemon stopped before the operation finished"}
			op.Finished = time.Now().UTC()
			if err := o.write(&op); err != nil {
				return nil, err
			}
		}
		o.ops[op.ID] = &op
	}
	o.prune()
	return o, nil
}

var opIDEncoding = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// start records a new running operation. It fails with AlreadyExists when
// an operation of the same kind on the same snapshot is running.
func (o *operations) start(kind, snapshot string) (apiv1.Operation, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	running := 0
	for _, op := range o.ops {
		if op.Status != apiv1.OperationRunning {
			continue
		}
		running++
		if op.Kind == kind && op.Snapshot == snapshot {
			return apiv1.Operation{}, errdefs.AlreadyExists("snapshot %q is being written by operation %s", snapshot, op.ID)
		}
	}
	if running >= maxRunningOperations {
		return apiv1.Operation{}, errdefs.ResourceExhausted("%d operations are running or queued (at most %d); try again when one has finished", running, maxRunningOperations)
	}
	var b [7]byte
	rand.Read(b[:])
	op := &apiv1.Operation{
		ID: "op-" + opIDEncoding.EncodeToString(b[:])[:10], Kind: kind, Status: apiv1.OperationRunning,
		Snapshot: snapshot, Created: time.Now().UTC(),
	}
	if err := o.write(op); err != nil {
		return apiv1.Operation{}, err
	}
	o.ops[op.ID] = op
	return *op, nil
}

// finish records an operation's end.
func (o *operations) finish(id string, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	op := o.ops[id]
	if op == nil {
		return
	}
	done := *op
	done.Status = apiv1.OperationSucceeded
	if err != nil {
		done.Status = apiv1.OperationFailed
		e := wireError(err)
		done.Error = &e
	}
	done.Finished = time.Now().UTC()
	if werr := o.write(&done); werr != nil {
		done.Error = &apiv1.Error{Code: apiv1.CodeInternal, Message: errors.Join(err, werr).Error()}
	}
	*op = done
	o.prune()
}

func (o *operations) get(id string) (apiv1.Operation, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	op := o.ops[id]
	if op == nil {
		return apiv1.Operation{}, errdefs.NotFound("operation %s not found", errdefs.Quote(id))
	}
	return *op, nil
}

// list returns the operations, newest first.
func (o *operations) list() []apiv1.Operation {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := make([]apiv1.Operation, 0, len(o.ops))
	for _, op := range o.ops {
		out = append(out, *op)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.After(out[j].Created) })
	return out
}

// writing returns the tags of snapshots being built (or pulled, or
// unpacked).
func (o *operations) writing() map[string]bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	tags := map[string]bool{}
	for _, op := range o.ops {
		if op.Kind == opPush || op.Kind == opPack {
			continue // these read their snapshot
		}
		if op.Status == apiv1.OperationRunning && op.Snapshot != "" {
			tags[op.Snapshot] = true
		}
	}
	return tags
}

// setTransfer records a transfer's progress (or summary) in operation id.
func (o *operations) setTransfer(id string, t *apiv1.Transfer) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if op := o.ops[id]; op != nil {
		op.Transfer = t // a new value each time: callers hold copies of op
	}
}

// setSnapshot names the snapshot of operation id, once known (a pull
// learns its tag from the snapshot's config).
func (o *operations) setSnapshot(id, tag string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if op := o.ops[id]; op != nil {
		op.Snapshot = tag
	}
}

// progress returns a writer whose lines become operation id's progress.
func (o *operations) progress(id string) io.Writer {
	return &lineWriter{line: func(line string) {
		o.mu.Lock()
		defer o.mu.Unlock()
		op := o.ops[id]
		if op == nil || op.Status != apiv1.OperationRunning {
			return
		}
		// A new slice each time: callers hold copies of op.
		p := append(append([]string(nil), op.Progress...), line)
		if len(p) > apiv1.MaxOperationProgress {
			p = p[len(p)-apiv1.MaxOperationProgress:]
		}
		op.Progress = p
		op.ProgressLines++
	}}
}

// lineWriter calls line for each complete line written to it (a line
// longer than maxProgressLine is cut there), without its newline.
type lineWriter struct {
	mu   sync.Mutex // guards buf
	buf  []byte
	line func(string)
}

// maxProgressLine bounds one progress line.
const maxProgressLine = 1024

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		var line []byte
		switch nl := bytes.IndexByte(w.buf, '\n'); {
		case nl >= 0 && nl <= maxProgressLine:
			line, w.buf = w.buf[:nl], w.buf[nl+1:]
		case len(w.buf) >= maxProgressLine:
			line, w.buf = w.buf[:maxProgressLine], w.buf[maxProgressLine:]
		default:
			return len(p), nil
		}
		if l := strings.TrimRight(string(line), "\r"); l != "" {
			w.line(l)
		}
	}
}

// write stores op atomically (nothing without a dir).
func (o *operations) write(op *apiv1.Operation) error {
	if o.dir == "" {
		return nil
	}
	b, err := json.Marshal(op)
	if err != nil {
		return err
	}
	return fsutil.WriteFile(filepath.Join(o.dir, op.ID+".json"), b, 0o600)
}

// prune drops the oldest finished operations beyond keepOperations.
// Called with mu held.
func (o *operations) prune() {
	if len(o.ops) <= keepOperations {
		return
	}
	var done []*apiv1.Operation
	for _, op := range o.ops {
		if op.Status != apiv1.OperationRunning {
			done = append(done, op)
		}
	}
	sort.Slice(done, func(i, j int) bool { return done[i].Created.Before(done[j].Created) })
	// Running operations are never dropped, so fewer than the excess may go.
	for _, op := range done[:min(len(done), max(0, len(o.ops)-keepOperations))] {
		if o.dir != "" {
			os.Remove(filepath.Join(o.dir, op.ID+".json"))
		}
		delete(o.ops, op.ID)
	}
}
