package server

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

// maxCallSecs bounds exec and eval timeouts.
const maxCallSecs = 24 * 60 * 60

// CallTimeout checks an exec or eval timeout of secs seconds: 0 (none) to
// a day, never negative, NaN or infinite. field names it in the error.
func CallTimeout(field string, secs float64) (time.Duration, error) {
	if !(secs >= 0 && secs <= maxCallSecs) {
		return 0, errdefs.InvalidArgument("%s = %v: want 0 (none) to %d seconds", field, secs, maxCallSecs)
	}
	return time.Duration(secs * float64(time.Second)), nil
}

// agentExec validates an exec request into the agent's form.
func agentExec(req *apiv1.ExecRequest) (agent.ExecRequest, error) {
	var out agent.ExecRequest
	if (len(req.Args) == 0) == (req.Shell == "") {
		return out, errdefs.InvalidArgument("give exactly one of args and shell")
	}
	if len(req.Args) > 0 && req.Args[0] == "" {
		return out, errdefs.InvalidArgument("args[0] is empty")
	}
	for k := range req.Env {
		if k == "" || strings.ContainsAny(k, "=\x00") {
			return out, errdefs.InvalidArgument("env name %q: want a name without '=' or NUL", k)
		}
	}
	d, err := CallTimeout("timeout_secs", req.TimeoutSecs)
	if err != nil {
		return out, err
	}
	out = agent.ExecRequest{Args: req.Args, Shell: req.Shell, Env: req.Env, Dir: req.Cwd, User: req.User, Timeout: d}
	if req.Stdin != nil {
		out.Stdin = bytes.NewReader(req.Stdin)
	}
	return out, nil
}

// withAgent runs fn with the agent of the sandbox named in the path.
func (s *Server) withAgent(r *http.Request, fn func(c *agent.Client) error) error {
	c, release, err := s.e.Agent(r.Context(), r.PathValue("id"))
	if err != nil {
		return err
	}
	defer release()
	return fn(c)
}

func (s *Server) ping(r *http.Request) (any, error) {
	var out apiv1.PingResult
	err := s.withAgent(r, func(c *agent.Client) error {
		start := time.Now()
		p, err := c.Ping(r.Context())
		if err != nil {
			return err
		}
		out = apiv1.PingResult{
			AgentVersion: p.AgentVersion, ProtocolVersion: p.ProtocolVersion, UptimeMS: p.UptimeMS,
			Hostname: p.Hostname, Features: p.Features, PythonReady: p.PythonReady,
			LatencyMS: float64(time.Since(start).Microseconds()) / 1000,
		}
		return nil
	})
	return out, err
}

// capBuffer keeps the first max bytes written to it.
type capBuffer struct {
	buf       bytes.Buffer
	max       int
	truncated bool
}

func (b *capBuffer) Write(p []byte) (int, error) {
	room := b.max - b.buf.Len()
	if len(p) > room {
		b.truncated = true
		p = p[:max(room, 0)]
	}
	b.buf.Write(p)
	return len(p), nil // more than max is dropped, not an error
}

// textOr puts output in text when it is valid UTF-8, in b64 otherwise.
func textOr(p []byte, text *string, b64 *[]byte) {
	if utf8.Valid(p) {
		*text = string(p)
	} else {
		*b64 = append([]byte(nil), p...)
	}
}

func execResult(res *proto.ExecResult) apiv1.ExecResult {
	return apiv1.ExecResult{ExitCode: res.ExitCode, Signal: res.Signal, TimedOut: res.TimedOut, DurationMS: res.DurationMS}
}

func (s *Server) exec(r *http.Request, req *apiv1.ExecRequest) (any, error) {
	areq, err := agentExec(req)
	if err != nil {
		return nil, err
	}
	var out apiv1.ExecResult
	err = s.withAgent(r, func(c *agent.Client) error {
		stdout := &capBuffer{max: s.cfg.MaxExecOutput}
		stderr := &capBuffer{max: s.cfg.MaxExecOutput}
		areq.Stdout, areq.Stderr = stdout, stderr
		res, err := c.Exec(r.Context(), areq)
		if err != nil {
			return err
		}
		out = execResult(res)
		textOr(stdout.buf.Bytes(), &out.Stdout, &out.StdoutB64)
		textOr(stderr.buf.Bytes(), &out.Stderr, &out.StderrB64)
		out.Truncated = stdout.truncated || stderr.truncated
		return nil
	})
	return out, err
}

// eventStream writes NDJSON events, flushing each so the caller sees
// output as it is produced. Safe for concurrent use.
type eventStream struct {
	mu  sync.Mutex // guards enc, rc
	enc *json.Encoder
	rc  *http.ResponseController
}

// startStream sends the stream's headers.
func startStream(w http.ResponseWriter) *eventStream {
	w.Header().Set("Content-Type", ndjson)
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	es := &eventStream{enc: json.NewEncoder(w), rc: http.NewResponseController(w)}
	es.rc.Flush()
	return es
}

func (es *eventStream) send(ev apiv1.StreamEvent) error {
	es.mu.Lock()
	defer es.mu.Unlock()
	if err := es.enc.Encode(ev); err != nil {
		return errdefs.Unavailable("caller went away: %v", err)
	}
	return es.rc.Flush()
}

// output is an io.Writer sending each write as one event of type typ.
func (es *eventStream) output(typ string) io.Writer {
	return writerFunc(func(p []byte) (int, error) {
		ev := apiv1.StreamEvent{Type: typ}
		textOr(p, &ev.Data, &ev.DataB64)
		if err := es.send(ev); err != nil {
			return 0, err
		}
		return len(p), nil
	})
}

// fail ends a stream with an error event.
func (es *eventStream) fail(err error) {
	e := wireError(err)
	es.send(apiv1.StreamEvent{Type: apiv1.EventError, Error: &e})
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// execStream runs a process and streams its output. Errors found before
// the process starts are ordinary HTTP errors; later ones end the stream
// with an "error" event.
func (s *Server) execStream(w http.ResponseWriter, r *http.Request) error {
	var req apiv1.ExecRequest
	if err := decodeBody(w, r, s.cfg.MaxBodyBytes, &req); err != nil {
		return err
	}
	areq, err := agentExec(&req)
	if err != nil {
		return err
	}
	return s.withAgent(r, func(c *agent.Client) error {
		es := startStream(w)
		areq.Stdout, areq.Stderr = es.output(apiv1.EventStdout), es.output(apiv1.EventStderr)
		res, err := c.Exec(r.Context(), areq)
		if err != nil {
			es.fail(err)
			return nil
		}
		er := execResult(res)
		es.send(apiv1.StreamEvent{Type: apiv1.EventExit, Exec: &er})
		return nil
	})
}

func evalRequest(req *apiv1.EvalRequest) (proto.EvalRequest, error) {
	if strings.TrimSpace(req.Code) == "" {
		return proto.EvalRequest{}, errdefs.InvalidArgument("code is empty")
	}
	d, err := CallTimeout("timeout_secs", req.TimeoutSecs)
	if err != nil {
		return proto.EvalRequest{}, err
	}
	return proto.EvalRequest{Code: req.Code, Timeout: d}, nil
}

func evalResult(res *proto.EvalResult) apiv1.EvalResult {
	out := apiv1.EvalResult{
		Value: res.Value, Stdout: res.Stdout, Stderr: res.Stderr, Truncated: res.Truncated,
		TimedOut: res.TimedOut, Restarted: res.Restarted, DurationMS: res.DurationMS,
	}
	if res.Error != nil {
		out.Error = &apiv1.EvalError{Name: res.Error.Name, Message: res.Error.Message, Traceback: res.Error.Traceback}
	}
	return out
}

func (s *Server) eval(r *http.Request, req *apiv1.EvalRequest) (any, error) {
	ereq, err := evalRequest(req)
	if err != nil {
		return nil, err
	}
	var out apiv1.EvalResult
	err = s.withAgent(r, func(c *agent.Client) error {
		res, err := c.Eval(r.Context(), ereq)
		if err != nil {
			return err
		}
		out = evalResult(res)
		return nil
	})
	return out, err
}

func (s *Server) evalStream(w http.ResponseWriter, r *http.Request) error {
	var req apiv1.EvalRequest
	if err := decodeBody(w, r, s.cfg.MaxBodyBytes, &req); err != nil {
		return err
	}
	ereq, err := evalRequest(&req)
	if err != nil {
		return err
	}
	return s.withAgent(r, func(c *agent.Client) error {
		es := startStream(w)
		res, err := c.EvalStream(r.Context(), ereq, es.output(apiv1.EventStdout), es.output(apiv1.EventStderr))
		if err != nil {
			es.fail(err)
			return nil
		}
		er := evalResult(res)
		es.send(apiv1.StreamEvent{Type: apiv1.EventResult, Eval: &er})
		return nil
	})
}
