package guest

import (
	"context"
	"encoding/json"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

// proc is a process in the table: every running process the agent started
// for a host, and the most recent ended ones.
type proc struct {
	pid     int
	tag     string
	args    []string
	dir     string
	started time.Time
	// background: output kept in rings, stdin (if any) written by
	// processes.stdin.
	background     bool
	stdout, stderr *ring
	pty            *os.File // the terminal's master; nil without one

	mu     sync.Mutex
	stdin  *os.File // guarded by mu; nil when closed or absent
	done   chan struct{}
	result proto.ExecResult // valid once done is closed
}

func (p *proc) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

func (p *proc) info() proto.ProcessInfo {
	pi := proto.ProcessInfo{PID: p.pid, Tag: p.tag, Args: p.args, Dir: p.dir, StartedAt: p.started, Running: p.running()}
	if !pi.Running {
		res := p.result
		pi.Result = &res
	}
	return pi
}

// procTable tracks processes by pid. Safe for concurrent use.
type procTable struct {
	mu     sync.Mutex
	procs  map[int]*proc // guarded by mu
	exited []int         // guarded by mu; pids of ended background processes, oldest first
}

func newProcTable() *procTable { return &procTable{procs: map[int]*proc{}} }

func (t *procTable) add(p *proc) *proc {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.procs[p.pid] = p
	return p
}

// finish records p's result; a foreground process leaves the table, a
// background one stays among the last maxExited ended processes.
func (t *procTable) finish(p *proc, res proto.ExecResult, forget bool) {
	res.Tag = p.tag
	p.result = res
	close(p.done)
	t.mu.Lock()
	defer t.mu.Unlock()
	if forget {
		if t.procs[p.pid] == p {
			delete(t.procs, p.pid)
		}
		return
	}
	t.exited = append(t.exited, p.pid)
	for len(t.exited) > maxExited {
		old := t.exited[0]
		t.exited = t.exited[1:]
		if q := t.procs[old]; q != nil && !q.running() {
			delete(t.procs, old)
		}
	}
}

func (t *procTable) get(pid int) (*proc, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.procs[pid]
	if p == nil {
		return nil, errdefs.NotFound("process %d not found", pid)
	}
	return p, nil
}

func (t *procTable) list() []proto.ProcessInfo {
	t.mu.Lock()
	ps := make([]*proc, 0, len(t.procs))
	for _, p := range t.procs {
		ps = append(ps, p)
	}
	t.mu.Unlock()
	sort.Slice(ps, func(i, j int) bool { return ps[i].started.Before(ps[j].started) })
	out := make([]proto.ProcessInfo, 0, len(ps))
	for _, p := range ps {
		out = append(out, p.info())
	}
	return out
}

// killAll kills every running process group in the table.
func (t *procTable) killAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, p := range t.procs {
		if p.running() {
			_ = killGroup(p.pid, syscall.SIGKILL) // fails only for a process already gone
		}
	}
}

// startBackground starts cmd with its output kept in rings and returns at
// once, or, with req.Attach, streams its output to r as well (paced by
// r's credit) and returns its result when it ends. An attached call that
// is cancelled, or whose session ends, leaves the process running.
func (a *Agent) startBackground(ctx context.Context, r *request, cmd *command, req *proto.ExecRequest) (any, error) {
	start := time.Now()
	var (
		pid  int
		done <-chan exitStatus
		std  *stdio
		err  error
	)
	if req.PTY != nil {
		pid, done, std, err = a.startWithPTY(cmd, *req.PTY)
	} else {
		pid, done, std, err = a.startWithPipes(cmd, req.Stdin)
	}
	if err != nil {
		return nil, err
	}
	p := a.procs.add(&proc{
		pid: pid, tag: req.Tag, args: cmd.argv, dir: cmd.dir, started: start,
		background: true, stdout: newRing(ringSize), stderr: newRing(ringSize),
		stdin: std.stdin, pty: std.pty, done: make(chan struct{}),
	})
	var att *attachment
	if req.Attach {
		att = &attachment{r: r, ctx: ctx}
		r.sendEvent(proto.Event{Kind: "started", PID: pid})
	}
	exited := make(chan struct{})
	var wg sync.WaitGroup
	outs := []struct {
		f  *os.File
		rg *ring
		st proto.Stream
	}{{std.stdout, p.stdout, proto.StreamStdout}, {std.stderr, p.stderr, proto.StreamStderr}}
	for _, s := range outs {
		if s.f == nil { // a terminal has one output
			s.rg.close()
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			pump(s.f, exited, func(b []byte) error {
				_, err := s.rg.Write(b)
				att.send(s.st, b)
				return err
			})
			s.f.Close()
			s.rg.close()
		}()
	}
	go func() {
		st, timedOut := awaitExit(done, pid, req.Timeout, nil)
		close(exited)
		// Pipes (or a terminal's master), open until the pumps end:
		// setting a deadline cannot fail.
		for _, s := range outs {
			if s.f != nil {
				_ = s.f.SetReadDeadline(time.Now().Add(drainGrace))
			}
		}
		wg.Wait()
		p.mu.Lock()
		if p.stdin != nil {
			p.stdin.Close()
			p.stdin = nil
		}
		p.mu.Unlock()
		a.procs.finish(p, *result(pid, st, start, timedOut), false)
	}()
	if !req.Attach {
		return &proto.ExecResult{PID: pid, Tag: req.Tag, Running: true}, nil
	}
	select {
	case <-p.done:
		res := p.result
		return &res, nil
	case <-ctx.Done():
		return nil, errdefs.Unavailable("exec: detached; process %d runs on", pid)
	}
}

// attachment streams a background process's output to the call that
// started it until a send fails (the call was cancelled or its session
// ended); a nil attachment sends nothing. Each pump sends on its own
// goroutine.
type attachment struct {
	r      *request
	ctx    context.Context
	failed atomic.Bool
}

func (at *attachment) send(st proto.Stream, b []byte) {
	if at == nil || at.failed.Load() {
		return
	}
	if err := at.r.sendData(at.ctx, st, b, false); err != nil {
		at.failed.Store(true)
	}
}

func (a *Agent) processList(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	return &proto.ProcessList{Processes: a.procs.list()}, nil
}

func (a *Agent) processRef(args json.RawMessage) (*proc, error) {
	var ref proto.ProcessRef
	if err := decode(args, &ref); err != nil {
		return nil, err
	}
	return a.procs.get(ref.PID)
}

func (a *Agent) processWait(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	p, err := a.processRef(args)
	if err != nil {
		return nil, err
	}
	select {
	case <-p.done:
		res := p.result
		return &res, nil
	case <-ctx.Done():
		return nil, errdefs.Unavailable("processes.wait: cancelled")
	}
}

func (a *Agent) signalProc(p *proc, sig syscall.Signal) error {
	if !p.running() {
		return errdefs.FailedPrecondition("process %d has ended", p.pid)
	}
	if err := killGroup(p.pid, sig); err != nil {
		return errdefs.FailedPrecondition("signal process %d: %w", p.pid, err)
	}
	return nil
}

func (a *Agent) processSignal(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.SignalRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	sig, err := proto.ParseSignal(req.Signal)
	if err != nil {
		return nil, err
	}
	p, err := a.procs.get(req.PID)
	if err != nil {
		return nil, err
	}
	return nil, a.signalProc(p, sig)
}

func (a *Agent) processKill(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	p, err := a.processRef(args)
	if err != nil {
		return nil, err
	}
	return nil, a.signalProc(p, syscall.SIGKILL)
}

func (a *Agent) processStdin(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.StdinRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	p, err := a.procs.get(req.PID)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stdin == nil {
		return nil, errdefs.FailedPrecondition("process %d has no open stdin", p.pid)
	}
	if len(req.Data) > 0 {
		// p.stdin is an open pipe (p.mu held): setting its deadline
		// cannot fail.
		stop := context.AfterFunc(ctx, func() { _ = p.stdin.SetWriteDeadline(time.Now()) })
		_, err := p.stdin.Write(req.Data)
		stop()
		_ = p.stdin.SetWriteDeadline(time.Time{})
		if err != nil {
			return nil, errdefs.FailedPrecondition("write stdin of process %d: %w", p.pid, err)
		}
	}
	if req.EOF {
		p.stdin.Close()
		p.stdin = nil
	}
	return nil, nil
}

// processConnect streams a background process's recent and live output and
// ends with its result.
func (a *Agent) processConnect(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var ref proto.ProcessRef
	if err := decode(args, &ref); err != nil {
		return nil, err
	}
	p, err := a.procs.get(ref.PID)
	if err != nil {
		return nil, err
	}
	if !p.background {
		return nil, errdefs.FailedPrecondition("process %d is not a background process", p.pid)
	}
	buf := make([]byte, chunkSize)
	var offOut, offErr int64
	if ref.Live {
		offOut, offErr = p.stdout.end(), p.stderr.end()
	}
	for {
		n1, next, endOut, w1 := p.stdout.readAt(offOut, buf)
		offOut = next
		if n1 > 0 {
			if err := r.sendData(ctx, proto.StreamStdout, buf[:n1], false); err != nil {
				return nil, errdefs.Unavailable("processes.connect: %w", err)
			}
		}
		n2, next, endErr, w2 := p.stderr.readAt(offErr, buf)
		offErr = next
		if n2 > 0 {
			if err := r.sendData(ctx, proto.StreamStderr, buf[:n2], false); err != nil {
				return nil, errdefs.Unavailable("processes.connect: %w", err)
			}
		}
		if endOut && endErr {
			select {
			case <-p.done:
				res := p.result
				return &res, nil
			case <-ctx.Done():
				return nil, errdefs.Unavailable("processes.connect: cancelled")
			}
		}
		if n1 == 0 && n2 == 0 {
			select {
			case <-w1:
			case <-w2:
			case <-ctx.Done():
				return nil, errdefs.Unavailable("processes.connect: cancelled")
			}
		}
	}
}
