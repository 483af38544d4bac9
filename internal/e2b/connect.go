package e2b

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
)

// The Connect protocol with the JSON codec, as connect-web speaks it to
// envd: unary calls are a bare JSON message each way (errors: a non-200
// status with {"code","message"}); server-streaming calls take one
// enveloped request message and answer 200 with enveloped messages ending
// with an end-of-stream envelope, which carries any error.

// Envelope flags.
const (
	flagCompressed = 0x01
	flagEndStream  = 0x02
)

// streamGrace is how long a stream outlives its Connect-Timeout-Ms.
const streamGrace = 2 * time.Second

// maxMessage bounds a request message.
const maxMessage = 16 << 20

// Connect error codes.
const (
	codeCanceled           = "canceled"
	codeUnknown            = "unknown"
	codeInvalidArgument    = "invalid_argument"
	codeDeadlineExceeded   = "deadline_exceeded"
	codeNotFound           = "not_found"
	codeAlreadyExists      = "already_exists"
	codePermissionDenied   = "permission_denied"
	codeResourceExhausted  = "resource_exhausted"
	codeFailedPrecondition = "failed_precondition"
	codeUnimplemented      = "unimplemented"
	codeInternal           = "internal"
	codeUnavailable        = "unavailable"
	codeUnauthenticated    = "unauthenticated"
)

// rpcError is an error with a Connect code of its own choosing.
type rpcError struct {
	code string
	err  error
}

func (e *rpcError) Error() string { return e.err.Error() }
func (e *rpcError) Unwrap() error { return e.err }

// withCode gives err the Connect code code.
func withCode(code string, err error) error { return &rpcError{code: code, err: err} }

// connectCode maps an error to its Connect code.
func connectCode(err error) string {
	var re *rpcError
	switch {
	case errors.As(err, &re):
		return re.code
	case errors.Is(err, context.Canceled):
		return codeCanceled
	case errdefs.IsNotFound(err):
		return codeNotFound
	case errdefs.IsAlreadyExists(err):
		return codeAlreadyExists
	case errdefs.IsInvalidArgument(err):
		return codeInvalidArgument
	case errdefs.IsFailedPrecondition(err):
		return codeFailedPrecondition
	case errdefs.IsResourceExhausted(err):
		return codeResourceExhausted
	case errdefs.IsUnavailable(err):
		return codeUnavailable
	case errdefs.IsUnauthenticated(err):
		return codeUnauthenticated
	case errdefs.IsNotImplemented(err):
		return codeUnimplemented
	case errdefs.IsDeadlineExceeded(err), errors.Is(err, context.DeadlineExceeded):
		return codeDeadlineExceeded
	}
	return codeInternal
}

// connectStatus is the HTTP status of a unary error with code.
func connectStatus(code string) int {
	switch code {
	case codeCanceled:
		return 499
	case codeInvalidArgument, codeFailedPrecondition:
		return http.StatusBadRequest
	case codeDeadlineExceeded:
		return http.StatusGatewayTimeout
	case codeNotFound, codeUnimplemented:
		return http.StatusNotFound
	case codeAlreadyExists:
		return http.StatusConflict
	case codePermissionDenied:
		return http.StatusForbidden
	case codeResourceExhausted:
		return http.StatusTooManyRequests
	case codeUnavailable:
		return http.StatusServiceUnavailable
	case codeUnauthenticated:
		return http.StatusUnauthorized
	}
	return http.StatusInternalServerError
}

// wireError is a Connect error's JSON.
type wireError struct {
	Code    string `json:"code"`
	Message string `json:"message,omitempty"`
}

func errorOf(err error) wireError { return wireError{Code: connectCode(err), Message: err.Error()} }

// writeUnaryError writes err as a unary call's error.
func writeUnaryError(w http.ResponseWriter, err error) {
	we := errorOf(err)
	writeJSON(w, connectStatus(we.Code), we)
}

// isJSON reports whether a Content-Type is application/json (charset
// utf-8, if any).
func contentType(r *http.Request) (string, bool) {
	mt, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil {
		return "", false
	}
	if cs, ok := params["charset"]; ok && cs != "utf-8" && cs != "UTF-8" && cs != "utf8" {
		return mt, false
	}
	return mt, true
}

// unary serves a unary call: the JSON request in, fn's answer out.
func unary[Req, Resp any](fn func(ctx context.Context, r *http.Request, req *Req) (*Resp, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if mt, ok := contentType(r); !ok || mt != "application/json" {
			writeUnaryError(w, withCode(codeInvalidArgument, fmt.Errorf("content type %q: want application/json", r.Header.Get("Content-Type"))))
			return
		}
		b, err := io.ReadAll(io.LimitReader(r.Body, maxMessage+1))
		if err != nil {
			writeUnaryError(w, withCode(codeInvalidArgument, fmt.Errorf("read request: %w", err)))
			return
		}
		if len(b) > maxMessage {
			writeUnaryError(w, withCode(codeResourceExhausted, fmt.Errorf("request over %d bytes", maxMessage)))
			return
		}
		var req Req
		if len(b) > 0 {
			if err := json.Unmarshal(b, &req); err != nil {
				writeUnaryError(w, withCode(codeInvalidArgument, fmt.Errorf("request: %w", err)))
				return
			}
		}
		ctx, cancel := deadline(r)
		defer cancel()
		resp, err := fn(ctx, r, &req)
		if err != nil {
			writeUnaryError(w, err)
			return
		}
		writeJSON(w, http.StatusOK, resp)
	}
}

// deadline is the request's context bounded by its Connect-Timeout-Ms.
func deadline(r *http.Request) (context.Context, context.CancelFunc) {
	if ms, err := strconv.ParseInt(r.Header.Get("Connect-Timeout-Ms"), 10, 64); err == nil && ms > 0 {
		return context.WithTimeout(r.Context(), time.Duration(ms)*time.Millisecond)
	}
	return context.WithCancel(r.Context())
}

// timeoutOf is the call's Connect-Timeout-Ms (0 when none).
func timeoutOf(r *http.Request) time.Duration {
	if ms, err := strconv.ParseInt(r.Header.Get("Connect-Timeout-Ms"), 10, 64); err == nil && ms > 0 {
		return time.Duration(ms) * time.Millisecond
	}
	return 0
}

// readEnvelope reads one enveloped message into v; io.EOF at a clean end.
func readEnvelope(br *bufio.Reader, v any) (flags byte, err error) {
	var hdr [5]byte
	if _, err := io.ReadFull(br, hdr[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return 0, withCode(codeInvalidArgument, errors.New("truncated envelope"))
		}
		return 0, err
	}
	n := binary.BigEndian.Uint32(hdr[1:])
	if hdr[0]&flagCompressed != 0 {
		return 0, withCode(codeInternal, errors.New("compressed messages are not supported"))
	}
	if n > maxMessage {
		return 0, withCode(codeResourceExhausted, fmt.Errorf("message of %d bytes over %d", n, maxMessage))
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(br, b); err != nil {
		return 0, withCode(codeInvalidArgument, fmt.Errorf("truncated message: %w", err))
	}
	if hdr[0]&flagEndStream == 0 && len(b) > 0 {
		if err := json.Unmarshal(b, v); err != nil {
			return 0, withCode(codeInvalidArgument, fmt.Errorf("request: %w", err))
		}
	}
	return hdr[0], nil
}

// streamWriter writes a streaming call's messages, each flushed. Safe for
// concurrent use.
type streamWriter struct {
	mu     sync.Mutex
	w      http.ResponseWriter
	rc     *http.ResponseController
	closed bool // guarded by mu
	last   time.Time
}

// send writes msg as one envelope.
func (sw *streamWriter) send(msg any) error {
	b, err := json.Marshal(msg)
	if err != nil {
		return err
	}
	return sw.envelope(0, b)
}

func (sw *streamWriter) envelope(flags byte, b []byte) error {
	sw.mu.Lock()
	defer sw.mu.Unlock()
	if sw.closed {
		return errors.New("stream ended")
	}
	var hdr [5]byte
	hdr[0] = flags
	binary.BigEndian.PutUint32(hdr[1:], uint32(len(b)))
	if _, err := sw.w.Write(append(hdr[:], b...)); err != nil {
		return err
	}
	sw.last = time.Now()
	return sw.rc.Flush()
}

// end writes the end-of-stream envelope, with err if any.
func (sw *streamWriter) end(err error) {
	body := []byte("{}")
	if err != nil {
		body, _ = json.Marshal(struct {
			Error wireError `json:"error"`
		}{errorOf(err)})
	}
	_ = sw.envelope(flagEndStream, body) // a caller that left reads nothing
	sw.mu.Lock()
	sw.closed = true
	sw.mu.Unlock()
}

// idle reports how long nothing was sent.
func (sw *streamWriter) idle() time.Duration {
	sw.mu.Lock()
	defer sw.mu.Unlock()
	return time.Since(sw.last)
}

// stream serves a server-streaming call: one request message in, then fn
// sends messages until it returns; its error ends the stream. keepalive,
// if set, is sent after Keepalive-Ping-Interval seconds without a message.
func stream[Req any](keepalive any, fn func(ctx context.Context, r *http.Request, req *Req, sw *streamWriter) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		mt, ok := contentType(r)
		if !ok || mt != "application/connect+json" {
			writeUnaryError(w, withCode(codeInvalidArgument, fmt.Errorf("content type %q: want application/connect+json", r.Header.Get("Content-Type"))))
			return
		}
		var req Req
		br := bufio.NewReader(io.LimitReader(r.Body, maxMessage+5))
		if _, err := readEnvelope(br, &req); err != nil && !errors.Is(err, io.EOF) {
			w.Header().Set("Content-Type", "application/connect+json")
			w.WriteHeader(http.StatusOK)
			sw := &streamWriter{w: w, rc: http.NewResponseController(w)}
			sw.end(err)
			return
		}
		// The call's deadline, with a grace: what ends at it (a process
		// the guest kills then) still gets its last messages out.
		ctx, cancel := context.WithCancel(r.Context())
		if d := timeoutOf(r); d > 0 {
			ctx, cancel = context.WithTimeout(r.Context(), d+streamGrace)
		}
		defer cancel()
		w.Header().Set("Content-Type", "application/connect+json")
		w.WriteHeader(http.StatusOK)
		sw := &streamWriter{w: w, rc: http.NewResponseController(w), last: time.Now()}
		_ = sw.rc.Flush()
		if keepalive != nil {
			if secs, err := strconv.Atoi(r.Header.Get("Keepalive-Ping-Interval")); err == nil && secs > 0 {
				every := time.Duration(secs) * time.Second
				go func() {
					t := time.NewTicker(every / 2)
					defer t.Stop()
					for {
						select {
						case <-ctx.Done():
							return
						case <-t.C:
							if sw.idle() >= every && sw.send(keepalive) != nil {
								return
							}
						}
					}
				}()
			}
		}
		sw.end(fn(ctx, r, &req, sw))
	}
}
