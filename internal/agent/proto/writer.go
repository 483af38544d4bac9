package proto

import (
	"encoding/json"
	"fmt"
	"io"
	"sync"
)

// Writer serialises frames onto a stream: every frame, and every message
// split over several frames, is written whole and never interleaved with
// another. It numbers the frames it writes. Safe for concurrent use.
type Writer struct {
	// SplitSize is the largest payload WriteMessage puts in one frame
	// (MaxPayload when zero). Set before use.
	SplitSize int
	// Charge, when set, is called with the lock held before each frame is
	// written; an error from it aborts the write. Set before use.
	Charge func(Frame) error

	// Retain keeps a copy of every frame written but hello_ack until
	// Release returns its cost (FrameCost), for Resend. Set before use.
	Retain bool

	// Lock order: mu, then wmu, then rmu. mu orders frames (charging and
	// numbering them); wmu guards the stream itself, so that Resend can
	// write while a writer holds mu waiting for credit that only the
	// resent frames will bring back.
	mu  sync.Mutex
	w   io.Writer
	buf []byte // guarded by mu
	seq uint32 // guarded by mu; the next frame's sequence number

	wmu sync.Mutex

	rmu      sync.Mutex // guards the fields below
	retained []retainedFrame
	carry    int // credit returned past the retained frames' cost
}

// retainedFrame is a frame written and not yet acknowledged.
type retainedFrame struct {
	seq  uint32
	b    []byte
	cost int
}

// NewWriter returns a Writer on w.
func NewWriter(w io.Writer) *Writer { return &Writer{w: w} }

// FrameWriter writes frames while a Writer's lock is held.
type FrameWriter interface {
	WriteFrame(Frame) error
	WriteMessage(t Type, id uint32, payload []byte) error
	// ResetSeq numbers the next frame 0.
	ResetSeq()
}

// locked is the FrameWriter handed out under the lock.
type locked struct{ w *Writer }

func (l locked) WriteFrame(f Frame) error { return l.w.writeFrameLocked(f) }
func (l locked) WriteMessage(t Type, id uint32, payload []byte) error {
	return l.w.writeMessageLocked(t, id, payload)
}
func (l locked) ResetSeq() {
	l.w.seq = 0
	l.w.rmu.Lock()
	l.w.retained, l.w.carry = nil, 0
	l.w.rmu.Unlock()
}

// Locked runs fn with the writer's lock held, so that a check made in fn
// and the frames fn writes are atomic with respect to every other write.
func (w *Writer) Locked(fn func(FrameWriter) error) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return fn(locked{w})
}

// WriteFrame writes one frame.
func (w *Writer) WriteFrame(f Frame) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.writeFrameLocked(f)
}

// WriteMessage writes payload as one message of type t for request id,
// split into frames of at most MaxPayload bytes.
func (w *Writer) WriteMessage(t Type, id uint32, payload []byte) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.writeMessageLocked(t, id, payload)
}

// WriteJSON marshals v and writes it as one message.
func (w *Writer) WriteJSON(t Type, id uint32, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return w.WriteMessage(t, id, b)
}

func (w *Writer) writeFrameLocked(f Frame) error {
	if w.Charge != nil {
		if err := w.Charge(f); err != nil {
			return err
		}
	}
	f.Seq = w.seq
	b, err := AppendFrame(w.buf[:0], f)
	if err != nil {
		return err
	}
	w.buf = b
	w.seq++
	w.wmu.Lock()
	defer w.wmu.Unlock()
	if w.Retain && f.Type != TypeHelloAck {
		w.rmu.Lock()
		w.retained = append(w.retained, retainedFrame{seq: f.Seq, b: append([]byte(nil), b...), cost: FrameCost(len(f.Payload))})
		w.rmu.Unlock()
	}
	_, err = w.w.Write(b)
	return err
}

// Release drops retained frames, oldest first, whose cost adds up to at
// most n (credit the receiver returned for frames it read in order).
func (w *Writer) Release(n int) {
	w.rmu.Lock()
	defer w.rmu.Unlock()
	w.carry += n
	i := 0
	for ; i < len(w.retained) && w.retained[i].cost <= w.carry; i++ {
		w.carry -= w.retained[i].cost
	}
	w.retained = w.retained[i:]
	if len(w.retained) == 0 {
		w.retained, w.carry = nil, 0
	}
}

// Resend writes again, in order, the retained frames numbered from on (in
// sequence-number order, wrapping). It does not wait for a writer waiting
// for credit, and takes no credit itself.
func (w *Writer) Resend(from uint32) error {
	w.wmu.Lock()
	defer w.wmu.Unlock()
	w.rmu.Lock()
	var again [][]byte
	for _, r := range w.retained {
		if int32(r.seq-from) >= 0 {
			again = append(again, r.b)
		}
	}
	w.rmu.Unlock()
	for _, b := range again {
		if _, err := w.w.Write(b); err != nil {
			return err
		}
	}
	return nil
}

// Retained returns the number and cost of the frames retained.
func (w *Writer) Retained() (frames, cost int) {
	w.rmu.Lock()
	defer w.rmu.Unlock()
	for _, r := range w.retained {
		cost += r.cost
	}
	return len(w.retained), cost
}

func (w *Writer) writeMessageLocked(t Type, id uint32, payload []byte) error {
	if len(payload) > MaxMessage {
		return fmt.Errorf("%s message of %d bytes exceeds %d", t, len(payload), MaxMessage)
	}
	split := w.SplitSize
	if split <= 0 || split > MaxPayload {
		split = MaxPayload
	}
	for {
		n := min(len(payload), split)
		f := Frame{Type: t, ID: id, Payload: payload[:n]}
		if n < len(payload) {
			f.Flags = FlagMore
		}
		if err := w.writeFrameLocked(f); err != nil {
			return err
		}
		payload = payload[n:]
		if len(payload) == 0 {
			return nil
		}
	}
}

// Assembler joins JSON messages split over several frames. The frames of
// one message are contiguous on the stream (Writer guarantees it), so a
// frame of another type or id drops a partial message. Not safe for
// concurrent use.
type Assembler struct {
	typ Type
	id  uint32
	buf []byte
	on  bool
}

// Add feeds one frame of a JSON type. It returns the complete message when f
// ends one; the slice is valid until the next call. A message over
// MaxMessage is dropped with an error.
func (a *Assembler) Add(f Frame) ([]byte, bool, error) {
	if a.on && (a.typ != f.Type || a.id != f.ID) {
		a.reset()
	}
	if !a.on && f.Flags&FlagMore == 0 {
		return f.Payload, true, nil
	}
	if !a.on {
		a.on, a.typ, a.id = true, f.Type, f.ID
	}
	if len(a.buf)+len(f.Payload) > MaxMessage {
		a.reset()
		return nil, false, fmt.Errorf("%s message for id %d exceeds %d bytes", f.Type, f.ID, MaxMessage)
	}
	a.buf = append(a.buf, f.Payload...)
	if f.Flags&FlagMore != 0 {
		return nil, false, nil
	}
	msg := a.buf
	a.on = false
	a.buf = a.buf[:0]
	if cap(a.buf) > 4*MaxPayload {
		a.buf = nil // do not pin a large buffer
	}
	return msg, true, nil
}

func (a *Assembler) reset() {
	a.on = false
	a.buf = a.buf[:0]
}
