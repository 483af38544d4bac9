package e2e

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
)

// TestTypeScriptSDK builds sdk/typescript (npm ci, then tsc through npm
// run build) and runs its tests with node --test: unit tests against a
// fake daemon, then a real `forkd serve` of this package's binary, which
// the tests start themselves with a snapshot of minimal and one of python.
func TestTypeScriptSDK(t *testing.T) {
	testvm.Require(t)
	testutil.RequireRoot(t) // the python image is built with debootstrap
	testutil.RequireCommand(t, "node", "npm")
	// A daemon and data dir of its own, mostly waiting on guests and
	// other processes: it runs beside the other SDK, MCP and example
	// tests (go test -parallel, GOMAXPROCS at a time).
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	dir := buildTypeScriptSDK(ctx, t)
	files, err := filepath.Glob(filepath.Join(dir, "test", "*.test.mjs"))
	testutil.Check(t, err)
	if len(files) == 0 {
		t.Fatalf("no tests in %s/test", dir)
	}
	env := append(os.Environ(),
		"FORKD_BIN="+forkdBin,
		"FORKD_AGENT="+testvm.AgentBinary(t),
		"FORKD_CACHE="+testvm.CacheDir(t),
		// No skipped suite: a missing binary fails.
		"FORKD_SDK_REQUIRE=1",
	)
	out, _ := runNode(ctx, t, dir, env, "node", append([]string{"--test", "--test-reporter=spec"}, files...)...)
	// The spec reporter ends with "ℹ tests 46", "ℹ pass 45", ...
	counts := map[string]string{}
	for _, m := range regexp.MustCompile(`(?m)^ℹ (tests|pass|skipped) (\d+)$`).FindAllStringSubmatch(out, -1) {
		counts[m[1]] = m[2]
	}
	t.Logf("node --test: %s tests, %s passed, %s skipped", counts["tests"], counts["pass"], counts["skipped"])
	if n := counts["skipped"]; n != "" && n != "0" {
		t.Logf("node --test report:\n%s", out)
		if testutil.Strict() {
			t.Fatalf("node --test skipped %s tests (%s=1: none may skip here)", n, testutil.StrictEnv)
		}
	}
}

// buildTypeScriptSDK installs the SDK's pinned dependencies (npm ci) and
// compiles it, once per test process, and returns its directory.
func buildTypeScriptSDK(ctx context.Context, t *testing.T) string {
	t.Helper()
	testutil.RequireCommand(t, "node", "npm")
	dir, err := filepath.Abs("../sdk/typescript")
	testutil.Check(t, err)
	// Once per test process: the SDK, MCP and E2B tests run in parallel,
	// and an npm ci in the directory another test builds in removes the
	// files under it.
	tsSDKBuild.Lock()
	defer tsSDKBuild.Unlock()
	if !tsSDKBuild.done {
		npmCI(ctx, t, dir, "--prefer-offline")
		runNode(ctx, t, dir, os.Environ(), "npm", "run", "build")
		tsSDKBuild.done = true
	}
	return dir
}

// tsSDKBuild says whether buildTypeScriptSDK has built the SDK.
var tsSDKBuild struct {
	sync.Mutex
	done bool
}
