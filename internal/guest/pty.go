package guest

import (
	"context"
	"encoding/json"
	"os"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

// openPTY allocates a pseudo-terminal of the given size and returns its
// master (non-blocking, so reads honour deadlines) and its slave, owned
// by cred's user when there is one (as login does).
func openPTY(size proto.PTYSize, cred *syscall.Credential) (master, slave *os.File, err error) {
	mfd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, errdefs.FailedPrecondition("open /dev/ptmx: %w", err)
	}
	fail := func(op string, err error) (*os.File, *os.File, error) {
		unix.Close(mfd)
		return nil, nil, errdefs.FailedPrecondition("pty: %s: %w", op, err)
	}
	if err := unix.IoctlSetPointerInt(mfd, unix.TIOCSPTLCK, 0); err != nil {
		return fail("unlock", err)
	}
	n, err := unix.IoctlGetUint32(mfd, unix.TIOCGPTN)
	if err != nil {
		return fail("number", err)
	}
	if err := setWinsize(mfd, size); err != nil {
		return fail("size", err)
	}
	name := "/dev/pts/" + strconv.FormatUint(uint64(n), 10)
	sfd, err := unix.Open(name, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fail("open "+name, err)
	}
	if cred != nil && os.Geteuid() == 0 {
		// The user's own terminal, as login makes it: a program that
		// reopens it (tty, ssh-agent) may.
		if err := unix.Fchown(sfd, int(cred.Uid), int(cred.Gid)); err != nil {
			unix.Close(sfd)
			return fail("chown "+name, err)
		}
	}
	return os.NewFile(uintptr(mfd), "ptmx"), os.NewFile(uintptr(sfd), name), nil
}

// setWinsize sets a terminal's size; zero fields take 80 columns, 24 rows.
func setWinsize(fd int, size proto.PTYSize) error {
	if size.Cols == 0 {
		size.Cols = 80
	}
	if size.Rows == 0 {
		size.Rows = 24
	}
	return unix.IoctlSetWinsize(fd, unix.TIOCSWINSZ, &unix.Winsize{Row: size.Rows, Col: size.Cols})
}

// startWithPTY starts cmd on a new pseudo-terminal: the session leader with
// the terminal as its controlling one, its three standard streams the
// slave. The agent keeps the master: stdout reads it, stdin (a second
// descriptor of it) writes it.
func (a *Agent) startWithPTY(cmd *command, size proto.PTYSize) (int, <-chan exitStatus, *stdio, error) {
	master, slave, err := openPTY(size, cmd.cred)
	if err != nil {
		return 0, nil, nil, err
	}
	in, err := dupFile(master)
	if err != nil {
		master.Close()
		slave.Close()
		return 0, nil, nil, err
	}
	sys := a.sysProcAttr(cmd)
	sys.Setctty, sys.Ctty = true, 0
	attr := &syscall.ProcAttr{
		Dir:   cmd.dir,
		Env:   cmd.env,
		Files: []uintptr{slave.Fd(), slave.Fd(), slave.Fd()},
		Sys:   sys,
	}
	pid, done, err := a.reaper.start(func() (int, error) {
		return syscall.ForkExec(cmd.path, cmd.argv, attr)
	})
	slave.Close()
	if err != nil {
		master.Close()
		in.Close()
		return 0, nil, nil, pathError("exec", cmd.argv[0], err)
	}
	return pid, done, &stdio{stdin: in, stdout: master, pty: master}, nil
}

// dupFile returns a second descriptor of f's open file, close-on-exec.
func dupFile(f *os.File) (*os.File, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	var nfd int
	var derr error
	if err := rc.Control(func(fd uintptr) {
		nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0)
	}); err != nil {
		return nil, err
	}
	if derr != nil {
		return nil, derr
	}
	return os.NewFile(uintptr(nfd), f.Name()), nil
}

func (a *Agent) processResize(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.ResizeRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	p, err := a.procs.get(req.PID)
	if err != nil {
		return nil, err
	}
	if p.pty == nil {
		return nil, errdefs.FailedPrecondition("process %d has no terminal", p.pid)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.running() {
		return nil, errdefs.FailedPrecondition("process %d has ended", p.pid)
	}
	rc, err := p.pty.SyscallConn()
	if err != nil {
		return nil, errdefs.FailedPrecondition("resize the terminal of process %d: %w", p.pid, err)
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = setWinsize(int(fd), req.PTYSize) }); err != nil {
		serr = err
	}
	if serr != nil {
		return nil, errdefs.FailedPrecondition("resize the terminal of process %d: %w", p.pid, serr)
	}
	return nil, nil
}
