package e2e

import (
	"bytes"
	"context"
	"os"
	"os/exec"
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
	dir, run := buildTypeScriptSDK(ctx, t)
	files, err := filepath.Glob(filepath.Join(dir, "test", "*.test.mjs"))
	testutil.Check(t, err)
	if len(files) == 0 {
		t.Fatalf("no tests in %s/test", dir)
	}
	out := run("node", append([]string{"--test", "--test-reporter=spec"}, files...)...)
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
// compiles it. It returns the SDK's directory and a runner of commands
// there, with the environment its tests and bench read (this package's
// binaries and image cache), that fails the test on a non-zero exit and
// returns stdout and stderr together.
func buildTypeScriptSDK(ctx context.Context, t *testing.T) (string, func(name string, args ...string) string) {
	t.Helper()
	testutil.RequireCommand(t, "node", "npm")
	dir, err := filepath.Abs("../sdk/typescript")
	testutil.Check(t, err)
	env := append(os.Environ(),
		"FORKD_BIN="+forkdBin,
		"FORKD_AGENT="+testvm.AgentBinary(t),
		"FORKD_CACHE="+testvm.CacheDir(t),
		// No skipped suite: a missing binary fails.
		"FORKD_SDK_REQUIRE=1",
		"npm_config_update_notifier=false",
	)
	run := func(name string, args ...string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Dir, cmd.Env = dir, env
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		start := time.Now()
		if err := cmd.Run(); err != nil {
			t.Fatalf("%s %v in %s: %v\n%s", name, args, dir, err, out.String())
		}
		t.Logf("%s %v: %.1fs", name, args, time.Since(start).Seconds())
		return out.String()
	}
	// Once per test process: the SDK, MCP and E2B tests run in parallel,
	// and an npm ci in the directory another test builds in removes the
	// files under it.
	tsSDKBuild.Lock()
	defer tsSDKBuild.Unlock()
	if !tsSDKBuild.done {
		run("npm", "ci", "--no-audit", "--no-fund", "--prefer-offline")
		run("npm", "run", "build")
		tsSDKBuild.done = true
	}
	return dir, run
}

// tsSDKBuild says whether buildTypeScriptSDK has built the SDK.
var tsSDKBuild struct {
	sync.Mutex
	done bool
}
