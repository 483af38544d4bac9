package server

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
)

// Request bodies are read within bounds, so that callers who send slowly
// or stall cannot pin the daemon's memory:
//
//   - a JSON body (or the JSON head of a streamed exec) must arrive within
//     Config.BodyTimeout, and any body, file uploads included, is cut when
//     no byte of it comes for Config.BodyStallTimeout (408);
//   - the bytes of JSON bodies held at once, all requests together, are
//     bounded by Config.MaxBodyBytesInFlight: a body is read into a
//     buffer grown as its bytes arrive, each growth taken from that
//     budget, and a request that cannot get its bytes within
//     Config.BodyWait is refused (429, Retry-After); its bytes go back
//     once decoded;
//   - a streamed exec's stdin, long-lived on purpose, has neither bound:
//     it is forwarded as read, paced by the agent's flow control.

// byteBudget is a semaphore of bytes. Safe for concurrent use.
type byteBudget struct {
	total int64
	mu    sync.Mutex    // guards free, wake
	free  int64         // bytes not held
	wake  chan struct{} // closed, and replaced, when bytes come back
}

func newByteBudget(total int64) *byteBudget {
	return &byteBudget{total: total, free: total, wake: make(chan struct{})}
}

// acquire takes n bytes, waiting for them until wait has passed or ctx
// ends; it reports whether it got them.
func (b *byteBudget) acquire(ctx context.Context, n int64, wait time.Duration) bool {
	if n > b.total {
		return false
	}
	var timeout <-chan time.Time
	for {
		b.mu.Lock()
		if b.free >= n {
			b.free -= n
			b.mu.Unlock()
			return true
		}
		wake := b.wake
		b.mu.Unlock()
		if timeout == nil {
			t := time.NewTimer(wait)
			defer t.Stop()
			timeout = t.C
		}
		select {
		case <-wake:
		case <-timeout:
			return false
		case <-ctx.Done():
			return false
		}
	}
}

// release gives back n bytes taken with acquire.
func (b *byteBudget) release(n int64) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.free += n
	close(b.wake)
	b.wake = make(chan struct{})
}

// held is the number of bytes taken.
func (b *byteBudget) held() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.total - b.free
}

// slowBody is a request body that did not arrive in time: class
// DeadlineExceeded, status 408.
type slowBody struct {
	stalled time.Duration // no byte came for this long; 0: the whole body was late
	within  time.Duration // the whole body's bound, when it was late
	cause   error
}

func (e *slowBody) Error() string {
	if e.stalled > 0 {
		return fmt.Sprintf("request body stalled: no data for %v", e.stalled)
	}
	return fmt.Sprintf("request body did not arrive within %v", e.within)
}

func (e *slowBody) Unwrap() []error { return []error{errdefs.ErrDeadlineExceeded, e.cause} }

// bodyDeadline reads a request body with a read deadline on its
// connection: each Read must make progress within stall, and none may end
// after end (zero: no such bound). A timeout is returned as a *slowBody.
// Call done once finished with it.
type bodyDeadline struct {
	r        io.Reader
	rc       *http.ResponseController
	end      time.Time
	stall    time.Duration
	total    time.Duration // what end was set from, for the message
	timedOut bool
}

// bodyDeadline wraps r's body; total 0 sets no bound on the whole body.
// A Local server sets none: its one caller is its own process.
func (s *Server) bodyDeadline(w http.ResponseWriter, r *http.Request, total time.Duration) *bodyDeadline {
	d := &bodyDeadline{r: r.Body, rc: http.NewResponseController(w), stall: s.cfg.BodyStallTimeout, total: total}
	if s.cfg.Local {
		d.stall, total = 0, 0
	}
	if total > 0 {
		d.end = time.Now().Add(total)
	}
	return d
}

func (d *bodyDeadline) Read(p []byte) (int, error) {
	if d.stall == 0 {
		return d.r.Read(p)
	}
	now := time.Now()
	dl := now.Add(d.stall)
	if !d.end.IsZero() && d.end.Before(dl) {
		dl = d.end
	}
	// A connection without deadlines (a test's recorder) is read as it is.
	_ = d.rc.SetReadDeadline(dl)
	n, err := d.r.Read(p)
	if err != nil && errors.Is(err, os.ErrDeadlineExceeded) {
		d.timedOut = true
		if !d.end.IsZero() && !time.Now().Before(d.end) {
			return n, &slowBody{within: d.total, cause: err}
		}
		return n, &slowBody{stalled: d.stall, cause: err}
	}
	return n, err
}

// done lifts the read deadline, so that later reads (the server's own, the
// rest of a stream) are not cut. After a timeout it stays: the server then
// waits for nothing more of the body and closes the connection after its
// answer.
func (d *bodyDeadline) done() {
	if d.stall != 0 && !d.timedOut {
		_ = d.rc.SetReadDeadline(time.Time{})
	}
}

// boundDiscard bounds how long the server, after an answer given before
// the body was read (an error), waits for the rest of the body to arrive
// before it closes the connection: BodyStallTimeout, unless a body
// deadline already passed.
func (s *Server) boundDiscard(w http.ResponseWriter, err error) {
	if _, slow := errors.AsType[*slowBody](err); !slow && !s.cfg.Local {
		_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(s.cfg.BodyStallTimeout))
	}
}

// bodyBusy is the refusal of a body the in-flight budget has no room for.
func (s *Server) bodyBusy(w http.ResponseWriter) error {
	w.Header().Set("Retry-After", "1")
	return errdefs.ResourceExhausted("the daemon holds %d bytes of request bodies, its limit (--max-body-bytes-in-flight): retry later",
		s.cfg.MaxBodyBytesInFlight)
}

// minBodyBuf is the first buffer a body is read into.
const minBodyBuf = 16 << 10

// readBody reads r's body, at most limit bytes (413 beyond), within
// BodyTimeout and BodyStallTimeout (408), into a buffer grown as the
// bytes arrive, each growth taken from the in-flight budget (429 when it
// has no room within BodyWait). Call release once b is no longer used.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request, limit int64) (b []byte, release func(), err error) {
	if r.ContentLength > limit {
		return nil, nil, &tooLarge{&http.MaxBytesError{Limit: limit}}
	}
	// The buffer never needs more than the body.
	most := limit
	if r.ContentLength >= 0 {
		most = r.ContentLength
	}
	var held int64
	release = func() {
		s.bodies.release(held)
		held = 0
	}
	dl := s.bodyDeadline(w, r, s.cfg.BodyTimeout)
	defer dl.done()
	src := http.MaxBytesReader(w, io.NopCloser(dl), limit)
	for {
		if len(b) == cap(b) && int64(cap(b)) == most {
			// Full: the body must end here.
			var one [1]byte
			n, err := src.Read(one[:])
			switch {
			case n > 0 && err == nil:
				err = &http.MaxBytesError{Limit: most}
			case errors.Is(err, io.EOF):
				return b, release, nil
			}
			release()
			return nil, nil, bodyError(err)
		}
		if len(b) == cap(b) {
			grow := min(max(2*int64(cap(b)), minBodyBuf), most)
			wait := s.cfg.BodyWait
			if !dl.end.IsZero() {
				wait = min(wait, time.Until(dl.end))
			}
			if !s.bodies.acquire(r.Context(), grow-held, wait) {
				release()
				return nil, nil, s.bodyBusy(w)
			}
			nb := make([]byte, len(b), grow)
			copy(nb, b)
			b, held = nb, grow
		}
		n, err := src.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if errors.Is(err, io.EOF) {
			return b, release, nil
		}
		if err != nil {
			release()
			return nil, nil, bodyError(err)
		}
	}
}

// decodeBody decodes r's JSON body into v strictly (see decodeStrict),
// read with readBody.
func (s *Server) decodeBody(w http.ResponseWriter, r *http.Request, v any) error {
	b, release, err := s.readBody(w, r, s.cfg.MaxBodyBytes)
	if err != nil {
		return err
	}
	defer release()
	return decodeStrictBytes(b, v)
}

// decodeHead decodes the JSON object at the start of r's body strictly
// (at most MaxBodyBytes of it, within the body deadlines and holding its
// bytes in the in-flight budget) into v, and returns the rest of the body,
// after one optional newline, unread and free of any deadline.
func (s *Server) decodeHead(w http.ResponseWriter, r *http.Request, v any) (io.Reader, error) {
	limit := s.cfg.MaxBodyBytes
	dl := s.bodyDeadline(w, r, s.cfg.BodyTimeout)
	defer dl.done()
	br := &budgetReader{r: dl, b: s.bodies, ctx: r.Context(), wait: s.cfg.BodyWait}
	defer br.release()
	lr := &io.LimitedReader{R: br, N: limit + 1}
	dec := json.NewDecoder(lr)
	var raw json.RawMessage
	if err := dec.Decode(&raw); err != nil {
		switch {
		case br.busy:
			return nil, s.bodyBusy(w)
		case lr.N <= 0:
			return nil, errdefs.InvalidArgument("request head is over the limit of %d bytes", limit)
		}
		return nil, bodyError(err)
	}
	if err := decodeStrictBytes(raw, v); err != nil {
		return nil, err
	}
	// What the decoder read past the head is the start of stdin: copied,
	// so the decoder's buffer (as large as the head) is not kept.
	rest, _ := io.ReadAll(dec.Buffered())
	return &skipNewline{r: io.MultiReader(bytes.NewReader(rest), r.Body)}, nil
}

// budgetReader holds, in b, the bytes read through it, until release.
type budgetReader struct {
	r    io.Reader
	b    *byteBudget
	ctx  context.Context
	wait time.Duration
	held int64
	busy bool // the budget had no room
}

func (br *budgetReader) Read(p []byte) (int, error) {
	if int64(len(p)) > br.b.total {
		p = p[:br.b.total]
	}
	if !br.b.acquire(br.ctx, int64(len(p)), br.wait) {
		br.busy = true
		return 0, errdefs.ResourceExhausted("request bodies in flight are at their limit")
	}
	n, err := br.r.Read(p)
	br.b.release(int64(len(p) - n))
	br.held += int64(n)
	return n, err
}

func (br *budgetReader) release() {
	br.b.release(br.held)
	br.held = 0
}

// skipNewline drops a newline that starts r, without reading before its
// first Read (stdin may come much later than the head).
type skipNewline struct {
	r       io.Reader
	started bool
}

func (s *skipNewline) Read(p []byte) (int, error) {
	for {
		n, err := s.r.Read(p)
		if !s.started && n > 0 {
			s.started = true
			if p[0] == '\n' {
				copy(p, p[1:n])
				n--
				if n == 0 && err == nil {
					continue
				}
			}
		}
		return n, err
	}
}
