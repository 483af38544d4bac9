package guest_test

import (
	"os"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/guest"
)

// The hello names the guest kernel's clocksource, which tells the host
// whether a woken guest needs its clock set.
func TestHelloNamesClocksource(t *testing.T) {
	sys := noSystem
	sys.Clocksource = func() string { return "tsc" }
	if c := serveConfig(t, guest.Config{System: sys}); c.Clocksource() != "tsc" {
		t.Errorf("clocksource %q, want tsc", c.Clocksource())
	}
	// The real reading is this machine's own, as the kernel names it.
	b, err := os.ReadFile("/sys/devices/system/clocksource/clocksource0/current_clocksource")
	if err != nil {
		t.Fatal(err)
	}
	sys.Clocksource = nil
	want := strings.TrimSpace(string(b))
	if c := serveConfig(t, guest.Config{System: sys}); c.Clocksource() != want || want == "" {
		t.Errorf("clocksource %q, want %q", c.Clocksource(), want)
	}
}
