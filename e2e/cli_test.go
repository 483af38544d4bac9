// Package e2e drives the real forkd binary the way the README does: real
// processes, real QEMU VMs, real exit codes.
package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/bench"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
)

var forkdBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "forkd-e2e-")
	if err != nil {
		panic(err)
	}
	forkdBin = filepath.Join(dir, "forkd")
	if out, err := exec.Command("go", "build", "-o", forkdBin, "../cmd/forkd").CombinedOutput(); err != nil {
		os.Stderr.Write(out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// cli runs forkd with a data dir and the shared image cache.
type cli struct {
	t    *testing.T
	data string
	env  []string
}

func newCLI(t *testing.T) *cli {
	testvm.Require(t)
	c := &cli{t: t, data: t.TempDir()}
	c.env = append(os.Environ(),
		"FORKD_DATA="+c.data,
		"FORKD_CACHE="+testvm.CacheDir(t),
		"FORKD_AGENT="+testvm.AgentBinary(t))
	t.Cleanup(func() { c.run("kill", "--all") })
	return c
}

// in returns a copy of c for the subtest t, whose failures (in run and ok)
// are t's and not the parent's.
func (c *cli) in(t *testing.T) *cli {
	cc := *c
	cc.t = t
	return &cc
}

// run returns stdout, stderr and the exit code.
func (c *cli) run(args ...string) (string, string, int) {
	c.t.Helper()
	cmd := exec.Command(forkdBin, args...)
	cmd.Env = c.env
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		c.t.Fatalf("forkd %v: %v", args, err)
	}
	return out.String(), errb.String(), code
}

func (c *cli) ok(args ...string) string {
	c.t.Helper()
	out, errs, code := c.run(args...)
	if code != 0 {
		c.t.Fatalf("forkd %s: exit %d\n%s", strings.Join(args, " "), code, errs)
	}
	return out
}

func TestSnapshotForkExecKill(t *testing.T) {
	c := newCLI(t)
	c.ok("snapshot", "--tag", "base", "--image", "minimal")

	var fork struct {
		Children []struct {
			ID      string  `json:"id"`
			ReadyMS float64 `json:"ready_ms"`
		} `json:"children"`
		WallMS float64 `json:"wall_ms"`
	}
	if err := json.Unmarshal([]byte(c.ok("fork", "--tag", "base", "-n", "3", "--json")), &fork); err != nil {
		t.Fatal(err)
	}
	if len(fork.Children) != 3 || fork.WallMS <= 0 || fork.Children[0].ReadyMS <= 0 {
		t.Fatalf("fork --json = %+v", fork)
	}
	id := fork.Children[0].ID

	// exec: guest stdout on ours, its exit code as ours, stderr apart.
	out, errs, code := c.run("exec", id, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
	if out != "out\n" || errs != "err\n" || code != 7 {
		t.Fatalf("exec = %q, %q, %d", out, errs, code)
	}
	if out := c.ok("exec", id, "--", "hostname"); strings.TrimSpace(out) != id {
		t.Fatalf("hostname = %q", out)
	}
	if out := c.ok("ping", id); !strings.HasPrefix(out, id+": agent ") {
		t.Fatalf("ping = %q", out)
	}
	// run: one command in a fresh child of the image, then the child goes.
	out, errs, code = c.run("run", "--image", "minimal", "--tag", "base", "--", "sh", "-c", "echo ran; exit 5")
	if out != "ran\n" || code != 5 {
		t.Fatalf("run = %q, exit %d, %q", out, code, errs)
	}
	if _, _, code := c.run("exec", id, "--", "sh", "-c", "kill -9 $$"); code != 128+9 {
		t.Fatalf("exec killed by SIGKILL: exit %d, want 137", code)
	}

	var ls struct {
		Sandboxes []struct {
			ID, Snapshot, Status string
		} `json:"sandboxes"`
	}
	testutil.Check(t, json.Unmarshal([]byte(c.ok("ls", "--json")), &ls))
	if len(ls.Sandboxes) != 3 || ls.Sandboxes[0].Status != "running" || ls.Sandboxes[0].Snapshot != "base" {
		t.Fatalf("ls --json = %+v", ls)
	}

	var images struct {
		Snapshots []struct {
			Tag      string `json:"tag"`
			Status   string `json:"status"`
			Refcount int    `json:"refcount"`
		} `json:"snapshots"`
	}
	testutil.Check(t, json.Unmarshal([]byte(c.ok("images", "--json")), &images))
	if len(images.Snapshots) != 1 || images.Snapshots[0].Refcount != 3 || images.Snapshots[0].Status != "ready" {
		t.Fatalf("images --json = %+v", images)
	}

	_, errs, code = c.run("rmi", "base")
	if code == 0 || !strings.Contains(errs, "in use by 3 sandbox") {
		t.Fatalf("rmi with live children: exit %d, %q", code, errs)
	}

	c.ok("kill", id)
	if _, errs, code := c.run("exec", id, "--", "true"); code == 0 || !strings.Contains(errs, "not found") {
		t.Fatalf("exec in a killed sandbox: %d %q", code, errs)
	}
	killed := strings.Fields(c.ok("kill", "--all"))
	if len(killed) != 2 {
		t.Fatalf("kill --all killed %v", killed)
	}
	if out := c.ok("ls", "--json"); !strings.Contains(out, `"sandboxes": []`) {
		t.Fatalf("ls after kill --all: %s", out)
	}
	c.ok("rmi", "base")
}

func TestBadInputExitCodes(t *testing.T) {
	c := newCLI(t)
	for _, tc := range []struct{ name, tag string }{
		{"dotdot", "../x"},
		{"absolute", "/etc"},
		{"slash", "a/b"},
		{"empty", ""},
		{"long", strings.Repeat("x", 200)},
	} {
		t.Run("tag "+tc.name, func(t *testing.T) {
			c := c.in(t)
			for _, args := range [][]string{
				{"snapshot", "--tag", tc.tag},
				{"fork", "--tag", tc.tag, "-n", "1"},
				{"rmi", tc.tag},
			} {
				_, errs, code := c.run(args...)
				if code != 2 || !strings.Contains(errs, "tag") {
					t.Errorf("forkd %q: exit %d, %q", args, code, errs)
				}
			}
		})
	}
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"fork n 0", []string{"fork", "--tag", "x", "-n", "0"}},
		{"kill nothing", []string{"kill"}},
		{"kill all and id", []string{"kill", "--all", "sb-aaaaaaaaaa"}},
		{"exec bad id", []string{"exec", "../../x", "--", "true"}},
		{"snapshot tiny memory", []string{"snapshot", "--tag", "x", "--mem-size-mib", "1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, _, code := c.in(t).run(tc.args...); code != 2 {
				t.Errorf("forkd %q: exit %d, want 2", tc.args, code)
			}
		})
	}
	// Nothing was created.
	entries, _ := os.ReadDir(filepath.Join(c.data, "snapshots"))
	if len(entries) != 0 {
		t.Errorf("snapshots created by bad input: %v", entries)
	}
}

func TestQuickstartIdempotent(t *testing.T) {
	c := newCLI(t)
	testutil.RequireRoot(t) // the python image is built with debootstrap
	for i := 0; i < 2; i++ {
		out := c.ok("quickstart", "-n", "2", "--yes")
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) != 2 {
			t.Fatalf("run %d: quickstart printed %q", i, out)
		}
		for _, l := range lines {
			if !strings.HasPrefix(l, "sb-") || !strings.Contains(l, "eval numpy.zeros(5).sum() -> 0.0") {
				t.Fatalf("run %d: child output %q", i, l)
			}
		}
	}
	// The minimal image runs a shell command instead.
	out := c.ok("quickstart", "-n", "1", "--yes", "--image", "minimal", "--tag", "qs-min")
	if !strings.Contains(out, "hello from sb-") {
		t.Fatalf("minimal quickstart printed %q", out)
	}
	var ls struct{ Sandboxes []struct{ ID string } }
	testutil.Check(t, json.Unmarshal([]byte(c.ok("ls", "--json")), &ls))
	if len(ls.Sandboxes) != 1 {
		t.Fatalf("after three quickstarts: %d sandboxes, want the last one's 1", len(ls.Sandboxes))
	}
	// A tag made from another image (or a typo) is refused, never replaced.
	for _, tc := range []struct{ name, img string }{
		{"other image", "python"},
		{"missing image", "no-such-image"},
		{"bad name", "../x"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, errs, code := c.in(t).run("quickstart", "-n", "1", "--yes", "--image", tc.img, "--tag", "qs-min")
			if code == 0 || !strings.Contains(errs, "image") {
				t.Fatalf("quickstart --image %s over a minimal snapshot: exit %d, %q", tc.img, code, errs)
			}
		})
	}
	if out := c.ok("images", "--json"); !strings.Contains(out, `"qs-min"`) {
		t.Fatalf("snapshot qs-min lost to a refused quickstart: %s", out)
	}
	testutil.Check(t, json.Unmarshal([]byte(c.ok("ls", "--json")), &ls))
	if len(ls.Sandboxes) != 1 {
		t.Fatalf("a refused quickstart changed the sandboxes: %d", len(ls.Sandboxes))
	}
}

func TestBenchJSON(t *testing.T) {
	c := newCLI(t)
	out := c.ok("bench", "-n", "2", "--cold-runs", "1", "--exec-runs", "5", "--idle", "1s", "--json")
	var r map[string]any
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"n", "cold_boot_ms", "cold_boot_n_wall_ms", "fork_n_wall_ms", "fork_ready_p50_ms",
		"fork_ready_p90_ms", "child_private_mib", "child_guest_private_mib", "idle_cpu_pct_per_child", "exec_roundtrip_p50_ms"} {
		v, ok := r[k].(float64)
		if !ok || v < 0 || (k != "idle_cpu_pct_per_child" && v == 0) {
			t.Errorf("bench key %s = %v", k, r[k])
		}
	}
	// The bench leaves no VM and no snapshot behind.
	if out := c.ok("ls", "--json"); !strings.Contains(out, `"sandboxes": []`) {
		t.Errorf("bench left sandboxes: %s", out)
	}
	if out := c.ok("images", "--json"); !strings.Contains(out, `"snapshots": []`) {
		t.Errorf("bench left snapshots: %s", out)
	}
}

// bench --scale forks N twice (the second time from the refilled pool),
// measures the children awake and frozen, and execs in each while the
// pool refills and again once it is full; with swap (CI has zram) it
// pages them out three times and execs in each after each page-out, the
// second and third time reading the pages back as it wakes (or, the third
// time, learning them afresh); it leaves nothing behind.
func TestBenchScaleJSON(t *testing.T) {
	c := newCLI(t)
	out := c.ok("bench", "--scale", "3", "--idle", "1s", "--json")
	var r bench.ScaleResult
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatal(err)
	}
	t.Logf("bench --scale 3: %s", out)
	if r.N != 3 || r.Pool != 3 || r.Frozen != 3 || r.FirstForkFailed+r.ForkFailed+r.ExecFailed != 0 {
		t.Errorf("n %d, pool %d, frozen %d, failed %d/%d/%d", r.N, r.Pool, r.Frozen, r.FirstForkFailed, r.ForkFailed, r.ExecFailed)
	}
	// A frozen fleet costs the daemon's idle watch little: far from a core.
	if r.FrozenDaemonCPUCores < 0 || r.FrozenDaemonCPUCores > 0.5 {
		t.Errorf("daemon CPU with every child frozen: %.3f cores", r.FrozenDaemonCPUCores)
	}
	if r.ChildrenLost != 0 {
		t.Errorf("%d children's VMMs went away during the run", r.ChildrenLost)
	}
	if r.ForkWallMS <= 0 || r.PoolFullRefillMS <= 0 || r.KillAllMS <= 0 {
		t.Errorf("fork wall %v, pool full after %v, kill all %v", r.ForkWallMS, r.PoolFullRefillMS, r.KillAllMS)
	}
	for name, s := range map[string]bench.Summary{"child_private_mib": r.ChildPrivateMiB, "exec_roundtrip_ms": r.ExecRoundtrip,
		"exec_roundtrip_steady_ms": r.ExecRoundtripSteady, "exec_awake_ms": r.ExecAwake} {
		if s.N != 3 || s.P50 <= 0 {
			t.Errorf("%s: %+v", name, s)
		}
	}
	if total, _, err := proc.Swap(); err == nil && total > 0 {
		if r.Reclaimed != 3 || r.ReclaimedAgain != 3 || r.PageIns != 3 || r.PageInMiB <= 0 {
			t.Errorf("paged out %d, then %d; %d wakes read back %.1f MiB each; want 3, 3, 3 and some", r.Reclaimed, r.ReclaimedAgain, r.PageIns, r.PageInMiB)
		}
		// At the first, the first child's wake faults on demand and is
		// noted (as its request ends); the third's reads those pages of
		// its VMM back, and the second's too unless it woke first.
		if r.SiblingPageIns < 1 || r.SiblingPageIns > 2 || r.SiblingPageInMiB <= 0 {
			t.Errorf("first page-out: %d wakes read back a sibling's %.1f MiB; want 1 or 2, and some", r.SiblingPageIns, r.SiblingPageInMiB)
		}
		// Under TCG each found the sibling's translated code by block
		// in its own VMM's code buffer, whose layout the idle watch read
		// before the page-out (KVM has no code buffer).
		if r.Machine.Accelerator == "tcg" && r.SiblingCodePageIns != r.SiblingPageIns {
			t.Errorf("first page-out: %d of %d sibling read-backs found the code by block", r.SiblingCodePageIns, r.SiblingPageIns)
		}
		// The third time each wake reads back what the second read back
		// and touched, or relearns.
		third := r.ReclaimedThird
		if third == nil {
			third = &bench.ReclaimRound{}
		}
		if third.Reclaimed != 3 || third.PageIns+int64(third.Relearned) != 3 || third.PageIns == 0 || third.PageInMiB <= 0 ||
			third.Memory == nil || third.AfterWakeMemory == nil {
			t.Errorf("third page-out: %+v", r.ReclaimedThird)
		}
		for name, s := range map[string]bench.Summary{"exec_reclaimed_ms": r.ExecReclaimed, "exec_reclaimed_again_ms": r.ExecReclaimedAgain,
			"reclaimed_third.exec_ms": third.Exec} {
			if s.N != 3 || s.P50 <= 0 {
				t.Errorf("%s: %+v", name, s)
			}
		}
	}
	// With a network each child's server answers a GET that wakes it: its
	// packets did.
	if r.Network && (r.TrafficFailed != 0 || r.TrafficBurstFailed != 0 || r.TrafficWoken.N != 3 || r.TrafficWoken.P50 <= 0 || r.TrafficAwake.N != 3 || r.TrafficWakes != 6 || r.TrafficBurst.N != 3 || r.TrafficBurstWallMS <= 0) {
		t.Errorf("traffic: %d failed (%d at once), %d traffic wakes, woken %+v, awake %+v, at once %+v (last after %.0f ms)", r.TrafficFailed, r.TrafficBurstFailed, r.TrafficWakes, r.TrafficWoken, r.TrafficAwake, r.TrafficBurst, r.TrafficBurstWallMS)
	}
	if out := c.ok("ls", "--json"); !strings.Contains(out, `"sandboxes": []`) {
		t.Errorf("bench left sandboxes: %s", out)
	}
	if out := c.ok("images", "--json"); !strings.Contains(out, `"snapshots": []`) {
		t.Errorf("bench left snapshots: %s", out)
	}
}

func TestDoctor(t *testing.T) {
	c := newCLI(t)
	out, _, code := c.run("doctor", "--json")
	var rep struct {
		Checks []struct {
			Name, Status, Detail, Hint string
		} `json:"checks"`
		Backend     string `json:"backend"`
		Accelerator string `json:"accelerator"`
		Failed      bool   `json:"failed"`
	}
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("doctor --json: %v\n%s", err, out)
	}
	if rep.Failed != (code != 0) {
		t.Fatalf("failed=%v but exit %d", rep.Failed, code)
	}
	if len(rep.Checks) < 18 || rep.Backend != "qemu" {
		t.Fatalf("%d checks, backend %q", len(rep.Checks), rep.Backend)
	}
	status := map[string]string{}
	for _, ch := range rep.Checks {
		status[ch.Name] = ch.Status
		if ch.Status == "FAIL" && ch.Hint == "" {
			t.Errorf("%s fails without a fix hint", ch.Name)
		}
	}
	if status["qemu"] != "PASS" {
		t.Errorf("qemu check %q", status["qemu"])
	}
	// The text form says the same.
	text, _, _ := c.run("doctor")
	if !strings.Contains(text, "backend qemu/"+rep.Accelerator) {
		t.Errorf("text report lacks the backend line:\n%s", text)
	}
}

// TestCleanup: after a VMM is killed behind forkd's back and a stray run
// dir appears, `forkd cleanup` marks the sandbox dead, releases what it
// held, removes the stray dir and keeps the live sibling.
func TestCleanup(t *testing.T) {
	c := newCLI(t)
	c.ok("snapshot", "--tag", "base", "--image", "minimal")
	var fork struct {
		Children []struct{ ID string } `json:"children"`
	}
	testutil.Check(t, json.Unmarshal([]byte(c.ok("fork", "--tag", "base", "-n", "2", "--json")), &fork))
	var ls struct {
		Sandboxes []struct {
			ID     string `json:"id"`
			PID    int    `json:"pid"`
			Status string `json:"status"`
		} `json:"sandboxes"`
	}
	testutil.Check(t, json.Unmarshal([]byte(c.ok("ls", "--json")), &ls))
	victim := ls.Sandboxes[0]
	id, err := proc.Self(victim.PID)
	if err != nil {
		t.Fatal(err)
	}
	// SIGKILL is asynchronous, and a zombie leader can show in /proc while
	// the rest of QEMU's threads are still exiting: wait on a pidfd, which
	// becomes readable only once the whole thread group has exited (the
	// same test cleanup uses).
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := proc.Kill(ctx, id); err != nil {
		t.Fatalf("kill VMM %d: %v", victim.PID, err)
	}
	stray := filepath.Join(c.data, "run", "sb-strayzzzzz")
	testutil.MkdirAll(t, stray, 0o700)
	var rep struct {
		Adopted    []string `json:"adopted"`
		Dead       []string `json:"dead"`
		OrphanDirs []string `json:"orphan_dirs"`
	}
	if err := json.Unmarshal([]byte(c.ok("cleanup", "--json")), &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Dead) != 1 || rep.Dead[0] != victim.ID || len(rep.Adopted) != 1 || len(rep.OrphanDirs) != 1 {
		t.Fatalf("cleanup report %+v", rep)
	}
	if _, err := os.Stat(stray); !os.IsNotExist(err) {
		t.Fatalf("stray run dir left: %v", err)
	}
	if _, err := os.Stat(filepath.Join(c.data, "run", victim.ID)); !os.IsNotExist(err) {
		t.Fatalf("dead sandbox's run dir left: %v", err)
	}
	testutil.Check(t, json.Unmarshal([]byte(c.ok("ls", "--json")), &ls))
	status := map[string]string{}
	for _, sb := range ls.Sandboxes {
		status[sb.ID] = sb.Status
	}
	if status[victim.ID] != "dead" || status[ls.Sandboxes[1].ID] != "running" && status[ls.Sandboxes[0].ID] != "running" {
		t.Fatalf("after cleanup: %v", status)
	}
	for id, st := range status {
		if st == "running" {
			if out := c.ok("exec", id, "--", "echo", "ok"); out != "ok\n" {
				t.Fatalf("live sibling after cleanup: %q", out)
			}
		}
	}
}
