package cli

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/internal/bench"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
)

func newBenchCmd(g *globals) *cobra.Command {
	var o bench.Options
	var asJSON, withBranch, branchOnly, withDisk, diskOnly bool
	var diskImage string
	var scale int
	var reclaim time.Duration
	cmd := &cobra.Command{
		Use:   "bench [-n N | --scale N] [--json]",
		Short: "Measure cold boot vs fork, per-child memory and CPU, exec round trips",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cmd.Flags().Changed("idle-reclaim") && !cmd.Flags().Changed("scale") {
				return errdefs.InvalidArgument("--idle-reclaim goes with --scale")
			}
			if cmd.Flags().Changed("scale") {
				return benchScale(cmd, g, bench.ScaleOptions{N: scale, Image: o.Image, MemoryMiB: o.MemoryMiB, IdleFor: o.IdleFor, IdleReclaim: reclaim}, asJSON)
			}
			if err := o.Validate(); err != nil {
				return err
			}
			e, done, err := openBenchEngine(g, "bench", nil)
			if err != nil {
				return err
			}
			defer done()
			o.DataDir = e.Config().DataDir
			o.Progress = g.stderr
			if exe, err := os.Executable(); err == nil {
				o.CLI = exe
			}
			r := &bench.Result{}
			only := branchOnly || diskOnly
			if !only {
				if r, err = bench.Run(cmd.Context(), e, o); err != nil {
					return err
				}
			}
			if withBranch || branchOnly {
				br, err := bench.RunBranch(cmd.Context(), e, bench.BranchOptions{Image: o.Image, Progress: g.stderr})
				if err != nil {
					return err
				}
				r.BranchResult = br
			}
			if withDisk || diskOnly {
				dr, err := bench.RunDisk(cmd.Context(), e, bench.DiskOptions{Image: diskImage, N: o.N, Progress: g.stderr})
				if err != nil {
					return err
				}
				r.DiskResult = dr
			}
			if only {
				r.Machine, r.Image = bench.DescribeRun(cmd.Context(), e.Backend()), o.Image
			}
			if only && asJSON {
				// What the run did not measure is left out, not printed
				// as zeros.
				return writeJSON(g.stdout, struct {
					Machine bench.Machine `json:"machine"`
					Image   string        `json:"image"`
					*bench.BranchResult
					*bench.DiskResult
				}{r.Machine, r.Image, r.BranchResult, r.DiskResult})
			}
			if asJSON {
				return writeJSON(g.stdout, r)
			}
			printBench(g, r)
			return nil
		},
	}
	f := cmd.Flags()
	f.IntVarP(&o.N, "n", "n", 10, fmt.Sprintf("children (and cold boots) at once, 1 to %d", bench.MaxN))
	f.StringVar(&o.Image, "image", "minimal", "image to measure")
	f.IntVar(&o.MemoryMiB, "mem-size-mib", 256, fmt.Sprintf("guest RAM in MiB, %d to %d", sandbox.MinMemoryMiB, sandbox.MaxMemoryMiB))
	f.IntVar(&o.ColdRuns, "cold-runs", 3, fmt.Sprintf("single cold boots to time, 1 to %d", bench.MaxColdRuns))
	f.IntVar(&o.ExecRuns, "exec-runs", 30, fmt.Sprintf("exec round trips to time, 1 to %d", bench.MaxExecRuns))
	f.DurationVar(&o.IdleFor, "idle", 5*time.Second, fmt.Sprintf("how long idle CPU is sampled, %v to %v", bench.MinIdle, bench.MaxIdle))
	f.BoolVar(&asJSON, "json", false, "print one JSON object")
	f.BoolVar(&withBranch, "branch", false, "also measure branching: pause and total per mode, 256 MiB vs 1 GiB, a fork from a chain vs a flat snapshot")
	f.BoolVar(&branchOnly, "branch-only", false, "measure branching only")
	f.BoolVar(&withDisk, "disk", false, "also measure the writable disk: a fork of n with and without --disk-mib, a branch with a 64 MiB dirty disk vs none")
	f.BoolVar(&diskOnly, "disk-only", false, "measure the writable disk only (with --branch-only: both)")
	f.StringVar(&diskImage, "disk-image", "python", "image the disk is measured on (one with a root file system)")
	f.IntVar(&scale, "scale", 0, fmt.Sprintf("instead: fork this many children in one call through a daemon's engine (pool, idle freezing) and measure them all, 1 to %d", bench.MaxScale))
	f.DurationVar(&reclaim, "idle-reclaim", 10*time.Second, "with --scale, last: how long the children stay frozen before the idle watch pages them out (serve --idle-reclaim), then memory and execs again; 0 skips that, or 1s to 10m")
	return cmd
}

func printBench(g *globals, r *bench.Result) {
	m := r.Machine
	if r.N == 0 { // --branch-only, --disk-only
		fmt.Fprintf(g.stdout, "machine: %s, %d cores, %d MiB, %s, kernel %s\n", m.CPUModel, m.Cores, m.MemoryMiB, m.OS, m.Kernel)
		printBranch(g, r)
		printDisk(g, r)
		return
	}
	fmt.Fprintf(g.stdout, "machine: %s, %d cores, %d MiB, %s, kernel %s\n", m.CPUModel, m.Cores, m.MemoryMiB, m.OS, m.Kernel)
	fmt.Fprintf(g.stdout, "backend: %s %s (%s); image %s; n = %d\n\n", m.Backend, m.Version, m.Accelerator, r.Image, r.N)
	tw := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
	row := func(name string, vals ...string) {
		fmt.Fprint(tw, name)
		for _, v := range vals {
			fmt.Fprint(tw, "\t", v)
		}
		fmt.Fprintln(tw, "\t")
	}
	ms := func(v float64) string { return fmt.Sprintf("%.1f ms", v) }
	row("measure", "p50", "p90", "")
	row("cold boot, 1 VM", ms(r.ColdBoot.P50), ms(r.ColdBoot.P90), fmt.Sprintf("%d runs", r.ColdBoot.N))
	row(fmt.Sprintf("cold boot, %d VMs (wall)", r.N), ms(r.ColdBootNWallMS), "", "")
	row("snapshot (boot+save)", ms(r.SnapshotMS), "", "")
	row(fmt.Sprintf("fork, %d children (wall)", r.N), ms(r.ForkNWallMS), "", "")
	row("fork, per-child ready", ms(r.ForkReady.P50), ms(r.ForkReady.P90), "")
	if r.ForkPooledReady.N > 0 {
		row(fmt.Sprintf("fork, %d from parked VMMs (wall)", r.N), ms(r.ForkPooledNWallMS), "", "")
		row("  per-child ready", ms(r.ForkPooledReady.P50), ms(r.ForkPooledReady.P90), "")
	}
	if r.ForkIsolatedReady.N > 0 {
		row(fmt.Sprintf("fork, %d with netns+cgroup (wall)", r.N), ms(r.ForkIsolatedNWallMS), "", "")
		row("  per-child ready", ms(r.ForkIsolatedReady.P50), ms(r.ForkIsolatedReady.P90), fmt.Sprintf("%+.1f ms vs plain", r.IsolationAddedMSPerChild))
	}
	row("private memory per child", fmt.Sprintf("%.1f MiB", r.ChildPrivate.P50), fmt.Sprintf("%.1f MiB", r.ChildPrivate.P90), "")
	row("  of which guest pages", fmt.Sprintf("%.2f MiB", r.ChildGuestPrivate.P50), fmt.Sprintf("%.2f MiB", r.ChildGuestPrivate.P90), "")
	row("idle CPU per child", fmt.Sprintf("%.2f %%", r.IdleCPUPctPerChild), "", "of one core")
	row("exec round trip (session)", ms(r.ExecRoundtrip.P50), ms(r.ExecRoundtrip.P90), "")
	if r.CLIExecP50MS > 0 {
		row("exec round trip (forkd exec)", ms(r.CLIExecP50MS), "", "")
	}
	if r.EvalP50MS > 0 {
		row("eval numpy.zeros(5).tolist()", ms(r.Eval.P50), ms(r.Eval.P90), "warm interpreter")
		row("exec python3 -c (same code)", ms(r.ExecPython.P50), ms(r.ExecPython.P90), fmt.Sprintf("%.0f× slower", r.RatioExecOverEval))
	}
	row("baseline: fork+exec true", ms(r.ProcessForkP50MS), "", "")
	if r.PythonStartP50MS > 0 {
		row("baseline: python3 -c pass", ms(r.PythonStartP50MS), "", "")
	}
	tw.Flush()
	if r.N > 0 {
		fmt.Fprintf(g.stdout, "\ncold boot of %d / fork of %d: %.1f×   cold boot / per-child ready: %.1f×\n",
			r.N, r.N, r.RatioColdNOverFork, r.RatioColdOverReady)
	}
	printBranch(g, r)
	printDisk(g, r)
}

// printBranch prints what --branch measured, if anything.
func printBranch(g *globals, r *bench.Result) {
	b := r.BranchResult
	if b == nil {
		return
	}
	fmt.Fprintf(g.stdout, "\nbranch (%d MiB written before each):\n", b.DirtyMiBWritten)
	for _, m := range []struct {
		name         string
		pause, total bench.Summary
	}{{"full", b.PauseFull, b.TotalFull}, {"diff", b.PauseDiff, b.TotalDiff}, {"live", b.PauseLive, b.TotalLive}} {
		fmt.Fprintf(g.stdout, "  %s: pause p50 %.1f ms, p90 %.1f ms; total p50 %.0f ms\n", m.name, m.pause.P50, m.pause.P90, m.total.P50)
	}
	fmt.Fprintf(g.stdout, "  diff: %.1f MiB dirty, layer %.1f MiB on disk\n", b.DirtyMiB, b.LayerPhysicalMiB)
	fmt.Fprintf(g.stdout, "  diff pause 256 MiB / 1 GiB guest: %.1f / %.1f ms (%.2f×)\n", b.Pause256MiB.P50, b.Pause1GiB.P50, b.RatioPause1GiBOver256)
	fmt.Fprintf(g.stdout, "  fork of 10: flat %.0f ms, from a depth-%d chain %.0f ms (%.2f×); ready p50 %.0f / %.0f ms (%.2f×)\n",
		b.FlatFork10MS, b.ChainDepth, b.Chain5Fork10MS, b.RatioChainOverFlat, b.FlatReady.P50, b.BranchReady.P50, b.RatioBranchReadyOverFlat)
}

func printDisk(g *globals, r *bench.Result) {
	d := r.DiskResult
	if d == nil {
		return
	}
	fmt.Fprintf(g.stdout, "\ndisk (%s, %d MiB disks):\n", d.Image, d.DiskMiB)
	fmt.Fprintf(g.stdout, "  fork of %d: %.0f ms without a disk, %.0f ms with (%.2f×); ready p50 %.0f / %.0f ms\n",
		d.N, d.ForkNWallMS, d.ForkNDiskWallMS, d.RatioForkNDisk, d.Ready.P50, d.ReadyDisk.P50)
	fmt.Fprintf(g.stdout, "  diff branch: pause p50 %.1f ms without a disk, %.1f ms with %d MiB written to it (disk switch %.1f ms)\n",
		d.Pause.P50, d.PauseDisk.P50, d.DirtyMiB, d.DiskSwitch.P50)
	fmt.Fprintf(g.stdout, "  layers: memory %.1f MiB without a disk, %.1f MiB with; disk layer %.1f MiB; total %.0f / %.0f ms\n",
		d.MemLayerMiB, d.MemLayerDisk, d.DiskLayerMiB, d.TotalMS, d.TotalDiskMS)
}

// benchScale runs forkd bench --scale: like the daemon, with its pool and
// its idle watch (idle time 1 s), in a data dir of its own.
func benchScale(cmd *cobra.Command, g *globals, o bench.ScaleOptions, asJSON bool) error {
	if err := o.Validate(); err != nil {
		return err
	}
	e, done, err := openBenchEngine(g, "bench-scale", func(c *sandbox.Config) {
		c.Daemon = true
		c.Pool = min(2*runtime.NumCPU(), maxServePool)
		c.PoolMax = defaultServePoolMax
		c.MaxChildren = max(o.N, sandbox.DefaultMaxChildren)
		c.IdleFreeze = time.Second
	})
	if err != nil {
		return err
	}
	defer done()
	o.Progress = g.stderr
	r, err := bench.RunScale(cmd.Context(), e, o)
	if err != nil {
		return err
	}
	if asJSON {
		return writeJSON(g.stdout, r)
	}
	m := r.Machine
	fmt.Fprintf(g.stdout, "machine: %s, %d cores, %d MiB; %s %s (%s); image %s; network %v; load %.1f → %.1f\n",
		m.CPUModel, m.Cores, m.MemoryMiB, m.Backend, m.Version, m.Accelerator, r.Image, r.Network, r.Load1Before, r.Load1After)
	fmt.Fprintf(g.stdout, "first fork of %d in one call (pool %d): %.1f s wall, ready p50 %.0f ms p90 %.0f ms, %d failed\n",
		r.N, r.PoolFirst, r.FirstForkWallMS/1000, r.FirstForkReady.P50, r.FirstForkReady.P90, r.FirstForkFailed)
	fmt.Fprintf(g.stdout, "fork of %d again (pool refilled to %d in %.1f s): %.1f s wall, ready p50 %.0f ms p90 %.0f ms, %d failed\n",
		r.N, r.Pool, r.PoolRefillMS/1000, r.ForkWallMS/1000, r.ForkReady.P50, r.ForkReady.P90, r.ForkFailed)
	fmt.Fprintf(g.stdout, "idle CPU of all: %.2f cores (%.0f wake-ups/s per child); frozen (%d): %.3f cores (%.1f wake-ups/s per child)\n",
		r.IdleCPUCores, r.IdleWakeupsPerSecPerChild, r.Frozen, r.FrozenCPUCores, r.FrozenWakeupsPerSecChild)
	fmt.Fprintf(g.stdout, "private memory per child: p50 %.1f MiB, p90 %.1f MiB\n", r.ChildPrivateMiB.P50, r.ChildPrivateMiB.P90)
	fmt.Fprintf(g.stdout, "exec over all while the pool refills, each woken: p50 %.0f ms, p90 %.0f ms, p99 %.0f ms, %d failed in all (mean wake %.0f ms)\n",
		r.ExecRoundtrip.P50, r.ExecRoundtrip.P90, r.ExecRoundtrip.P99, r.ExecFailed, r.MeanWakeMS)
	fmt.Fprintf(g.stdout, "exec again, awake: p50 %.0f ms, p90 %.0f ms, p99 %.0f ms\n", r.ExecAwake.P50, r.ExecAwake.P90, r.ExecAwake.P99)
	if r.PoolFullRefillMS > 0 {
		fmt.Fprintf(g.stdout, "exec over all once the pool is full (%.0f s after the fork), each woken: p50 %.0f ms, p90 %.0f ms, p99 %.0f ms (mean wake %.0f ms); awake: p50 %.0f ms\n",
			r.PoolFullRefillMS/1000, r.ExecRoundtripSteady.P50, r.ExecRoundtripSteady.P90, r.ExecRoundtripSteady.P99, r.MeanWakeSteadyMS, r.ExecAwakeSteady.P50)
	}
	if m := r.ReclaimedMemory; m != nil {
		fmt.Fprintf(g.stdout, "paged out (%d, in %.0f s): resident p50 %.1f MiB, swap p50 %.1f MiB; host per child %.1f MiB (%.1f compacted; zram holds %.2f of what it stores)\n",
			r.Reclaimed, r.AllReclaimedMS/1000, m.PrivateMiB.P50, m.SwapMiB.P50, m.HostMiB, m.HostCompactedMiB, m.ZramCompactedPerOrig)
		fmt.Fprintf(g.stdout, "exec over all, each woken from paged out: p50 %.0f ms, p90 %.0f ms, p99 %.0f ms (mean wake %.0f ms; %d read back a sibling's %.1f MiB in %.0f ms, %d its code by block); awake: p50 %.0f ms\n",
			r.ExecReclaimed.P50, r.ExecReclaimed.P90, r.ExecReclaimed.P99, r.MeanWakeReclaimedMS, r.SiblingPageIns, r.SiblingPageInMiB, r.SiblingPageInMS, r.SiblingCodePageIns, r.ExecAwakeReclaimed.P50)
	}
	afterExec := func(m *bench.ChildMemory) {
		fmt.Fprintf(g.stdout, "after that exec: resident p50 %.1f MiB p90 %.1f MiB, swap p50 %.1f MiB; host per child %.1f MiB (%.1f compacted)\n",
			m.PrivateMiB.P50, m.PrivateMiB.P90, m.SwapMiB.P50, m.HostMiB, m.HostCompactedMiB)
	}
	if m := r.AfterWakeMemory; m != nil {
		afterExec(m)
	}
	if m := r.AfterReclaimMemory; m != nil {
		fmt.Fprintf(g.stdout, "exec over all, each woken from frozen again (not paged out again): p50 %.0f ms, p90 %.0f ms, p99 %.0f ms (mean wake %.0f ms); awake: p50 %.0f ms\n",
			r.ExecAfterReclaim.P50, r.ExecAfterReclaim.P90, r.ExecAfterReclaim.P99, r.MeanWakeAfterReclaimMS, r.ExecAwakeAfterReclaim.P50)
		afterExec(m)
	}
	if m := r.ReclaimedAgainMemory; m != nil {
		fmt.Fprintf(g.stdout, "paged out again (%d, in %.0f s): resident p50 %.1f MiB, swap p50 %.1f MiB; host per child %.1f MiB (%.1f compacted)\n",
			r.ReclaimedAgain, r.AllReclaimedAgainMS/1000, m.PrivateMiB.P50, m.SwapMiB.P50, m.HostMiB, m.HostCompactedMiB)
		fmt.Fprintf(g.stdout, "exec over all, each woken from its second page-out: p50 %.0f ms, p90 %.0f ms, p99 %.0f ms (mean wake %.0f ms; %d read back %.1f MiB in %.0f ms); awake: p50 %.0f ms\n",
			r.ExecReclaimedAgain.P50, r.ExecReclaimedAgain.P90, r.ExecReclaimedAgain.P99, r.MeanWakeReclaimedAgainMS, r.PageIns, r.PageInMiB, r.PageInMS, r.ExecAwakeReclaimedAgain.P50)
	}
	if m := r.AfterWakeAgainMemory; m != nil {
		afterExec(m)
	}
	if t := r.ReclaimedThird; t != nil && t.Memory != nil {
		fmt.Fprintf(g.stdout, "paged out a third time (%d, in %.0f s): resident p50 %.1f MiB, swap p50 %.1f MiB; host per child %.1f MiB (%.1f compacted)\n",
			t.Reclaimed, t.AllReclaimedMS/1000, t.Memory.PrivateMiB.P50, t.Memory.SwapMiB.P50, t.Memory.HostMiB, t.Memory.HostCompactedMiB)
		fmt.Fprintf(g.stdout, "exec over all, each woken from its third page-out: p50 %.0f ms, p90 %.0f ms, p99 %.0f ms (mean wake %.0f ms; %d read back %.1f MiB in %.0f ms, %d learning afresh); awake: p50 %.0f ms\n",
			t.Exec.P50, t.Exec.P90, t.Exec.P99, t.MeanWakeMS, t.PageIns, t.PageInMiB, t.PageInMS, t.Relearned, t.ExecAwake.P50)
		if t.AfterWakeMemory != nil {
			afterExec(t.AfterWakeMemory)
		}
	}
	if r.TrafficWoken.N > 0 || r.TrafficFailed > 0 {
		fmt.Fprintf(g.stdout, "GET from a server in each child, woken from frozen by its packets: p50 %.0f ms, p90 %.0f ms, p99 %.0f ms, %d failed; awake: p50 %.0f ms\n",
			r.TrafficWoken.P50, r.TrafficWoken.P90, r.TrafficWoken.P99, r.TrafficFailed, r.TrafficAwake.P50)
		fmt.Fprintf(g.stdout, "GET from every child at once, each woken from frozen: p50 %.0f ms, p90 %.0f ms, p99 %.0f ms, %d failed; the last answered after %.0f ms\n",
			r.TrafficBurst.P50, r.TrafficBurst.P90, r.TrafficBurst.P99, r.TrafficBurstFailed, r.TrafficBurstWallMS)
	}
	if r.ChildrenLost > 0 {
		fmt.Fprintf(g.stdout, "children whose VMM went away during the run (not sampled after): %d\n", r.ChildrenLost)
	}
	fmt.Fprintf(g.stdout, "kill all: %.1f s\n", r.KillAllMS/1000)
	return nil
}

// openBenchEngine opens an engine on a data dir of its own, sub below the
// user's (sharing the image cache), so that a benchmark never meets the
// user's sandboxes nor a daemon holding the main state. done closes it and
// removes the dir.
func openBenchEngine(g *globals, sub string, tune func(*sandbox.Config)) (e *sandbox.Engine, done func(), err error) {
	dir, err := g.resolveDataDir()
	if err != nil {
		return nil, nil, err
	}
	bg := *g
	bg.dataDir = filepath.Join(dir, sub)
	e, err = bg.openEngine(func(c *sandbox.Config) {
		if c.CacheDir == "" {
			c.CacheDir = filepath.Join(dir, "cache")
		}
		if tune != nil {
			tune(c)
		}
	})
	if err != nil {
		return nil, nil, err
	}
	return e, func() {
		e.Close()
		os.RemoveAll(bg.dataDir)
	}, nil
}
