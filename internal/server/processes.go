package server

import (
	"io"
	"net/http"
	"strconv"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
)

// maxStdinChunk bounds one POST .../stdin body: a chunk, not a stream.
const maxStdinChunk = 16 << 20

// pid reads the {pid} path value.
func pid(r *http.Request) (int, error) {
	v := r.PathValue("pid")
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		return 0, errdefs.InvalidArgument("pid %s: want a positive number", errdefs.Quote(v))
	}
	return n, nil
}

func viewProcess(p proto.ProcessInfo) apiv1.Process {
	v := apiv1.Process{PID: p.PID, Tag: p.Tag, Args: p.Args, Cwd: p.Dir, StartedAt: p.StartedAt, Running: p.Running}
	if v.Args == nil {
		v.Args = []string{}
	}
	if p.Result != nil {
		er := request.ExecResult(p.Result)
		v.Result = &er
	}
	return v
}

func (s *Server) startProcess(r *http.Request, req *apiv1.StartProcessRequest) (any, error) {
	areq, err := request.Exec(&req.ExecRequest)
	if err != nil {
		return nil, err
	}
	if req.StdinOpen && req.Stdin != nil {
		return nil, errdefs.InvalidArgument("give stdin or stdin_open, not both")
	}
	if len(req.Tag) > 256 {
		return nil, errdefs.InvalidArgument("tag: at most 256 bytes")
	}
	areq.Background, areq.StdinOpen, areq.Tag = true, req.StdinOpen, req.Tag
	var out apiv1.Process
	err = s.withAgent(r, func(c *agent.Client) error {
		res, err := c.Exec(r.Context(), areq)
		if err != nil {
			return err
		}
		out = apiv1.Process{PID: res.PID, Tag: res.Tag, Running: res.Running, Args: append([]string{}, req.Args...), Cwd: req.Cwd}
		if req.Shell != "" {
			out.Args = []string{"/bin/sh", "-c", req.Shell}
		}
		if !res.Running {
			er := request.ExecResult(res)
			out.Result = &er
		}
		return nil
	})
	return statusValue{http.StatusCreated, out}, err
}

func (s *Server) listProcesses(r *http.Request) (any, error) {
	out := apiv1.ProcessList{Processes: []apiv1.Process{}}
	err := s.withAgent(r, func(c *agent.Client) error {
		list, err := c.Processes(r.Context())
		for _, p := range list {
			out.Processes = append(out.Processes, viewProcess(p))
		}
		return err
	})
	return out, err
}

func (s *Server) getProcess(r *http.Request) (any, error) {
	n, err := pid(r)
	if err != nil {
		return nil, err
	}
	var out apiv1.Process
	err = s.withAgent(r, func(c *agent.Client) error {
		list, err := c.Processes(r.Context())
		if err != nil {
			return err
		}
		for _, p := range list {
			if p.PID == n {
				out = viewProcess(p)
				return nil
			}
		}
		return errdefs.NotFound("no background process %d", n)
	})
	return out, err
}

func (s *Server) waitProcess(r *http.Request) (any, error) {
	n, err := pid(r)
	if err != nil {
		return nil, err
	}
	var out apiv1.ExecResult
	err = s.withAgent(r, func(c *agent.Client) error {
		res, err := c.WaitProcess(r.Context(), n)
		if err == nil {
			out = request.ExecResult(res)
		}
		return err
	})
	return out, err
}

// streamProcess attaches to a background process: its recent output, then
// live output, as NDJSON events, ending with its exit.
func (s *Server) streamProcess(w http.ResponseWriter, r *http.Request) error {
	n, err := pid(r)
	if err != nil {
		return err
	}
	return s.withAgent(r, func(c *agent.Client) error {
		es := startStream(w)
		res, err := c.ConnectProcess(r.Context(), n, es.output(apiv1.EventStdout), es.output(apiv1.EventStderr))
		if err != nil {
			es.fail(err)
			return nil
		}
		er := request.ExecResult(res)
		return es.send(apiv1.StreamEvent{Type: apiv1.EventExit, Exec: &er})
	})
}

// processStdin writes the raw body to a background process's stdin;
// ?eof=true closes it after.
func (s *Server) processStdin(w http.ResponseWriter, r *http.Request) (any, error) {
	n, err := pid(r)
	if err != nil {
		return nil, err
	}
	eof := false
	switch v := r.URL.Query().Get("eof"); v {
	case "", "false":
	case "true":
		eof = true
	default:
		return nil, errdefs.InvalidArgument("eof=%s: want true or false", errdefs.Quote(v))
	}
	dl := s.bodyDeadline(w, r, 0)
	defer dl.done()
	data, err := io.ReadAll(http.MaxBytesReader(nil, io.NopCloser(dl), maxStdinChunk))
	if err != nil {
		return nil, bodyError(err)
	}
	return nil, s.withAgent(r, func(c *agent.Client) error {
		if len(data) > 0 {
			if err := c.SendStdin(r.Context(), n, data); err != nil {
				return err
			}
		}
		if eof {
			return c.CloseStdin(r.Context(), n)
		}
		return nil
	})
}

func (s *Server) signalProcess(r *http.Request, req *apiv1.SignalRequest) (any, error) {
	n, err := pid(r)
	if err != nil {
		return nil, err
	}
	if _, err := proto.ParseSignal(req.Signal); err != nil {
		return nil, err
	}
	return nil, s.withAgent(r, func(c *agent.Client) error { return c.SignalProcess(r.Context(), n, req.Signal) })
}

func (s *Server) killProcess(r *http.Request) (any, error) {
	n, err := pid(r)
	if err != nil {
		return nil, err
	}
	return nil, s.withAgent(r, func(c *agent.Client) error { return c.KillProcess(r.Context(), n) })
}
