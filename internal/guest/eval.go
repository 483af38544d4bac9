package guest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"syscall"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

func (a *Agent) eval(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	if a.py == nil {
		return nil, errdefs.NotImplemented("eval: python is not available in this image")
	}
	var req struct {
		proto.EvalRequest
		Stream bool `json:"stream"`
	}
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	return a.py.eval(ctx, r, req.EvalRequest, req.Stream)
}

func (in *interp) eval(ctx context.Context, r *request, req proto.EvalRequest, stream bool) (*proto.EvalResult, error) {
	p, err := in.acquire(ctx)
	if err != nil {
		return nil, err
	}
	defer in.release()
	call := &pyCall{r: r, ctx: ctx}
	if stream {
		call.stream = newStreamer(ctx, r)
		defer call.stream.close()
	}
	in.mu.Lock()
	in.call = call
	in.mu.Unlock()
	defer func() {
		in.mu.Lock()
		in.call = nil
		in.mu.Unlock()
	}()

	start := time.Now()
	id, err := in.send(p, pyReq{Op: "eval", Code: req.Code, Context: req.Context, Reset: req.Reset,
		Env: req.Env, Dir: req.Dir, Rich: req.Rich})
	if err != nil {
		in.kill(p)
		return nil, errdefs.Unavailable("eval: python interpreter is gone (%w); restarted", err)
	}
	var timeout <-chan time.Time
	if req.Timeout > 0 {
		t := time.NewTimer(req.Timeout)
		defer t.Stop()
		timeout = t.C
	}
	var grace <-chan time.Time
	cancelled, timedOut := false, false
	ctxDone := ctx.Done()
	interrupt := func() {
		// Fails only for an interpreter already gone; the grace timer
		// below ends the wait either way.
		_ = syscall.Kill(p.pid, syscall.SIGINT)
		t := time.NewTimer(in.a.cfg.EvalGrace)
		grace = t.C
	}
	finish := func(res *proto.EvalResult) (*proto.EvalResult, error) {
		call.mu.Lock()
		res.Stdout, res.Stderr = call.stdout.String(), call.stderr.String()
		res.Truncated = res.Truncated || call.truncated
		call.mu.Unlock()
		res.DurationMS = time.Since(start).Milliseconds()
		if cancelled {
			return nil, errdefs.Unavailable("eval: cancelled")
		}
		return res, nil
	}
	for {
		select {
		case m, ok := <-p.msgs:
			if !ok {
				<-p.dead
				in.startAsync()
				return finish(&proto.EvalResult{
					Restarted: true,
					TimedOut:  timedOut,
					Error: &proto.EvalError{
						Name:    "InterpreterExited",
						Message: fmt.Sprintf("python interpreter exited (%s); restarted, state lost", describeStatus(p.status.ws)),
					},
				})
			}
			if m.ID != id {
				continue
			}
			switch m.T {
			case "out":
				call.output(proto.StreamStdout, m.S)
			case "err":
				call.output(proto.StreamStderr, m.S)
			case "done":
				in.awaitSync(p, id)
				res := &proto.EvalResult{Value: m.Value, Error: m.Error, Truncated: m.Truncated, Results: m.Results, Count: m.Count}
				if m.Interrupted && timedOut {
					res.TimedOut = true
					tb := ""
					if m.Error != nil {
						tb = m.Error.Traceback
					}
					res.Error = &proto.EvalError{
						Name:      "TimeoutError",
						Message:   fmt.Sprintf("execution exceeded the timeout of %v and was interrupted", req.Timeout),
						Traceback: tb,
					}
				}
				return finish(res)
			}
		case <-timeout:
			timeout = nil
			timedOut = true
			if grace == nil {
				interrupt()
			}
		case <-ctxDone:
			ctxDone = nil
			cancelled = true
			if grace == nil {
				interrupt()
			}
		case <-grace:
			in.a.log.Warn("python ignored SIGINT; restarting it", "pid", p.pid)
			in.kill(p)
			return finish(&proto.EvalResult{
				TimedOut:  timedOut,
				Restarted: true,
				Error: &proto.EvalError{
					Name: "TimeoutError",
					Message: fmt.Sprintf("execution exceeded the timeout of %v and did not stop within %v of an interrupt; interpreter restarted, state lost",
						req.Timeout, in.a.cfg.EvalGrace),
				},
			})
		}
	}
}

// syncWait bounds how long an eval waits for its raw output to drain.
const syncWait = 5 * time.Second

// awaitSync waits until both raw output pumps have passed call id's sync
// marker, so that the call's fd-level output is in its result.
func (in *interp) awaitSync(p *pyProc, id int64) {
	t := time.NewTimer(syncWait)
	defer t.Stop()
	for _, ch := range p.synced {
		for done := false; !done; {
			select {
			case got := <-ch:
				done = got >= id
			case <-p.dead:
				return
			case <-t.C:
				in.a.log.Warn("python output did not drain", "call", id)
				return
			}
		}
	}
}

// syncPrefix and syncSuffix frame pyserver.py's sync markers.
var (
	syncPrefix = []byte("\x00\x1bforkd-sync-")
	syncSuffix = []byte("\x1b\x00")
)

// syncScanner removes sync markers from a byte stream, across chunk
// boundaries.
type syncScanner struct {
	pending []byte // a possible marker start held back from the last chunk
}

// feed returns b's bytes that are output, and the ids of the markers in b.
func (s *syncScanner) feed(b []byte) ([]byte, []int64) {
	data := b
	if len(s.pending) > 0 {
		data = append(s.pending, b...)
		s.pending = nil
	}
	var out []byte
	var ids []int64
	for len(data) > 0 {
		i := bytes.Index(data, syncPrefix)
		if i < 0 {
			// Hold back a tail that could begin a marker.
			keep := 0
			for k := min(len(syncPrefix)-1, len(data)); k > 0; k-- {
				if bytes.HasPrefix(syncPrefix, data[len(data)-k:]) {
					keep = k
					break
				}
			}
			out = append(out, data[:len(data)-keep]...)
			s.pending = append(s.pending, data[len(data)-keep:]...)
			break
		}
		out = append(out, data[:i]...)
		rest := data[i+len(syncPrefix):]
		j := bytes.Index(rest, syncSuffix)
		if j < 0 {
			if len(rest) <= 20 {
				s.pending = append(s.pending, data[i:]...)
				break
			}
			// Not a marker after all.
			out = append(out, data[i:i+len(syncPrefix)]...)
			data = rest
			continue
		}
		id, err := strconv.ParseInt(string(rest[:j]), 10, 64)
		if err != nil {
			out = append(out, data[i:i+len(syncPrefix)]...)
			data = rest
			continue
		}
		ids = append(ids, id)
		data = rest[j+len(syncSuffix):]
	}
	return out, ids
}
