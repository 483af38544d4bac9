package e2e

import (
	"bytes"
	"context"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
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
	// A daemon and data dir of its own, mostly waiting on guests and
	// other processes: it runs beside the other SDK, MCP and example
	// tests (go test -parallel, GOMAXPROCS at a time).
	t.Parallel()
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

// runBenchPy runs sdk/python/bench.py for n calls of each of its
// measures and returns every call's time by measure.
func runBenchPy(t *testing.T, sock, sb, py string, n int) map[string][]float64 {
	t.Helper()
	cmd := exec.Command(sdkPython(t), filepath.Join("..", "sdk", "python", "bench.py"),
		"--socket", sock, "--sandbox", sb, "--python-sandbox", py, "-n", strconv.Itoa(n), "--warmup", "1", "--samples")
	cmd.Env = append(os.Environ(), "PYTHONDONTWRITEBYTECODE=1")
	return benchSamples(t, cmd)
}

// roundTrips are the quantiles of a call's wall time, in milliseconds.
type roundTrips struct {
	P50  float64 `json:"p50_ms"`
	P90  float64 `json:"p90_ms"`
	Mean float64 `json:"mean_ms"`
	Min  float64 `json:"min_ms"`
	Max  float64 `json:"max_ms"`
}

// timeCalls times n calls of fn, in milliseconds, after one warm-up call.
func timeCalls(t *testing.T, n int, fn func() error) []float64 {
	t.Helper()
	if err := fn(); err != nil {
		t.Fatal(err)
	}
	ms := make([]float64, 0, n)
	for range n {
		start := time.Now()
		if err := fn(); err != nil {
			t.Fatal(err)
		}
		ms = append(ms, float64(time.Since(start).Microseconds())/1000)
	}
	return ms
}

// quantiles summarizes times as bench.py does (nearest rank).
func quantiles(ms []float64) roundTrips {
	sorted := slices.Clone(ms)
	slices.Sort(sorted)
	q := func(p float64) float64 { return sorted[min(len(sorted)-1, int(math.Round(p*float64(len(sorted)-1))))] }
	sum := 0.0
	for _, v := range ms {
		sum += v
	}
	r2 := func(v float64) float64 { return math.Round(v*100) / 100 }
	return roundTrips{P50: r2(q(0.5)), P90: r2(q(0.9)), Mean: r2(sum / float64(len(ms))), Min: r2(sorted[0]), Max: r2(sorted[len(sorted)-1])}
}
