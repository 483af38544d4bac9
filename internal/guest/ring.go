package guest

import "sync"

// ring keeps the most recent bytes of a background process's output and
// lets any number of readers follow it by absolute offset. Writers never
// block; a reader that falls more than the ring's size behind loses the
// bytes in between. Safe for concurrent use.
type ring struct {
	mu     sync.Mutex
	size   int
	buf    []byte        // guarded by mu; allocated on first write
	total  int64         // guarded by mu; bytes ever written
	closed bool          // guarded by mu; no more writes
	wake   chan struct{} // guarded by mu; closed and replaced on write and close
}

func newRing(size int) *ring { return &ring{size: size, wake: make(chan struct{})} }

func (r *ring) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(p) == 0 {
		return 0, nil
	}
	if r.buf == nil {
		r.buf = make([]byte, r.size)
	}
	n := len(p)
	if len(p) > r.size {
		r.total += int64(len(p) - r.size)
		p = p[len(p)-r.size:]
	}
	for len(p) > 0 {
		off := int(r.total % int64(r.size))
		c := copy(r.buf[off:], p)
		p = p[c:]
		r.total += int64(c)
	}
	close(r.wake)
	r.wake = make(chan struct{})
	return n, nil
}

// close marks the end of the output.
func (r *ring) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.closed {
		r.closed = true
		close(r.wake)
		r.wake = make(chan struct{})
	}
}

// readAt copies bytes from absolute offset from into p. It returns the
// count, the offset after them, whether the output has ended at that
// offset, and a channel that is closed when there is more to read. from is
// moved forward past bytes that were overwritten.
func (r *ring) readAt(from int64, p []byte) (n int, next int64, ended bool, wake <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if oldest := r.total - int64(r.size); from < oldest {
		from = oldest
	}
	for from < r.total && n < len(p) {
		off := int(from % int64(r.size))
		end := min(r.size, off+int(r.total-from))
		c := copy(p[n:], r.buf[off:end])
		n += c
		from += int64(c)
	}
	return n, from, r.closed && from == r.total, r.wake
}

// end returns the offset just past the last byte written.
func (r *ring) end() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.total
}
