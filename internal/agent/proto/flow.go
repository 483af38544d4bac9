package proto

import (
	"context"
	"sync"
)

// Credit is the sending side of one request's data window: how many bytes
// may still be sent before the receiver returns credit. Safe for concurrent
// use.
type Credit struct {
	mu   sync.Mutex
	n    int64         // guarded by mu
	wake chan struct{} // guarded by mu; closed and replaced when n grows or on Close
	err  error         // guarded by mu
}

// NewCredit returns a Credit holding n bytes.
func NewCredit(n int) *Credit {
	return &Credit{n: int64(n), wake: make(chan struct{})}
}

// Take waits until some credit is available and takes up to max bytes of
// it. It fails when ctx ends or the Credit is closed.
func (c *Credit) Take(ctx context.Context, max int) (int, error) {
	for {
		c.mu.Lock()
		if c.err != nil {
			err := c.err
			c.mu.Unlock()
			return 0, err
		}
		if c.n > 0 {
			n := int(min(int64(max), c.n))
			c.n -= int64(n)
			c.mu.Unlock()
			return n, nil
		}
		wake := c.wake
		c.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// TakeAll waits until n bytes of credit are available and takes them. It
// fails when ctx ends or the Credit is closed.
func (c *Credit) TakeAll(ctx context.Context, n int) error {
	for {
		c.mu.Lock()
		if c.err != nil {
			err := c.err
			c.mu.Unlock()
			return err
		}
		if c.n >= int64(n) {
			c.n -= int64(n)
			c.mu.Unlock()
			return nil
		}
		wake := c.wake
		c.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Add returns n bytes of credit.
func (c *Credit) Add(n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n += int64(n)
	close(c.wake)
	c.wake = make(chan struct{})
}

// Close fails every current and future Take with err. The first error
// wins.
func (c *Credit) Close(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		c.err = err
		close(c.wake)
		c.wake = make(chan struct{})
	}
}

// Queue is a FIFO between one request's frame dispatcher and its handler.
// Push never blocks; the peer's respect of the window bounds what it holds.
// Safe for concurrent use.
type Queue[T any] struct {
	mu    sync.Mutex
	items []T           // guarded by mu
	wake  chan struct{} // guarded by mu; closed and replaced on Push and Close
	err   error         // guarded by mu
}

// NewQueue returns an empty open Queue.
func NewQueue[T any]() *Queue[T] { return &Queue[T]{wake: make(chan struct{})} }

// Push appends v; it reports false when the Queue is closed.
func (q *Queue[T]) Push(v T) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.err != nil {
		return false
	}
	q.items = append(q.items, v)
	close(q.wake)
	q.wake = make(chan struct{})
	return true
}

// Close makes Pop fail with err once the queued items are consumed. The
// first error wins.
func (q *Queue[T]) Close(err error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.err == nil {
		q.err = err
		close(q.wake)
		q.wake = make(chan struct{})
	}
}

// Pop removes and returns the oldest item, waiting for one. It fails when
// ctx ends, or when the Queue is closed and empty.
func (q *Queue[T]) Pop(ctx context.Context) (T, error) {
	for {
		q.mu.Lock()
		if len(q.items) > 0 {
			v := q.items[0]
			var zero T
			q.items[0] = zero
			q.items = q.items[1:]
			if len(q.items) == 0 {
				q.items = nil
			}
			q.mu.Unlock()
			return v, nil
		}
		err, wake := q.err, q.wake
		q.mu.Unlock()
		if err != nil {
			var zero T
			return zero, err
		}
		select {
		case <-wake:
		case <-ctx.Done():
			var zero T
			return zero, ctx.Err()
		}
	}
}
