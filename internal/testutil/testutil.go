// Package testutil holds the test-tier helpers shared by forkd's tests.
//
// Tests come in three tiers, each a level that includes the ones below
// it: unit (anyone, anywhere), root (netns, nftables, cgroups) and vm
// (real QEMU guests). FORKD_TEST_TIER says how far a run goes (unit, root
// or vm; default vm, every tier); a test above it is skipped, whatever
// FORKD_TEST_STRICT says, since that was asked for (make unit).
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

// TierEnv is the environment variable that says how far the tiers go.
const TierEnv = "FORKD_TEST_TIER"

// Test tiers, in order.
const (
	TierUnit = "unit"
	TierRoot = "root"
	TierVM   = "vm"
)

var tierLevel = map[string]int{TierUnit: 0, TierRoot: 1, TierVM: 2}

// Tier reports whether tier is part of this run (FORKD_TEST_TIER is it or
// a tier above it). An unknown FORKD_TEST_TIER panics: a typo must not
// silently run nothing or everything.
func Tier(tier string) bool {
	sel := os.Getenv(TierEnv)
	if sel == "" {
		sel = TierVM
	}
	level, ok := tierLevel[sel]
	if !ok {
		panic(TierEnv + "=" + sel + ": want unit, root or vm")
	}
	return tierLevel[tier] <= level
}

// RequireTier skips t unless tier is part of this run (see Tier); this skip
// is never a failure.
func RequireTier(t testing.TB, tier string) {
	t.Helper()
	if !Tier(tier) {
		t.Skipf("%s tier not selected (%s=%s)", tier, TierEnv, os.Getenv(TierEnv))
	}
}

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
	RequireTier(t, TierRoot)
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
