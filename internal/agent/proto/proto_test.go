package proto

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"testing"
	"time"
)

func mustFrame(t *testing.T, f Frame) []byte {
	t.Helper()
	b, err := AppendFrame(nil, f)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestReaderSkipsGarbageAndBadFrames(t *testing.T) {
	good1 := mustFrame(t, Frame{Type: TypeRequest, ID: 7, Payload: []byte(`{"op":"ping"}`)})
	good2 := mustFrame(t, Frame{Type: TypeData, Flags: uint16(StreamStdout) | FlagEOF, ID: 9, Payload: []byte("hello")})
	corrupt := mustFrame(t, Frame{Type: TypeData, ID: 3, Payload: []byte("corrupt me")})
	corrupt[len(corrupt)-1] ^= 0xFF
	tooLong := mustFrame(t, Frame{Type: TypeData, ID: 4})
	tooLong[16], tooLong[17] = 0xFF, 0xFF // length far over MaxPayload

	var s []byte
	s = append(s, "login: \x1b[0m garbage"...)
	s = append(s, Magic[:]...) // a lone magic
	s = append(s, corrupt...)
	s = append(s, good1...)
	s = append(s, tooLong...)
	s = append(s, Magic[:2]...)
	s = append(s, good2...)

	r := NewReader(bytes.NewReader(s))
	f, err := r.Next()
	if err != nil || f.Type != TypeRequest || f.ID != 7 || string(f.Payload) != `{"op":"ping"}` {
		t.Fatalf("first frame = %+v, %v", f, err)
	}
	f, err = r.Next()
	if err != nil || f.Type != TypeData || f.ID != 9 || f.Stream() != StreamStdout || !f.EOF() || string(f.Payload) != "hello" {
		t.Fatalf("second frame = %+v, %v", f, err)
	}
	if _, err := r.Next(); !errors.Is(err, io.EOF) {
		t.Fatalf("after the frames: %v, want EOF", err)
	}
	if r.Skipped() == 0 {
		t.Fatal("nothing counted as skipped")
	}
}

// A frame split across many small reads is still found.
func TestReaderByteByByte(t *testing.T) {
	var s []byte
	for i := range 5 {
		s = append(s, mustFrame(t, Frame{Type: TypeEvent, ID: uint32(i), Payload: bytes.Repeat([]byte{'x'}, i*1000)})...)
	}
	r := NewReader(&oneByteReader{b: s})
	for i := range 5 {
		f, err := r.Next()
		if err != nil || f.ID != uint32(i) || len(f.Payload) != i*1000 {
			t.Fatalf("frame %d = %v/%d, %v", i, f.ID, len(f.Payload), err)
		}
	}
}

type oneByteReader struct{ b []byte }

func (r *oneByteReader) Read(p []byte) (int, error) {
	if len(r.b) == 0 {
		return 0, io.EOF
	}
	p[0] = r.b[0]
	r.b = r.b[1:]
	return 1, nil
}

// A torn frame (its writer died) is given up after the partial timeout and
// the bytes that followed it are scanned again.
func TestReaderPartialTimeout(t *testing.T) {
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
	defer pw.Close()
	torn := mustFrame(t, Frame{Type: TypeData, ID: 1, Payload: bytes.Repeat([]byte{'a'}, 50000)})
	good := mustFrame(t, Frame{Type: TypeHello, Payload: []byte(`{"nonce":"n"}`)})
	werr := make(chan error, 1)
	go func() {
		_, err := pw.Write(torn[:1000])
		if err == nil {
			_, err = pw.Write(good) // swallowed by the torn frame's payload at first
		}
		werr <- err
	}()
	r := NewReader(pr)
	r.PartialTimeout = 200 * time.Millisecond
	start := time.Now()
	f, err := r.Next()
	if err != nil || f.Type != TypeHello {
		t.Fatalf("got %+v, %v", f, err)
	}
	if err := <-werr; err != nil {
		t.Fatalf("write to the pipe: %v", err)
	}
	if d := time.Since(start); d < 200*time.Millisecond {
		t.Fatalf("frame found after %v, before the partial timeout", d)
	}
}

func TestAssembler(t *testing.T) {
	var buf bytes.Buffer
	w := NewWriter(&buf)
	big := bytes.Repeat([]byte("0123456789"), 20000) // 200 kB, 4 frames
	if err := w.WriteMessage(TypeResult, 5, big); err != nil {
		t.Fatal(err)
	}
	if err := w.WriteMessage(TypeResult, 6, []byte("small")); err != nil {
		t.Fatal(err)
	}
	r := NewReader(&buf)
	var a Assembler
	var got [][]byte
	for {
		f, err := r.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		msg, ok, err := a.Add(f)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			got = append(got, bytes.Clone(msg))
		}
	}
	if len(got) != 2 || !bytes.Equal(got[0], big) || string(got[1]) != "small" {
		t.Fatalf("got %d messages", len(got))
	}
}

func TestCreditAndQueue(t *testing.T) {
	c := NewCredit(10)
	if n, err := c.Take(context.Background(), 100); n != 10 || err != nil {
		t.Fatalf("Take = %d, %v", n, err)
	}
	done := make(chan int)
	go func() {
		n, _ := c.Take(context.Background(), 3)
		done <- n
	}()
	c.Add(5)
	if n := <-done; n != 3 {
		t.Fatalf("Take after Add = %d", n)
	}
	boom := errors.New("closed")
	c.Close(boom)
	if _, err := c.Take(context.Background(), 1); !errors.Is(err, boom) {
		t.Fatalf("Take after Close: %v", err)
	}

	q := NewQueue[int]()
	q.Push(1)
	q.Push(2)
	q.Close(boom)
	for _, want := range []int{1, 2} {
		if v, err := q.Pop(context.Background()); v != want || err != nil {
			t.Fatalf("Pop = %d, %v", v, err)
		}
	}
	if _, err := q.Pop(context.Background()); !errors.Is(err, boom) {
		t.Fatalf("Pop after Close: %v", err)
	}
	if q.Push(3) {
		t.Fatal("Push after Close accepted")
	}
}

func TestCheckVersions(t *testing.T) {
	if err := CheckVersions(1, 1, 1, 1); err != nil {
		t.Fatal(err)
	}
	err := CheckVersions(1, 1, 3, 2)
	if err == nil || !bytes.Contains([]byte(err.Error()), []byte("host speaks v1")) || !bytes.Contains([]byte(err.Error()), []byte("agent speaks v3")) {
		t.Fatalf("mismatch error = %v", err)
	}
}

func TestClockFollowsHost(t *testing.T) {
	for src, want := range map[string]bool{"tsc": true, "kvm-clock": true,
		"refined-jiffies": false, "jiffies": false, "hpet": false, "": false} {
		if got := ClockFollowsHost(src); got != want {
			t.Errorf("ClockFollowsHost(%q) = %v", src, got)
		}
	}
}

func TestWriterNumbersAndCharges(t *testing.T) {
	var buf bytes.Buffer
	w := NewWriter(&buf)
	w.SplitSize = 10
	var charged []int
	w.Charge = func(f Frame) error {
		charged = append(charged, FrameCost(len(f.Payload)))
		if f.ID == 99 {
			return errors.New("no credit")
		}
		return nil
	}
	w.WriteMessage(TypeResult, 1, bytes.Repeat([]byte{'x'}, 25)) // 3 frames
	w.Locked(func(fw FrameWriter) error {
		fw.ResetSeq()
		return fw.WriteFrame(Frame{Type: TypeHelloAck})
	})
	if err := w.WriteFrame(Frame{Type: TypeEvent, ID: 99}); err == nil {
		t.Fatal("a refused charge wrote the frame")
	}
	w.WriteFrame(Frame{Type: TypeEvent, ID: 2})
	r := NewReader(&buf)
	var got []string
	for {
		f, err := r.Next()
		if err != nil {
			break
		}
		got = append(got, fmt.Sprintf("%s/%d/%d/%d", f.Type, f.ID, f.Seq, len(f.Payload)))
	}
	want := []string{"result/1/0/10", "result/1/1/10", "result/1/2/5", "hello_ack/0/0/0", "event/2/1/0"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("frames %v, want %v", got, want)
	}
	if len(charged) != 6 || charged[0] != HeaderSize+10+FrameOverhead {
		t.Fatalf("charged %v", charged)
	}
}

// A stream of fake headers, each claiming a full payload that fails its
// CRC, makes Next fail once MaxSkipped is passed instead of checksumming
// the stream without end.
func TestReaderSkipLimit(t *testing.T) {
	fake := mustFrame(t, Frame{Type: TypeData, ID: 1, Payload: bytes.Repeat([]byte{'a'}, MaxPayload)})
	fake[len(fake)-1] ^= 0xFF
	var s []byte
	for range 64 {
		s = append(s, fake[:HeaderSize]...)
	}
	s = append(s, fake[HeaderSize:]...)
	s = append(s, mustFrame(t, Frame{Type: TypeEvent, ID: 2})...)
	r := NewReader(bytes.NewReader(s))
	r.MaxSkipped = 100
	if _, err := r.Next(); !errors.Is(err, ErrSkipLimit) {
		t.Fatalf("Next over fake headers = %v, want ErrSkipLimit", err)
	}
	if r.Skipped() <= 100 || r.Skipped() > 200 {
		t.Fatalf("skipped %d bytes before giving up", r.Skipped())
	}
	// Without a limit the same stream resynchronises on the real frame.
	r = NewReader(bytes.NewReader(s))
	if f, err := r.Next(); err != nil || f.ID != 2 {
		t.Fatalf("Next without a limit = %+v, %v", f, err)
	}
}
