package guest

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"golang.org/x/sys/unix"
)

const (
	// drainGrace is how long output is still read after a process exits
	// while its pipes stay open (a grandchild holding them) and idle.
	drainGrace = 250 * time.Millisecond
	// ringSize is the recent output kept per stream of a background
	// process.
	ringSize = 64 << 10
	// maxExited bounds how many ended processes the table remembers.
	maxExited = 64
	// chunkSize is the read size of output pumps.
	chunkSize = 32 << 10
)

// command is a resolved ExecRequest.
type command struct {
	path string
	argv []string
	env  []string
	dir  string
	cred *syscall.Credential
}

// resolve validates req and finds the user, environment, directory and
// executable.
func (a *Agent) resolve(req *proto.ExecRequest) (*command, error) {
	var argv []string
	switch {
	case req.Shell != "" && len(req.Args) > 0:
		return nil, errdefs.InvalidArgument("exec: both args and shell given")
	case req.Shell != "":
		argv = []string{"/bin/sh", "-c", req.Shell}
	case len(req.Args) > 0 && req.Args[0] != "":
		argv = req.Args
	default:
		return nil, errdefs.InvalidArgument("exec: no command")
	}
	user := req.User
	if user == "" {
		user = strconv.Itoa(os.Geteuid())
	}
	acct, err := lookupUser(a.cfg.Root, user)
	if err != nil {
		return nil, err
	}
	env := map[string]string{}
	for _, kv := range a.cfg.Env {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	env["HOME"] = acct.home
	env["USER"] = acct.name
	env["LOGNAME"] = acct.name
	for k, v := range req.Env {
		if k == "" || strings.ContainsAny(k, "=\x00") || strings.Contains(v, "\x00") {
			return nil, errdefs.InvalidArgument("exec: bad environment variable %q", k)
		}
		env[k] = v
	}
	dir := req.Dir
	if dir == "" {
		dir = "/"
		if st, err := os.Stat(acct.home); err == nil && st.IsDir() {
			dir = acct.home
		}
	} else {
		if !filepath.IsAbs(dir) {
			return nil, errdefs.InvalidArgument("exec: working directory %q is not absolute", dir)
		}
		st, err := os.Stat(dir)
		if err != nil {
			return nil, pathError("exec: working directory", dir, err)
		}
		if !st.IsDir() {
			return nil, errdefs.InvalidArgument("exec: working directory %q is not a directory", dir)
		}
	}
	env["PWD"] = dir
	path, err := lookPath(argv[0], env["PATH"], dir)
	if err != nil {
		return nil, err
	}
	envList := make([]string, 0, len(env))
	for k, v := range env {
		envList = append(envList, k+"="+v)
	}
	sort.Strings(envList)
	return &command{path: path, argv: argv, env: envList, dir: dir, cred: acct.credential()}, nil
}

// lookPath finds an executable like a shell does, with the child's PATH.
func lookPath(file, pathEnv, dir string) (string, error) {
	if strings.Contains(file, "/") {
		p := file
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if err := executable(p); err != nil {
			return "", pathError("exec", file, err)
		}
		return p, nil
	}
	for _, d := range filepath.SplitList(pathEnv) {
		if d == "" {
			d = "."
		}
		if !filepath.IsAbs(d) {
			d = filepath.Join(dir, d)
		}
		p := filepath.Join(d, file)
		if executable(p) == nil {
			return p, nil
		}
	}
	return "", errdefs.NotFound("exec: %q not found in PATH", file)
}

func executable(p string) error {
	st, err := os.Stat(p)
	if err != nil {
		return err
	}
	if st.IsDir() || st.Mode()&0o111 == 0 {
		return syscall.EACCES
	}
	return nil
}

// spawn starts cmd in a new session (so that its process group can be
// killed as one) with the given standard files.
func (a *Agent) spawn(cmd *command, stdin, stdout, stderr *os.File) (int, <-chan exitStatus, error) {
	attr := &syscall.ProcAttr{
		Dir:   cmd.dir,
		Env:   cmd.env,
		Files: []uintptr{stdin.Fd(), stdout.Fd(), stderr.Fd()},
		Sys:   &syscall.SysProcAttr{Setsid: true, Credential: cmd.cred},
	}
	pid, done, err := a.reaper.start(func() (int, error) {
		return syscall.ForkExec(cmd.path, cmd.argv, attr)
	})
	if err != nil {
		return 0, nil, pathError("exec", cmd.argv[0], err)
	}
	return pid, done, nil
}

// stdio holds the agent's ends of a process's standard streams.
type stdio struct {
	stdin          *os.File // nil when the child has /dev/null
	stdout, stderr *os.File
}

// startWithPipes starts cmd with pipes for stdout and stderr, and for stdin
// when wantStdin.
func (a *Agent) startWithPipes(cmd *command, wantStdin bool) (int, <-chan exitStatus, *stdio, error) {
	var parent stdio
	var child []*os.File
	closeAll := func(fs ...*os.File) {
		for _, f := range fs {
			if f != nil {
				f.Close()
			}
		}
	}
	var in *os.File
	if wantStdin {
		r, w, err := os.Pipe()
		if err != nil {
			return 0, nil, nil, err
		}
		in, parent.stdin = r, w
	} else {
		f, err := os.Open(os.DevNull)
		if err != nil {
			return 0, nil, nil, err
		}
		in = f
	}
	child = append(child, in)
	or, ow, err := os.Pipe()
	if err != nil {
		closeAll(append(child, parent.stdin)...)
		return 0, nil, nil, err
	}
	er, ew, err := os.Pipe()
	if err != nil {
		closeAll(append(child, parent.stdin, or, ow)...)
		return 0, nil, nil, err
	}
	child = append(child, ow, ew)
	parent.stdout, parent.stderr = or, er
	pid, done, err := a.spawn(cmd, in, ow, ew)
	closeAll(child...)
	if err != nil {
		closeAll(parent.stdin, parent.stdout, parent.stderr)
		return 0, nil, nil, err
	}
	return pid, done, &parent, nil
}

// pump copies f to out until EOF, or, once exited is closed, until f stays
// idle for drainGrace. Errors from out stop the copying but not the
// draining, so the writer never blocks on a full pipe.
func pump(f *os.File, exited <-chan struct{}, out func([]byte) error) {
	buf := make([]byte, chunkSize)
	failed := false
	for {
		select {
		case <-exited:
			f.SetReadDeadline(time.Now().Add(drainGrace))
		default:
		}
		n, err := f.Read(buf)
		if n > 0 && !failed {
			failed = out(buf[:n]) != nil
		}
		if err != nil {
			return
		}
	}
}

// result builds an ExecResult from a wait status.
func result(pid int, st exitStatus, start time.Time, timedOut bool) *proto.ExecResult {
	res := &proto.ExecResult{
		PID:        pid,
		TimedOut:   timedOut,
		DurationMS: time.Since(start).Milliseconds(),
	}
	switch {
	case st.err != nil:
		res.ExitCode = -1
	case st.ws.Signaled():
		res.ExitCode = -1
		res.Signal = unix.SignalName(st.ws.Signal())
	default:
		res.ExitCode = st.ws.ExitStatus()
	}
	return res
}

// killGroup signals pid's process group, and pid itself if the group is
// gone (it left its session).
func killGroup(pid int, sig syscall.Signal) error {
	err := syscall.Kill(-pid, sig)
	if errors.Is(err, syscall.ESRCH) {
		err = syscall.Kill(pid, sig)
	}
	return err
}

func (a *Agent) exec(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.ExecRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	cmd, err := a.resolve(&req)
	if err != nil {
		return nil, err
	}
	if req.Background {
		return a.startBackground(cmd, &req)
	}
	start := time.Now()
	pid, done, std, err := a.startWithPipes(cmd, req.Stdin)
	if err != nil {
		return nil, err
	}
	p := a.procs.add(&proc{pid: pid, args: cmd.argv, dir: cmd.dir, started: start, done: make(chan struct{})})
	r.sendEvent(proto.Event{Kind: "started", PID: pid})

	exited := make(chan struct{})
	var wg sync.WaitGroup
	for _, s := range []struct {
		f  *os.File
		st proto.Stream
	}{{std.stdout, proto.StreamStdout}, {std.stderr, proto.StreamStderr}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pump(s.f, exited, func(b []byte) error { return r.sendData(ctx, s.st, b, false) })
		}()
	}
	feedCtx, stopFeed := context.WithCancel(ctx)
	if std.stdin != nil {
		go feedStdin(feedCtx, r, std.stdin)
	}

	var timeout <-chan time.Time
	if req.Timeout > 0 {
		t := time.NewTimer(req.Timeout)
		defer t.Stop()
		timeout = t.C
	}
	cancelled := ctx.Done()
	timedOut := false
	var st exitStatus
wait:
	for {
		select {
		case st = <-done:
			break wait
		case <-timeout:
			timedOut = true
			timeout = nil
			killGroup(pid, syscall.SIGKILL)
		case <-cancelled:
			cancelled = nil
			killGroup(pid, syscall.SIGKILL)
		}
	}
	close(exited)
	std.stdout.SetReadDeadline(time.Now().Add(drainGrace))
	std.stderr.SetReadDeadline(time.Now().Add(drainGrace))
	wg.Wait()
	stopFeed()
	std.stdout.Close()
	std.stderr.Close()
	if std.stdin != nil {
		std.stdin.Close()
	}
	res := result(pid, st, start, timedOut)
	a.procs.finish(p, *res, true)
	if err := ctx.Err(); err != nil {
		return nil, errdefs.Unavailable("exec: cancelled")
	}
	return res, nil
}

// feedStdin copies the host's stdin frames into w until the host's EOF,
// returning credit as it goes; after a write error it keeps consuming so
// that the host is never left without credit.
func feedStdin(ctx context.Context, r *request, w *os.File) {
	defer w.Close()
	broken := false
	for {
		f, err := r.recvData(ctx)
		if err != nil {
			return
		}
		if len(f.Payload) > 0 && !broken {
			if _, err := w.Write(f.Payload); err != nil {
				broken = true
			}
		}
		r.consumed(len(f.Payload))
		if f.EOF() {
			return
		}
	}
}

// proc is a process in the table: every running process the agent started
// for a host, and the most recent ended ones.
type proc struct {
	pid     int
	tag     string
	args    []string
	dir     string
	started time.Time
	// background: output kept in rings, stdin (if any) written by
	// processes.stdin.
	background     bool
	stdout, stderr *ring

	mu     sync.Mutex
	stdin  *os.File // guarded by mu; nil when closed or absent
	done   chan struct{}
	result proto.ExecResult // valid once done is closed
}

func (p *proc) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

func (p *proc) info() proto.ProcessInfo {
	pi := proto.ProcessInfo{PID: p.pid, Tag: p.tag, Args: p.args, Dir: p.dir, StartedAt: p.started, Running: p.running()}
	if !pi.Running {
		res := p.result
		pi.Result = &res
	}
	return pi
}

// procTable tracks processes by pid. Safe for concurrent use.
type procTable struct {
	mu     sync.Mutex
	procs  map[int]*proc // guarded by mu
	exited []int         // guarded by mu; pids of ended background processes, oldest first
}

func newProcTable() *procTable { return &procTable{procs: map[int]*proc{}} }

func (t *procTable) add(p *proc) *proc {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.procs[p.pid] = p
	return p
}

// finish records p's result; a foreground process leaves the table, a
// background one stays among the last maxExited ended processes.
func (t *procTable) finish(p *proc, res proto.ExecResult, forget bool) {
	res.Tag = p.tag
	p.result = res
	close(p.done)
	t.mu.Lock()
	defer t.mu.Unlock()
	if forget {
		if t.procs[p.pid] == p {
			delete(t.procs, p.pid)
		}
		return
	}
	t.exited = append(t.exited, p.pid)
	for len(t.exited) > maxExited {
		old := t.exited[0]
		t.exited = t.exited[1:]
		if q := t.procs[old]; q != nil && !q.running() {
			delete(t.procs, old)
		}
	}
}

func (t *procTable) get(pid int) (*proc, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.procs[pid]
	if p == nil {
		return nil, errdefs.NotFound("process %d not found", pid)
	}
	return p, nil
}

func (t *procTable) list() []proto.ProcessInfo {
	t.mu.Lock()
	ps := make([]*proc, 0, len(t.procs))
	for _, p := range t.procs {
		ps = append(ps, p)
	}
	t.mu.Unlock()
	sort.Slice(ps, func(i, j int) bool { return ps[i].started.Before(ps[j].started) })
	out := make([]proto.ProcessInfo, 0, len(ps))
	for _, p := range ps {
		out = append(out, p.info())
	}
	return out
}

// killAll kills every running process group in the table.
func (t *procTable) killAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, p := range t.procs {
		if p.running() {
			killGroup(p.pid, syscall.SIGKILL)
		}
	}
}

// startBackground starts cmd with its output kept in rings and returns at
// once.
func (a *Agent) startBackground(cmd *command, req *proto.ExecRequest) (any, error) {
	start := time.Now()
	pid, done, std, err := a.startWithPipes(cmd, req.Stdin)
	if err != nil {
		return nil, err
	}
	p := a.procs.add(&proc{
		pid: pid, tag: req.Tag, args: cmd.argv, dir: cmd.dir, started: start,
		background: true, stdout: newRing(ringSize), stderr: newRing(ringSize),
		stdin: std.stdin, done: make(chan struct{}),
	})
	exited := make(chan struct{})
	var wg sync.WaitGroup
	for _, s := range []struct {
		f  *os.File
		rg *ring
	}{{std.stdout, p.stdout}, {std.stderr, p.stderr}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pump(s.f, exited, func(b []byte) error { s.rg.Write(b); return nil })
			s.f.Close()
			s.rg.close()
		}()
	}
	go func() {
		var timeout <-chan time.Time
		if req.Timeout > 0 {
			t := time.NewTimer(req.Timeout)
			defer t.Stop()
			timeout = t.C
		}
		timedOut := false
		var st exitStatus
	wait:
		for {
			select {
			case st = <-done:
				break wait
			case <-timeout:
				timedOut = true
				timeout = nil
				killGroup(pid, syscall.SIGKILL)
			}
		}
		close(exited)
		std.stdout.SetReadDeadline(time.Now().Add(drainGrace))
		std.stderr.SetReadDeadline(time.Now().Add(drainGrace))
		wg.Wait()
		p.mu.Lock()
		if p.stdin != nil {
			p.stdin.Close()
			p.stdin = nil
		}
		p.mu.Unlock()
		a.procs.finish(p, *result(pid, st, start, timedOut), false)
	}()
	return &proto.ExecResult{PID: pid, Tag: req.Tag, Running: true}, nil
}

func (a *Agent) processList(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	return &proto.ProcessList{Processes: a.procs.list()}, nil
}

func (a *Agent) processRef(args json.RawMessage) (*proc, error) {
	var ref proto.ProcessRef
	if err := decode(args, &ref); err != nil {
		return nil, err
	}
	return a.procs.get(ref.PID)
}

func (a *Agent) processWait(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	p, err := a.processRef(args)
	if err != nil {
		return nil, err
	}
	select {
	case <-p.done:
		res := p.result
		return &res, nil
	case <-ctx.Done():
		return nil, errdefs.Unavailable("processes.wait: cancelled")
	}
}

// parseSignal accepts "SIGTERM", "TERM", "term" or "15".
func parseSignal(s string) (syscall.Signal, error) {
	if n, err := strconv.Atoi(s); err == nil && n > 0 && n < 65 {
		return syscall.Signal(n), nil
	}
	name := strings.ToUpper(s)
	if !strings.HasPrefix(name, "SIG") {
		name = "SIG" + name
	}
	if sig := unix.SignalNum(name); sig != 0 {
		return sig, nil
	}
	return 0, errdefs.InvalidArgument("unknown signal %q", s)
}

func (a *Agent) signalProc(p *proc, sig syscall.Signal) error {
	if !p.running() {
		return errdefs.FailedPrecondition("process %d has ended", p.pid)
	}
	if err := killGroup(p.pid, sig); err != nil {
		return errdefs.FailedPrecondition("signal process %d: %v", p.pid, err)
	}
	return nil
}

func (a *Agent) processSignal(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.SignalRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	sig, err := parseSignal(req.Signal)
	if err != nil {
		return nil, err
	}
	p, err := a.procs.get(req.PID)
	if err != nil {
		return nil, err
	}
	return nil, a.signalProc(p, sig)
}

func (a *Agent) processKill(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	p, err := a.processRef(args)
	if err != nil {
		return nil, err
	}
	return nil, a.signalProc(p, syscall.SIGKILL)
}

func (a *Agent) processStdin(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.StdinRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	p, err := a.procs.get(req.PID)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stdin == nil {
		return nil, errdefs.FailedPrecondition("process %d has no open stdin", p.pid)
	}
	if len(req.Data) > 0 {
		stop := context.AfterFunc(ctx, func() { p.stdin.SetWriteDeadline(time.Now()) })
		_, err := p.stdin.Write(req.Data)
		stop()
		p.stdin.SetWriteDeadline(time.Time{})
		if err != nil {
			return nil, errdefs.FailedPrecondition("write stdin of process %d: %v", p.pid, err)
		}
	}
	if req.EOF {
		p.stdin.Close()
		p.stdin = nil
	}
	return nil, nil
}

// processConnect streams a background process's recent and live output and
// ends with its result.
func (a *Agent) processConnect(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	p, err := a.processRef(args)
	if err != nil {
		return nil, err
	}
	if !p.background {
		return nil, errdefs.FailedPrecondition("process %d is not a background process", p.pid)
	}
	buf := make([]byte, chunkSize)
	var offOut, offErr int64
	for {
		n1, next, endOut, w1 := p.stdout.readAt(offOut, buf)
		offOut = next
		if n1 > 0 {
			if err := r.sendData(ctx, proto.StreamStdout, buf[:n1], false); err != nil {
				return nil, errdefs.Unavailable("processes.connect: %v", err)
			}
		}
		n2, next, endErr, w2 := p.stderr.readAt(offErr, buf)
		offErr = next
		if n2 > 0 {
			if err := r.sendData(ctx, proto.StreamStderr, buf[:n2], false); err != nil {
				return nil, errdefs.Unavailable("processes.connect: %v", err)
			}
		}
		if endOut && endErr {
			select {
			case <-p.done:
				res := p.result
				return &res, nil
			case <-ctx.Done():
				return nil, errdefs.Unavailable("processes.connect: cancelled")
			}
		}
		if n1 == 0 && n2 == 0 {
			select {
			case <-w1:
			case <-w2:
			case <-ctx.Done():
				return nil, errdefs.Unavailable("processes.connect: cancelled")
			}
		}
	}
}
