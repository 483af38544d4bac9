package qemu

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
)

// qmp is a client for one QEMU Machine Protocol connection. Commands are
// sent one at a time (guarded by mu). Asynchronous events go to onEvent
// when it is set and are dropped otherwise: forkd polls state, and waits
// for an event (awaitEvent) only to learn sooner what polling would tell.
type qmp struct {
	conn *net.UnixConn
	mu   sync.Mutex // guards r, line, and the write/read pairing of a command
	r    *bufio.Reader
	line []byte // a line read in part when a deadline cut the read short

	// onEvent, if set, receives every event read, on the goroutine that
	// reads it, with mu held. Set it while no command runs.
	onEvent func(name string, data json.RawMessage)
}

type qmpError struct {
	Class string `json:"class"`
	Desc  string `json:"desc"`
}

type qmpReply struct {
	Return json.RawMessage `json:"return"`
	Error  *qmpError       `json:"error"`
	Event  string          `json:"event"`
	Data   json.RawMessage `json:"data"`
	QMP    json.RawMessage `json:"QMP"`
}

// dialQMP connects to the QMP socket at path, retrying until the socket
// accepts or ctx ends, then negotiates capabilities.
func dialQMP(ctx context.Context, path string, exited func() bool) (*qmp, error) {
	var conn *net.UnixConn
	for {
		c, err := dialUnix(ctx, path)
		if err == nil {
			conn = c
			break
		}
		if exited != nil && exited() {
			return nil, errdefs.Unavailable("qemu exited before its monitor answered")
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("connect qmp: %w (last: %w)", ctx.Err(), err)
		case <-time.After(2 * time.Millisecond):
		}
	}
	q := &qmp{conn: conn, r: bufio.NewReaderSize(conn, 64<<10)}
	// Deadlines fail only on a closed connection, where the I/O they
	// bound fails too.
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Now()) })
	defer stop()
	var greet qmpReply
	if err := q.read(&greet); err != nil {
		conn.Close()
		return nil, fmt.Errorf("qmp greeting: %w", err)
	}
	if greet.QMP == nil {
		conn.Close()
		return nil, fmt.Errorf("qmp greeting: unexpected message")
	}
	if err := q.execute(ctx, "qmp_capabilities", nil, nil, -1); err != nil {
		conn.Close()
		return nil, err
	}
	return q, nil
}

func (q *qmp) close() error { return q.conn.Close() }

// read reads the next reply or event line. A line cut short by a read
// deadline is kept, and completed by the next read.
func (q *qmp) read(v *qmpReply) error {
	for {
		chunk, err := q.r.ReadSlice('\n')
		q.line = append(q.line, chunk...)
		if errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		if err != nil {
			return err
		}
		line := q.line
		q.line = q.line[:0]
		*v = qmpReply{}
		return json.Unmarshal(line, v)
	}
}

// event hands an event to onEvent.
func (q *qmp) event(rep *qmpReply) {
	if q.onEvent != nil {
		q.onEvent(rep.Event, rep.Data)
	}
}

// awaitEvent waits up to d for an event, hands it to onEvent and reports
// whether one came. Only events may arrive: no command is in flight.
func (q *qmp) awaitEvent(ctx context.Context, d time.Duration) (bool, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	dl := time.Now().Add(d)
	if cdl, ok := ctx.Deadline(); ok && cdl.Before(dl) {
		dl = cdl
	}
	_ = q.conn.SetDeadline(dl)
	stop := context.AfterFunc(ctx, func() { _ = q.conn.SetDeadline(time.Now()) })
	defer stop()
	var rep qmpReply
	if err := q.read(&rep); err != nil {
		if ctx.Err() == nil && errors.Is(err, os.ErrDeadlineExceeded) {
			return false, nil
		}
		return false, q.ioErr(ctx, "(awaiting an event)", err)
	}
	if rep.Event == "" {
		return false, errdefs.Unavailable("qmp: a reply nobody asked for")
	}
	q.event(&rep)
	return true, nil
}

// execute runs cmd with args and decodes its return value into out (if not
// nil). If fd >= 0 it is passed along with the command (SCM_RIGHTS), as
// getfd needs.
func (q *qmp) execute(ctx context.Context, cmd string, args, out any, fd int) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	msg, err := json.Marshal(req)
	if err != nil {
		return err
	}
	// Deadlines fail only on a closed connection, where the I/O they
	// bound fails too.
	if dl, ok := ctx.Deadline(); ok {
		_ = q.conn.SetDeadline(dl)
	} else {
		_ = q.conn.SetDeadline(time.Time{})
	}
	stop := context.AfterFunc(ctx, func() { _ = q.conn.SetDeadline(time.Now()) })
	defer stop()
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	if _, _, err := q.conn.WriteMsgUnix(append(msg, '\n'), oob, nil); err != nil {
		return q.ioErr(ctx, cmd, err)
	}
	for {
		var rep qmpReply
		if err := q.read(&rep); err != nil {
			return q.ioErr(ctx, cmd, err)
		}
		if rep.Event != "" {
			q.event(&rep)
			continue
		}
		if rep.Error != nil {
			return &replyError{cmd: cmd, class: rep.Error.Class, desc: rep.Error.Desc}
		}
		if out != nil && rep.Return != nil {
			if err := json.Unmarshal(rep.Return, out); err != nil {
				return fmt.Errorf("qmp %s: decode reply: %w", cmd, err)
			}
		}
		return nil
	}
}

// replyError is QEMU's answer that a command failed (as opposed to a
// command whose answer never came).
type replyError struct{ cmd, class, desc string }

func (e *replyError) Error() string { return fmt.Sprintf("qmp %s: %s: %s", e.cmd, e.class, e.desc) }

func (q *qmp) ioErr(ctx context.Context, cmd string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("qmp %s: %w", cmd, ctx.Err())
	}
	if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
		// The connection's deadline fired before ctx's timer.
		return fmt.Errorf("qmp %s: %w", cmd, context.DeadlineExceeded)
	}
	if errors.Is(err, net.ErrClosed) {
		return errdefs.Unavailable("qmp %s: connection closed", cmd)
	}
	return errdefs.Unavailable("qmp %s: %w", cmd, err)
}

// migrationStatus is the part of query-migrate forkd reads.
type migrationStatus struct {
	Status      string `json:"status"`
	ErrorDesc   string `json:"error-desc"`
	TotalTimeMS int64  `json:"total-time"`
}

// waitMigration polls query-migrate until the migration completes or fails.
func (q *qmp) waitMigration(ctx context.Context) error {
	for {
		var st migrationStatus
		if err := q.execute(ctx, "query-migrate", nil, &st, -1); err != nil {
			return err
		}
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("migration %s: %s", st.Status, st.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("migration: %w", ctx.Err())
		case <-time.After(3 * time.Millisecond):
		}
	}
}

// runStatus returns QEMU's run state ("running", "paused", "inmigrate", ...).
func (q *qmp) runStatus(ctx context.Context) (string, error) {
	var st struct {
		Status string `json:"status"`
	}
	if err := q.execute(ctx, "query-status", nil, &st, -1); err != nil {
		return "", err
	}
	return st.Status, nil
}

var ignoreShared = map[string]any{
	"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": true}},
}
