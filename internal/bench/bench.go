// Package bench measures forkd against its baselines in one run, on one
// image: cold boots, forks, per-child memory and idle CPU, exec round trips,
// and host process start-up for scale.
package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/vmm"
)

// Options configure a run. Run fills in zero fields with defaults; then
// every field must be within its bounds (Validate).
type Options struct {
	N         int
	Image     string
	MemoryMiB int
	ColdRuns  int           // single cold boots to time (median)
	ExecRuns  int           // exec round trips to time
	IdleFor   time.Duration // how long idle CPU is sampled
	// CLI, if set, is a forkd binary whose `exec` is also timed end to end.
	CLI      string
	DataDir  string
	Progress io.Writer
}

// Result is the JSON `forkd bench --json` prints. Keys only get added.
type Result struct {
	Machine Machine `json:"machine"`
	N       int     `json:"n"`
	Image   string  `json:"image"`

	SnapshotMS float64 `json:"snapshot_ms"`

	ColdBootMS      float64 `json:"cold_boot_ms"`
	ColdBoot        Summary `json:"cold_boot"`
	ColdBootNWallMS float64 `json:"cold_boot_n_wall_ms"`

	ForkNWallMS    float64 `json:"fork_n_wall_ms"`
	ForkReadyP50MS float64 `json:"fork_ready_p50_ms"`
	ForkReadyP90MS float64 `json:"fork_ready_p90_ms"`
	ForkReady      Summary `json:"fork_ready"`

	ChildPrivateMiB      float64 `json:"child_private_mib"`
	ChildGuestPrivateMiB float64 `json:"child_guest_private_mib"`
	ChildPrivate         Summary `json:"child_private_mib_dist"`
	ChildGuestPrivate    Summary `json:"child_guest_private_mib_dist"`

	IdleCPUPctPerChild float64 `json:"idle_cpu_pct_per_child"`

	ExecRoundtripP50MS float64 `json:"exec_roundtrip_p50_ms"`
	ExecRoundtrip      Summary `json:"exec_roundtrip"`
	CLIExecP50MS       float64 `json:"cli_exec_p50_ms,omitempty"`

	// With a Python image, in the same child: eval in the warm interpreter
	// vs a fresh python3 -c, both computing numpy.zeros(5).tolist().
	EvalP50MS         float64 `json:"eval_p50_ms,omitempty"`
	Eval              Summary `json:"eval,omitzero"`
	ExecPythonP50MS   float64 `json:"exec_python_p50_ms,omitempty"`
	ExecPython        Summary `json:"exec_python,omitzero"`
	RatioExecOverEval float64 `json:"ratio_exec_python_over_eval,omitempty"`

	// The same fork when every child takes a VMM parked ahead of time
	// (forkd serve's pool).
	ForkPooledNWallMS float64 `json:"fork_pooled_n_wall_ms,omitempty"`
	ForkPooledReady   Summary `json:"fork_pooled_ready,omitzero"`

	// With per-child networking (as root): the same fork from a snapshot
	// with a NIC, each child in its own netns with a cgroup of limits.
	ForkIsolatedNWallMS      float64 `json:"fork_isolated_n_wall_ms,omitempty"`
	ForkIsolatedReady        Summary `json:"fork_isolated_ready,omitzero"`
	IsolationAddedMSPerChild float64 `json:"isolation_added_ms_per_child,omitempty"`

	// With --branch: branching, measured in the same run.
	*BranchResult
	// With --disk: the writable disk against no disk.
	*DiskResult

	ProcessForkP50MS   float64 `json:"baseline_process_fork_p50_ms"`
	PythonStartP50MS   float64 `json:"baseline_python_c_p50_ms,omitempty"`
	RatioColdNOverFork float64 `json:"ratio_cold_n_over_fork_n"`
	RatioColdOverReady float64 `json:"ratio_cold_over_fork_ready_p50"`
}

// Bounds of Options, named as forkd bench's flags.
const (
	MaxN        = 1000 // a fork's largest batch
	MaxColdRuns = 100
	MaxExecRuns = 10000
	MinIdle     = 100 * time.Millisecond
	MaxIdle     = 10 * time.Minute
)

// Validate checks o's fields, as given (zero is out of bounds too), before
// anything is built or started. Errors are errdefs.ErrInvalidArgument.
func (o *Options) Validate() error {
	for _, c := range []struct {
		name      string
		v, lo, hi int
	}{
		{"-n", o.N, 1, MaxN},
		{"--mem-size-mib", o.MemoryMiB, sandbox.MinMemoryMiB, sandbox.MaxMemoryMiB},
		{"--cold-runs", o.ColdRuns, 1, MaxColdRuns},
		{"--exec-runs", o.ExecRuns, 1, MaxExecRuns},
	} {
		if c.v < c.lo || c.v > c.hi {
			return errdefs.InvalidArgument("%s %d: want %d to %d", c.name, c.v, c.lo, c.hi)
		}
	}
	if o.IdleFor < MinIdle || o.IdleFor > MaxIdle {
		return errdefs.InvalidArgument("--idle %v: want %v to %v", o.IdleFor, MinIdle, MaxIdle)
	}
	if err := image.ValidateName(o.Image); err != nil {
		return fmt.Errorf("--image: %w", err)
	}
	return nil
}

// Run performs the benchmark with e. It creates a temporary snapshot and
// removes it, and kills every VM it started, also on failure. Zero fields
// of o take their defaults; a field out of bounds (Validate) is an error.
func Run(ctx context.Context, e *sandbox.Engine, o Options) (*Result, error) {
	if o.N == 0 {
		o.N = 10
	}
	if o.Image == "" {
		o.Image = "minimal"
	}
	if o.MemoryMiB == 0 {
		o.MemoryMiB = 256
	}
	if o.ColdRuns == 0 {
		o.ColdRuns = 3
	}
	if o.ExecRuns == 0 {
		o.ExecRuns = 30
	}
	if o.IdleFor == 0 {
		o.IdleFor = 5 * time.Second
	}
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	say := progress(o.Progress)
	r := &Result{Machine: DescribeRun(ctx, e.Backend()), N: o.N, Image: o.Image}

	img, err := e.Images().Build(ctx, o.Image)
	if err != nil {
		return nil, err
	}

	say("baselines: process fork+exec, python3 -c")
	r.ProcessForkP50MS = Summarize(timeCommand(ctx, 30, "true")).P50
	if _, err := exec.LookPath("python3"); err == nil {
		r.PythonStartP50MS = Summarize(timeCommand(ctx, 10, "python3", "-c", "pass")).P50
	}

	say("cold boot ×%d, one at a time", o.ColdRuns)
	var cold []float64
	for i := 0; i < o.ColdRuns; i++ {
		walls, err := coldBoot(ctx, e, img, o, 1)
		if err != nil {
			return nil, fmt.Errorf("cold boot: %w", err)
		}
		cold = append(cold, walls[0])
	}
	r.ColdBoot = Summarize(cold)
	r.ColdBootMS = r.ColdBoot.P50

	say("cold boot of %d at once", o.N)
	start := time.Now()
	if _, err := coldBoot(ctx, e, img, o, o.N); err != nil {
		return nil, fmt.Errorf("cold boot ×%d: %w", o.N, err)
	}
	r.ColdBootNWallMS = msSince(start)

	tag := fmt.Sprintf("bench-%d", os.Getpid())
	say("snapshot %s", tag)
	start = time.Now()
	snap, err := e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: tag, Built: img, MemoryMiB: o.MemoryMiB})
	if err != nil {
		return nil, err
	}
	r.SnapshotMS = msSince(start)
	defer func() { cleanupFailed(o, "remove snapshot "+tag, e.RemoveSnapshot(tag)) }()

	if err := warmFork(ctx, e, sandbox.ForkSpec{Tag: tag, N: 1}); err != nil {
		return nil, err
	}
	say("fork %d", o.N)
	fr, err := e.Fork(ctx, sandbox.ForkSpec{Tag: tag, N: o.N, Metadata: map[string]string{"origin": "bench"}})
	if err != nil {
		return nil, err
	}
	defer func() {
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		_, err := e.KillAll(kctx, tag)
		cleanupFailed(o, "kill the children of "+tag, err)
	}()
	r.ForkNWallMS = fr.WallMS
	var ready []float64
	for _, c := range fr.Children {
		ready = append(ready, c.ReadyMS)
	}
	r.ForkReady = Summarize(ready)
	r.ForkReadyP50MS, r.ForkReadyP90MS = r.ForkReady.P50, r.ForkReady.P90

	say("exec round trips")
	first := fr.Children[0].ID
	rt, err := execRoundTrips(ctx, e, first, o.ExecRuns)
	if err != nil {
		return nil, err
	}
	r.ExecRoundtrip = Summarize(rt)
	r.ExecRoundtripP50MS = r.ExecRoundtrip.P50
	if o.CLI != "" {
		env := append(os.Environ(), "FORKD_DATA="+o.DataDir)
		r.CLIExecP50MS = Summarize(timeCommandEnv(ctx, 10, env, o.CLI, "exec", first, "--", "true")).P50
	}

	if snap.Python != "" {
		say("eval vs python3 -c")
		if err := evalVsExec(ctx, e, first, o.ExecRuns, r); err != nil {
			return nil, err
		}
	}

	say("idle CPU over %s", o.IdleFor)
	time.Sleep(time.Second) // let the exec traffic settle
	pids := make([]int, 0, len(fr.Children))
	for _, c := range fr.Children {
		pids = append(pids, c.Sandbox.Handle.Process.PID)
	}
	r.IdleCPUPctPerChild, err = idleCPU(ctx, pids, o.IdleFor)
	if err != nil {
		return nil, err
	}

	var priv, guest []float64
	for _, pid := range pids {
		t, g, err := smapsPrivate(pid, snap.MemoryPath())
		if err != nil {
			return nil, err
		}
		priv = append(priv, float64(t)/1024)
		guest = append(guest, float64(g)/1024)
	}
	r.ChildPrivate, r.ChildGuestPrivate = Summarize(priv), Summarize(guest)
	r.ChildPrivateMiB, r.ChildGuestPrivateMiB = r.ChildPrivate.P50, r.ChildGuestPrivate.P50

	if e.Config().Net != nil && e.Config().Cgroups != nil {
		say("fork %d with per-child networking and limits", o.N)
		if err := isolatedFork(ctx, e, img, o, r); err != nil {
			return nil, err
		}
	}

	// Last: parking refills the pool in the background after each fork.
	say("fork %d from parked VMMs", o.N)
	if err := pooledFork(ctx, e, tag, o, r); err != nil {
		return nil, err
	}

	if r.ForkNWallMS > 0 {
		r.RatioColdNOverFork = r.ColdBootNWallMS / r.ForkNWallMS
	}
	if r.ForkReadyP50MS > 0 {
		r.RatioColdOverReady = r.ColdBootMS / r.ForkReadyP50MS
	}
	return r, nil
}

// cleanupFailed reports on o.Progress a cleanup step that failed (err not
// nil): the measurements stand, but what the run made may be left over.
func cleanupFailed(o Options, what string, err error) {
	if err != nil {
		progress(o.Progress)("cleanup: %s: %v", what, err)
	}
}

// coldBoot boots n VMs from img at once (bounded like forks are), each with
// anonymous RAM, and returns each one's time until its agent answered init
// (which, for a Python image, waits for the warm interpreter).
func coldBoot(ctx context.Context, e *sandbox.Engine, img *image.Image, o Options, n int) ([]float64, error) {
	be := e.Backend()
	walls := make([]float64, n)
	errs := make([]error, n)
	sem := make(chan struct{}, e.Config().MaxParallel)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			start := time.Now()
			spec := vmm.BootSpec{
				Name:      fmt.Sprintf("cold%d-%d", os.Getpid(), i),
				RunDir:    filepath.Join(o.DataDir, "run", fmt.Sprintf("cold%d-%d", os.Getpid(), i)),
				Resources: vmm.Resources{MemoryMiB: o.MemoryMiB, VCPUs: 1},
				Kernel:    img.Kernel, Initrd: img.Initrd, Cmdline: img.Cmdline,
			}
			// Read back only when the guest does not answer.
			spec.ConsoleLog = filepath.Join(spec.RunDir, "console.log")
			if img.Rootfs != "" {
				spec.Disks = []vmm.Disk{{Path: img.Rootfs, ReadOnly: true}}
			}
			m, err := be.Boot(ctx, spec)
			if err != nil {
				errs[i] = err
				return
			}
			defer func() {
				sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
				defer cancel()
				cleanupFailed(o, "stop "+spec.Name, m.Stop(sctx))
			}()
			bctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
			defer cancel()
			c, err := sandbox.DialAgent(bctx, m, agent.Options{})
			if err != nil {
				errs[i] = fmt.Errorf("%w%s%s", err, sandbox.GuestReport(ctx, m), sandbox.ConsoleTail(spec.ConsoleLog))
				return
			}
			defer c.Close()
			// Ready means what it means for a fork: the agent answered
			// init, which waits for a warm interpreter to be up.
			if err := c.Init(bctx, proto.InitRequest{Time: time.Now(), SandboxID: spec.Name, Hostname: spec.Name}); err != nil {
				errs[i] = err
				return
			}
			walls[i] = msSince(start)
		}(i)
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	return walls, nil
}

// execRoundTrips times `true` run through one agent session.
func execRoundTrips(ctx context.Context, e *sandbox.Engine, id string, n int) ([]float64, error) {
	c, release, err := e.Agent(ctx, id)
	if err != nil {
		return nil, err
	}
	defer release()
	var out []float64
	for i := 0; i < n; i++ {
		start := time.Now()
		res, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"true"}})
		if err != nil {
			return nil, err
		}
		if res.ExitCode != 0 {
			return nil, fmt.Errorf("true exited %d", res.ExitCode)
		}
		out = append(out, msSince(start))
	}
	return out, nil
}

// pooledFork parks o.N VMMs for tag, then times a fork of o.N children
// that all take one, and kills them.
func pooledFork(ctx context.Context, e *sandbox.Engine, tag string, o Options, r *Result) error {
	pctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	if err := e.PrimePool(pctx, tag, o.N); err != nil {
		return err
	}
	fr, err := e.Fork(ctx, sandbox.ForkSpec{Tag: tag, N: o.N, Metadata: map[string]string{"origin": "bench"}})
	if err != nil {
		return err
	}
	var ready []float64
	for _, c := range fr.Children {
		ready = append(ready, c.ReadyMS)
	}
	r.ForkPooledNWallMS, r.ForkPooledReady = fr.WallMS, Summarize(ready)
	for _, c := range fr.Children {
		if err := e.Kill(ctx, c.ID); err != nil {
			return err
		}
	}
	return nil
}

// warmFork forks one child and kills it, so that the measured fork does
// not pay for a cold page cache of the new snapshot.
func warmFork(ctx context.Context, e *sandbox.Engine, spec sandbox.ForkSpec) error {
	fr, err := e.Fork(ctx, spec)
	if err != nil {
		return err
	}
	return e.Kill(ctx, fr.Children[0].ID)
}

// isolatedFork measures a fork of o.N children that each get a network
// namespace and a cgroup (memory, CPU and pids limits), against the plain
// fork measured before.
func isolatedFork(ctx context.Context, e *sandbox.Engine, img *image.Image, o Options, r *Result) error {
	tag := fmt.Sprintf("bench-net-%d", os.Getpid())
	if _, err := e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: tag, Built: img, MemoryMiB: o.MemoryMiB, Network: true}); err != nil {
		return err
	}
	defer func() { cleanupFailed(o, "remove snapshot "+tag, e.RemoveSnapshot(tag)) }()
	spec := sandbox.ForkSpec{Tag: tag, N: o.N, Metadata: map[string]string{"origin": "bench"},
		Limits: &state.Limits{MemoryMiB: int64(o.MemoryMiB) + 256, CPUs: 1, PIDs: 256}}
	if err := warmFork(ctx, e, sandbox.ForkSpec{Tag: tag, N: 1, Limits: spec.Limits}); err != nil {
		return err
	}
	fr, err := e.Fork(ctx, spec)
	if err != nil {
		return err
	}
	kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	defer func() {
		_, err := e.KillAll(kctx, tag)
		cleanupFailed(o, "kill the children of "+tag, err)
	}()
	var ready []float64
	for _, c := range fr.Children {
		ready = append(ready, c.ReadyMS)
	}
	r.ForkIsolatedNWallMS = fr.WallMS
	r.ForkIsolatedReady = Summarize(ready)
	r.IsolationAddedMSPerChild = r.ForkIsolatedReady.P50 - r.ForkReady.P50
	return nil
}

// evalVsExec times numpy.zeros(5).tolist() by eval in the warm
// interpreter and by exec of a fresh python3, in one child.
func evalVsExec(ctx context.Context, e *sandbox.Engine, id string, n int, r *Result) error {
	c, release, err := e.Agent(ctx, id)
	if err != nil {
		return err
	}
	defer release()
	const want = "[0.0, 0.0, 0.0, 0.0, 0.0]"
	var evals, execs []float64
	for i := 0; i < n; i++ {
		start := time.Now()
		res, err := c.Eval(ctx, proto.EvalRequest{Code: "numpy.zeros(5).tolist()"})
		if err != nil {
			return err
		}
		if res.Error != nil || res.Value != want {
			return fmt.Errorf("eval gave %q (%v)", res.Value, res.Error)
		}
		evals = append(evals, msSince(start))
	}
	for i := 0; i < max(3, n/5); i++ {
		var out strings.Builder
		start := time.Now()
		res, err := c.Exec(ctx, agent.ExecRequest{
			Args:   []string{"python3", "-c", "import numpy; print(numpy.zeros(5).tolist())"},
			Stdout: &out,
		})
		if err != nil {
			return err
		}
		if res.ExitCode != 0 || strings.TrimSpace(out.String()) != want {
			return fmt.Errorf("python3 -c gave %q (exit %d)", out.String(), res.ExitCode)
		}
		execs = append(execs, msSince(start))
	}
	r.Eval, r.ExecPython = Summarize(evals), Summarize(execs)
	r.EvalP50MS, r.ExecPythonP50MS = r.Eval.P50, r.ExecPython.P50
	if r.EvalP50MS > 0 {
		r.RatioExecOverEval = r.ExecPythonP50MS / r.EvalP50MS
	}
	return nil
}

// idleCPU samples the CPU time of pids over d and returns the mean per
// process, in percent of one core.
func idleCPU(ctx context.Context, pids []int, d time.Duration) (float64, error) {
	before := make([]int64, len(pids))
	for i, pid := range pids {
		t, err := cpuTicks(pid)
		if err != nil {
			return 0, err
		}
		before[i] = t
	}
	start := time.Now()
	select {
	case <-ctx.Done():
		return 0, ctx.Err()
	case <-time.After(d):
	}
	elapsed := time.Since(start).Seconds()
	var total int64
	for i, pid := range pids {
		t, err := cpuTicks(pid)
		if err != nil {
			return 0, err
		}
		total += t - before[i]
	}
	return float64(total) / clockTicks / elapsed / float64(len(pids)) * 100, nil
}

func timeCommand(ctx context.Context, n int, name string, args ...string) []float64 {
	return timeCommandEnv(ctx, n, nil, name, args...)
}

func timeCommandEnv(ctx context.Context, n int, env []string, name string, args ...string) []float64 {
	var out []float64
	for i := 0; i < n; i++ {
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Env = env
		start := time.Now()
		if err := cmd.Run(); err != nil {
			continue
		}
		out = append(out, msSince(start))
	}
	return out
}

func msSince(t time.Time) float64 { return float64(time.Since(t).Microseconds()) / 1000 }
