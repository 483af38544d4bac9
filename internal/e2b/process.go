package e2b

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

// Messages of envd's process.Process service (process.proto), with their
// proto3 JSON names.

type processConfig struct {
	Cmd  string            `json:"cmd"`
	Args []string          `json:"args"`
	Envs map[string]string `json:"envs"`
	Cwd  *string           `json:"cwd,omitempty"`
}

type ptySize struct {
	Cols uint32 `json:"cols"`
	Rows uint32 `json:"rows"`
}

type ptyMsg struct {
	Size *ptySize `json:"size,omitempty"`
}

type startRequest struct {
	Process *processConfig `json:"process"`
	PTY     *ptyMsg        `json:"pty,omitempty"`
	Tag     *string        `json:"tag,omitempty"`
	Stdin   *bool          `json:"stdin,omitempty"`
}

type processSelector struct {
	PID *uint32 `json:"pid,omitempty"`
	Tag *string `json:"tag,omitempty"`
}

type selectorRequest struct {
	Process processSelector `json:"process"`
}

type processEvent struct {
	Start     *startEvent `json:"start,omitempty"`
	Data      *dataEvent  `json:"data,omitempty"`
	End       *endEvent   `json:"end,omitempty"`
	Keepalive *struct{}   `json:"keepalive,omitempty"`
}

type startEvent struct {
	PID uint32 `json:"pid"`
}

type dataEvent struct {
	Stdout []byte `json:"stdout,omitempty"`
	Stderr []byte `json:"stderr,omitempty"`
	PTY    []byte `json:"pty,omitempty"`
}

type endEvent struct {
	ExitCode int32   `json:"exitCode,omitempty"`
	Exited   bool    `json:"exited,omitempty"`
	Status   string  `json:"status,omitempty"`
	Error    *string `json:"error,omitempty"`
}

type startResponse struct {
	Event processEvent `json:"event"`
}

type processInfo struct {
	Config processConfig `json:"config"`
	PID    uint32        `json:"pid"`
	Tag    *string       `json:"tag,omitempty"`
}

type listResponse struct {
	Processes []processInfo `json:"processes"`
}

type processInput struct {
	Stdin []byte `json:"stdin,omitempty"`
	PTY   []byte `json:"pty,omitempty"`
}

type sendInputRequest struct {
	Process processSelector `json:"process"`
	Input   *processInput   `json:"input"`
}

type sendSignalRequest struct {
	Process processSelector `json:"process"`
	Signal  signalEnum      `json:"signal"`
}

type updateRequest struct {
	Process processSelector `json:"process"`
	PTY     *ptyMsg         `json:"pty,omitempty"`
}

type streamInputRequest struct {
	Start *struct {
		Process processSelector `json:"process"`
	} `json:"start,omitempty"`
	Data *struct {
		Input *processInput `json:"input"`
	} `json:"data,omitempty"`
	Keepalive *struct{} `json:"keepalive,omitempty"`
}

type empty struct{}

// signalEnum is process.Signal: its name or number.
type signalEnum string

func (s *signalEnum) UnmarshalJSON(b []byte) error {
	var name string
	if err := decodeJSON(b, &name); err == nil {
		*s = signalEnum(name)
		return nil
	}
	var n int
	if err := decodeJSON(b, &n); err != nil {
		return fmt.Errorf("signal: want a name or a number")
	}
	switch n {
	case 9:
		*s = "SIGNAL_SIGKILL"
	case 15:
		*s = "SIGNAL_SIGTERM"
	default:
		*s = signalEnum("SIGNAL_" + strconv.Itoa(n))
	}
	return nil
}

// pid resolves a selector: a pid, or a tag among the running processes.
func (ec *envdCall) pid(ctx context.Context, sel processSelector) (int, error) {
	if sel.PID != nil {
		return int(*sel.PID), nil
	}
	if sel.Tag == nil {
		return 0, withCode(codeInvalidArgument, errors.New("process: want a pid or a tag"))
	}
	ps, err := ec.c.Processes(ctx)
	if err != nil {
		return 0, err
	}
	for _, p := range ps {
		if p.Running && p.Tag == *sel.Tag {
			return p.PID, nil
		}
	}
	return 0, errdefs.NotFound("process with tag %s not found", errdefs.Quote(*sel.Tag))
}

// endOf is a process's end event as envd reports it (Go's ProcessState).
func endOf(res *proto.ExecResult) *endEvent {
	ev := &endEvent{}
	switch {
	case res.Signal != "":
		ev.ExitCode = -1
		ev.Status = "signal: " + signalText(res.Signal)
	default:
		ev.ExitCode, ev.Exited = int32(res.ExitCode), true
		ev.Status = "exit status " + strconv.Itoa(res.ExitCode)
	}
	if ev.ExitCode != 0 {
		msg := ev.Status
		ev.Error = &msg
	}
	return ev
}

// signalText is a signal's description as Go's syscall.Signal.String has it.
func signalText(name string) string {
	switch name {
	case "SIGKILL":
		return "killed"
	case "SIGTERM":
		return "terminated"
	case "SIGINT":
		return "interrupt"
	case "SIGHUP":
		return "hangup"
	case "SIGQUIT":
		return "quit"
	case "SIGABRT":
		return "aborted"
	case "SIGSEGV":
		return "segmentation fault"
	case "SIGPIPE":
		return "broken pipe"
	case "SIGBUS":
		return "bus error"
	case "SIGFPE":
		return "floating point exception"
	}
	return strings.ToLower(strings.TrimPrefix(name, "SIG"))
}

// output sends a process's output as data events of one field.
type output struct {
	sw    *streamWriter
	field string // "stdout", "stderr" or "pty"
}

func (o output) Write(p []byte) (int, error) {
	d := &dataEvent{}
	switch o.field {
	case "stderr":
		d.Stderr = p
	case "pty":
		d.PTY = p
	default:
		d.Stdout = p
	}
	if err := o.sw.send(startResponse{Event: processEvent{Data: d}}); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (ec *envdCall) start(ctx context.Context, r *http.Request, req *startRequest, sw *streamWriter) error {
	if req.Process == nil || req.Process.Cmd == "" {
		return withCode(codeInvalidArgument, errors.New("process.cmd is empty"))
	}
	user, err := ec.user(ctx, r, "")
	if err != nil {
		return err
	}
	cwd := user.Home
	if req.Process.Cwd != nil && *req.Process.Cwd != "" {
		cwd = user.abs(*req.Process.Cwd)
	}
	var pty *proto.PTYSize
	if req.PTY != nil {
		pty = &proto.PTYSize{Cols: 80, Rows: 24}
		if sz := req.PTY.Size; sz != nil {
			pty.Cols, pty.Rows = uint16(min(sz.Cols, 65535)), uint16(min(sz.Rows, 65535))
		}
	}
	tag := ""
	if req.Tag != nil {
		tag = *req.Tag
	}
	out, errOut := output{sw, "stdout"}, output{sw, "stderr"}
	if pty != nil {
		out.field = "pty"
	}
	cfg := *req.Process
	cfg.Envs = cloneMap(cfg.Envs)
	if cfg.Envs == nil {
		cfg.Envs = map[string]string{}
	}
	if cfg.Args == nil {
		cfg.Args = []string{}
	}
	if cfg.Cwd == nil {
		cfg.Cwd = &cwd
	}
	started := false
	res, err := ec.c.Exec(ctx, agent.ExecRequest{
		Args: append([]string{req.Process.Cmd}, req.Process.Args...), Env: ec.envOf(req.Process.Envs), Dir: cwd, User: user.Name,
		Background: true, Attach: true, StdinOpen: req.Stdin == nil || *req.Stdin, PTY: pty,
		Timeout: timeoutOf(r), Tag: tag, Stdout: out, Stderr: errOut,
		OnStart: func(pid int) {
			started = true
			ec.s.procs.add(ec.sb.ID, pid, procInfo{config: cfg, tag: tag, pty: pty != nil})
			// A failed send (the caller left) shows in the next one.
			_ = sw.send(startResponse{Event: processEvent{Start: &startEvent{PID: uint32(pid)}}})
		},
	})
	if err != nil {
		if !started && (errdefs.IsNotFound(err) || errdefs.IsFailedPrecondition(err)) {
			return withCode(codeInvalidArgument, err)
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return err
	}
	return sw.send(startResponse{Event: processEvent{End: endOf(res)}})
}

func (ec *envdCall) connect(ctx context.Context, r *http.Request, req *selectorRequest, sw *streamWriter) error {
	pid, err := ec.pid(ctx, req.Process)
	if err != nil {
		return err
	}
	ps, err := ec.c.Processes(ctx)
	if err != nil {
		return err
	}
	known := false
	for _, p := range ps {
		known = known || p.PID == pid
	}
	if !known {
		return errdefs.NotFound("process %d not found", pid)
	}
	if err := sw.send(startResponse{Event: processEvent{Start: &startEvent{PID: uint32(pid)}}}); err != nil {
		return err
	}
	out := output{sw, "stdout"}
	if pi, ok := ec.s.procs.get(ec.sb.ID, pid); ok && pi.pty {
		out.field = "pty"
	}
	res, err := ec.c.FollowProcess(ctx, pid, out, output{sw, "stderr"})
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return err
	}
	return sw.send(startResponse{Event: processEvent{End: endOf(res)}})
}

func (ec *envdCall) list(ctx context.Context, r *http.Request, _ *empty) (*listResponse, error) {
	ps, err := ec.c.Processes(ctx)
	if err != nil {
		return nil, err
	}
	out := &listResponse{Processes: []processInfo{}}
	running := map[int]bool{}
	for _, p := range ps {
		if !p.Running {
			continue
		}
		running[p.PID] = true
		pi, ok := ec.s.procs.get(ec.sb.ID, p.PID)
		if !ok {
			dir := p.Dir
			pi = procInfo{tag: p.Tag, config: processConfig{Args: []string{}, Envs: map[string]string{}, Cwd: &dir}}
			if len(p.Args) > 0 {
				pi.config.Cmd, pi.config.Args = p.Args[0], p.Args[1:]
			}
		}
		info := processInfo{Config: pi.config, PID: uint32(p.PID)}
		if pi.tag != "" {
			tag := pi.tag
			info.Tag = &tag
		}
		out.Processes = append(out.Processes, info)
	}
	ec.s.procs.keep(ec.sb.ID, running)
	return out, nil
}

// processError maps an agent error about a process to envd's codes: an
// ended process is not found.
func processError(err error) error {
	if errdefs.IsFailedPrecondition(err) && strings.Contains(err.Error(), "has ended") {
		return withCode(codeNotFound, err)
	}
	return err
}

func (ec *envdCall) sendInput(ctx context.Context, r *http.Request, req *sendInputRequest) (*empty, error) {
	pid, err := ec.pid(ctx, req.Process)
	if err != nil {
		return nil, err
	}
	if req.Input == nil {
		return &empty{}, nil
	}
	data := req.Input.Stdin
	if data == nil {
		data = req.Input.PTY
	}
	if len(data) == 0 {
		return &empty{}, nil
	}
	if err := ec.c.SendStdin(ctx, pid, data); err != nil {
		return nil, processError(err)
	}
	return &empty{}, nil
}

func (ec *envdCall) closeStdin(ctx context.Context, r *http.Request, req *selectorRequest) (*empty, error) {
	pid, err := ec.pid(ctx, req.Process)
	if err != nil {
		return nil, err
	}
	if err := ec.c.CloseStdin(ctx, pid); err != nil {
		return nil, processError(err)
	}
	return &empty{}, nil
}

func (ec *envdCall) sendSignal(ctx context.Context, r *http.Request, req *sendSignalRequest) (*empty, error) {
	pid, err := ec.pid(ctx, req.Process)
	if err != nil {
		return nil, err
	}
	var sig string
	switch req.Signal {
	case "SIGNAL_SIGKILL":
		sig = "SIGKILL"
	case "SIGNAL_SIGTERM":
		sig = "SIGTERM"
	default:
		return nil, withCode(codeInvalidArgument, fmt.Errorf("signal %s: want SIGNAL_SIGKILL or SIGNAL_SIGTERM", errdefs.Quote(string(req.Signal))))
	}
	if err := ec.c.SignalProcess(ctx, pid, sig); err != nil {
		return nil, processError(err)
	}
	return &empty{}, nil
}

func (ec *envdCall) update(ctx context.Context, r *http.Request, req *updateRequest) (*empty, error) {
	pid, err := ec.pid(ctx, req.Process)
	if err != nil {
		return nil, err
	}
	if req.PTY == nil || req.PTY.Size == nil {
		return &empty{}, nil
	}
	sz := proto.PTYSize{Cols: uint16(min(req.PTY.Size.Cols, 65535)), Rows: uint16(min(req.PTY.Size.Rows, 65535))}
	if err := ec.c.ResizeProcess(ctx, pid, sz); err != nil {
		return nil, processError(err)
	}
	return &empty{}, nil
}

// streamInput serves the client-streaming StreamInput: a start message
// naming the process, then input, until the request body ends.
func (ec *envdCall) streamInput(w http.ResponseWriter, r *http.Request) {
	if mt, ok := contentType(r); !ok || mt != "application/connect+json" {
		writeUnaryError(w, withCode(codeInvalidArgument, fmt.Errorf("content type %q: want application/connect+json", r.Header.Get("Content-Type"))))
		return
	}
	ctx, cancel := deadline(r)
	defer cancel()
	br := bufio.NewReader(r.Body)
	err := func() error {
		pid := -1
		for {
			var msg streamInputRequest
			flags, err := readEnvelope(br, &msg)
			if errors.Is(err, io.EOF) || err == nil && flags&flagEndStream != 0 {
				return nil
			}
			if err != nil {
				return err
			}
			switch {
			case msg.Start != nil:
				if pid, err = ec.pid(ctx, msg.Start.Process); err != nil {
					return err
				}
			case msg.Data != nil && msg.Data.Input != nil:
				if pid < 0 {
					return withCode(codeFailedPrecondition, errors.New("input before the start message"))
				}
				data := msg.Data.Input.Stdin
				if data == nil {
					data = msg.Data.Input.PTY
				}
				if len(data) > 0 {
					if err := ec.c.SendStdin(ctx, pid, data); err != nil {
						return processError(err)
					}
				}
			}
		}
	}()
	w.Header().Set("Content-Type", "application/connect+json")
	w.WriteHeader(http.StatusOK)
	sw := &streamWriter{w: w, rc: http.NewResponseController(w), last: time.Now()}
	if err == nil {
		err = sw.send(empty{})
	}
	sw.end(err)
}

// signature is the unpadded base64 SHA-256 of raw.
func signature(raw string) string {
	sum := sha256.Sum256([]byte(raw))
	return strings.TrimRight(base64.StdEncoding.EncodeToString(sum[:]), "=")
}
