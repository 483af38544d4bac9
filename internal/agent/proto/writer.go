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

	mu  sync.Mutex
	w   io.Writer
	buf []byte // guarded by mu
	seq uint32 // guarded by mu; the next frame's sequence number
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
func (l locked) ResetSeq() { l.w.seq = 0 }

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
	_, err = w.w.Write(b)
	return err
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
