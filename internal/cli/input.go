package cli

import (
	"context"
	"io"
	"sync"

	"github.com/forkd/forkd/internal/errdefs"
)

// readInput reads r whole, at most limit bytes (more is an error naming
// what), and gives up when ctx ends (Ctrl-C while a terminal is read).
func readInput(ctx context.Context, r io.Reader, what string, limit int64) ([]byte, error) {
	type result struct {
		b   []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		b, err := io.ReadAll(io.LimitReader(r, limit+1))
		done <- result{b, err}
	}()
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case res := <-done:
		if res.err == nil && int64(len(res.b)) > limit {
			return nil, errdefs.InvalidArgument("%s is over %d MiB", what, limit>>20)
		}
		return res.b, res.err
	}
}

// stoppable is a reader over r that ends (io.EOF) once stop is called,
// even while a read of r is blocked, as on a terminal: streamed stdin must
// end when the command it feeds has, or the request carrying it never
// would. r is read by a goroutine of its own, which a blocked read keeps
// until it returns; it holds at most one chunk.
type stoppable struct {
	chunks  chan chunk
	stopped chan struct{}
	once    sync.Once
	rest    []byte // of the last chunk, not yet read
	err     error  // r's error, once met
}

type chunk struct {
	b   []byte
	err error
}

func newStoppable(r io.Reader) *stoppable {
	s := &stoppable{chunks: make(chan chunk), stopped: make(chan struct{})}
	go func() {
		for {
			b := make([]byte, 32<<10)
			n, err := r.Read(b)
			select {
			case s.chunks <- chunk{b[:n], err}:
			case <-s.stopped:
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return s
}

func (s *stoppable) Read(p []byte) (int, error) {
	for len(s.rest) == 0 {
		if s.err != nil {
			return 0, s.err
		}
		select {
		case c := <-s.chunks:
			s.rest, s.err = c.b, c.err
		case <-s.stopped:
			return 0, io.EOF
		}
	}
	n := copy(p, s.rest)
	s.rest = s.rest[n:]
	return n, nil
}

// stop ends the reader. Idempotent.
func (s *stoppable) stop() { s.once.Do(func() { close(s.stopped) }) }
