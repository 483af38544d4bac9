package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/bench"
	"github.com/forkd/forkd/internal/testutil"
)

// TestSDKBench compares round trips of the Go client, the Python SDK and
// the TypeScript SDK on the same daemon and sandboxes, over the unix
// socket: exec of `true` (the SDKs' commands.run) and eval of 1+1 (their
// run_code), 30 calls of each, in 3 rounds of 10 that rotate which side
// goes first, so that all meet the same load. p50/p90 are printed as one
// JSON document, and written to $FORKD_SDK_BENCH_OUT when set. Opt in
// with FORKD_SDK_BENCH=1.
func TestSDKBench(t *testing.T) {
	if os.Getenv("FORKD_SDK_BENCH") != "1" {
		t.Skip("set FORKD_SDK_BENCH=1 to compare the Go client's and the SDKs' round trips")
	}
	testutil.RequireRoot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	tsDir := buildTypeScriptSDK(ctx, t)
	c := newCLI(t)
	d := startServe(t, c, "--pool", "1")
	uc, err := client.New("unix://"+d.sock, "")
	testutil.Check(t, err)
	for _, s := range [][2]string{{"bench-min", "minimal"}, {"bench-py", "python"}} {
		op, err := uc.CreateSnapshot(ctx, apiv1.CreateSnapshotRequest{Tag: s[0], Image: s[1]})
		testutil.Check(t, err)
		// One after the other: two parents booting at once on a loaded
		// machine can miss the agent's start-up deadline.
		_, err = uc.WaitOperation(ctx, op.ID)
		testutil.Check(t, err)
	}
	child := func(tag string) string {
		res, err := uc.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: tag})
		testutil.Check(t, err)
		return res.Sandboxes[0].ID
	}
	sb, py := child("bench-min"), child("bench-py")
	calls := []struct {
		name string
		fn   func() error
	}{
		{"Exec(shell: true)", func() error { _, err := uc.Exec(ctx, sb, apiv1.ExecRequest{Shell: "true"}); return err }},
		{"Exec(args: [true])", func() error { _, err := uc.Exec(ctx, sb, apiv1.ExecRequest{Args: []string{"true"}}); return err }},
		{"Eval(1+1)", func() error { _, err := uc.Eval(ctx, py, apiv1.EvalRequest{Code: "1+1"}); return err }},
		{"GetSandbox (no guest)", func() error { _, err := uc.GetSandbox(ctx, sb); return err }},
	}
	load0 := loadAvg()
	const rounds, per = 3, 10
	ms := map[string]map[string][]float64{"go_client": {}, "python_sdk": {}, "typescript_sdk": {}}
	add := func(side string, got map[string][]float64) {
		for name, v := range got {
			ms[side][name] = append(ms[side][name], v...)
		}
	}
	sides := []func(){
		func() {
			for _, call := range calls {
				add("go_client", map[string][]float64{call.name: timeCalls(t, per, call.fn)})
			}
		},
		func() { add("python_sdk", runBenchPy(t, d.sock, sb, py, per)) },
		func() { add("typescript_sdk", runBenchTS(ctx, t, tsDir, d.sock, sb, py, per)) },
	}
	for r := range rounds {
		for i := range sides {
			sides[(r+i)%len(sides)]()
		}
	}
	doc := map[string]any{"calls": rounds * per, "rounds": rounds, "socket": "unix",
		"machine": bench.DescribeHost(), "loadavg_before": load0, "loadavg_after": loadAvg()}
	for side, m := range ms {
		out := map[string]roundTrips{}
		for name, v := range m {
			out[name] = quantiles(v)
		}
		doc[side] = out
	}
	b, err := json.MarshalIndent(doc, "", "  ")
	testutil.Check(t, err)
	t.Logf("round trips:\n%s", b)
	if p := os.Getenv("FORKD_SDK_BENCH_OUT"); p != "" {
		testutil.Check(t, os.WriteFile(p, append(b, '\n'), 0o644))
	}
}

// runBenchTS runs the TypeScript SDK's bench/roundtrip.mjs on the running
// sandboxes sb and py for n calls of each measure (after one warm-up) and
// returns every call's time by measure.
func runBenchTS(ctx context.Context, t *testing.T, dir, sock, sb, py string, n int) map[string][]float64 {
	t.Helper()
	env := append(os.Environ(), "FORKD_URL=unix://"+sock, "BENCH_SANDBOX="+sb, "BENCH_PYTHON_SANDBOX="+py,
		"BENCH_N="+strconv.Itoa(n), "BENCH_WARMUP=1")
	out, _ := runNode(ctx, t, dir, env, "node", "bench/roundtrip.mjs")
	return parseSamples(t, "node bench/roundtrip.mjs", []byte(out))
}

// loadAvg is the host's load average over 1, 5 and 15 minutes, as
// /proc/loadavg gives it.
func loadAvg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	return strings.Join(f[:min(3, len(f))], " ")
}

// benchSamples runs cmd, a bench that prints JSON with every call's time
// by measure, and returns them.
func benchSamples(t *testing.T, cmd *exec.Cmd) map[string][]float64 {
	t.Helper()
	var errb bytes.Buffer
	cmd.Stderr = &errb
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s: %v\n%s", cmd, err, errb.String())
	}
	return parseSamples(t, cmd.String(), out)
}

// parseSamples reads out, what a bench printed: JSON with every call's
// time by measure ({"results": {name: {"samples_ms": [...]}}}).
func parseSamples(t *testing.T, bench string, out []byte) map[string][]float64 {
	t.Helper()
	var doc struct {
		Results map[string]struct {
			Samples []float64 `json:"samples_ms"`
		} `json:"results"`
	}
	if err := json.Unmarshal(out, &doc); err != nil {
		t.Fatalf("%s: output %q: %v", bench, out, err)
	}
	res := map[string][]float64{}
	for name, r := range doc.Results {
		if len(r.Samples) == 0 {
			t.Fatalf("%s: no samples for %s", bench, name)
		}
		res[name] = r.Samples
	}
	return res
}
