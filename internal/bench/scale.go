package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image"
	"github.com/forkd/forkd/internal/sandbox"
)

// ScaleOptions configure RunScale.
type ScaleOptions struct {
	N         int
	Image     string
	MemoryMiB int
	IdleFor   time.Duration // how long idle CPU is sampled, each time
	// IdleReclaim is how long a child stays frozen before the idle watch
	// pages it out; 0 skips the reclaim phase.
	IdleReclaim time.Duration
	Progress    io.Writer
}

// MaxScale is the most children RunScale forks.
const MaxScale = 1000

// Validate checks o's fields.
func (o *ScaleOptions) Validate() error {
	if o.N < 1 || o.N > MaxScale {
		return errdefs.InvalidArgument("--scale %d: want 1 to %d", o.N, MaxScale)
	}
	if o.MemoryMiB < sandbox.MinMemoryMiB || o.MemoryMiB > sandbox.MaxMemoryMiB {
		return errdefs.InvalidArgument("--mem-size-mib %d: want %d to %d", o.MemoryMiB, sandbox.MinMemoryMiB, sandbox.MaxMemoryMiB)
	}
	if o.IdleFor < MinIdle || o.IdleFor > MaxIdle {
		return errdefs.InvalidArgument("--idle %v: want %v to %v", o.IdleFor, MinIdle, MaxIdle)
	}
	if err := image.ValidateName(o.Image); err != nil {
		return fmt.Errorf("--image: %w", err)
	}
	if o.IdleReclaim != 0 && (o.IdleReclaim < time.Second || o.IdleReclaim > 10*time.Minute) {
		return errdefs.InvalidArgument("--idle-reclaim %v: want 0 (no reclaim phase) or 1s to 10m", o.IdleReclaim)
	}
	return nil
}

// ScaleResult is the JSON `forkd bench --scale N --json` prints. Keys only
// get added.
type ScaleResult struct {
	Machine Machine `json:"machine"`
	N       int     `json:"n"`
	Image   string  `json:"image"`
	// Network: every child in its own network namespace (as root).
	Network bool `json:"network"`
	// Pool is how many VMMs waited in the snapshot's pool, restored and
	// stopped, at the measured fork: the daemon's pool follows its
	// largest recent fork, so it is measured as the daemon's second fork
	// of N. PoolFirst is how many waited at the first fork of N (the
	// pool's base size), whose wall and ready times are First*.
	Pool      int `json:"pool"`
	PoolFirst int `json:"pool_first"`
	// Load1Before and Load1After are the host's 1-minute load average
	// before the fork and before the kill (other work on the host shows
	// here).
	Load1Before float64 `json:"load1_before"`
	Load1After  float64 `json:"load1_after"`

	FirstForkWallMS float64 `json:"first_fork_wall_ms"`
	FirstForkReady  Summary `json:"first_fork_ready_ms"`
	FirstForkFailed int     `json:"first_fork_failed"`
	// PoolRefillMS is how long the pool took to refill for the second
	// fork, after the first fork's children were killed.
	PoolRefillMS float64 `json:"pool_refill_ms"`

	ForkWallMS float64 `json:"fork_wall_ms"`
	ForkReady  Summary `json:"fork_ready_ms"`
	ForkFailed int     `json:"fork_failed"`
	// ForkErrors says why the first children that failed did.
	ForkErrors []string `json:"fork_errors,omitempty"`
	// ChildrenLost counts the children whose VMM went away during the
	// run (the host's OOM killer, a crash): sampled no more after, their
	// execs counted as failed.
	ChildrenLost int `json:"children_lost"`

	// Idle CPU of all children together, in cores, without freezing and
	// once the idle watch froze them all; wake-ups are the children's VMM
	// threads' context switches a second, per child.
	IdleCPUCores              float64 `json:"idle_cpu_cores"`
	IdleWakeupsPerSecPerChild float64 `json:"idle_wakeups_per_sec_per_child"`
	FrozenCPUCores            float64 `json:"frozen_idle_cpu_cores"`
	FrozenWakeupsPerSecChild  float64 `json:"frozen_wakeups_per_sec_per_child"`
	// AllFrozenMS is how long after the idle watch started every child
	// was frozen (idle time 1 s).
	AllFrozenMS float64 `json:"all_frozen_ms"`
	Frozen      int     `json:"frozen"`
	// FrozenWatched is how many of them had their inbound traffic
	// watched by a packet socket (the rest: their counters polled).
	FrozenWatched int `json:"frozen_watched"`

	ChildPrivateMiB Summary `json:"child_private_mib"`

	// Exec of `true` in every child in turn, each frozen before (its
	// wake included), through the daemon's engine.
	// ExecFailed counts the execs that failed, in every round here and
	// below, first or second.
	ExecRoundtrip Summary `json:"exec_roundtrip_ms"`
	ExecFailed    int     `json:"exec_failed"`
	MeanWakeMS    float64 `json:"mean_wake_ms"`
	// ExecAwake is a second exec in each child right after the first:
	// the round trip of a child that is awake.
	ExecAwake Summary `json:"exec_awake_ms"`
	// The execs above run while the pool refills behind the measured
	// fork (restores in SCHED_IDLE, on the CPU the execs leave). The
	// same execs again once it has refilled, in PoolFullRefillMS after
	// the fork, and every child is frozen again: the daemon's steady
	// state. Zero when the pool did not refill.
	PoolFullRefillMS float64 `json:"pool_full_refill_ms,omitempty"`
	// FrozenDaemonCPUCores is the CPU this process (the daemon's engine:
	// its idle watch looks at every child ten times a second) used over
	// the idle time then, before those execs, in cores.
	FrozenDaemonCPUCores float64 `json:"frozen_daemon_cpu_cores"`
	ExecRoundtripSteady  Summary `json:"exec_roundtrip_steady_ms"`
	ExecAwakeSteady      Summary `json:"exec_awake_steady_ms"`
	MeanWakeSteadyMS     float64 `json:"mean_wake_steady_ms,omitempty"`

	// The reclaim phase (once the steady execs are done, with
	// --idle-reclaim): every child frozen again and left until the idle
	// watch paged its VMM out (AllReclaimedMS after the page-outs were
	// turned on, or until none was for half a minute); Reclaimed
	// children were. Memory is measured then (Reclaimed*), and
	// again right after an exec in each, woken from paged out
	// (ExecReclaimed, ExecAwakeReclaimed): the pages that exec touched
	// are back, the rest stay out (AfterWake*). The first child to wake
	// faults on demand and is noted for its siblings, whose wakes read
	// those pages of theirs back while their guests run: SiblingPageIns
	// wakes did, reading SiblingPageInMiB in SiblingPageInMS each
	// (means); SiblingCodePageIns of them found the sibling's
	// translated code by block in their own code buffers.
	AllReclaimedMS      float64      `json:"all_reclaimed_ms,omitempty"`
	Reclaimed           int          `json:"reclaimed"`
	ReclaimedMemory     *ChildMemory `json:"reclaimed_memory,omitempty"`
	ExecReclaimed       Summary      `json:"exec_reclaimed_ms"`
	ExecAwakeReclaimed  Summary      `json:"exec_awake_reclaimed_ms"`
	MeanWakeReclaimedMS float64      `json:"mean_wake_reclaimed_ms,omitempty"`
	SiblingPageIns      int64        `json:"sibling_page_ins"`
	SiblingPageInMiB    float64      `json:"sibling_page_in_mib,omitempty"`
	SiblingPageInMS     float64      `json:"sibling_page_in_ms,omitempty"`
	SiblingCodePageIns  int64        `json:"sibling_code_page_ins"`
	AfterWakeMemory     *ChildMemory `json:"after_wake_memory,omitempty"`
	// Then, every child frozen again (not paged out again), an exec in
	// each, and the memory after it: the state of a child the daemon
	// paged out once and that was woken more often than IdleReclaim since.
	ExecAfterReclaim       Summary      `json:"exec_after_reclaim_ms"`
	ExecAwakeAfterReclaim  Summary      `json:"exec_awake_after_reclaim_ms"`
	MeanWakeAfterReclaimMS float64      `json:"mean_wake_after_reclaim_ms,omitempty"`
	AfterReclaimMemory     *ChildMemory `json:"after_reclaim_memory,omitempty"`
	// Then the reclaim phase once more: every child paged out a second
	// time (ReclaimedAgain of them), an exec in each, and the memory
	// after it. At this page-out the idle watch notes what the wakes
	// since the first one brought back, and the wake reads it back
	// while its guest runs: PageIns wakes did, reading PageInMiB in
	// PageInMS each (means).
	AllReclaimedAgainMS      float64      `json:"all_reclaimed_again_ms,omitempty"`
	ReclaimedAgain           int          `json:"reclaimed_again"`
	ReclaimedAgainMemory     *ChildMemory `json:"reclaimed_again_memory,omitempty"`
	ExecReclaimedAgain       Summary      `json:"exec_reclaimed_again_ms"`
	ExecAwakeReclaimedAgain  Summary      `json:"exec_awake_reclaimed_again_ms"`
	MeanWakeReclaimedAgainMS float64      `json:"mean_wake_reclaimed_again_ms,omitempty"`
	PageIns                  int64        `json:"page_ins"`
	PageInMiB                float64      `json:"page_in_mib,omitempty"`
	PageInMS                 float64      `json:"page_in_ms,omitempty"`
	AfterWakeAgainMemory     *ChildMemory `json:"after_wake_again_memory,omitempty"`
	// Then a third time (nil if nothing was paged out): the idle watch
	// keeps what it learned unless a child's resident set outgrew it by
	// more than a quarter, and then learns afresh from a wake that reads
	// nothing back (ReclaimRound.Relearned).
	ReclaimedThird *ReclaimRound `json:"reclaimed_third,omitempty"`

	// The traffic phase, last (with Network and freezing): an HTTP server
	// started in each child (busybox httpd on TrafficPort) and a first GET
	// of its page, awake; every child frozen again, then a GET of the
	// child's page from the host, at the child's address, in each child in
	// turn: the packets alone wake it (TrafficWoken, the whole GET;
	// TrafficWakes is how many wakes the idle watch started for traffic in
	// the phase). TrafficAwake is a second GET right after. TrafficFailed
	// counts the children whose server did not start or one of whose GETs
	// failed.
	TrafficWoken  Summary `json:"traffic_woken_ms"`
	TrafficAwake  Summary `json:"traffic_awake_ms"`
	TrafficWakes  int64   `json:"traffic_wakes"`
	TrafficFailed int     `json:"traffic_failed"`
	// Then every child frozen again and a GET to each at once:
	// TrafficBurst is each GET's time, TrafficBurstWallMS the time until
	// the last answered, TrafficBurstFailed how many GETs failed.
	TrafficBurst       Summary `json:"traffic_burst_ms"`
	TrafficBurstWallMS float64 `json:"traffic_burst_wall_ms"`
	TrafficBurstFailed int     `json:"traffic_burst_failed"`

	KillAllMS float64 `json:"kill_all_ms"`
}

// ReclaimRound is one reclaim phase after the first: every child paged
// out (Reclaimed of them, in AllReclaimedMS) and its memory then, an exec
// in each, woken from paged out, and the memory after it. PageIns of
// those wakes read back what the wake before them touched, PageInMiB in
// PageInMS each (means); Relearned children were paged out and their
// wakes read nothing back: the idle watch was learning their working set
// afresh.
type ReclaimRound struct {
	AllReclaimedMS  float64      `json:"all_reclaimed_ms"`
	Reclaimed       int          `json:"reclaimed"`
	Memory          *ChildMemory `json:"memory,omitempty"`
	Exec            Summary      `json:"exec_ms"`
	ExecAwake       Summary      `json:"exec_awake_ms"`
	MeanWakeMS      float64      `json:"mean_wake_ms,omitempty"`
	PageIns         int64        `json:"page_ins"`
	PageInMiB       float64      `json:"page_in_mib,omitempty"`
	PageInMS        float64      `json:"page_in_ms,omitempty"`
	Relearned       int          `json:"relearned"`
	AfterWakeMemory *ChildMemory `json:"after_wake_memory,omitempty"`
}

// ChildMemory is what the children's VMMs hold, per child.
type ChildMemory struct {
	// PrivateMiB is resident private memory (as ChildPrivateMiB);
	// SwapMiB what is in swap.
	PrivateMiB Summary `json:"private_mib"`
	SwapMiB    Summary `json:"swap_mib"`
	// ZramUsedPerOrig is the RAM zram holds per byte stored in it, over
	// all its devices (0: no zram in use); HostMiB is the mean resident
	// private memory plus the swap's share of that RAM, per child: what
	// each costs the host. HostCompactedMiB is the same once zram has
	// compacted its pools (as it does under memory pressure).
	ZramUsedPerOrig      float64 `json:"zram_used_per_orig"`
	HostMiB              float64 `json:"host_mib"`
	ZramCompactedPerOrig float64 `json:"zram_compacted_used_per_orig"`
	HostCompactedMiB     float64 `json:"host_compacted_mib"`
}

// RunScale forks o.N children of a new snapshot in one call with e, which
// must be a daemon's engine (Config.Daemon, IdleFreeze 1 s, its idle
// watch not running) so that freezing and the pool are measured too. It
// kills what it started and removes its snapshot, also on failure.
func RunScale(ctx context.Context, e *sandbox.Engine, o ScaleOptions) (*ScaleResult, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	say := progress(o.Progress)
	cfg := e.Config()
	r := &ScaleResult{Machine: DescribeRun(ctx, e.Backend()), N: o.N, Image: o.Image,
		Network: cfg.Net != nil && cfg.Cgroups != nil}

	img, err := e.Images().Build(ctx, o.Image)
	if err != nil {
		return nil, err
	}
	tag := fmt.Sprintf("bench-scale-%d", os.Getpid())
	say("snapshot %s", tag)
	snap, err := e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: tag, Built: img, MemoryMiB: o.MemoryMiB, Network: r.Network})
	if err != nil {
		return nil, err
	}
	defer func() { cleanupFailed(Options{Progress: o.Progress}, "remove snapshot "+tag, e.RemoveSnapshot(tag)) }()
	// The first fork of N finds a warm page cache and the pool at its
	// base size, as a daemon's first large fork of a snapshot does.
	if err := warmFork(ctx, e, sandbox.ForkSpec{Tag: tag, N: 1}); err != nil {
		return nil, err
	}
	r.PoolFirst = waitPool(ctx, e, tag, cfg.Pool, time.Minute)
	say("first fork of %d in one call, pool %d (load %.1f)", o.N, r.PoolFirst, load1())
	if err := firstFork(ctx, e, tag, o.N, r); err != nil {
		return nil, err
	}
	// The measured fork finds the pool refilled for the demand the first
	// fork showed, as the daemon's next fork of N does.
	start := time.Now()
	want := min(o.N, max(cfg.PoolMax, cfg.Pool))
	say("refill the pool to %d", want)
	r.Pool = waitPool(ctx, e, tag, want, refillTime(want))
	r.PoolRefillMS = msSince(start)

	r.Load1Before = load1()
	say("fork %d in one call (load %.1f)", o.N, r.Load1Before)
	forked := time.Now()
	fr, err := e.Fork(ctx, sandbox.ForkSpec{Tag: tag, N: o.N, KeepPartial: true, Metadata: map[string]string{"origin": "bench"}})
	defer func() {
		start := time.Now()
		err := killAll(ctx, e, tag)
		cleanupFailed(Options{Progress: o.Progress}, "kill the children of "+tag, err)
		if r.KillAllMS == 0 {
			r.KillAllMS = msSince(start)
		}
	}()
	if err != nil && fr == nil {
		return nil, err
	}
	// The pool refills behind the fork while the steps below run: timed
	// when it is full, not when a step next looks.
	var fullMS float64 // after the fork; 0: not refilled
	full := make(chan struct{})
	rctx, stopRefill := context.WithCancel(ctx)
	go func() {
		defer close(full)
		if waitPool(rctx, e, tag, want, refillTime(want)) >= want {
			fullMS = msSince(forked)
		}
	}()
	defer func() { stopRefill(); <-full }()
	refilled := func() bool {
		<-full
		r.PoolFullRefillMS = fullMS
		return fullMS > 0
	}
	r.ForkWallMS = fr.WallMS
	var ready []float64
	var ids, addrs []string
	var pids []int
	for _, c := range fr.Children {
		if c.Err != nil {
			if r.ForkFailed++; r.ForkFailed <= 5 {
				r.ForkErrors = append(r.ForkErrors, c.ID+": "+c.Err.Error())
			}
			continue
		}
		ready = append(ready, c.ReadyMS)
		ids = append(ids, c.ID)
		pids = append(pids, c.Sandbox.Handle.Process.PID)
		addr := ""
		if c.Sandbox.Net != nil {
			addr = c.Sandbox.Net.Address
		}
		addrs = append(addrs, addr)
	}
	r.ForkReady = Summarize(ready)
	if len(ids) == 0 {
		return nil, fmt.Errorf("no child came up: %w", err)
	}

	say("idle CPU of %d children over %s, not frozen", len(ids), o.IdleFor)
	time.Sleep(2 * time.Second)
	live, err := living(pids, &r.ChildrenLost)
	if err != nil {
		return nil, err
	}
	if r.IdleCPUCores, r.IdleWakeupsPerSecPerChild, err = idleCost(ctx, live, o.IdleFor); err != nil {
		return nil, err
	}
	var priv []float64
	for _, pid := range live {
		t, _, err := smapsPrivate(pid, snap.MemoryPath())
		if err != nil {
			return nil, err
		}
		priv = append(priv, float64(t)/1024)
	}
	r.ChildPrivateMiB = Summarize(priv)

	if err := scaleFrozen(ctx, e, ids, addrs, pids, o, r, refilled, say); err != nil {
		return nil, err
	}
	r.Load1After = load1()
	say("kill all (load %.1f)", r.Load1After)
	start = time.Now()
	if err := killAll(ctx, e, tag); err != nil {
		return nil, err
	}
	r.KillAllMS = msSince(start)
	return r, nil
}

// waitPool waits up to d until tag's pool holds want VMMs, or stops
// growing for half a minute (a park failed, or the host's memory is low),
// or ctx ends, and returns how many it holds.
func waitPool(ctx context.Context, e *sandbox.Engine, tag string, want int, d time.Duration) int {
	n, grew := 0, time.Now()
	for start := time.Now(); time.Since(start) < d && time.Since(grew) < 30*time.Second; {
		parked, _ := e.PoolStats()
		if parked[tag] >= want {
			return parked[tag]
		}
		if parked[tag] > n {
			n, grew = parked[tag], time.Now()
		}
		if !pause(ctx) {
			break
		}
	}
	parked, _ := e.PoolStats()
	return parked[tag]
}

// refillTime bounds how long a pool may take to refill n entries.
func refillTime(n int) time.Duration { return time.Minute + time.Duration(n)*3*time.Second }

// firstFork forks n children of tag in one call into r's First* fields,
// then kills them.
func firstFork(ctx context.Context, e *sandbox.Engine, tag string, n int, r *ScaleResult) error {
	fr, err := e.Fork(ctx, sandbox.ForkSpec{Tag: tag, N: n, KeepPartial: true, Metadata: map[string]string{"origin": "bench"}})
	if fr != nil {
		r.FirstForkWallMS = fr.WallMS
		var ready []float64
		for _, c := range fr.Children {
			if c.Err != nil {
				r.FirstForkFailed++
				continue
			}
			ready = append(ready, c.ReadyMS)
		}
		r.FirstForkReady = Summarize(ready)
	}
	kerr := killAll(ctx, e, tag)
	if fr == nil {
		return errors.Join(err, kerr)
	}
	return kerr
}

// killAll kills the children of tag, within ten minutes even once ctx
// has ended.
func killAll(ctx context.Context, e *sandbox.Engine, tag string) error {
	kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Minute)
	defer cancel()
	_, err := e.KillAll(kctx, tag)
	return err
}

// scaleFrozen runs the engine's idle watch, measures the children once
// all are frozen, then times an exec in each (waking it); then, once
// refilled reports the pool full again, waits until all are frozen again
// and times those execs again; then the reclaim phase, and with a network
// the traffic phase (addrs are the children's addresses, as ids).
func scaleFrozen(ctx context.Context, e *sandbox.Engine, ids, addrs []string, pids []int, o ScaleOptions, r *ScaleResult, refilled func() bool, say func(string, ...any)) error {
	if e.Config().IdleFreeze <= 0 {
		return nil
	}
	ictx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); e.RunIdle(ictx) }()
	defer func() { stop(); <-done }()
	say("waiting for the idle watch to freeze them")
	r.AllFrozenMS = waitFrozen(ctx, e, len(ids)-r.ChildrenLost, say)
	st := e.FreezeStats()
	r.Frozen, r.FrozenWatched = st.Frozen, st.Watched
	if r.Frozen == 0 {
		say("nothing was frozen: this host has no cgroup freezer forkd can use")
		return nil
	}
	var err error
	say("idle CPU of %d frozen children over %s", r.Frozen, o.IdleFor)
	live, err := living(pids, &r.ChildrenLost)
	if err != nil {
		return err
	}
	if r.FrozenCPUCores, r.FrozenWakeupsPerSecChild, err = idleCost(ctx, live, o.IdleFor); err != nil {
		return err
	}
	say("exec in each child, woken from frozen, while the pool refills")
	r.ExecRoundtrip, r.ExecAwake, r.MeanWakeMS, r.ExecFailed = execEach(ctx, e, ids, say)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	say("waiting for the pool to refill")
	if refilled() {
		waitFrozen(ctx, e, len(ids)-r.ChildrenLost, say)
		say("CPU of the daemon over %s, every child frozen and the pool full", o.IdleFor)
		pct, err := idleCPU(ctx, []int{os.Getpid()}, o.IdleFor)
		if err != nil {
			return err
		}
		r.FrozenDaemonCPUCores = pct / 100
		say("exec in each child again, woken from frozen, the pool full (refilled %.0f s after the fork)", r.PoolFullRefillMS/1000)
		var failed int
		r.ExecRoundtripSteady, r.ExecAwakeSteady, r.MeanWakeSteadyMS, failed = execEach(ctx, e, ids, say)
		r.ExecFailed += failed
	} else {
		// With many children alive the host's memory can stop the
		// refill (the pool keeps some free): page-outs still measure.
		say("the pool did not refill: no steady-state execs")
	}
	if err := scaleReclaimed(ctx, e, ids, pids, o.IdleReclaim, r, say); err != nil {
		return err
	}
	if r.Network && ctx.Err() == nil {
		scaleTraffic(ctx, e, ids, addrs, r, say)
	}
	// A step that ctx ended measured only part of the children.
	return ctx.Err()
}

// waitFrozen waits up to two minutes, or until ctx ends, for the idle
// watch to show n sandboxes frozen, says so when fewer are, and returns
// how long it waited, in ms.
func waitFrozen(ctx context.Context, e *sandbox.Engine, n int, say func(string, ...any)) float64 {
	start := time.Now()
	for e.FreezeStats().Frozen < n && time.Since(start) < 2*time.Minute && pause(ctx) {
	}
	if f := e.FreezeStats().Frozen; f < n && ctx.Err() == nil {
		say("only %d of %d children froze: the next requests find the others awake", f, n)
	}
	return msSince(start)
}

// pause sleeps a tenth of a second and reports whether ctx is still on.
func pause(ctx context.Context) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(100 * time.Millisecond):
		return true
	}
}

// execEach times an exec of `true` in each of ids in turn (waking it when
// frozen), then a second one (awake), and returns both, the mean wake
// and how many execs failed, first or second. It stops once ctx ends.
func execEach(ctx context.Context, e *sandbox.Engine, ids []string, say func(string, ...any)) (woken, awake Summary, meanWakeMS float64, failed int) {
	before := e.FreezeStats()
	var rts, again []float64
	for _, id := range ids {
		if ctx.Err() != nil {
			break
		}
		start := time.Now()
		if err := execTrue(ctx, e, id); err != nil {
			failed++
			say("exec in %s: %v", id, err)
			continue
		}
		rts = append(rts, msSince(start))
		start = time.Now()
		if err := execTrue(ctx, e, id); err != nil {
			failed++
			say("second exec in %s: %v", id, err)
			continue
		}
		again = append(again, msSince(start))
	}
	if after := e.FreezeStats(); after.Wakes > before.Wakes {
		meanWakeMS = 1000 * (after.WakeSeconds - before.WakeSeconds) / float64(after.Wakes-before.Wakes)
	}
	return Summarize(rts), Summarize(again), meanWakeMS, failed
}

// execTrue runs `true` in sandbox id.
func execTrue(ctx context.Context, e *sandbox.Engine, id string) error {
	return withAgent(ctx, e, id, func(ctx context.Context, c *agent.Client) error {
		res, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"true"}})
		if err == nil && res.ExitCode != 0 {
			err = fmt.Errorf("true exited %d", res.ExitCode)
		}
		return err
	})
}

// withAgent calls f with sandbox id's agent client (waking it when
// frozen), both bounded by a minute.
func withAgent(ctx context.Context, e *sandbox.Engine, id string, f func(context.Context, *agent.Client) error) error {
	xctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	c, release, err := e.Agent(xctx, id)
	if err != nil {
		return err
	}
	defer release()
	return f(xctx, c)
}

// living returns those of pids whose process still runs, and counts the
// others in lost (the most so far): a run measures the children it has
// left. None left is an error.
func living(pids []int, lost *int) ([]int, error) {
	var live []int
	for _, pid := range pids {
		if _, err := os.Stat(filepath.Join("/proc", strconv.Itoa(pid))); err == nil {
			live = append(live, pid)
		}
	}
	*lost = max(*lost, len(pids)-len(live))
	if len(live) == 0 {
		return nil, fmt.Errorf("all %d children's VMMs went away", len(pids))
	}
	return live, nil
}

// idleCost samples pids over d: their CPU in cores all together, and their
// threads' context switches a second per process.
func idleCost(ctx context.Context, pids []int, d time.Duration) (cores, switches float64, err error) {
	sw0, err := ctxSwitches(pids)
	if err != nil {
		return 0, 0, err
	}
	start := time.Now()
	pct, err := idleCPU(ctx, pids, d)
	if err != nil {
		return 0, 0, err
	}
	elapsed := time.Since(start).Seconds()
	sw1, err := ctxSwitches(pids)
	if err != nil {
		return 0, 0, err
	}
	return pct * float64(len(pids)) / 100, float64(sw1-sw0) / elapsed / float64(len(pids)), nil
}

// ctxSwitches sums the voluntary and involuntary context switches of every
// thread of pids: each is a wake-up of that thread.
func ctxSwitches(pids []int) (int64, error) {
	var n int64
	for _, pid := range pids {
		tasks, err := os.ReadDir(filepath.Join("/proc", strconv.Itoa(pid), "task"))
		if err != nil {
			return 0, err
		}
		for _, t := range tasks {
			b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "task", t.Name(), "status"))
			if errors.Is(err, os.ErrNotExist) {
				continue // the thread ended
			}
			if err != nil {
				return 0, err
			}
			for _, line := range strings.Split(string(b), "\n") {
				k, v, ok := strings.Cut(line, ":")
				if ok && (k == "voluntary_ctxt_switches" || k == "nonvoluntary_ctxt_switches") {
					x, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
					n += x
				}
			}
		}
	}
	return n, nil
}

// load1 is the host's 1-minute load average (0 when unknown).
func load1() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}
