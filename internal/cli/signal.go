package cli

import (
	"context"
	"io"
	"strconv"
	"strings"

	"github.com/forkd/forkd/internal/errdefs"
	"golang.org/x/sys/unix"
)

// signalNumber maps a signal name ("SIGKILL", "KILL", "killed") to its
// number, 0 if unknown.
func signalNumber(name string) int {
	n := strings.ToUpper(strings.TrimSpace(name))
	if !strings.HasPrefix(n, "SIG") {
		n = "SIG" + n
	}
	if s := unix.SignalNum(n); s != 0 {
		return int(s)
	}
	if i, err := strconv.Atoi(strings.TrimPrefix(n, "SIG")); err == nil && i > 0 && i < 65 {
		return i // "SIG35": a real-time signal, which has no name
	}
	for i := 1; i < 65; i++ {
		if strings.EqualFold(unix.SignalName(unix.Signal(i)), n) || strings.EqualFold(unix.Signal(i).String(), name) {
			return i
		}
	}
	return 0
}

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
