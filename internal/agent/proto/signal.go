package proto

import (
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
)

// SignalName is the wire name of sig: sig as "SIGTERM"; a signal without a name (the
// real-time ones) as "SIG35", which ParseSignal reads back.
func SignalName(sig syscall.Signal) string {
	if name := unix.SignalName(sig); name != "" {
		return name
	}
	return "SIG" + strconv.Itoa(int(sig))
}

// ParseSignal reads a signal as sent on the wire or given by a user: "SIGTERM", "TERM", "term", "15" or "SIG35".
func ParseSignal(s string) (syscall.Signal, error) {
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
	if n, err := strconv.Atoi(strings.TrimPrefix(name, "SIG")); err == nil && n > 0 && n < 65 {
		return syscall.Signal(n), nil
	}
	return 0, errdefs.InvalidArgument("unknown signal %q", s)
}
