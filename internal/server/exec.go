package server

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"sync"
	"time"
	"unicode/utf8"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
)

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

func (s *Server) exec(r *http.Request, req *apiv1.ExecRequest) (any, error) {
	areq, err := request.Exec(req)
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
		out = request.ExecResult(res)
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
		return errdefs.Unavailable("caller went away: %w", err)
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
	// The stream started already: a failed send means the caller left,
	// and there is nobody else to tell.
	_ = es.send(apiv1.StreamEvent{Type: apiv1.EventError, Error: &e})
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// execStream runs a process and streams its output. Errors found before
// the process starts are ordinary HTTP errors; later ones end the stream
// with an "error" event.
func (s *Server) execStream(w http.ResponseWriter, r *http.Request) error {
	var req apiv1.ExecRequest
	var stdin io.Reader
	mt, err := bodyType(r, apiv1.ExecStdinStream)
	if err != nil {
		return err
	}
	if mt == apiv1.ExecStdinStream {
		if stdin, err = s.decodeHead(w, r, &req); err != nil {
			return err
		}
		if !req.StdinStream || req.Stdin != nil {
			return errdefs.InvalidArgument("a %s body streams stdin: set stdin_stream and not stdin", apiv1.ExecStdinStream)
		}
	} else {
		if err := s.decodeBody(w, r, &req); err != nil {
			return err
		}
		if req.StdinStream {
			return errdefs.InvalidArgument("stdin_stream needs Content-Type %s", apiv1.ExecStdinStream)
		}
	}
	areq, err := request.Exec(&req)
	if err != nil {
		return err
	}
	if stdin != nil {
		// Stdin is read while the output streams.
		if err := http.NewResponseController(w).EnableFullDuplex(); err != nil {
			return errdefs.NotImplemented("streamed stdin: %w", err)
		}
		areq.Stdin = stdin
	}
	return s.withAgent(r, func(c *agent.Client) error {
		es := startStream(w)
		areq.Stdout, areq.Stderr = es.output(apiv1.EventStdout), es.output(apiv1.EventStderr)
		res, err := c.Exec(r.Context(), areq)
		if err != nil {
			es.fail(err)
			return nil
		}
		er := request.ExecResult(res)
		_ = es.send(apiv1.StreamEvent{Type: apiv1.EventExit, Exec: &er}) // a failure means the caller left
		return nil
	})
}

func (s *Server) eval(r *http.Request, req *apiv1.EvalRequest) (any, error) {
	ereq, err := request.Eval(req)
	if err != nil {
		return nil, err
	}
	var out apiv1.EvalResult
	err = s.withAgent(r, func(c *agent.Client) error {
		res, err := c.Eval(r.Context(), ereq)
		if err != nil {
			return err
		}
		out = request.EvalResult(res)
		return nil
	})
	return out, err
}

func (s *Server) evalStream(w http.ResponseWriter, r *http.Request) error {
	if _, err := bodyType(r); err != nil {
		return err
	}
	var req apiv1.EvalRequest
	if err := s.decodeBody(w, r, &req); err != nil {
		return err
	}
	ereq, err := request.Eval(&req)
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
		er := request.EvalResult(res)
		_ = es.send(apiv1.StreamEvent{Type: apiv1.EventResult, Eval: &er}) // a failure means the caller left
		return nil
	})
}
