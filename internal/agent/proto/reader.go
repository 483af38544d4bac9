package proto

import (
	"bytes"
	"errors"
	"io"
	"os"
	"time"
)

// DefaultPartialTimeout is how long a Reader waits for the rest of a frame
// whose magic it has seen before it gives the candidate up.
const DefaultPartialTimeout = 1500 * time.Millisecond

// deadliner is implemented by *os.File (when pollable) and net.Conn.
type deadliner interface {
	SetReadDeadline(time.Time) error
}

// Reader reads frames from a stream that may hold garbage, stale bytes or
// torn frames, and resynchronises on them.
//
// It scans for Magic; a candidate whose header is invalid, whose payload
// fails the CRC, or whose payload does not arrive within PartialTimeout of
// the candidate being found is skipped by one byte and the bytes already
// buffered are scanned again. The timeout needs a source with read deadlines
// (a pollable *os.File or a net.Conn); other sources wait indefinitely. While
// no candidate is pending the Reader sets no deadline, so an idle stream costs
// nothing.
//
// A Reader is not safe for concurrent use.
type Reader struct {
	// PartialTimeout overrides DefaultPartialTimeout when positive.
	PartialTimeout time.Duration
	// MaxSkipped, when positive, makes Next fail with ErrSkipLimit once
	// Skipped passes it. Each skipped byte may cost a CRC over a whole
	// candidate frame, so a reader of a stream that should be clean (after
	// a handshake) bounds the work a hostile peer can cause.
	MaxSkipped uint64
	// OnTorn, when set, is called (on the reading goroutine) each time a
	// candidate frame is given up because the rest of it did not arrive in
	// time: bytes were lost.
	OnTorn func()

	r          io.Reader
	dl         deadliner
	buf        []byte
	start, end int // buffered bytes are buf[start:end]

	cand       int       // buffer offset of the pending candidate, or -1
	candSince  time.Time // when the pending candidate was found
	deadline   time.Time // the read deadline currently set on dl
	skipped    uint64
	pendingErr error // a read error held back until buffered bytes are used
}

// NewReader returns a Reader on r.
func NewReader(r io.Reader) *Reader {
	rd := &Reader{
		r:    r,
		buf:  make([]byte, 2*(HeaderSize+MaxPayload)),
		cand: -1,
	}
	rd.dl, _ = r.(deadliner)
	return rd
}

// ErrSkipLimit is returned by Next once more than MaxSkipped bytes were
// skipped.
var ErrSkipLimit = errors.New("too many bytes skipped while resynchronising")

// Skipped returns how many bytes were discarded while resynchronising.
func (r *Reader) Skipped() uint64 { return r.skipped }

func (r *Reader) partialTimeout() time.Duration {
	if r.PartialTimeout > 0 {
		return r.PartialTimeout
	}
	return DefaultPartialTimeout
}

// Next returns the next valid frame. Its payload aliases the Reader's buffer
// and is valid until the next call. Next returns an error only when the
// underlying reader fails (io.EOF included) or with ErrSkipLimit.
func (r *Reader) Next() (Frame, error) {
	for {
		if r.MaxSkipped > 0 && r.skipped > r.MaxSkipped {
			return Frame{}, ErrSkipLimit
		}
		data := r.buf[r.start:r.end]
		i := bytes.Index(data, Magic[:])
		if i < 0 {
			// Keep a tail that could be the start of a magic.
			keep := min(len(data), len(Magic)-1)
			r.skipped += uint64(len(data) - keep)
			r.start = r.end - keep
			r.cand = -1
			if err := r.fill(time.Time{}); err != nil {
				return Frame{}, err
			}
			continue
		}
		if i > 0 {
			r.skipped += uint64(i)
			r.start += i
		}
		if r.cand != r.start {
			r.cand = r.start
			r.candSince = time.Now()
		}
		data = r.buf[r.start:r.end]
		if len(data) >= HeaderSize {
			h, ok := parseHeader(data)
			if !ok {
				r.skipOne()
				continue
			}
			if n := HeaderSize + h.length; len(data) >= n {
				if !checkCRC(data, h) {
					r.skipOne()
					continue
				}
				r.start += n
				r.cand = -1
				return Frame{Type: h.typ, Flags: h.flags, ID: h.id, Seq: h.seq, Payload: data[HeaderSize:n:n]}, nil
			}
		}
		// The candidate is incomplete: wait for more, but not forever.
		limit := r.candSince.Add(r.partialTimeout())
		if r.dl != nil && !time.Now().Before(limit) {
			r.skipOne()
			if r.OnTorn != nil {
				r.OnTorn()
			}
			continue
		}
		if r.dl == nil {
			limit = time.Time{}
		}
		if err := r.fill(limit); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				continue
			}
			return Frame{}, err
		}
	}
}

// skipOne gives up the candidate at r.start.
func (r *Reader) skipOne() {
	r.start++
	r.skipped++
	r.cand = -1
}

// fill reads more bytes, with a read deadline when deadline is non-zero.
func (r *Reader) fill(deadline time.Time) error {
	if r.pendingErr != nil {
		err := r.pendingErr
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return err
		}
		r.pendingErr = nil
	}
	if r.start > 0 && (r.end == len(r.buf) || r.start == r.end || r.start > len(r.buf)/2) {
		n := copy(r.buf, r.buf[r.start:r.end])
		if r.cand >= 0 {
			r.cand -= r.start
		}
		r.start, r.end = 0, n
	}
	if r.dl != nil && !deadline.Equal(r.deadline) {
		if err := r.dl.SetReadDeadline(deadline); err == nil {
			r.deadline = deadline
		} else {
			r.dl = nil // the source cannot time out reads; wait instead
		}
	}
	n, err := r.r.Read(r.buf[r.end:])
	r.end += n
	if err != nil {
		if n > 0 {
			r.pendingErr = err
			return nil
		}
		return err
	}
	return nil
}
