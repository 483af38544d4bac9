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
)

const (
	// drainGrace is how long output is still read after a process exits
	// while its pipes stay open (a grandchild holding them) and idle.
	drainGrace = 250 * time.Millisecond
	// drainMax bounds how long output is read after a process exits, however
	// busy a grandchild holding its pipes keeps them.
	drainMax = 2 * time.Second
	// groupGoneMax bounds how long a finished command's answer waits for
	// the process group it left behind, once killed, to be reaped.
	groupGoneMax = 5 * time.Second
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
		Sys:   a.sysProcAttr(cmd),
	}
	pid, done, err := a.reaper.start(func() (int, error) {
		return syscall.ForkExec(cmd.path, cmd.argv, attr)
	})
	if err != nil {
		return 0, nil, pathError("exec", cmd.argv[0], err)
	}
	return pid, done, nil
}

// sysProcAttr starts a process in a new session (so that its process
// group can be killed as one), as cmd's user, born in the workload cgroup
// when there is one.
func (a *Agent) sysProcAttr(cmd *command) *syscall.SysProcAttr {
	sys := &syscall.SysProcAttr{Setsid: true, Credential: cmd.cred}
	if a.cgroupFD >= 0 {
		sys.UseCgroupFD, sys.CgroupFD = true, a.cgroupFD
	}
	return sys
}

// stdio holds the agent's ends of a process's standard streams.
type stdio struct {
	stdin          *os.File // nil when the child has /dev/null
	stdout, stderr *os.File // stderr is nil on a terminal
	pty            *os.File // the terminal's master, when there is one
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
// idle for drainGrace or drainMax has passed. Errors from out stop the
// copying but not the draining, so the writer never blocks on a full pipe.
func pump(f *os.File, exited <-chan struct{}, out func([]byte) error) {
	buf := make([]byte, chunkSize)
	failed := false
	var stopAt time.Time // zero until exited is seen
	for {
		select {
		case <-exited:
			now := time.Now()
			if stopAt.IsZero() {
				stopAt = now.Add(drainMax)
			}
			// f is a pipe (pollable): this fails only once f is closed,
			// and then the read below fails too.
			_ = f.SetReadDeadline(minTime(now.Add(drainGrace), stopAt))
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

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
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
		res.Signal = proto.SignalName(st.ws.Signal())
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
	if req.PTY != nil && !req.Background {
		return nil, errdefs.InvalidArgument("exec: a terminal (pty) is for background processes only")
	}
	if req.Attach && !req.Background {
		return nil, errdefs.InvalidArgument("exec: attach is for background processes only")
	}
	if req.Background {
		return a.startBackground(ctx, r, cmd, &req)
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

	st, timedOut := awaitExit(done, pid, req.Timeout, ctx.Done())
	close(exited)
	// Pipes, open until below: setting a deadline on them cannot fail.
	_ = std.stdout.SetReadDeadline(time.Now().Add(drainGrace))
	_ = std.stderr.SetReadDeadline(time.Now().Add(drainGrace))
	if !drainLeftovers(&wg, pid, start, req.Timeout, ctx.Done(), a.reaper.reapAll) && ctx.Err() == nil {
		a.log.Warn("exec: processes it left behind are not gone", "pgid", pid, "after", groupGoneMax)
	}
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

// drainLeftovers waits for a foreground process's output pumps once the
// process itself has exited, then kills what is left of its process group:
// a foreground command's background children (`cmd &`) end with it; only
// processes started as background processes, or that left the group, live
// on. The pumps stop within drainMax; the timeout, measured from start, or
// cancel kills the group sooner. When reaped (this agent reaps orphans: PID
// 1), it also waits for the killed members to be reaped, and reports false
// if some were still there after groupGoneMax.
func drainLeftovers(wg *sync.WaitGroup, pid int, start time.Time, timeout time.Duration, cancel <-chan struct{}, reaped bool) bool {
	drained := make(chan struct{})
	go func() {
		wg.Wait()
		close(drained)
	}()
	var expire <-chan time.Time
	if timeout > 0 {
		t := time.NewTimer(time.Until(start.Add(timeout)))
		defer t.Stop()
		expire = t.C
	}
	select {
	case <-drained:
	case <-expire:
	case <-cancel:
	}
	// pid was reaped but still names the group while members are left;
	// signal only the group, never a pid that may have been reused. It
	// fails (ESRCH) when no member is left: nothing to kill.
	gone := true
	if syscall.Kill(-pid, syscall.SIGKILL) == nil && reaped {
		gone = awaitGroupGone(pid, groupGoneMax, cancel)
	}
	<-drained
	return gone
}

// awaitGroupGone waits until no member of process group pgid is left,
// zombies included, and reports whether none is; it gives up after limit
// or once cancel is closed. A killed group's zombies still count against
// the workload's pids limit until reaped: the next command, answered
// before, would find no task free (after a fork bomb's 341). Zombies stay
// in their group until reaped, so kill(-pgid, 0) succeeds until the last
// is gone.
func awaitGroupGone(pgid int, limit time.Duration, cancel <-chan struct{}) bool {
	deadline := time.NewTimer(limit)
	defer deadline.Stop()
	wait := time.Millisecond
	for syscall.Kill(-pgid, 0) == nil {
		select {
		case <-time.After(wait):
		case <-deadline.C:
			return false
		case <-cancel:
			return false
		}
		wait = min(2*wait, 50*time.Millisecond)
	}
	return true
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

// awaitExit waits for a started process's status on done. Past timeout
// (when positive), or once cancel is closed, it kills the process group
// and goes on waiting; timedOut says the timeout fired.
func awaitExit(done <-chan exitStatus, pid int, timeout time.Duration, cancel <-chan struct{}) (st exitStatus, timedOut bool) {
	var expire <-chan time.Time
	if timeout > 0 {
		t := time.NewTimer(timeout)
		defer t.Stop()
		expire = t.C
	}
	for {
		select {
		case st = <-done:
			return st, timedOut
		case <-expire:
			timedOut = true
			expire = nil
			_ = killGroup(pid, syscall.SIGKILL) // fails only for a process gone, whose status is coming
		case <-cancel:
			cancel = nil
			_ = killGroup(pid, syscall.SIGKILL) // fails only for a process gone, whose status is coming
		}
	}
}
