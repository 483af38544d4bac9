// Package guest is forkd's in-guest agent: PID 1 of every microVM (or a
// process under a tiny init), serving the host over one byte stream.
//
// The stream carries the frames of package proto. The agent never sees the
// host connect or disconnect, so sessions are explicit: a hello with a new
// nonce starts a session and cancels the previous session's foreground
// requests (killing their processes); background processes and the warm
// Python interpreter belong to the Agent and outlive sessions, which is what
// lets a VM restored from a snapshot serve a new host.
//
// Every frame the agent writes for a request is written only while that
// request's session is current (checked under the writer's lock), so once a
// hello_ack for a new session is on the stream no frame of an older session
// follows it.
//
// The agent is idle-quiet: with no requests in flight it blocks in reads and
// in its reaper's signal wait, with no tickers.
package guest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

// DefaultEnv is the base environment of processes the agent starts.
var DefaultEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"LANG=C.UTF-8",
	"TERM=xterm",
}

// Config configures an Agent.
type Config struct {
	// Version is the agent's build version, reported to hosts ("dev" when
	// empty).
	Version string
	// Python is the interpreter for eval; empty makes eval unavailable.
	Python string
	// Preload lists modules the interpreter imports at start.
	Preload []string
	// PythonDir is the interpreter's working directory (the agent user's
	// home, or /, when empty).
	PythonDir string
	// EvalGrace is how long an interrupted eval may take to stop before the
	// interpreter is killed and restarted (3 s when zero).
	EvalGrace time.Duration
	// Env is the base environment of started processes (DefaultEnv when
	// nil); HOME, USER and LOGNAME come from the user's passwd entry and the
	// request's env overrides all.
	Env []string
	// Root is where /etc/passwd and /etc/group are read ("/" when empty).
	Root string
	// System performs init's effects on the machine; nil fields use the
	// real ones (RealSystem).
	System System
	// SandboxID and Hostname are the identity before any init.
	SandboxID, Hostname string
	// Cgroup is the cgroup2 directory every process the agent starts is
	// born in (WorkloadCgroup when PID 1); empty: the agent's own cgroup.
	Cgroup string
	// PIDsLimit is the cgroup's pids.max when an init names none (the
	// boot budget's); 0 leaves it alone.
	PIDsLimit int
	// PartialTimeout overrides proto.DefaultPartialTimeout for torn frames.
	PartialTimeout time.Duration
	Logger         *slog.Logger
}

// Agent serves requests. It owns background processes and the Python
// interpreter; Serve may be called again after it returns.
type Agent struct {
	cfg     Config
	log     *slog.Logger
	started time.Time
	reaper  *reaper
	procs   *procTable
	py      *interp // nil when no interpreter is configured
	sys     System
	// cgroupFD is cfg.Cgroup opened for CLONE_INTO_CGROUP, kept for the
	// agent's lifetime; -1 when none.
	cgroupFD int

	// channel is the device number of the character device Serve last
	// served on (0: none), which the files API refuses to touch.
	channel atomic.Uint64

	ids idNames // owner and group names of files

	idMu      sync.Mutex
	sandboxID string // guarded by idMu
	hostname  string // guarded by idMu

	diskMu sync.Mutex  // held while a disk is attached
	disk   *proto.Disk // guarded by diskMu; the disk the root is on, nil: RAM
}

// New returns an Agent and starts its Python interpreter, if configured, in
// the background.
func New(cfg Config) *Agent {
	if cfg.Version == "" {
		cfg.Version = "dev"
	}
	if cfg.EvalGrace <= 0 {
		cfg.EvalGrace = 3 * time.Second
	}
	if cfg.Env == nil {
		cfg.Env = DefaultEnv
	}
	if cfg.Root == "" {
		cfg.Root = "/"
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	a := &Agent{
		cfg:       cfg,
		log:       log,
		started:   time.Now(),
		reaper:    processReaper(),
		procs:     newProcTable(),
		sys:       cfg.System.withDefaults(),
		sandboxID: cfg.SandboxID,
		hostname:  cfg.Hostname,
		cgroupFD:  -1,
		ids:       idNames{root: cfg.Root},
	}
	if cfg.Cgroup != "" {
		fd, err := syscall.Open(cfg.Cgroup, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
		if err != nil {
			log.Error("workload cgroup; processes run in the agent's", "cgroup", cfg.Cgroup, "err", err)
		} else {
			a.cgroupFD = fd
		}
	}
	if cfg.Python != "" {
		a.py = newInterp(a, cfg.Python, cfg.Preload)
		a.py.startAsync()
	}
	return a
}

// Close kills the agent's background processes and its interpreter.
func (a *Agent) Close() error {
	a.procs.killAll()
	if a.py != nil {
		a.py.stop()
	}
	return nil
}

// features lists what this agent offers.
func (a *Agent) features() []string {
	f := []string{proto.FeatureExec, proto.FeatureFiles, proto.FeatureProcesses, proto.FeatureDisk,
		proto.FeaturePTY, proto.FeatureAttach, proto.FeatureWatch}
	if a.py != nil {
		f = append(f, proto.FeatureEval, proto.FeatureRich)
	}
	if a.cgroupFD >= 0 {
		f = append(f, proto.FeatureLimits)
	}
	return f
}

// Serve reads frames from rw and answers on rw until reading fails (io.EOF
// included), which it returns. Requests run under ctx.
func (a *Agent) Serve(ctx context.Context, rw io.ReadWriter) error {
	if f, ok := rw.(*os.File); ok {
		if st, err := f.Stat(); err == nil && st.Mode()&fs.ModeCharDevice != 0 {
			if sys, ok := st.Sys().(*syscall.Stat_t); ok {
				a.channel.Store(sys.Rdev)
			}
		}
	}
	c := &conn{a: a, ctx: ctx, w: proto.NewWriter(rw)}
	c.w.SplitSize = proto.GuestMaxPayload
	c.w.Charge = c.charge
	c.w.Retain = true // for the host's resend requests
	r := proto.NewReader(rw)
	r.PartialTimeout = a.cfg.PartialTimeout
	defer func() {
		if s := c.cur.Load(); s != nil {
			s.end()
		}
	}()
	for {
		f, err := r.Next()
		if err != nil {
			return err
		}
		c.dispatch(f)
	}
}

// conn is the agent's side of one stream. Its reading goroutine never
// waits for the writer except to start a session (after ending the old
// one): a write may wait for connection credit, which only that goroutine
// can deliver.
type conn struct {
	a   *Agent
	ctx context.Context
	w   *proto.Writer
	// cur is the current session; stored only with w's lock held.
	cur atomic.Pointer[session]
	asm proto.Assembler // used by the reading goroutine only

	resendMu      sync.Mutex // guards the fields below
	resending     bool       // a resend goroutine runs
	resendPending bool       // resendFrom is yet to be resent
	resendFrom    uint32
}

// session is one host's session; it ends when a hello with another nonce
// arrives or the stream fails.
type session struct {
	nonce  string
	ctx    context.Context
	cancel context.CancelFunc
	// credit is the session's share of proto.ConnWindow.
	credit *proto.Credit
	mu     sync.Mutex
	reqs   map[uint32]*request // guarded by mu
}

// charge takes a frame's cost from the current session's connection
// credit (proto.ConnWindow), waiting for the host to return some. It runs
// with the writer's lock held, so the current session cannot change under
// it; a new hello ends the session first, which releases a waiting writer.
func (c *conn) charge(f proto.Frame) error {
	if f.Type == proto.TypeHelloAck {
		return nil
	}
	s := c.cur.Load()
	if s == nil {
		return nil
	}
	if err := s.credit.TakeAll(s.ctx, proto.FrameCost(len(f.Payload))); err != nil {
		return errStale
	}
	return nil
}

func (s *session) end() {
	s.cancel()
	s.credit.Close(errStale)
}

func (s *session) get(id uint32) *request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.reqs[id]
}

// request is one request in flight.
type request struct {
	id     uint32
	op     string
	c      *conn
	sess   *session
	ctx    context.Context
	cancel context.CancelFunc
	in     *proto.Queue[proto.Frame] // host data frames, payloads owned
	inUsed atomic.Int64              // bytes queued and not yet consumed
	credit *proto.Credit             // for data we send
	acked  int                       // consumed bytes not yet returned as credit; handler only
}

var errStale = errors.New("session ended")

func (c *conn) dispatch(f proto.Frame) {
	switch f.Type {
	case proto.TypeHello, proto.TypeRequest:
		msg, ok, err := c.asm.Add(f)
		if err != nil {
			c.a.log.Warn("dropped message", "err", err)
		}
		if !ok {
			return
		}
		if f.Type == proto.TypeHello {
			c.hello(msg)
		} else {
			c.request(f.ID, msg)
		}
	case proto.TypeData:
		s := c.cur.Load()
		if s == nil {
			return
		}
		r := s.get(f.ID)
		if r == nil {
			return
		}
		if r.inUsed.Add(int64(len(f.Payload))) > 2*proto.InitialWindow {
			r.cancel() // the host ignores the window
			return
		}
		f.Payload = append([]byte(nil), f.Payload...)
		r.in.Push(f)
	case proto.TypeWindow, proto.TypeCancel:
		s := c.cur.Load()
		if s == nil {
			return
		}
		if f.Type == proto.TypeWindow && f.ID == 0 {
			if n, err := proto.ParseWindow(f.Payload); err == nil {
				c.w.Release(int(n))
				s.credit.Add(int(n))
			}
			return
		}
		r := s.get(f.ID)
		if r == nil {
			return
		}
		if f.Type == proto.TypeCancel {
			r.cancel()
			return
		}
		if n, err := proto.ParseWindow(f.Payload); err == nil {
			r.credit.Add(int(n))
		}
	case proto.TypeResend:
		if from, err := proto.ParseWindow(f.Payload); err == nil && f.ID == 0 && c.cur.Load() != nil {
			c.resend(from)
		}
	default:
		c.a.log.Debug("ignored frame", "type", f.Type, "id", f.ID)
	}
}

// resend writes again the frames the host lost, from a goroutine of its
// own: the reading goroutine must never wait for the stream. One resend
// runs at a time; a request arriving meanwhile is merged into the next
// one (the earliest sequence number wins).
func (c *conn) resend(from uint32) {
	c.resendMu.Lock()
	defer c.resendMu.Unlock()
	if c.resendPending && int32(from-c.resendFrom) >= 0 {
		return
	}
	c.resendFrom, c.resendPending = from, true
	if c.resending {
		return
	}
	c.resending = true
	go func() {
		for {
			c.resendMu.Lock()
			if !c.resendPending {
				c.resending = false
				c.resendMu.Unlock()
				return
			}
			from := c.resendFrom
			c.resendPending = false
			c.resendMu.Unlock()
			if err := c.w.Resend(from); err != nil {
				c.a.log.Warn("resend frames", "from", from, "err", err)
			}
		}
	}()
}

func (c *conn) hello(msg []byte) {
	var h proto.Hello
	if err := json.Unmarshal(msg, &h); err != nil {
		c.a.log.Warn("bad hello", "err", err)
		return
	}
	ack := proto.HelloAck{
		Version:      proto.ProtocolVersion,
		MinVersion:   proto.MinProtocolVersion,
		Nonce:        h.Nonce,
		AgentVersion: c.a.cfg.Version,
		Features:     c.a.features(),
		Clocksource:  c.a.sys.Clocksource(),
	}
	if err := proto.CheckVersions(h.Version, h.MinVersion, proto.ProtocolVersion, proto.MinProtocolVersion); err != nil {
		c.a.log.Error("refused host", "err", err)
		ack.Error = proto.ErrorOf(err)
		go c.writeJSON(proto.TypeHelloAck, 0, ack)
		return
	}
	b, _ := json.Marshal(ack)
	cur := c.cur.Load()
	if cur != nil && cur.nonce == h.Nonce {
		// The same host again: acknowledge within its session, without
		// holding up this reader behind a writer waiting for credit.
		go func() {
			err := c.w.Locked(func(fw proto.FrameWriter) error {
				if c.cur.Load() != cur {
					return errStale
				}
				return fw.WriteMessage(proto.TypeHelloAck, 0, b)
			})
			if err != nil && !errors.Is(err, errStale) {
				c.a.log.Warn("write hello_ack", "err", err)
			}
		}()
		return
	}
	// End the old session first: that cancels its requests and releases a
	// writer waiting for the old host's credit, so the lock comes free.
	if cur != nil {
		cur.end()
	}
	ctx, cancel := context.WithCancel(c.ctx)
	s := &session{
		nonce: h.Nonce, ctx: ctx, cancel: cancel,
		credit: proto.NewCredit(proto.ConnWindow),
		reqs:   map[uint32]*request{},
	}
	err := c.w.Locked(func(fw proto.FrameWriter) error {
		c.cur.Store(s)
		fw.ResetSeq()
		return fw.WriteMessage(proto.TypeHelloAck, 0, b)
	})
	if err != nil {
		c.a.log.Warn("write hello_ack", "err", err)
	}
}

func (c *conn) writeJSON(t proto.Type, id uint32, v any) {
	if err := c.w.WriteJSON(t, id, v); err != nil {
		c.a.log.Warn("write", "type", t, "err", err)
	}
}

func (c *conn) request(id uint32, msg []byte) {
	s := c.cur.Load()
	if s == nil {
		return // no session: the host is not listening for answers
	}
	ctx, cancel := context.WithCancel(s.ctx)
	r := &request{
		id: id, c: c, sess: s, ctx: ctx, cancel: cancel,
		in:     proto.NewQueue[proto.Frame](),
		credit: proto.NewCredit(proto.InitialWindow),
	}
	var req proto.Request
	if err := json.Unmarshal(msg, &req); err != nil {
		go r.finish(nil, errdefs.InvalidArgument("request %d: %w", id, err))
		return
	}
	r.op = req.Op
	s.mu.Lock()
	if _, dup := s.reqs[id]; dup {
		s.mu.Unlock()
		cancel()
		c.a.log.Warn("duplicate request id", "id", id)
		return
	}
	s.reqs[id] = r
	s.mu.Unlock()
	go func() {
		res, err := c.a.handle(r, req.Op, req.Args)
		r.finish(res, err)
	}()
}

// finish sends the result and forgets the request. A result whose encoding
// exceeds proto.MaxMessage is replaced by a ResourceExhausted error.
func (r *request) finish(res any, err error) {
	var out proto.Result
	if err != nil {
		out.Error = proto.ErrorOf(err)
	} else if res != nil {
		b, merr := json.Marshal(res)
		if merr != nil {
			out.Error = proto.ErrorOf(fmt.Errorf("encode %s result: %w", r.op, merr))
		} else {
			out.Result = b
		}
	}
	b, _ := json.Marshal(out)
	if len(b) > proto.MaxMessage {
		// The host would drop it and wait forever: say why instead.
		big := errdefs.ResourceExhausted("%s: result of %d bytes encoded exceeds the %d-byte message limit", r.op, len(b), proto.MaxMessage)
		b, _ = json.Marshal(proto.Result{Error: proto.ErrorOf(big)})
	}
	if err := r.sendMessage(proto.TypeResult, b); err != nil && !errors.Is(err, errStale) {
		r.c.a.log.Warn("write result", "op", r.op, "id", r.id, "err", err)
	}
	r.sess.mu.Lock()
	if r.sess.reqs[r.id] == r {
		delete(r.sess.reqs, r.id)
	}
	r.sess.mu.Unlock()
	r.cancel()
	r.in.Close(errStale)
	r.credit.Close(errStale)
}

// sendMessage writes a JSON message if r's session is still current.
func (r *request) sendMessage(t proto.Type, payload []byte) error {
	return r.c.w.Locked(func(fw proto.FrameWriter) error {
		if r.c.cur.Load() != r.sess {
			return errStale
		}
		return fw.WriteMessage(t, r.id, payload)
	})
}

// sendEvent writes an event for r.
func (r *request) sendEvent(ev proto.Event) {
	b, _ := json.Marshal(ev)
	if err := r.sendMessage(proto.TypeEvent, b); err != nil && !errors.Is(err, errStale) {
		r.c.a.log.Warn("write event", "op", r.op, "id", r.id, "err", err)
	}
}

// sendData writes p as data frames of stream st, waiting for credit.
func (r *request) sendData(ctx context.Context, st proto.Stream, p []byte, eof bool) error {
	for len(p) > 0 || eof {
		n := 0
		if len(p) > 0 {
			var err error
			if n, err = r.credit.Take(ctx, min(len(p), proto.GuestMaxPayload)); err != nil {
				return err
			}
		}
		f := proto.Frame{Type: proto.TypeData, Flags: uint16(st), ID: r.id, Payload: p[:n]}
		if n == len(p) && eof {
			f.Flags |= proto.FlagEOF
			eof = false
		}
		err := r.c.w.Locked(func(fw proto.FrameWriter) error {
			if r.c.cur.Load() != r.sess {
				return errStale
			}
			return fw.WriteFrame(f)
		})
		if err != nil {
			return err
		}
		p = p[n:]
	}
	return nil
}

// recvData returns the next data frame from the host.
func (r *request) recvData(ctx context.Context) (proto.Frame, error) {
	f, err := r.in.Pop(ctx)
	if err != nil {
		return f, err
	}
	r.inUsed.Add(-int64(len(f.Payload)))
	return f, nil
}

// consumed returns n bytes of credit to the host, in batches.
func (r *request) consumed(n int) {
	r.acked += n
	if r.acked < proto.InitialWindow/4 {
		return
	}
	inc := r.acked
	r.acked = 0
	err := r.c.w.Locked(func(fw proto.FrameWriter) error {
		if r.c.cur.Load() != r.sess {
			return errStale
		}
		return fw.WriteFrame(proto.Frame{Type: proto.TypeWindow, ID: r.id, Payload: proto.WindowPayload(uint32(inc))})
	})
	if err != nil && !errors.Is(err, errStale) {
		r.c.a.log.Warn("write window", "op", r.op, "id", r.id, "err", err)
	}
}

// handler runs one operation. A handler that streams data uses r; its
// return value becomes the result.
type handler func(a *Agent, ctx context.Context, r *request, args json.RawMessage) (any, error)

var handlers = map[string]handler{
	proto.OpPing:           (*Agent).ping,
	proto.OpInit:           (*Agent).init,
	proto.OpExec:           (*Agent).exec,
	proto.OpProcessList:    (*Agent).processList,
	proto.OpProcessWait:    (*Agent).processWait,
	proto.OpProcessSignal:  (*Agent).processSignal,
	proto.OpProcessKill:    (*Agent).processKill,
	proto.OpProcessConnect: (*Agent).processConnect,
	proto.OpProcessStdin:   (*Agent).processStdin,
	proto.OpProcessResize:  (*Agent).processResize,
	proto.OpFileWatch:      (*Agent).fileWatch,
	proto.OpFileRead:       (*Agent).fileRead,
	proto.OpFileWrite:      (*Agent).fileWrite,
	proto.OpFileList:       (*Agent).fileList,
	proto.OpFileStat:       (*Agent).fileStat,
	proto.OpFileMkdir:      (*Agent).fileMkdir,
	proto.OpFileRemove:     (*Agent).fileRemove,
	proto.OpFileRename:     (*Agent).fileRename,
	proto.OpEval:           (*Agent).eval,
}

func (a *Agent) handle(r *request, op string, args json.RawMessage) (res any, err error) {
	h, ok := handlers[op]
	if !ok {
		return nil, errdefs.NotImplemented("unknown operation %q", op)
	}
	defer func() {
		if p := recover(); p != nil {
			a.log.Error("handler panic", "op", op, "panic", p)
			res, err = nil, fmt.Errorf("%s: internal error: %v", op, p)
		}
	}()
	return h(a, r.ctx, r, args)
}

// decode unmarshals a request's arguments.
func decode(args json.RawMessage, v any) error {
	if len(args) == 0 {
		return nil
	}
	if err := json.Unmarshal(args, v); err != nil {
		return errdefs.InvalidArgument("arguments: %w", err)
	}
	return nil
}

func (a *Agent) ping(ctx context.Context, r *request, _ json.RawMessage) (any, error) {
	a.idMu.Lock()
	id, host := a.sandboxID, a.hostname
	a.idMu.Unlock()
	if host == "" {
		host, _ = os.Hostname()
	}
	return &proto.PingResult{
		AgentVersion:    a.cfg.Version,
		ProtocolVersion: proto.ProtocolVersion,
		UptimeMS:        time.Since(a.started).Milliseconds(),
		SandboxID:       id,
		Hostname:        host,
		Features:        a.features(),
		PythonReady:     a.py != nil && a.py.ready(),
		Python:          a.py.state(),
	}, nil
}
