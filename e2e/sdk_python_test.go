package e2e

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
)

// TestPythonSDK runs the Python SDK's tests (sdk/python/tests, unittest)
// against this build of forkd: they start their own `forkd serve` over a
// temporary data dir, build a minimal and a python snapshot in the shared
// image cache, and drive real children through the SDK. Their output is
// logged; any failure (or, with FORKD_TEST_STRICT=1, any skip of a test
// that should run here) fails this test.
func TestPythonSDK(t *testing.T) {
	testvm.Require(t)
	testutil.RequireRoot(t) // the python image (run_code) is built with debootstrap
	py := sdkPython(t)
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, "-m", "unittest", "discover", "-s", filepath.Join("sdk", "python", "tests"), "-v")
	cmd.Dir = ".."
	// On timeout, interrupt: the tests then kill their sandboxes and stop
	// their daemon (atexit) instead of leaving them running.
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 2 * time.Minute
	cmd.Env = append(os.Environ(),
		"FORKD_BIN="+forkdBin,
		"FORKD_AGENT="+testvm.AgentBinary(t),
		"FORKD_CACHE="+testvm.CacheDir(t),
		"PYTHONDONTWRITEBYTECODE=1",
		"PYTHONUNBUFFERED=1")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	err := cmd.Run()
	t.Logf("%s -m unittest discover -s sdk/python/tests (%s):\n%s", py, time.Since(start).Round(time.Second), out.String())
	if err != nil {
		t.Fatalf("python SDK tests: %v", err)
	}
}

// sdkPython is the interpreter the SDK is tested with: the distro's
// /usr/bin/python3, where scripts/deps.txt installs pip and setuptools,
// else the first python3 in PATH.
func sdkPython(t *testing.T) string {
	t.Helper()
	if _, err := os.Stat("/usr/bin/python3"); err == nil {
		return "/usr/bin/python3"
	}
	return testutil.RequireCommand(t, "python3")
}
