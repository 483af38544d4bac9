// Package testutil holds the test-tier helpers shared by forkd's tests.
//
// A helper that finds its tier cannot run (not root, a host command missing)
// skips the test with the reason. When the environment variable
// FORKD_TEST_STRICT is "1" (CI sets it) the same helper fails the test
// instead, so a tier that CI is meant to run can never be skipped silently.
package testutil

import (
	"os"
	"testing"

	"github.com/forkd/forkd/internal/image/deb"
)

// StrictEnv is the environment variable that turns skips into failures.
const StrictEnv = "FORKD_TEST_STRICT"

// Strict reports whether skips are failures in this run.
func Strict() bool { return os.Getenv(StrictEnv) == "1" }

// Unavailable skips t with reason, or fails it when Strict.
func Unavailable(t testing.TB, reason string) {
	t.Helper()
	if Strict() {
		t.Fatalf("%s (%s=1: this tier must run here)", reason, StrictEnv)
	}
	t.Skip(reason)
}

// RequireRoot skips (or, when Strict, fails) t unless it runs as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		Unavailable(t, "test needs root")
	}
}

// RequireCommand skips (or, when Strict, fails) t unless every named command
// is found in PATH, /usr/sbin or /sbin. It returns the path of the first.
func RequireCommand(t testing.TB, names ...string) string {
	t.Helper()
	first := ""
	for _, name := range names {
		p, err := LookPath(name)
		if err != nil {
			Unavailable(t, "test needs command "+name+" (see scripts/deps.txt)")
			return ""
		}
		if first == "" {
			first = p
		}
	}
	return first
}

// LookPath finds a host command the way forkd itself does (deb.LookPath:
// PATH, then /usr/sbin and /sbin, which a non-root PATH often lacks).
func LookPath(name string) (string, error) { return deb.LookPath(name) }

// Check fails t at once when err, the result of a test's setup step (a
// fixture put in a store, a file put in a tree), is not nil.
func Check(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
