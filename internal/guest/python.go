package guest

import (
	"bufio"
	"context"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

//go:embed pyserver.py
var pyServer string

// pyBootstrap runs pyServer (argv[1]) under the file name "<forkd>", which
// its tracebacks filter out.
const pyBootstrap = "import sys; exec(compile(sys.argv[1], '<forkd>', 'exec'))"

// maxCapture bounds the stdout and stderr an EvalResult carries.
const maxCapture = 1 << 20

// interp is the warm Python interpreter: one long-lived process running
// pyserver.py, used by one eval (or reseed) at a time.
type interp struct {
	a       *Agent
	path    string
	preload []string

	// sem has one slot, held by whoever talks to the interpreter.
	sem chan struct{}

	mu     sync.Mutex
	cur    *pyProc // guarded by mu; nil before the first start
	call   *pyCall // guarded by mu; the eval in progress
	next   int64   // guarded by mu; request ids
	closed bool    // guarded by mu; set by stop
}

// pyProc is one interpreter process.
type pyProc struct {
	pid      int
	req      *os.File   // writes to the interpreter's fd 3
	msgs     chan pyMsg // replies other than ready; closed at EOF
	readyCh  chan struct{}
	dead     chan struct{} // closed once the process is reaped
	status   exitStatus    // valid once dead is closed
	startErr error         // valid once readyCh is closed: why it never became ready
	// synced receives, from the fd 1 and fd 2 pumps, the ids of the sync
	// markers they pass.
	synced [2]chan int64
}

// pyMsg is one reply line of pyserver.py.
type pyMsg struct {
	ID          int64               `json:"id"`
	T           string              `json:"t"`
	S           string              `json:"s"`
	Value       string              `json:"value"`
	Error       *proto.EvalError    `json:"error"`
	Interrupted bool                `json:"interrupted"`
	Truncated   bool                `json:"truncated"`
	Results     []proto.EvalDisplay `json:"results"`
	Count       int                 `json:"count"`
	Python      string              `json:"python"`
	Preloaded   []string            `json:"preloaded"`
	Failed      map[string]string   `json:"failed"`
}

// pyCall collects one eval's output.
type pyCall struct {
	r         *request
	ctx       context.Context
	stream    *streamer // nil unless the host asked for streamed output
	mu        sync.Mutex
	stdout    strings.Builder // guarded by mu
	stderr    strings.Builder // guarded by mu
	truncated bool            // guarded by mu
}

func (c *pyCall) output(st proto.Stream, s string) {
	c.mu.Lock()
	b := &c.stdout
	if st == proto.StreamStderr {
		b = &c.stderr
	}
	if room := maxCapture - b.Len(); room < len(s) {
		b.WriteString(s[:max(room, 0)])
		c.truncated = true
	} else {
		b.WriteString(s)
	}
	c.mu.Unlock()
	if c.stream != nil {
		c.stream.write(st, s)
	}
}

func newInterp(a *Agent, path string, preload []string) *interp {
	return &interp{a: a, path: path, preload: preload, sem: make(chan struct{}, 1)}
}

// startAsync starts the interpreter if none is running.
func (in *interp) startAsync() {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.startLocked()
}

// ready reports whether the interpreter is up and has preloaded.
func (in *interp) ready() bool {
	in.mu.Lock()
	p := in.cur
	in.mu.Unlock()
	if p == nil {
		return false
	}
	select {
	case <-p.readyCh:
		return p.startErr == nil && !p.isDead()
	default:
		return false
	}
}

// state describes the interpreter for PingResult.Python; "" for a nil
// interp.
func (in *interp) state() string {
	if in == nil {
		return ""
	}
	in.mu.Lock()
	p := in.cur
	in.mu.Unlock()
	if p == nil {
		return "starting"
	}
	select {
	case <-p.readyCh:
	default:
		return "starting"
	}
	switch {
	case p.startErr != nil:
		return "failed: " + p.startErr.Error()
	case p.isDead():
		return "exited"
	}
	return "ready"
}

func (p *pyProc) isDead() bool {
	select {
	case <-p.dead:
		return true
	default:
		return false
	}
}

// startLocked starts a new interpreter process unless the current one is
// alive. Called with in.mu held.
func (in *interp) startLocked() *pyProc {
	if in.cur != nil && !in.cur.isDead() {
		return in.cur
	}
	p := &pyProc{
		msgs:    make(chan pyMsg, 64),
		readyCh: make(chan struct{}),
		dead:    make(chan struct{}),
		synced:  [2]chan int64{make(chan int64, 16), make(chan int64, 16)},
	}
	in.cur = p
	err := errdefs.Unavailable("agent is closed")
	if !in.closed {
		err = in.spawn(p)
	}
	if err != nil {
		p.startErr = err
		close(p.readyCh)
		close(p.msgs)
		close(p.dead)
		in.a.log.Error("python did not start", "python", in.path, "err", err)
	}
	return p
}

// spawn starts pyserver.py with fds 0 /dev/null, 1 and 2 pipes whose
// output goes to the eval in progress, 3 requests, 4 replies.
func (in *interp) spawn(p *pyProc) error {
	args := append([]string{in.path, "-c", pyBootstrap, pyServer}, in.preload...)
	cmd, err := in.a.resolve(&proto.ExecRequest{Args: args, Dir: in.a.cfg.PythonDir})
	if err != nil {
		return err
	}
	var opened []*os.File
	closeAll := func() {
		for _, f := range opened {
			f.Close()
		}
	}
	pipe := func() (*os.File, *os.File, error) {
		r, w, err := os.Pipe()
		if err == nil {
			opened = append(opened, r, w)
		}
		return r, w, err
	}
	null, err := os.Open(os.DevNull)
	if err != nil {
		return err
	}
	opened = append(opened, null)
	outR, outW, err1 := pipe()
	errR, errW, err2 := pipe()
	reqR, reqW, err3 := pipe()
	respR, respW, err4 := pipe()
	for _, e := range []error{err1, err2, err3, err4} {
		if e != nil {
			closeAll()
			return e
		}
	}
	attr := &syscall.ProcAttr{
		Dir:   cmd.dir,
		Env:   cmd.env,
		Files: []uintptr{null.Fd(), outW.Fd(), errW.Fd(), reqR.Fd(), respW.Fd()},
		Sys:   in.a.sysProcAttr(cmd),
	}
	pid, done, err := in.a.reaper.start(func() (int, error) {
		return syscall.ForkExec(cmd.path, cmd.argv, attr)
	})
	for _, f := range []*os.File{null, outW, errW, reqR, respW} {
		f.Close()
	}
	if err != nil {
		for _, f := range []*os.File{outR, errR, reqW, respR} {
			f.Close()
		}
		return err
	}
	p.pid, p.req = pid, reqW
	never := make(chan struct{})
	for i, s := range []struct {
		f  *os.File
		st proto.Stream
	}{{outR, proto.StreamStdout}, {errR, proto.StreamStderr}} {
		go func() {
			var sc syncScanner
			pump(s.f, never, func(b []byte) error {
				out, marks := sc.feed(b)
				if len(out) > 0 {
					in.mu.Lock()
					c := in.call
					in.mu.Unlock()
					if c != nil {
						c.output(s.st, string(out))
					}
				}
				for _, id := range marks {
					select {
					case p.synced[i] <- id:
					default:
					}
				}
				return nil
			})
			s.f.Close()
		}()
	}
	go in.readReplies(p, respR)
	go func() {
		p.status = <-done
		close(p.dead)
		reqW.Close()
	}()
	return nil
}

// readReplies parses the interpreter's replies until EOF.
func (in *interp) readReplies(p *pyProc, f *os.File) {
	defer f.Close()
	defer close(p.msgs)
	readied := false
	defer func() {
		if !readied {
			p.startErr = fmt.Errorf("python exited before it was ready")
			close(p.readyCh)
		}
	}()
	br := bufio.NewReaderSize(f, 64<<10)
	for {
		line, err := br.ReadBytes('\n')
		if err != nil {
			return
		}
		var m pyMsg
		if err := json.Unmarshal(line, &m); err != nil {
			in.a.log.Warn("bad reply from python", "err", err)
			continue
		}
		if m.T == "ready" {
			if !readied {
				readied = true
				close(p.readyCh)
				in.a.log.Info("python ready", "version", m.Python, "preloaded", m.Preloaded, "failed", m.Failed)
			}
			continue
		}
		p.msgs <- m
	}
}

// acquire takes the interpreter for one caller and returns a ready
// process.
func (in *interp) acquire(ctx context.Context) (*pyProc, error) {
	select {
	case in.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, errdefs.Unavailable("eval: cancelled while waiting for the interpreter")
	}
	in.mu.Lock()
	p := in.startLocked()
	in.mu.Unlock()
	select {
	case <-p.readyCh:
	case <-ctx.Done():
		<-in.sem
		return nil, errdefs.Unavailable("eval: cancelled while python was starting")
	}
	if p.startErr != nil {
		<-in.sem
		// The next call tries again.
		return nil, errdefs.Unavailable("python interpreter %s: %w", in.path, p.startErr)
	}
	return p, nil
}

func (in *interp) release() { <-in.sem }

// pyReq is one request line of pyserver.py.
type pyReq struct {
	ID      int64             `json:"id"`
	Op      string            `json:"op"`
	Code    string            `json:"code,omitempty"`
	Seed    string            `json:"seed,omitempty"`
	Path    string            `json:"path,omitempty"`
	Context string            `json:"ctx,omitempty"`
	Reset   bool              `json:"reset,omitempty"`
	Env     map[string]string `json:"env,omitempty"`
	Dir     string            `json:"cwd,omitempty"`
	Rich    bool              `json:"rich,omitempty"`
}

// send writes one request line and returns its id.
func (in *interp) send(p *pyProc, req pyReq) (int64, error) {
	in.mu.Lock()
	in.next++
	req.ID = in.next
	in.mu.Unlock()
	b, err := json.Marshal(req)
	if err != nil {
		return 0, err
	}
	b = append(b, '\n')
	if _, err := p.req.Write(b); err != nil {
		return 0, err
	}
	return req.ID, nil
}

// kill ends p and waits for it to be reaped; a new process starts on the
// next acquire (and now, so that it preloads meanwhile).
func (in *interp) kill(p *pyProc) {
	_ = killGroup(p.pid, syscall.SIGKILL) // fails only for a process already gone
	<-p.dead
	go func() {
		for range p.msgs { // let the reply reader reach EOF
		}
	}()
	in.startAsync()
}

// waitStarted starts the interpreter if it is not running and waits until it
// is ready or has failed, or ctx ends. It does not wait for an eval in
// progress.
func (in *interp) waitStarted(ctx context.Context) {
	in.mu.Lock()
	p := in.startLocked()
	in.mu.Unlock()
	select {
	case <-p.readyCh:
	case <-ctx.Done():
	}
}

// reseed reseeds the interpreter's random and numpy.random from seed. It
// runs now when the interpreter is idle and ready, otherwise as soon as it
// is free.
func (in *interp) reseed(seed []byte) {
	do := func(p *pyProc) {
		id, err := in.send(p, pyReq{Op: "reseed", Seed: hex.EncodeToString(seed)})
		if err != nil {
			return
		}
		t := time.NewTimer(5 * time.Second)
		defer t.Stop()
		for {
			select {
			case m, ok := <-p.msgs:
				if !ok || (m.ID == id && m.T == "done") {
					return
				}
			case <-t.C:
				in.a.log.Warn("python did not answer reseed")
				return
			}
		}
	}
	select {
	case in.sem <- struct{}{}:
		in.mu.Lock()
		p := in.cur
		in.mu.Unlock()
		if p != nil && in.ready() {
			do(p)
			in.release()
			return
		}
		in.release()
	default:
	}
	go func() {
		p, err := in.acquire(context.Background())
		if err != nil {
			return
		}
		defer in.release()
		do(p)
	}()
}

// workDir returns the interpreter's working directory ("" when there is
// no interpreter, or it cannot be told).
func (in *interp) workDir() string {
	if in == nil {
		return ""
	}
	in.mu.Lock()
	p := in.cur
	in.mu.Unlock()
	if p == nil || p.isDead() {
		return ""
	}
	dir, err := os.Readlink("/proc/" + strconv.Itoa(p.pid) + "/cwd")
	if err != nil {
		return ""
	}
	return dir
}

// chdir makes the interpreter change its working directory to dir (a
// path, resolved in its root now) and waits, up to 5 s or until ctx ends,
// for it to have done so. It waits for an eval in progress to end first.
func (in *interp) chdir(ctx context.Context, dir string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	p, err := in.acquire(ctx)
	if err != nil {
		return err
	}
	defer in.release()
	id, err := in.send(p, pyReq{Op: "chdir", Path: dir})
	if err != nil {
		return err
	}
	for {
		select {
		case m, ok := <-p.msgs:
			if !ok {
				return errors.New("the interpreter exited")
			}
			if m.ID == id && m.T == "done" {
				if m.Error != nil {
					return fmt.Errorf("%s: %s", m.Error.Name, m.Error.Message)
				}
				return nil
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// stop kills the interpreter for good (Agent.Close).
func (in *interp) stop() {
	in.mu.Lock()
	in.closed = true
	p := in.cur
	in.mu.Unlock()
	if p != nil && !p.isDead() {
		_ = killGroup(p.pid, syscall.SIGKILL) // fails only for a process already gone
		<-p.dead
	}
}
