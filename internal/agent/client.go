// Package agent is the host side of the guest agent protocol (package
// proto): a client that multiplexes any number of concurrent calls over one
// connection to a VM's agent channel.
//
// A Client lives as long as its connection. When the connection breaks or
// the Client is closed, every pending and later call fails at once with an
// errdefs.ErrUnavailable error. Errors the agent returns keep their errdefs
// class. A call whose context ends is cancelled in the guest (a foreground
// process is killed, a file write is abandoned) and returns an error of
// class errdefs.ErrDeadlineExceeded (matching context.DeadlineExceeded too)
// or context.Canceled.
package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

const (
	// helloInterval is how often Dial repeats its hello until acknowledged.
	helloInterval = time.Second
	// maxQueuedEvents bounds the event bytes queued for one call and not
	// yet consumed; the agent sends a few small events per call.
	maxQueuedEvents = 1 << 20
	// DefaultWriteTimeout bounds one frame write when Options.WriteTimeout
	// is zero.
	DefaultWriteTimeout = 30 * time.Second
	// After the handshake the Reader may skip bytes only from a budget:
	// skipped bytes mean bytes were lost (the rest of a torn frame) or a
	// broken or hostile guest, and each may cost a CRC over a whole frame.
	// The budget starts at skipBudget, refills at skipRefill bytes a second
	// up to skipBudgetMax; a guest that exhausts it stops the client.
	skipBudget    = 32 << 10
	skipBudgetMax = 128 << 10
	skipRefill    = 4 << 10
	// resendRetry is how long the client waits for the frames it asked to
	// be resent before it asks again.
	resendRetry = time.Second
)

// Options configures a Client.
type Options struct {
	// Logger receives protocol anomalies at debug level; nil discards.
	Logger *slog.Logger
	// WriteTimeout bounds each frame write (DefaultWriteTimeout when zero).
	// A guest that stops reading for longer stops the Client, so that no
	// caller stays wedged behind a blocked write.
	WriteTimeout time.Duration
	// Silence and ProbeTimeout tune the liveness watch (DefaultSilence,
	// DefaultProbeTimeout when zero): with calls pending and nothing
	// received for Silence, the client pings; unanswered for ProbeTimeout,
	// the agent is reported unresponsive to OnHealth (called on a goroutine
	// of its own), and responsive again at its next frame. Calls go on
	// waiting: each is bounded by its own deadline.
	Silence, ProbeTimeout time.Duration
	OnHealth              func(Health)
	// CallGrace is what the host adds to an exec's or an eval's own
	// timeout before giving up on the guest (DefaultCallGrace when zero).
	CallGrace time.Duration
}

// Client is a session with one guest agent. Safe for concurrent use.
type Client struct {
	conn         net.Conn
	w            *proto.Writer // writes through connWriter
	log          *slog.Logger
	ack          proto.HelloAck
	writeTimeout time.Duration
	// writeCap, when non-zero, is a UnixNano deadline no write may pass
	// (set by Close).
	writeCap atomic.Int64

	// Liveness (liveness.go): the time of the last frame received, and
	// whether the last probe went unanswered.
	lastRecv              atomic.Int64
	unresponsive          atomic.Bool
	silence, probeTimeout time.Duration
	callGrace             time.Duration
	onHealth              func(Health)

	// resendFrom is the sequence number to ask the agent to resend from,
	// and resendAsk whether to ask (protocol 2); set by readLoop, sent by
	// ackLoop.
	resendFrom atomic.Uint32
	resendAsk  atomic.Bool
	nextSeq    atomic.Uint32 // readLoop's next expected sequence number
	busy       chan struct{} // wakes the liveness watch when a call starts
	resends    atomic.Int64  // resend requests sent

	// owed is the connection credit (proto.ConnWindow) read but not yet
	// returned to the agent; ackWake asks ackLoop to return it.
	owed    atomic.Int64
	ackWake chan struct{}

	mu      sync.Mutex
	nextID  uint32           // guarded by mu
	calls   map[uint32]*call // guarded by mu
	err     error            // guarded by mu; why the client stopped
	done    chan struct{}    // closed once err is set
	cancels atomic.Int64     // cancel frames being written
}

// Dial performs the hello handshake over conn, already connected to the
// VM's agent channel, and returns a Client. It discards whatever the channel
// holds before the agent's answer and repeats its hello every second until
// the agent answers or ctx ends. Dial owns conn: it is closed when Dial
// fails and when the Client is closed.
func Dial(ctx context.Context, conn net.Conn, opts Options) (*Client, error) {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c := &Client{
		conn:         conn,
		log:          log,
		writeTimeout: opts.WriteTimeout,
		calls:        map[uint32]*call{},
		done:         make(chan struct{}),
		ackWake:      make(chan struct{}, 1),
		busy:         make(chan struct{}, 1),
	}
	if c.writeTimeout <= 0 {
		c.writeTimeout = DefaultWriteTimeout
	}
	c.silence, c.probeTimeout, c.onHealth, c.callGrace = opts.Silence, opts.ProbeTimeout, opts.OnHealth, opts.CallGrace
	if c.callGrace <= 0 {
		c.callGrace = DefaultCallGrace
	}
	if c.silence <= 0 {
		c.silence = DefaultSilence
	}
	if c.probeTimeout <= 0 {
		c.probeTimeout = DefaultProbeTimeout
	}
	c.w = proto.NewWriter(connWriter{c})
	var nb [16]byte
	rand.Read(nb[:])
	nonce := hex.EncodeToString(nb[:])
	hello, _ := json.Marshal(proto.Hello{
		Version:    proto.ProtocolVersion,
		MinVersion: proto.MinProtocolVersion,
		Nonce:      nonce,
	})

	// Unblock the reads below when ctx ends.
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	acked := make(chan struct{})
	var ackOnce sync.Once
	endHello := func() { ackOnce.Do(func() { close(acked) }) }
	go func() {
		t := time.NewTicker(helloInterval)
		defer t.Stop()
		for {
			if err := c.w.WriteMessage(proto.TypeHello, 0, hello); err != nil {
				return
			}
			select {
			case <-acked:
				return
			case <-t.C:
			}
		}
	}()
	fail := func(err error) (*Client, error) {
		endHello()
		stop()
		conn.Close()
		if ctx.Err() != nil {
			return nil, ctxError("handshake", ctx.Err())
		}
		return nil, err
	}

	r := proto.NewReader(conn)
	var asm proto.Assembler
	var nextSeq uint32
	for {
		f, err := r.Next()
		if err != nil {
			return fail(errdefs.Unavailable("agent handshake: %w", err))
		}
		if f.Type != proto.TypeHelloAck {
			continue
		}
		msg, ok, _ := asm.Add(f)
		if !ok {
			continue
		}
		var ack proto.HelloAck
		if err := json.Unmarshal(msg, &ack); err != nil || ack.Nonce != nonce {
			continue // stale or foreign
		}
		if ack.Error != nil {
			return fail(fmt.Errorf("agent handshake: %w", ack.Error.Err()))
		}
		if err := proto.CheckVersions(proto.ProtocolVersion, proto.MinProtocolVersion, ack.Version, ack.MinVersion); err != nil {
			return fail(fmt.Errorf("agent handshake: %w", err))
		}
		c.ack = ack
		nextSeq = f.Seq + 1
		break
	}
	endHello()
	if !stop() {
		return fail(nil) // ctx ended just now and closed conn
	}
	c.lastRecv.Store(time.Now().UnixNano())
	go c.readLoop(r, nextSeq)
	go c.ackLoop()
	go c.watch()
	return c, nil
}

// AgentVersion returns the agent's build version.
func (c *Client) AgentVersion() string { return c.ack.AgentVersion }

// ProtocolVersion returns the protocol version the agent speaks.
func (c *Client) ProtocolVersion() int { return c.ack.Version }

// Features returns what the agent offers (proto.Feature*).
func (c *Client) Features() []string { return c.ack.Features }

// Clocksource returns the guest kernel's clocksource as the agent reported
// it when the session opened ("" from older agents).
func (c *Client) Clocksource() string { return c.ack.Clocksource }

// Done is closed when the Client stops (closed or connection lost).
func (c *Client) Done() <-chan struct{} { return c.done }

// Err returns why the Client stopped, or nil while it runs.
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Pending returns how many calls wait for the agent now.
func (c *Client) Pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.calls)
}

// Close cancels pending calls in the guest (best effort), closes the
// connection and fails the calls. Had the connection broken instead, the
// guest would cancel this session's foreground requests only when the next
// session starts, since it cannot see a disconnect.
func (c *Client) Close() error {
	c.cancelPending()
	c.stop(errdefs.Unavailable("agent client closed"))
	return nil
}

// cancelPending tells the guest to abandon the calls still pending, unless
// the client has stopped already (there is no connection left to use).
// It gives up after about a second, or at the first write that fails.
func (c *Client) cancelPending() {
	c.mu.Lock()
	pending := make([]uint32, 0, len(c.calls))
	for id := range c.calls {
		pending = append(pending, id)
	}
	stopped := c.err != nil
	c.mu.Unlock()
	if stopped {
		return
	}
	limit := time.Now().Add(time.Second)
	c.writeCap.Store(limit.UnixNano())
	// A write already blocked (a guest that stopped reading) is cut at
	// the same limit, not at its own 30 s deadline. It fails only on a
	// closed connection, where the writes below fail too.
	_ = c.conn.SetWriteDeadline(limit)
	for deadline := time.Now().Add(time.Second); c.cancels.Load() > 0 && time.Now().Before(deadline); {
		time.Sleep(2 * time.Millisecond)
	}
	for _, id := range pending {
		if c.w.WriteFrame(proto.Frame{Type: proto.TypeCancel, ID: id}) != nil {
			break
		}
	}
}

// stop ends the client with err; the first error wins.
func (c *Client) stop(err error) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err = err
	calls := c.calls
	c.calls = map[uint32]*call{}
	close(c.done)
	c.mu.Unlock()
	c.conn.Close()
	for _, cl := range calls {
		cl.q.Close(err)
		cl.credit.Close(err)
	}
}

// connWriter writes to the connection with a deadline per write (one
// frame: proto.Writer writes each whole). A failed write may have left a
// partial frame on the stream, so it stops the client.
type connWriter struct{ c *Client }

func (w connWriter) Write(p []byte) (int, error) {
	c := w.c
	dl := time.Now().Add(c.writeTimeout)
	if lim := c.writeCap.Load(); lim != 0 && dl.UnixNano() > lim {
		dl = time.Unix(0, lim)
	}
	// It fails only on a closed connection, which the write reports.
	_ = c.conn.SetWriteDeadline(dl)
	n, err := c.conn.Write(p)
	if err != nil {
		c.stop(errdefs.Unavailable("agent connection lost: write: %w", err))
	}
	return n, err
}

// readLoop reads the agent's frames and dispatches them to calls; it never
// blocks on a call's consumer, so the connection credit it returns flows
// whatever the callers do. A gap in the agent's sequence numbers, or a torn
// frame (a console dropped bytes), makes it ask the agent to resend from
// the first frame missing (protocol 2; before it, the client stops), and
// it drops what arrives out of order meanwhile. Skipping more garbage
// than the skip budget allows ends the client.
func (c *Client) readLoop(r *proto.Reader, nextSeq uint32) {
	var asm proto.Assembler
	c.nextSeq.Store(nextSeq)
	canResend := c.ack.Version >= 2
	budget, refilled := uint64(skipBudget), time.Now()
	r.MaxSkipped = r.Skipped() + budget
	r.OnTorn = func() {
		if canResend {
			c.askResend(nextSeq)
		}
	}
	for {
		f, err := r.Next()
		if errors.Is(err, proto.ErrSkipLimit) {
			c.stop(errdefs.Unavailable("agent channel corrupt: more than %d bytes skipped after the handshake", budget))
			return
		}
		if err != nil {
			c.stop(errdefs.Unavailable("agent connection lost: %w", err))
			return
		}
		// Refill the skip budget with time.
		if now := time.Now(); now.Sub(refilled) >= time.Second {
			budget = min(budget+uint64(now.Sub(refilled)/time.Second)*skipRefill, skipBudgetMax)
			refilled = now
		}
		r.MaxSkipped = r.Skipped() + budget
		if f.Seq != nextSeq {
			if !canResend {
				c.stop(errdefs.Unavailable("agent channel lost data: frame %d arrived, %d expected", f.Seq, nextSeq))
				return
			}
			if int32(f.Seq-nextSeq) > 0 {
				c.askResend(nextSeq) // frames from nextSeq were lost
			}
			c.heard()
			continue // a duplicate, or a frame that comes again after the lost ones
		}
		nextSeq++
		c.nextSeq.Store(nextSeq)
		c.resendAsk.Store(false)
		c.heard()
		if f.Type != proto.TypeHelloAck {
			if c.owed.Add(int64(proto.FrameCost(len(f.Payload)))) >= proto.ConnWindow/4 {
				select {
				case c.ackWake <- struct{}{}:
				default:
				}
			}
		}
		switch f.Type {
		case proto.TypeResult, proto.TypeEvent:
			msg, ok, err := asm.Add(f)
			if err != nil {
				c.log.Debug("agent message dropped", "err", err)
			}
			if !ok {
				continue
			}
			f.Payload = msg
		case proto.TypeData, proto.TypeWindow:
		default:
			continue // hello_ack repeats and anything host-bound
		}
		c.mu.Lock()
		cl := c.calls[f.ID]
		c.mu.Unlock()
		if cl == nil {
			c.log.Debug("agent frame for no call", "type", f.Type, "id", f.ID)
			continue
		}
		if f.Type == proto.TypeWindow {
			if n, err := proto.ParseWindow(f.Payload); err == nil {
				cl.credit.Add(int(n))
			}
			continue
		}
		if err := cl.admit(f); err != nil {
			c.stop(err)
			return
		}
		f.Payload = append([]byte(nil), f.Payload...)
		cl.q.Push(f)
	}
}

// askResend asks ackLoop to have the agent resend its frames from seq.
func (c *Client) askResend(seq uint32) {
	if c.resendAsk.Load() && c.resendFrom.Load() == seq {
		return // asked already; ackLoop asks again if nothing comes
	}
	c.resendFrom.Store(seq)
	c.resendAsk.Store(true)
	select {
	case c.ackWake <- struct{}{}:
	default:
	}
}

// Resends returns how many times the client asked the agent to resend
// lost frames.
func (c *Client) Resends() int64 { return c.resends.Load() }

// ackLoop returns connection credit to the agent and sends resend
// requests, apart from readLoop so that a blocked write never stalls
// reading. A resend request not answered within resendRetry is repeated.
func (c *Client) ackLoop() {
	retry := time.NewTimer(time.Hour)
	retry.Stop()
	var asked uint32
	askedAt := time.Time{}
	for {
		select {
		case <-c.ackWake:
		case <-retry.C:
		case <-c.done:
			retry.Stop()
			return
		}
		if n := c.owed.Swap(0); n > 0 {
			if err := c.w.WriteFrame(proto.Frame{Type: proto.TypeWindow, Payload: proto.WindowPayload(uint32(n))}); err != nil {
				c.stop(errdefs.Unavailable("agent connection lost: %w", err))
				return
			}
		}
		if !c.resendAsk.Load() {
			continue
		}
		from := c.resendFrom.Load()
		if from == asked && time.Since(askedAt) < resendRetry {
			retry.Reset(resendRetry - time.Since(askedAt))
			continue
		}
		if err := c.w.WriteFrame(proto.Frame{Type: proto.TypeResend, Payload: proto.WindowPayload(from)}); err != nil {
			c.stop(errdefs.Unavailable("agent connection lost: %w", err))
			return
		}
		c.resends.Add(1)
		c.log.Debug("asked the agent to resend", "from", from)
		asked, askedAt = from, time.Now()
		retry.Reset(resendRetry)
	}
}

// Ping asks the agent for its version, uptime and identity.
func (c *Client) Ping(ctx context.Context) (*proto.PingResult, error) {
	var res proto.PingResult
	if err := c.do(ctx, proto.OpPing, nil, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// WaitReady waits until the agent's warm interpreter, if it has one, has
// started and preloaded its modules: call it before snapshotting a parent,
// so that children inherit a warm interpreter. It fails with
// errdefs.ErrUnavailable when the interpreter could not start.
func (c *Client) WaitReady(ctx context.Context) error {
	for {
		p, err := c.Ping(ctx)
		if err != nil {
			return err
		}
		switch {
		case p.Python == "" || p.Python == "ready":
			return nil
		case strings.HasPrefix(p.Python, "failed"):
			return errdefs.Unavailable("agent python: %s", p.Python)
		}
		select {
		case <-ctx.Done():
			return ctxError("wait ready", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Init sets the guest's clock, adds entropy to its RNG (and reseeds the warm
// interpreter's random generators) and sets its identity. Send it after
// first boot and after every restore. It returns once the warm interpreter,
// if the image has one, has started and preloaded its modules (or failed
// to), so that a parent snapshotted after its Init carries a warm
// interpreter.
func (c *Client) Init(ctx context.Context, req proto.InitRequest) error {
	return c.do(ctx, proto.OpInit, req, nil)
}
