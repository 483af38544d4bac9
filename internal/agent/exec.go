package agent

import (
	"context"
	"errors"
	"io"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
)

// ExecRequest describes a process to run in the guest.
type ExecRequest struct {
	// Args is the argv (looked up in PATH when Args[0] has no slash);
	// Shell, instead, runs under /bin/sh -c.
	Args  []string
	Shell string
	// Env is added to the guest's default environment (PATH, HOME, ...).
	Env map[string]string
	// Dir is the working directory; the user's home (or /) when empty.
	Dir string
	// User is a name or uid from the guest's /etc/passwd; the agent's own
	// user (root) when empty.
	User string
	// Stdin, when set, is streamed to the process. For a background process
	// it is fed by a goroutine that lives until Stdin ends or the Client
	// stops. Without it the process reads /dev/null.
	Stdin io.Reader
	// Stdout and Stderr receive output as it is produced (nil discards).
	// Not used for background processes: see ConnectProcess.
	Stdout, Stderr io.Writer
	// Timeout, when positive, kills the process group after this long;
	// the result then has TimedOut.
	Timeout time.Duration
	// Background returns as soon as the process started (Running, PID).
	Background bool
	// StdinOpen, for a background process without Stdin, keeps its stdin
	// open for SendStdin and CloseStdin.
	StdinOpen bool
	// Tag labels a background process in Processes.
	Tag string
	// Attach, with Background, keeps the call until the process ends: its
	// output streams to Stdout and Stderr (paced by how fast they take
	// it) and Exec returns its result. Ending ctx detaches: the process
	// runs on as a plain background process (proto.ExecRequest.Attach).
	// The guest needs proto.FeatureAttach.
	Attach bool
	// OnStart, if set, is called with the pid once an attached process
	// has started.
	OnStart func(pid int)
	// PTY, with Background, runs the process on a pseudo-terminal of this
	// size: its output comes to Stdout, SendStdin feeds its input, and
	// ResizeProcess resizes it. The guest needs proto.FeaturePTY.
	PTY *proto.PTYSize
}

// Exec runs a process. A foreground call returns when the process has
// ended and its output was delivered; ending ctx kills the process group.
// Children a foreground process leaves behind in its group (`cmd &`) end
// with it: output they write after it exits is still read for a short while
// (about 2 s at most), then the group is killed. Start helpers that must
// outlive the call as Background processes.
func (c *Client) Exec(ctx context.Context, req ExecRequest) (*proto.ExecResult, error) {
	var cancel context.CancelFunc
	switch {
	case req.Background && req.Attach:
		ctx, cancel = context.WithCancel(ctx) // as long as the caller stays
	case req.Background:
		ctx, cancel = withDeadline(ctx, DefaultCallTimeout) // until it started
	default:
		ctx, cancel = c.callDeadline(ctx, req.Timeout)
	}
	defer cancel()
	wire := proto.ExecRequest{
		Args: req.Args, Shell: req.Shell, Env: req.Env, Dir: req.Dir, User: req.User,
		Stdin: req.Stdin != nil || (req.StdinOpen && req.Background), Timeout: req.Timeout, Background: req.Background, Tag: req.Tag,
		Attach: req.Attach && req.Background, PTY: req.PTY,
	}
	cl, err := c.start(ctx, proto.OpExec, wire)
	if err != nil {
		return nil, err
	}
	if req.Stdin != nil && !req.Background {
		sctx, stop := context.WithCancel(ctx)
		defer stop()
		go func() {
			var re *readError
			if err := c.sendStream(sctx, cl, proto.StreamStdin, req.Stdin); errors.As(err, &re) {
				// A broken stdin source ends the process's stdin. A failed
				// write stops the client, which fails the call.
				_ = c.w.WriteFrame(proto.Frame{Type: proto.TypeData, Flags: uint16(proto.StreamStdin) | proto.FlagEOF, ID: cl.id})
			}
		}()
	}
	var res proto.ExecResult
	var onEvent func(proto.Event) error
	if wire.Attach {
		onEvent = func(ev proto.Event) error {
			if ev.Kind == "started" {
				if req.Stdin != nil {
					go c.feedBackground(ev.PID, req.Stdin)
				}
				if req.OnStart != nil {
					req.OnStart(ev.PID)
				}
			}
			return nil
		}
	}
	out := streams(req.Stdout, req.Stderr)
	if wire.Attach {
		// A writer that fails detaches rather than cancels: the
		// process runs on.
		out = func(f proto.Frame) error {
			if err := streams(req.Stdout, req.Stderr)(f); err != nil {
				return &detached{err}
			}
			return nil
		}
	}
	err = c.waitEvents(ctx, cl, onEvent, out, &res)
	if err != nil {
		return nil, err
	}
	if req.Background && !wire.Attach && req.Stdin != nil {
		go c.feedBackground(res.PID, req.Stdin)
	}
	return &res, nil
}

// detached is the error of an attached exec whose output writer failed:
// the call was cancelled and the process runs on.
type detached struct{ err error }

func (d *detached) Error() string { return "detached: " + d.err.Error() }
func (d *detached) Unwrap() error { return d.err }

// ResizeProcess resizes the terminal of a process started with a PTY.
func (c *Client) ResizeProcess(ctx context.Context, pid int, size proto.PTYSize) error {
	return c.do(ctx, proto.OpProcessResize, proto.ResizeRequest{PID: pid, PTYSize: size}, nil)
}

// FollowProcess is ConnectProcess without the recent output: only what the
// process writes from now on, then its result. Needs proto.FeatureAttach.
func (c *Client) FollowProcess(ctx context.Context, pid int, stdout, stderr io.Writer) (*proto.ExecResult, error) {
	cl, err := c.start(ctx, proto.OpProcessConnect, proto.ProcessRef{PID: pid, Live: true})
	if err != nil {
		return nil, err
	}
	var res proto.ExecResult
	if err := c.wait(ctx, cl, streams(stdout, stderr), &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// feedBackground copies r to a background process's stdin, then closes it.
func (c *Client) feedBackground(pid int, r io.Reader) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-c.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if c.SendStdin(ctx, pid, buf[:n]) != nil {
				return
			}
		}
		if err != nil {
			// Best effort, like the sends: it fails only when the process
			// has ended or the client has stopped, and nobody waits for it.
			_ = c.CloseStdin(ctx, pid)
			return
		}
	}
}

// Processes lists the guest's processes started by the agent: running ones
// and recently ended background ones.
func (c *Client) Processes(ctx context.Context) ([]proto.ProcessInfo, error) {
	var res proto.ProcessList
	if err := c.do(ctx, proto.OpProcessList, nil, &res); err != nil {
		return nil, err
	}
	return res.Processes, nil
}

// WaitProcess waits for a process to end and returns its result, for as
// long as ctx allows.
func (c *Client) WaitProcess(ctx context.Context, pid int) (*proto.ExecResult, error) {
	var res proto.ExecResult
	if err := c.doUntil(ctx, proto.OpProcessWait, proto.ProcessRef{PID: pid}, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// SignalProcess sends a signal ("SIGTERM", "TERM", "15") to a process's
// group.
func (c *Client) SignalProcess(ctx context.Context, pid int, signal string) error {
	return c.do(ctx, proto.OpProcessSignal, proto.SignalRequest{PID: pid, Signal: signal}, nil)
}

// KillProcess sends SIGKILL to a process's group.
func (c *Client) KillProcess(ctx context.Context, pid int) error {
	return c.do(ctx, proto.OpProcessKill, proto.ProcessRef{PID: pid}, nil)
}

// SendStdin writes to the stdin of a background process started with Stdin.
func (c *Client) SendStdin(ctx context.Context, pid int, data []byte) error {
	return c.do(ctx, proto.OpProcessStdin, proto.StdinRequest{PID: pid, Data: data}, nil)
}

// CloseStdin closes the stdin of a background process.
func (c *Client) CloseStdin(ctx context.Context, pid int) error {
	return c.do(ctx, proto.OpProcessStdin, proto.StdinRequest{PID: pid, EOF: true}, nil)
}

// ConnectProcess attaches to a background process: it writes the recent
// output the agent kept (up to 64 KiB per stream), then live output, and
// returns the process's result when it ends. Ending ctx detaches without
// affecting the process.
func (c *Client) ConnectProcess(ctx context.Context, pid int, stdout, stderr io.Writer) (*proto.ExecResult, error) {
	cl, err := c.start(ctx, proto.OpProcessConnect, proto.ProcessRef{PID: pid})
	if err != nil {
		return nil, err
	}
	var res proto.ExecResult
	err = c.wait(ctx, cl, streams(stdout, stderr), &res)
	if err != nil {
		return nil, err
	}
	return &res, nil
}

// Eval runs Python code in the guest's warm interpreter. Exceptions and
// timeouts of the code are reported in the result; the error is for the
// call itself (errdefs.ErrNotImplemented: the image has no Python;
// errdefs.ErrUnavailable: the interpreter could not run).
func (c *Client) Eval(ctx context.Context, req proto.EvalRequest) (*proto.EvalResult, error) {
	return c.EvalStream(ctx, req, nil, nil)
}

// EvalStream is Eval that also writes the code's output to stdout and stderr
// as it is produced.
func (c *Client) EvalStream(ctx context.Context, req proto.EvalRequest, stdout, stderr io.Writer) (*proto.EvalResult, error) {
	wire := struct {
		proto.EvalRequest
		Stream bool `json:"stream,omitempty"`
	}{req, stdout != nil || stderr != nil}
	ctx, cancel := c.callDeadline(ctx, req.Timeout)
	defer cancel()
	cl, err := c.start(ctx, proto.OpEval, wire)
	if err != nil {
		return nil, err
	}
	var res proto.EvalResult
	write := streams(stdout, stderr)
	err = c.wait(ctx, cl, func(f proto.Frame) error {
		_ = write(f) // a failing writer must not lose the result
		return nil
	}, &res)
	if err != nil {
		return nil, err
	}
	return &res, nil
}

// streams returns a frame handler writing the stdout and stderr data of a
// call to the given writers (nil discards); it returns their write error.
func streams(stdout, stderr io.Writer) func(proto.Frame) error {
	return func(f proto.Frame) error {
		var w io.Writer
		switch f.Stream() {
		case proto.StreamStdout:
			w = stdout
		case proto.StreamStderr:
			w = stderr
		}
		if w == nil {
			return nil
		}
		_, err := w.Write(f.Payload)
		return err
	}
}
