package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync/atomic"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

// call is one request in flight.
//
// readLoop counts what it queues against what the call granted: unacked
// data bytes against proto.InitialWindow, event bytes against
// maxQueuedEvents, and at most one result. A guest that exceeds them stops
// the client, so a call's queue stays bounded whatever the guest sends.
type call struct {
	id     uint32
	op     string
	q      *proto.Queue[proto.Frame] // result, events and data from the guest, payloads owned
	credit *proto.Credit             // for data sent to the guest
	acked  int                       // consumed bytes not yet returned as credit; owner only
	// unacked is data received and not yet returned as credit.
	unacked atomic.Int64
	// events is event bytes queued and not yet consumed.
	events atomic.Int64
	// result is set once a result is queued; readLoop only.
	result bool
}

// admit counts a frame readLoop is about to queue for cl and fails when the
// agent overran what the call allows.
func (cl *call) admit(f proto.Frame) error {
	switch f.Type {
	case proto.TypeData:
		if n := cl.unacked.Add(int64(len(f.Payload))); n > proto.InitialWindow {
			return errdefs.Unavailable("agent %s: agent ignored the data window (%d bytes unacknowledged, window %d)", cl.op, n, proto.InitialWindow)
		}
	case proto.TypeEvent:
		if n := cl.events.Add(int64(len(f.Payload))); n > maxQueuedEvents {
			return errdefs.Unavailable("agent %s: agent flooded the call with %d bytes of events", cl.op, n)
		}
	case proto.TypeResult:
		if cl.result {
			return errdefs.Unavailable("agent %s: agent sent a second result", cl.op)
		}
		cl.result = true
	}
	return nil
}

// start registers a call and sends its request. ctx is checked before the
// request is written; the write itself is bounded by the write timeout.
func (c *Client) start(ctx context.Context, op string, args any) (*call, error) {
	if err := ctx.Err(); err != nil {
		return nil, ctxError(op, err)
	}
	var raw json.RawMessage
	if args != nil {
		b, err := json.Marshal(args)
		if err != nil {
			return nil, errdefs.InvalidArgument("agent %s: %w", op, err)
		}
		raw = b
	}
	req, err := json.Marshal(proto.Request{Op: op, Args: raw})
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return nil, err
	}
	c.nextID++
	if c.nextID == 0 {
		c.nextID = 1
	}
	cl := &call{id: c.nextID, op: op, q: proto.NewQueue[proto.Frame](), credit: proto.NewCredit(proto.InitialWindow)}
	c.calls[cl.id] = cl
	first := len(c.calls) == 1
	c.mu.Unlock()
	if first {
		select {
		case c.busy <- struct{}{}:
		default:
		}
	}
	if err := c.w.WriteMessage(proto.TypeRequest, cl.id, req); err != nil {
		c.forget(cl)
		if !errdefs.Classed(err) {
			err = errdefs.Unavailable("agent %s: %w", op, err)
		}
		return nil, err
	}
	return cl, nil
}

// forget unregisters a call.
func (c *Client) forget(cl *call) {
	c.mu.Lock()
	if c.calls[cl.id] == cl {
		delete(c.calls, cl.id)
	}
	c.mu.Unlock()
	cl.q.Close(errdefs.Unavailable("agent %s: call ended", cl.op))
	cl.credit.Close(errdefs.Unavailable("agent %s: call ended", cl.op))
}

// cancel tells the guest to abandon a call and forgets it. The cancel
// frame is written in the background so that a stuck connection cannot
// hold up a caller whose context ended.
func (c *Client) cancel(cl *call) {
	// Written in the background (a guest slow to read must not hold up
	// the caller), but Close waits for it: a CLI interrupted by Ctrl-C
	// closes its client at once, and the cancel must reach the guest
	// before the connection goes, or the command runs on.
	c.cancels.Add(1)
	go func() {
		defer c.cancels.Add(-1)
		// A failed write stops the client (connWriter): nothing is left
		// in the guest to cancel through it.
		_ = c.w.WriteFrame(proto.Frame{Type: proto.TypeCancel, ID: cl.id})
	}()
	c.forget(cl)
}

// wait consumes a call's frames until its result, which it decodes into
// out. Data frames go to onData (dropped when nil); an error from onData
// cancels the call and is returned.
func (c *Client) wait(ctx context.Context, cl *call, onData func(proto.Frame) error, out any) error {
	return c.waitEvents(ctx, cl, nil, onData, out)
}

// waitEvents is wait that also hands the call's events to onEvent (when
// set); an error from onEvent cancels the call and is returned.
func (c *Client) waitEvents(ctx context.Context, cl *call, onEvent func(proto.Event) error, onData func(proto.Frame) error, out any) error {
	for {
		f, err := cl.q.Pop(ctx)
		if err != nil {
			if ctx.Err() != nil {
				c.cancel(cl)
				return ctxError(cl.op, ctx.Err())
			}
			return err
		}
		switch f.Type {
		case proto.TypeEvent:
			cl.events.Add(-int64(len(f.Payload)))
			if onEvent != nil {
				var ev proto.Event
				if err := json.Unmarshal(f.Payload, &ev); err != nil {
					c.cancel(cl)
					return fmt.Errorf("agent %s: bad event: %w", cl.op, err)
				}
				if err := onEvent(ev); err != nil {
					c.cancel(cl)
					return err
				}
			}
		case proto.TypeData:
			if onData != nil {
				if err := onData(f); err != nil {
					c.cancel(cl)
					return err
				}
			}
			c.consumed(cl, len(f.Payload))
		case proto.TypeResult:
			c.forget(cl)
			var res proto.Result
			if err := json.Unmarshal(f.Payload, &res); err != nil {
				return fmt.Errorf("agent %s: bad result: %w", cl.op, err)
			}
			if res.Error != nil {
				return res.Error.Err()
			}
			if out != nil && len(res.Result) > 0 {
				if err := json.Unmarshal(res.Result, out); err != nil {
					return fmt.Errorf("agent %s: bad result: %w", cl.op, err)
				}
			}
			return nil
		}
	}
}

// consumed returns credit to the guest in batches.
func (c *Client) consumed(cl *call, n int) {
	cl.acked += n
	if cl.acked < proto.InitialWindow/4 {
		return
	}
	inc := cl.acked
	cl.acked = 0
	cl.unacked.Add(-int64(inc))
	// A failed write stops the client (connWriter), which fails the call.
	_ = c.w.WriteFrame(proto.Frame{Type: proto.TypeWindow, ID: cl.id, Payload: proto.WindowPayload(uint32(inc))})
}

// sendStream copies r to the guest as data frames of stream st, ending with
// FlagEOF at r's EOF. It returns r's other errors without ending the
// stream: the caller decides between EOF and cancelling the call.
func (c *Client) sendStream(ctx context.Context, cl *call, st proto.Stream, r io.Reader) error {
	buf := make([]byte, 32<<10)
	for {
		n, rerr := r.Read(buf)
		for p := buf[:n]; len(p) > 0; {
			k, err := cl.credit.Take(ctx, len(p))
			if err != nil {
				return err
			}
			if err := c.w.WriteFrame(proto.Frame{Type: proto.TypeData, Flags: uint16(st), ID: cl.id, Payload: p[:k]}); err != nil {
				return err
			}
			p = p[k:]
		}
		if rerr == io.EOF {
			return c.w.WriteFrame(proto.Frame{Type: proto.TypeData, Flags: uint16(st) | proto.FlagEOF, ID: cl.id})
		}
		if rerr != nil {
			return &readError{rerr}
		}
	}
}

// readError is an error from the caller's reader in sendStream.
type readError struct{ err error }

func (e *readError) Error() string { return e.err.Error() }

func (e *readError) Unwrap() error { return e.err }

// do runs a call without data streams, bounded by DefaultCallTimeout
// unless ctx has a deadline.
func (c *Client) do(ctx context.Context, op string, args, out any) error {
	ctx, cancel := withDeadline(ctx, DefaultCallTimeout)
	defer cancel()
	return c.doUntil(ctx, op, args, out)
}

// doUntil runs a call without data streams for as long as ctx allows (a
// wait for a process that may run for hours).
func (c *Client) doUntil(ctx context.Context, op string, args, out any) error {
	cl, err := c.start(ctx, op, args)
	if err != nil {
		return err
	}
	return c.wait(ctx, cl, nil, out)
}

// ctxError is the error of call op whose context ended with err: a passed
// deadline is of class errdefs.ErrDeadlineExceeded and still matches
// context.DeadlineExceeded; a cancellation stays unclassed.
func ctxError(op string, err error) error {
	if errors.Is(err, context.DeadlineExceeded) {
		return errdefs.DeadlineExceeded("agent %s: %w", op, err)
	}
	return fmt.Errorf("agent %s: %w", op, err)
}
