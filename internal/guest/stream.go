package guest

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
)

const (
	// streamBuffer bounds the output a streamer holds while the host is
	// slow to return credit.
	streamBuffer = 1 << 20
	// streamFlush bounds how long close waits for held output to reach a
	// slow host.
	streamFlush = 2 * time.Second
)

// streamer forwards an eval's output to the host from its own goroutine,
// so that the eval loop, and with it the eval's timeout and cancellation,
// never waits for the host's credit. It holds at most streamBuffer bytes;
// output beyond that is dropped, and a marker saying how much takes its
// place in the stream. (The result still carries the output, up to
// maxCapture.)
type streamer struct {
	r      *request
	ctx    context.Context
	cancel context.CancelFunc
	wake   chan struct{} // one slot: output or close pending
	done   chan struct{} // closed when run returns

	mu      sync.Mutex
	chunks  []streamChunk // guarded by mu
	size    int           // guarded by mu; bytes in chunks
	dropped [2]int        // guarded by mu; bytes dropped per stream (stdout, stderr) since the last marker
	closed  bool          // guarded by mu
}

type streamChunk struct {
	st proto.Stream
	b  []byte
}

// newStreamer starts forwarding to r's host until ctx ends or close.
func newStreamer(ctx context.Context, r *request) *streamer {
	ctx, cancel := context.WithCancel(ctx)
	s := &streamer{r: r, ctx: ctx, cancel: cancel, wake: make(chan struct{}, 1), done: make(chan struct{})}
	go s.run()
	return s
}

func streamIndex(st proto.Stream) int {
	if st == proto.StreamStderr {
		return 1
	}
	return 0
}

// write queues p for stream st without blocking.
func (s *streamer) write(st proto.Stream, p string) {
	s.mu.Lock()
	i := streamIndex(st)
	switch {
	case s.closed:
	case s.size+len(p) > streamBuffer:
		s.dropped[i] += len(p)
	default:
		s.markLocked(st)
		s.chunks = append(s.chunks, streamChunk{st, []byte(p)})
		s.size += len(p)
	}
	s.mu.Unlock()
	s.notify()
}

// markLocked queues a marker for output of st dropped since the last one.
func (s *streamer) markLocked(st proto.Stream) {
	i := streamIndex(st)
	if s.dropped[i] == 0 {
		return
	}
	m := fmt.Sprintf("\n[forkd: %d bytes of output dropped: the host read too slowly]\n", s.dropped[i])
	s.dropped[i] = 0
	s.chunks = append(s.chunks, streamChunk{st, []byte(m)})
	s.size += len(m)
}

func (s *streamer) notify() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// run sends queued output until close has been called and everything is
// sent, or ctx ends. After a send fails it discards what is queued.
func (s *streamer) run() {
	defer close(s.done)
	failed := false
	for {
		s.mu.Lock()
		chunks, closed := s.chunks, s.closed
		s.chunks, s.size = nil, 0
		s.mu.Unlock()
		for _, c := range chunks {
			if !failed && s.r.sendData(s.ctx, c.st, c.b, false) != nil {
				failed = true
			}
		}
		if closed && len(chunks) == 0 {
			return
		}
		if len(chunks) > 0 {
			continue
		}
		select {
		case <-s.wake:
		case <-s.ctx.Done():
			return
		}
	}
}

// close stops taking output, gives what is held up to streamFlush to reach
// the host, and returns once nothing more will be sent, so that the result
// follows all streamed data.
func (s *streamer) close() {
	s.mu.Lock()
	s.closed = true
	s.markLocked(proto.StreamStdout)
	s.markLocked(proto.StreamStderr)
	s.mu.Unlock()
	s.notify()
	t := time.NewTimer(streamFlush)
	defer t.Stop()
	select {
	case <-s.done:
	case <-t.C:
	}
	s.cancel()
	<-s.done
}
