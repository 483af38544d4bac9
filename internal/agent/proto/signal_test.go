package proto

import (
	"syscall"
	"testing"
)

func TestParseSignal(t *testing.T) {
	for in, want := range map[string]syscall.Signal{"SIGTERM": syscall.SIGTERM, "term": syscall.SIGTERM, "9": syscall.SIGKILL, "HUP": syscall.SIGHUP, "SIG35": syscall.Signal(35), "35": syscall.Signal(35)} {
		t.Run(in, func(t *testing.T) {
			if got, err := ParseSignal(in); err != nil || got != want {
				t.Errorf("ParseSignal(%q) = %v, %v", in, got, err)
			}
		})
	}
	if got := SignalName(syscall.Signal(35)); got != "SIG35" {
		t.Errorf("SignalName(35) = %q", got)
	}
	for _, in := range []string{"", "SIGNOPE", "0", "99", "SIG99"} {
		t.Run("bad "+in, func(t *testing.T) {
			if _, err := ParseSignal(in); err == nil {
				t.Errorf("%q accepted", in)
			}
		})
	}
}
