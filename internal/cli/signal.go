package cli

import (
	"strings"

	"github.com/forkd/forkd/internal/agent/proto"
	"golang.org/x/sys/unix"
)

// signalNumber maps a signal name as the guest reports it ("SIGKILL",
// "SIG35"; also "KILL" or "killed") to its number, 0 if unknown.
func signalNumber(name string) int {
	if sig, err := proto.ParseSignal(strings.TrimSpace(name)); err == nil {
		return int(sig)
	}
	for i := 1; i < 65; i++ {
		if strings.EqualFold(unix.Signal(i).String(), name) {
			return i
		}
	}
	return 0
}
