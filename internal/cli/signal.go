package cli

import (
	"strings"

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
	for i := 1; i < 65; i++ {
		if strings.EqualFold(unix.SignalName(unix.Signal(i)), n) || strings.EqualFold(unix.Signal(i).String(), name) {
			return i
		}
	}
	return 0
}
