package cgroup

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/forkd/forkd/internal/errdefs"
)

// Limits for one group. Zero fields mean "no limit" (or the default
// weight).
type Limits struct {
	// MemoryMiB caps memory, swap included. For a VMM: guest RAM plus the
	// VMM's own overhead (~64 MiB for QEMU/TCG), the caller's choice.
	MemoryMiB int64 `json:"memory_mib,omitempty"`
	// CPUs caps CPU time, in CPUs (1.5 = one and a half cores' worth per
	// period).
	CPUs float64 `json:"cpus,omitempty"`
	// CPUWeight is the relative share under contention, 1..10000 (v2
	// scale, default 100; v1 cpu.shares = weight*1024/100).
	CPUWeight uint64 `json:"cpu_weight,omitempty"`
	// PIDs caps processes and threads (a QEMU has ~10 threads).
	PIDs int64 `json:"pids,omitempty"`
	// IOWeight is the relative IO share, 1..10000 (v2 scale; v1
	// blkio.weight or blkio.bfq.weight 10..1000).
	IOWeight uint64 `json:"io_weight,omitempty"`
	// IO caps bandwidth and operations per block device.
	IO []IOLimit `json:"io,omitempty"`
}

// IOLimit caps IO on the block device Major:Minor; zero fields are not
// limited.
type IOLimit struct {
	Major     uint32 `json:"major"`
	Minor     uint32 `json:"minor"`
	ReadBps   uint64 `json:"read_bps,omitempty"`
	WriteBps  uint64 `json:"write_bps,omitempty"`
	ReadIOPS  uint64 `json:"read_iops,omitempty"`
	WriteIOPS uint64 `json:"write_iops,omitempty"`
}

func (l Limits) validate() error {
	switch {
	case l.MemoryMiB < 0 || l.MemoryMiB > 1<<30:
		return errdefs.InvalidArgument("memory limit %d MiB", l.MemoryMiB)
	case l.CPUs < 0 || math.IsNaN(l.CPUs) || l.CPUs > 4096 || (l.CPUs > 0 && l.CPUs < 0.01):
		return errdefs.InvalidArgument("cpu limit %v: want 0.01..4096 CPUs", l.CPUs)
	case l.CPUWeight > 10000:
		return errdefs.InvalidArgument("cpu weight %d: want 1..10000", l.CPUWeight)
	case l.PIDs < 0:
		return errdefs.InvalidArgument("pids limit %d", l.PIDs)
	case l.IOWeight > 10000:
		return errdefs.InvalidArgument("io weight %d: want 1..10000", l.IOWeight)
	}
	return nil
}

// wants reports whether l limits kind.
func (l Limits) wants(kind string) bool {
	switch kind {
	case Memory:
		return l.MemoryMiB > 0
	case CPU:
		return l.CPUs > 0 || l.CPUWeight > 0
	case PIDs:
		return l.PIDs > 0
	case IO:
		return l.IOWeight > 0 || len(l.IO) > 0
	}
	return false
}

// setLimits writes l into the group's control files.
func (g *Group) setLimits(l Limits) error {
	if l.MemoryMiB > 0 {
		d, bytes := g.dir(Memory), strconv.FormatInt(l.MemoryMiB<<20, 10)
		if g.m.place[Memory].v2 {
			if err := write(d, "memory.max", bytes); err != nil {
				return err
			}
			if exists(d, "memory.swap.max") {
				if err := write(d, "memory.swap.max", "0"); err != nil {
					return err
				}
			}
		} else {
			if err := write(d, "memory.limit_in_bytes", bytes); err != nil {
				return err
			}
			if exists(d, "memory.memsw.limit_in_bytes") {
				if err := write(d, "memory.memsw.limit_in_bytes", bytes); err != nil {
					return err
				}
			}
		}
	}
	if l.CPUs > 0 || l.CPUWeight > 0 {
		d, v2 := g.dir(CPU), g.m.place[CPU].v2
		const period = 100000
		quota := max(int64(math.Round(l.CPUs*period)), 1000)
		switch {
		case l.CPUs > 0 && v2:
			if err := write(d, "cpu.max", fmt.Sprintf("%d %d", quota, period)); err != nil {
				return err
			}
		case l.CPUs > 0:
			if err := write(d, "cpu.cfs_period_us", strconv.Itoa(period)); err != nil {
				return err
			}
			if err := write(d, "cpu.cfs_quota_us", strconv.FormatInt(quota, 10)); err != nil {
				return err
			}
		}
		switch {
		case l.CPUWeight > 0 && v2:
			if err := write(d, "cpu.weight", strconv.FormatUint(l.CPUWeight, 10)); err != nil {
				return err
			}
		case l.CPUWeight > 0:
			if err := write(d, "cpu.shares", strconv.FormatUint(max(l.CPUWeight*1024/100, 2), 10)); err != nil {
				return err
			}
		}
	}
	if l.PIDs > 0 {
		if err := write(g.dir(PIDs), "pids.max", strconv.FormatInt(l.PIDs, 10)); err != nil {
			return err
		}
	}
	if l.IOWeight > 0 || len(l.IO) > 0 {
		if err := g.setIO(l); err != nil {
			return err
		}
	}
	return nil
}

func (g *Group) setIO(l Limits) error {
	d := g.dir(IO)
	if g.m.place[IO].v2 {
		if l.IOWeight > 0 {
			if err := write(d, "io.weight", "default "+strconv.FormatUint(l.IOWeight, 10)); err != nil {
				return err
			}
		}
		for _, io := range l.IO {
			var parts []string
			for _, kv := range []struct {
				k string
				v uint64
			}{{"rbps", io.ReadBps}, {"wbps", io.WriteBps}, {"riops", io.ReadIOPS}, {"wiops", io.WriteIOPS}} {
				if kv.v > 0 {
					parts = append(parts, fmt.Sprintf("%s=%d", kv.k, kv.v))
				}
			}
			if len(parts) == 0 {
				continue
			}
			if err := write(d, "io.max", fmt.Sprintf("%d:%d %s", io.Major, io.Minor, strings.Join(parts, " "))); err != nil {
				return err
			}
		}
		return nil
	}
	if l.IOWeight > 0 {
		// The v2 weight (1-10000, default 100) in v1's scales, as systemd
		// maps them: blkio.weight 10-1000 (default 500), bfq 1-1000
		// (default 100).
		w := strconv.FormatUint(min(max(l.IOWeight*5, 10), 1000), 10)
		bfq := strconv.FormatUint(min(max(l.IOWeight/10, 1), 1000), 10)
		switch {
		case exists(d, "blkio.weight"):
			if err := write(d, "blkio.weight", w); err != nil {
				return err
			}
		case exists(d, "blkio.bfq.weight"):
			if err := write(d, "blkio.bfq.weight", bfq); err != nil {
				return err
			}
		default:
			return errdefs.FailedPrecondition("io weight: the host's blkio controller has no weight (no CFQ/BFQ scheduler)")
		}
	}
	for _, io := range l.IO {
		for _, kv := range []struct {
			file string
			v    uint64
		}{{"blkio.throttle.read_bps_device", io.ReadBps}, {"blkio.throttle.write_bps_device", io.WriteBps},
			{"blkio.throttle.read_iops_device", io.ReadIOPS}, {"blkio.throttle.write_iops_device", io.WriteIOPS}} {
			if kv.v == 0 {
				continue
			}
			if err := write(d, kv.file, fmt.Sprintf("%d:%d %d", io.Major, io.Minor, kv.v)); err != nil {
				return err
			}
		}
	}
	return nil
}
