package cli

import (
	"context"
	"io"

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
