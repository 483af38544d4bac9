package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/memimage"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
)

// BranchOptions configure RunBranch.
type BranchOptions struct {
	Image string
	// Rounds is how many branches each mode is timed over.
	Rounds int
	// DirtyMiB is what the source writes in its guest before each branch.
	DirtyMiB int
	// ChainDepth is the depth of the chain a fork of 10 is timed from.
	ChainDepth int
	Progress   io.Writer
}

// BranchResult is what `forkd bench --branch --json` adds, measured in one
// run. Pauses are how long the source was stopped; a mode's totals
// include materialising the memory its children map.
type BranchResult struct {
	DirtyMiBWritten int `json:"dirty_mib_written"`

	PauseFull Summary `json:"branch_pause_full"`
	PauseDiff Summary `json:"branch_pause_diff"`
	PauseLive Summary `json:"branch_pause_live"`
	TotalFull Summary `json:"branch_total_full"`
	TotalDiff Summary `json:"branch_total_diff"`
	TotalLive Summary `json:"branch_total_live"`

	// The flat keys the issue names: pause p50/p90 per mode, and the diff
	// mode's total, dirty set and layer size.
	PauseP50MS       map[string]float64 `json:"branch_pause_p50_ms"`
	PauseP90MS       map[string]float64 `json:"branch_pause_p90_ms"`
	TotalMS          float64            `json:"branch_total_ms"`
	DirtyMiB         float64            `json:"branch_dirty_mib"`
	LayerPhysicalMiB float64            `json:"branch_layer_physical_mib"`

	// Diff pause for the same dirty set on a 256 MiB and a 1 GiB guest.
	Pause256MiB           Summary `json:"branch_pause_diff_256mib"`
	Pause1GiB             Summary `json:"branch_pause_diff_1gib"`
	RatioPause1GiBOver256 float64 `json:"ratio_pause_1gib_over_256mib"`

	// Fork of 10 from a flat snapshot and from a chain of ChainDepth
	// diff branches; children's ready times from each.
	ChainDepth               int     `json:"chain_depth"`
	FlatFork10MS             float64 `json:"flat_fork10_ms"`
	Chain5Fork10MS           float64 `json:"chain5_fork10_ms"`
	RatioChainOverFlat       float64 `json:"ratio_chain_over_flat_fork10"`
	FlatReady                Summary `json:"flat_ready"`
	BranchReady              Summary `json:"branch_ready"`
	RatioBranchReadyOverFlat float64 `json:"ratio_branch_ready_over_flat_p50"`
}

// RunBranch measures branching with e: pauses and totals per mode for a
// set dirty set, the pause's growth from a 256 MiB to a 1 GiB guest, and
// forks from a chain against forks from a flat snapshot. It removes what
// it made, also on failure.
func RunBranch(ctx context.Context, e *sandbox.Engine, o BranchOptions) (*BranchResult, error) {
	if o.Image == "" {
		o.Image = "minimal"
	}
	if o.Rounds <= 0 {
		o.Rounds = 5
	}
	if o.DirtyMiB <= 0 {
		o.DirtyMiB = 16
	}
	if o.ChainDepth <= 0 {
		o.ChainDepth = 5
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	say := func(format string, args ...any) { fmt.Fprintf(o.Progress, "bench: branch: "+format+"\n", args...) }
	r := &BranchResult{DirtyMiBWritten: o.DirtyMiB, ChainDepth: o.ChainDepth,
		PauseP50MS: map[string]float64{}, PauseP90MS: map[string]float64{}}
	b := &brancher{e: e, o: o}
	defer b.cleanup(ctx)

	base := fmt.Sprintf("benchbr-%d", os.Getpid())
	say("snapshots %s (256 MiB) and %s-1g (1 GiB)", base, base)
	if err := b.snapshot(ctx, base, 256); err != nil {
		return nil, err
	}
	if err := b.snapshot(ctx, base+"-1g", 1024); err != nil {
		return nil, err
	}

	for _, mode := range []string{sandbox.BranchFull, sandbox.BranchDiff, sandbox.BranchLive} {
		say("%s branches ×%d, %d MiB written each time", mode, o.Rounds, o.DirtyMiB)
		var pause, total, dirty, layer []float64
		for i := 0; i < o.Rounds; i++ {
			sn, err := b.dirtyBranch(ctx, base, mode)
			if err != nil {
				return nil, fmt.Errorf("%s branch: %w", mode, err)
			}
			pause = append(pause, sn.Branch.PauseMS)
			total = append(total, sn.Branch.TotalMS)
			dirty = append(dirty, float64(sn.Branch.DirtyBytes)/(1<<20))
			if phys, err := memimage.Allocated(sn.LayerPath()); err == nil {
				layer = append(layer, float64(phys)/(1<<20))
			}
			b.remove(sn.Tag)
		}
		ps, ts := Summarize(pause), Summarize(total)
		r.PauseP50MS[mode], r.PauseP90MS[mode] = ps.P50, ps.P90
		switch mode {
		case sandbox.BranchFull:
			r.PauseFull, r.TotalFull = ps, ts
		case sandbox.BranchDiff:
			r.PauseDiff, r.TotalDiff = ps, ts
			r.TotalMS, r.DirtyMiB = ts.P50, Summarize(dirty).P50
			r.LayerPhysicalMiB = Summarize(layer).P50
		case sandbox.BranchLive:
			r.PauseLive, r.TotalLive = ps, ts
		}
	}

	say("diff pause, %d MiB written, on 256 MiB and 1 GiB guests", o.DirtyMiB)
	var p256, p1g []float64
	for i := 0; i < o.Rounds; i++ {
		for _, c := range []struct {
			tag string
			out *[]float64
		}{{base, &p256}, {base + "-1g", &p1g}} {
			sn, err := b.dirtyBranch(ctx, c.tag, sandbox.BranchDiff)
			if err != nil {
				return nil, err
			}
			*c.out = append(*c.out, sn.Branch.PauseMS)
			b.remove(sn.Tag)
		}
	}
	r.Pause256MiB, r.Pause1GiB = Summarize(p256), Summarize(p1g)
	if r.Pause256MiB.P50 > 0 {
		r.RatioPause1GiBOver256 = r.Pause1GiB.P50 / r.Pause256MiB.P50
	}

	say("a chain of %d diff branches", o.ChainDepth)
	from := base
	for d := 1; d <= o.ChainDepth; d++ {
		sn, err := b.dirtyBranch(ctx, from, sandbox.BranchDiff)
		if err != nil {
			return nil, fmt.Errorf("chain link %d: %w", d, err)
		}
		from = sn.Tag
	}
	say("fork 10 from the flat snapshot and from the chain, twice each")
	var flat, chain, flatReady, chainReady []float64
	for i := 0; i < 2; i++ {
		for _, c := range []struct {
			tag   string
			wall  *[]float64
			ready *[]float64
		}{{base, &flat, &flatReady}, {from, &chain, &chainReady}} {
			res, err := e.Fork(ctx, sandbox.ForkSpec{Tag: c.tag, N: 10})
			if err != nil {
				return nil, err
			}
			*c.wall = append(*c.wall, res.WallMS)
			for _, ch := range res.Children {
				*c.ready = append(*c.ready, ch.ReadyMS)
			}
			if _, err := e.KillAll(ctx, c.tag); err != nil {
				return nil, err
			}
		}
	}
	r.FlatFork10MS, r.Chain5Fork10MS = Summarize(flat).Min, Summarize(chain).Min
	if r.FlatFork10MS > 0 {
		r.RatioChainOverFlat = r.Chain5Fork10MS / r.FlatFork10MS
	}
	r.FlatReady, r.BranchReady = Summarize(flatReady), Summarize(chainReady)
	if r.FlatReady.P50 > 0 {
		r.RatioBranchReadyOverFlat = r.BranchReady.P50 / r.FlatReady.P50
	}
	return r, nil
}

// brancher makes and removes what RunBranch measures.
type brancher struct {
	e    *sandbox.Engine
	o    BranchOptions
	tags []string // snapshots made, oldest first
	n    int
}

func (b *brancher) snapshot(ctx context.Context, tag string, mib int) error {
	if _, err := b.e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: tag, Image: b.o.Image, MemoryMiB: mib}); err != nil {
		return err
	}
	b.tags = append(b.tags, tag)
	return nil
}

// dirtyBranch forks a child of tag, has it write DirtyMiB in its guest,
// branches it in mode, kills it and returns the branch.
func (b *brancher) dirtyBranch(ctx context.Context, tag, mode string) (*snapshot.Snapshot, error) {
	res, err := b.e.Fork(ctx, sandbox.ForkSpec{Tag: tag, N: 1})
	if err != nil {
		return nil, err
	}
	id := res.Children[0].ID
	defer func() {
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		_ = b.e.Kill(kctx, id) // measured already; a failure shows in cleanup
	}()
	// A byte count: busybox's head takes "m" as its MiB suffix, coreutils'
	// "M"; both take a plain number.
	if err := b.exec(ctx, id, fmt.Sprintf("head -c %d /dev/urandom > /tmp/dirty-%d", b.o.DirtyMiB<<20, b.n)); err != nil {
		return nil, err
	}
	b.n++
	sn, err := b.e.Branch(ctx, sandbox.BranchSpec{ID: id, Tag: fmt.Sprintf("%s-b%d", tag, b.n), Mode: mode})
	if err != nil {
		return nil, err
	}
	b.tags = append(b.tags, sn.Tag)
	return sn, nil
}

// exec runs cmd in sandbox id, failing on a non-zero exit with its
// stderr.
func (b *brancher) exec(ctx context.Context, id, cmd string) error {
	c, release, err := b.e.Agent(ctx, id)
	if err != nil {
		return err
	}
	defer release()
	var stderr bytes.Buffer
	r, err := c.Exec(ctx, agent.ExecRequest{Shell: cmd, Timeout: 5 * time.Minute, Stderr: &stderr})
	if err != nil {
		return err
	}
	if r.ExitCode != 0 {
		return fmt.Errorf("%s: exit %d: %s", cmd, r.ExitCode, bytes.TrimSpace(stderr.Bytes()))
	}
	return nil
}

func (b *brancher) remove(tag string) {
	if err := b.e.RemoveSnapshot(tag); err != nil {
		fmt.Fprintf(b.o.Progress, "bench: cleanup: remove %s: %v\n", tag, err)
	}
}

// cleanup kills what is left and removes the snapshots, newest first.
func (b *brancher) cleanup(ctx context.Context) {
	kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
	defer cancel()
	for i := len(b.tags) - 1; i >= 0; i-- {
		if _, err := b.e.KillAll(kctx, b.tags[i]); err != nil {
			fmt.Fprintf(b.o.Progress, "bench: cleanup: kill children of %s: %v\n", b.tags[i], err)
		}
		if _, err := b.e.Snapshots().Get(b.tags[i]); err == nil {
			b.remove(b.tags[i])
		}
	}
}
