package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/forkd/forkd/internal/memimage"
	"github.com/forkd/forkd/internal/sandbox"
)

// DiskOptions configure RunDisk.
type DiskOptions struct {
	// Image must have a root file system (a disk holds its writable
	// layer); python by default.
	Image string
	// N children are forked at once, with and without a disk.
	N int
	// DiskMiB is the children's disk size.
	DiskMiB int
	// DirtyMiB is what a source writes to its disk before it is branched.
	DirtyMiB int
	// Rounds is how many branches are timed with a disk and without.
	Rounds   int
	Progress io.Writer
}

// DiskResult is what `forkd bench --disk --json` adds, measured in one
// run against a baseline without a disk.
type DiskResult struct {
	Image    string `json:"disk_image"`
	N        int    `json:"disk_n"`
	DiskMiB  int    `json:"disk_mib"`
	DirtyMiB int    `json:"disk_dirty_mib_written"`

	// Fork of N: the best wall time of two, and every child's ready time.
	ForkNWallMS     float64 `json:"disk_fork_n_wall_ms"`
	ForkNDiskWallMS float64 `json:"disk_fork_n_with_disk_wall_ms"`
	Ready           Summary `json:"disk_fork_ready"`
	ReadyDisk       Summary `json:"disk_fork_ready_with_disk"`

	// Diff branches of a source without a disk and of one that wrote
	// DirtyMiB to its disk: the pause (the disk switch's share of it) and
	// the physical size of the memory and disk layers.
	Pause          Summary `json:"disk_branch_pause"`
	PauseDisk      Summary `json:"disk_branch_pause_with_disk"`
	DiskSwitch     Summary `json:"disk_branch_disk_switch"`
	MemLayerMiB    float64 `json:"disk_branch_memory_layer_mib"`
	MemLayerDisk   float64 `json:"disk_branch_memory_layer_with_disk_mib"`
	DiskLayerMiB   float64 `json:"disk_branch_disk_layer_mib"`
	TotalMS        float64 `json:"disk_branch_total_ms"`
	TotalDiskMS    float64 `json:"disk_branch_total_with_disk_ms"`
	RatioForkNDisk float64 `json:"ratio_fork_n_disk_over_plain"`
}

// RunDisk measures the writable disk with e: a fork of N with and without
// one, and a diff branch of a source that wrote DirtyMiB to its disk
// against one without a disk. It removes what it made, also on failure.
func RunDisk(ctx context.Context, e *sandbox.Engine, o DiskOptions) (*DiskResult, error) {
	if o.Image == "" {
		o.Image = "python"
	}
	if o.N <= 0 {
		o.N = 10
	}
	if o.DiskMiB <= 0 {
		o.DiskMiB = 256
	}
	if o.DirtyMiB <= 0 {
		o.DirtyMiB = 64
	}
	if o.Rounds <= 0 {
		o.Rounds = 3
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	say := func(format string, args ...any) { fmt.Fprintf(o.Progress, "bench: disk: "+format+"\n", args...) }
	r := &DiskResult{Image: o.Image, N: o.N, DiskMiB: o.DiskMiB, DirtyMiB: o.DirtyMiB}
	b := &brancher{e: e, o: BranchOptions{Image: o.Image, Progress: o.Progress}}
	defer b.cleanup(ctx)
	base := fmt.Sprintf("benchdisk-%d", os.Getpid())
	say("snapshot %s of %s", base, o.Image)
	if err := b.snapshot(ctx, base, 256); err != nil {
		return nil, err
	}

	say("fork %d with and without a %d MiB disk, twice each", o.N, o.DiskMiB)
	if err := warmFork(ctx, e, sandbox.ForkSpec{Tag: base, N: 1, DiskMiB: o.DiskMiB}); err != nil {
		return nil, err
	}
	var wall, wallDisk, ready, readyDisk []float64
	for i := 0; i < 2; i++ {
		for _, c := range []struct {
			mib         int
			wall, ready *[]float64
		}{{0, &wall, &ready}, {o.DiskMiB, &wallDisk, &readyDisk}} {
			res, err := e.Fork(ctx, sandbox.ForkSpec{Tag: base, N: o.N, DiskMiB: c.mib})
			if err != nil {
				return nil, err
			}
			*c.wall = append(*c.wall, res.WallMS)
			for _, ch := range res.Children {
				*c.ready = append(*c.ready, ch.ReadyMS)
			}
			if _, err := e.KillAll(ctx, base); err != nil {
				return nil, err
			}
		}
	}
	r.ForkNWallMS, r.ForkNDiskWallMS = Summarize(wall).Min, Summarize(wallDisk).Min
	r.Ready, r.ReadyDisk = Summarize(ready), Summarize(readyDisk)
	if r.ForkNWallMS > 0 {
		r.RatioForkNDisk = r.ForkNDiskWallMS / r.ForkNWallMS
	}

	say("diff branches ×%d, without a disk and after writing %d MiB to one", o.Rounds, o.DirtyMiB)
	var pause, pauseDisk, sw, mem, memDisk, dl, total, totalDisk []float64
	for i := 0; i < o.Rounds; i++ {
		for _, mib := range []int{0, o.DiskMiB} {
			p, err := b.diskBranch(ctx, base, mib, o.DirtyMiB)
			if err != nil {
				return nil, err
			}
			if mib == 0 {
				pause, mem, total = append(pause, p.PauseMS), append(mem, p.memMiB), append(total, p.TotalMS)
				continue
			}
			pauseDisk, memDisk, totalDisk = append(pauseDisk, p.PauseMS), append(memDisk, p.memMiB), append(totalDisk, p.TotalMS)
			sw, dl = append(sw, p.DiskSwitchMS), append(dl, p.diskMiB)
		}
	}
	r.Pause, r.PauseDisk, r.DiskSwitch = Summarize(pause), Summarize(pauseDisk), Summarize(sw)
	r.MemLayerMiB, r.MemLayerDisk, r.DiskLayerMiB = Summarize(mem).P50, Summarize(memDisk).P50, Summarize(dl).P50
	r.TotalMS, r.TotalDiskMS = Summarize(total).P50, Summarize(totalDisk).P50
	return r, nil
}

// diskBranched is one branch RunDisk measured.
type diskBranched struct {
	PauseMS, DiskSwitchMS, TotalMS float64
	memMiB, diskMiB                float64
}

// diskBranch forks a child of tag with a disk of mib (0: none), has it
// write dirty MiB to its disk (to RAM without one), branches it in diff
// mode, kills it and removes the branch.
func (b *brancher) diskBranch(ctx context.Context, tag string, mib, dirty int) (diskBranched, error) {
	res, err := b.e.Fork(ctx, sandbox.ForkSpec{Tag: tag, N: 1, DiskMiB: mib})
	if err != nil {
		return diskBranched{}, err
	}
	id := res.Children[0].ID
	defer func() {
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		_ = b.e.Kill(kctx, id) // measured already; a failure shows in cleanup
	}()
	// O_DIRECT keeps the file out of the guest's page cache: with a
	// disk, the memory layer holds no copy of it.
	cmd := fmt.Sprintf("dd if=/dev/urandom of=/root/dirty bs=1M count=%d iflag=fullblock oflag=direct status=none", dirty)
	if mib == 0 {
		cmd = fmt.Sprintf("head -c %d /dev/urandom > /tmp/dirty", dirty<<20)
	}
	if err := b.exec(ctx, id, cmd); err != nil {
		return diskBranched{}, err
	}
	b.n++
	sn, err := b.e.Branch(ctx, sandbox.BranchSpec{ID: id, Tag: fmt.Sprintf("%s-d%d", tag, b.n), Mode: sandbox.BranchDiff})
	if err != nil {
		return diskBranched{}, err
	}
	b.tags = append(b.tags, sn.Tag)
	defer b.remove(sn.Tag)
	p := diskBranched{PauseMS: sn.Branch.PauseMS, DiskSwitchMS: sn.Branch.DiskSwitchMS, TotalMS: sn.Branch.TotalMS}
	if n, err := memimage.Allocated(sn.LayerPath()); err == nil {
		p.memMiB = float64(n) / (1 << 20)
	}
	if sn.Branch.Disk != "" {
		if n, err := memimage.Allocated(filepath.Join(b.e.Config().DataDir, "disks", sn.Branch.Disk+".qcow2")); err == nil {
			p.diskMiB = float64(n) / (1 << 20)
		}
	}
	return p, nil
}
