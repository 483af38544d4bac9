package server

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
)

// Pipe serves s in this process, for a CLI that runs the engine itself
// when no daemon serves its data dir: the CLI then speaks the same API, through
// the same client, as it does to a daemon. Each connection dial makes is a
// unix socket pair, so the caller is vouched for by the kernel (it is this
// process) as on the daemon's socket.
//
// shutdown stops serving: it waits (until ctx ends) for the requests in
// flight, whose callers may have gone (an interrupted fork rolls back what
// it made first), then cancels and waits for background work such as a
// snapshot build, which undoes itself. Call it before the process exits.
func (s *Server) Pipe() (dial func(ctx context.Context) (net.Conn, error), shutdown func(ctx context.Context) error) {
	ln := &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
	hs := s.HTTPServer()
	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()
	dial = func(ctx context.Context) (net.Conn, error) {
		ours, theirs, err := socketPair()
		if err != nil {
			return nil, err
		}
		select {
		case ln.conns <- theirs:
			return ours, nil
		case <-ln.done:
			err = errdefs.Unavailable("the in-process server has stopped")
		case <-ctx.Done():
			err = ctx.Err()
		}
		ours.Close()
		theirs.Close()
		return nil, err
	}
	shutdown = func(ctx context.Context) error {
		err := hs.Shutdown(ctx)
		if err != nil {
			hs.Close()
		}
		s.Close()
		if serr := <-served; !errors.Is(serr, net.ErrClosed) && !errors.Is(serr, http.ErrServerClosed) {
			err = errors.Join(err, serr)
		}
		return err
	}
	return dial, shutdown
}

// socketPair returns the two ends of a connected unix stream socket pair.
func socketPair() (net.Conn, net.Conn, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	var conns [2]net.Conn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "forkd-pipe")
		c, err := net.FileConn(f)
		f.Close() // FileConn dups the fd
		if err != nil {
			if i == 1 {
				conns[0].Close()
			} else {
				unix.Close(fds[1])
			}
			return nil, nil, err
		}
		conns[i] = c
	}
	return conns[0], conns[1], nil
}

// pipeListener hands the server the connections dial made.
type pipeListener struct {
	conns chan net.Conn
	once  sync.Once
	done  chan struct{} // closed by Close
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *pipeListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *pipeListener) Addr() net.Addr { return pipeAddr{} }

type pipeAddr struct{}

func (pipeAddr) Network() string { return "unix" }
func (pipeAddr) String() string  { return "forkd-in-process" }
