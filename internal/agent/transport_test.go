package agent_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/guest"
)

// Bytes the console drops anyway (a chunk of a frame, here) are asked for
// again and resent: the call gets every byte, in order, and the client
// goes on.
func TestLostFrameResent(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	c := cd.dial()
	ctx := testCtx(t)
	if _, err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		cd.dropNext.Store(true)
		var out bytes.Buffer
		res, err := c.Exec(ctx, agent.ExecRequest{Shell: "seq 1 60000", Stdout: &out})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("exec %d across a lossy console: %+v, %v", i, res, err)
		}
		var want bytes.Buffer
		for n := 1; n <= 60000; n++ {
			fmt.Fprintf(&want, "%d\n", n)
		}
		if !bytes.Equal(out.Bytes(), want.Bytes()) {
			t.Fatalf("exec %d: %d bytes of output differ from the %d expected", i, out.Len(), want.Len())
		}
	}
	if c.Resends() == 0 {
		t.Fatal("no resend asked, yet chunks were dropped")
	}
	select {
	case <-c.Done():
		t.Fatalf("client stopped: %v", c.Err())
	default:
	}
}

// A frame torn at the very end of what the agent sends (its last chunk
// lost, nothing after it) is asked for again once the partial timeout
// shows it torn: the result arrives.
func TestTornLastFrameResent(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	c := cd.dial()
	ctx := testCtx(t)
	if _, err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	// The result of a stat is one small frame: drop it whole.
	cd.dropNext.Store(true)
	start := time.Now()
	if _, err := c.Stat(ctx, "/"); err != nil {
		t.Fatalf("stat whose result was dropped: %v", err)
	}
	t.Logf("recovered in %v", time.Since(start))
}

// A malformed request is answered with an invalid-argument error, an
// unknown operation with not-implemented.
func TestMalformedRequests(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	h := newRawHost(t, cd.connect())
	h.send(proto.TypeHello, 0, proto.Hello{Version: 1, MinVersion: 1, Nonce: "n"})
	h.next(proto.TypeHelloAck)
	if err := h.w.WriteMessage(proto.TypeRequest, 1, []byte("{not json")); err != nil {
		t.Fatal(err)
	}
	h.send(proto.TypeRequest, 2, proto.Request{Op: "no.such.op"})
	got := map[uint32]error{}
	for len(got) < 2 {
		f := h.next(proto.TypeResult)
		var res proto.Result
		if err := json.Unmarshal(f.Payload, &res); err != nil || res.Error == nil {
			t.Fatalf("result %s", f.Payload)
		}
		got[f.ID] = res.Error.Err()
	}
	if !errdefs.IsInvalidArgument(got[1]) || !errdefs.IsNotImplemented(got[2]) {
		t.Fatalf("errors %v", got)
	}
}

// A guest that ignores a call's data window, or floods it with events or
// results, stops the client with an unavailable error instead of growing
// the call's queue without bound while its caller is busy. (A call whose
// first result was queued still returns it.)
func TestHostileGuestOverrunsCall(t *testing.T) {
	chunk := bytes.Repeat([]byte{'x'}, proto.GuestMaxPayload)
	for _, tc := range []struct {
		name, want string
		gotResult  bool // the call's first result was queued before the flood
		flood      func(w *proto.Writer, id uint32) error
	}{
		{"data", "ignored the data window", false, func(w *proto.Writer, id uint32) error {
			return w.WriteFrame(proto.Frame{Type: proto.TypeData, Flags: uint16(proto.StreamStdout), ID: id, Payload: chunk})
		}},
		{"events", "events", false, func(w *proto.Writer, id uint32) error {
			return w.WriteMessage(proto.TypeEvent, id, chunk)
		}},
		{"results", "second result", true, func(w *proto.Writer, id uint32) error {
			return w.WriteMessage(proto.TypeResult, id, []byte(`{}`))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn := fakeGuest(t, func(w *proto.Writer, id uint32, req proto.Request) {
				// One byte of output holds the caller in its writer.
				w.WriteFrame(proto.Frame{Type: proto.TypeData, Flags: uint16(proto.StreamStdout), ID: id, Payload: []byte("x")})
				for range 4096 { // 64 MiB if nothing stops it
					if tc.flood(w, id) != nil {
						return
					}
				}
			})
			c, err := agent.Dial(testCtx(t), conn, agent.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			out := &blockingWriter{release: c.Done()}
			_, err = c.Exec(testCtx(t), agent.ExecRequest{Shell: "flood", Stdout: out})
			if tc.gotResult && err != nil || !tc.gotResult && (!errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("exec against a flooding guest = %v", err)
			}
			if c.Err() == nil || !strings.Contains(c.Err().Error(), tc.want) {
				t.Fatalf("client stopped with %v", c.Err())
			}
			if n := out.n.Load(); n > proto.InitialWindow+proto.MaxPayload {
				t.Fatalf("%d bytes delivered past a %d-byte window", n, proto.InitialWindow)
			}
		})
	}
}

// A guest that stops reading does not wedge the host: a write blocked past
// the write timeout stops the client, and every call fails with an
// unavailable error instead of waiting behind it.
func TestGuestThatStopsReading(t *testing.T) {
	hostConn, guestConn := socketPair(t)
	// Acknowledge the hello, then never read again.
	go answerHello(proto.NewReader(guestConn), proto.NewWriter(guestConn),
		proto.HelloAck{Version: proto.ProtocolVersion, MinVersion: proto.MinProtocolVersion})
	c, err := agent.Dial(testCtx(t), hostConn, agent.Options{WriteTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// Each call may send a window's worth (256 KiB) of file data: together
	// far more than the socket buffers hold.
	ctx := testCtx(t)
	errs := make(chan error, 8)
	for i := range 8 {
		go func() {
			_, err := c.WriteFile(ctx, fmt.Sprintf("/tmp/f%d", i), bytes.NewReader(make([]byte, 1<<20)), 0)
			errs <- err
		}()
	}
	for range 8 {
		if err := <-errs; !errdefs.IsUnavailable(err) {
			t.Fatalf("WriteFile to a guest that stopped reading = %v", err)
		}
	}
	if c.Err() == nil || !strings.Contains(c.Err().Error(), "write") {
		t.Fatalf("client stopped with %v", c.Err())
	}
	if _, err := c.Ping(ctx); !errdefs.IsUnavailable(err) {
		t.Fatalf("Ping after the client stopped = %v", err)
	}
}

// Close of a client whose write is blocked on a guest that stopped reading
// cuts that write at Close's own short limit, not the write's deadline.
func TestCloseCutsABlockedWrite(t *testing.T) {
	hostConn, guestConn := socketPair(t)
	go answerHello(proto.NewReader(guestConn), proto.NewWriter(guestConn),
		proto.HelloAck{Version: proto.ProtocolVersion, MinVersion: proto.MinProtocolVersion})
	c, err := agent.Dial(testCtx(t), hostConn, agent.Options{WriteTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	ctx := testCtx(t)
	for i := range 4 {
		go c.WriteFile(ctx, fmt.Sprintf("/tmp/f%d", i), bytes.NewReader(make([]byte, 1<<20)), 0)
	}
	time.Sleep(500 * time.Millisecond) // the socket buffers fill; the writes block
	start := time.Now()
	c.Close()
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("Close took %v behind a blocked write (its deadline is a minute)", d)
	}
}

// Garbage after the handshake (here fake headers, each of which would cost
// a CRC over a whole frame to reject) stops the client once a few KiB were
// skipped.
func TestGarbageAfterHandshakeStopsClient(t *testing.T) {
	hostConn, guestConn := socketPair(t)
	fake, _ := proto.AppendFrame(nil, proto.Frame{Type: proto.TypeData, ID: 1, Payload: make([]byte, proto.MaxPayload)})
	go func() {
		err := answerHello(proto.NewReader(guestConn), proto.NewWriter(guestConn),
			proto.HelloAck{Version: proto.ProtocolVersion, MinVersion: proto.MinProtocolVersion})
		if err != nil {
			return
		}
		garbage := bytes.Repeat(fake[:proto.HeaderSize], 4096) // 96 KiB
		for range 64 {
			if _, err := guestConn.Write(garbage); err != nil {
				return
			}
		}
	}()
	c, err := agent.Dial(testCtx(t), hostConn, agent.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	select {
	case <-c.Done():
	case <-testCtx(t).Done():
		t.Fatal("client still running after garbage")
	}
	if err := c.Err(); !errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), "skipped") {
		t.Fatalf("client stopped with %v", err)
	}
}
