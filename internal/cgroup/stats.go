package cgroup

import (
	"bufio"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Stats are a group's usage counters; a field is zero when the host lacks
// its controller.
type Stats struct {
	// MemoryBytes is the memory charged now (page cache included).
	MemoryBytes uint64 `json:"memory_bytes"`
	// MemoryPeakBytes is the most ever charged (0 when the kernel does not
	// say).
	MemoryPeakBytes uint64 `json:"memory_peak_bytes"`
	// MemoryLimitBytes is the limit in force (0 for none).
	MemoryLimitBytes uint64 `json:"memory_limit_bytes"`
	// MemoryFailures counts charges that hit the limit.
	MemoryFailures uint64 `json:"memory_failures"`
	// OOMKills counts processes the OOM killer ended in the group.
	OOMKills uint64 `json:"oom_kills"`
	// CPU is the CPU time used by the group.
	CPU time.Duration `json:"cpu_ns"`
	// CPUThrottled counts periods in which the CPU limit stopped the group.
	CPUThrottled uint64 `json:"cpu_throttled"`
	// PIDs is the number of tasks in the group now; PIDsRefused counts
	// forks refused by the pids limit.
	PIDs        uint64 `json:"pids"`
	PIDsRefused uint64 `json:"pids_refused"`
}

// OOMKilled reports whether the OOM killer ended a process of the group
// (v1 memory.oom_control oom_kill, v2 memory.events oom_kill; on an old v1
// kernel without that counter, whether the group is under OOM now).
func (g *Group) OOMKilled() (bool, error) {
	d := g.dir(Memory)
	if d == "" {
		return false, nil
	}
	if g.m.place[Memory].v2 {
		kv, err := readKV(d, "memory.events")
		if err != nil {
			return false, err
		}
		return kv["oom_kill"] > 0, nil
	}
	kv, err := readKV(d, "memory.oom_control")
	if err != nil {
		return false, err
	}
	if n, ok := kv["oom_kill"]; ok {
		return n > 0, nil
	}
	return kv["under_oom"] > 0, nil
}

// Stats reads the group's counters.
func (g *Group) Stats() (Stats, error) {
	var s Stats
	var err error
	if d := g.dir(Memory); d != "" {
		if g.m.place[Memory].v2 {
			s.MemoryBytes, err = readUint(d, "memory.current")
			if err != nil {
				return s, err
			}
			s.MemoryPeakBytes, _ = readUint(d, "memory.peak")
			s.MemoryLimitBytes, _ = readUint(d, "memory.max")
			if kv, err := readKV(d, "memory.events"); err == nil {
				s.MemoryFailures, s.OOMKills = kv["max"], kv["oom_kill"]
			}
		} else {
			s.MemoryBytes, err = readUint(d, "memory.usage_in_bytes")
			if err != nil {
				return s, err
			}
			s.MemoryPeakBytes, _ = readUint(d, "memory.max_usage_in_bytes")
			s.MemoryLimitBytes, _ = readUint(d, "memory.limit_in_bytes")
			if s.MemoryLimitBytes >= 1<<62 {
				s.MemoryLimitBytes = 0 // the kernel's "unlimited"
			}
			s.MemoryFailures, _ = readUint(d, "memory.failcnt")
			if kv, err := readKV(d, "memory.oom_control"); err == nil {
				s.OOMKills = kv["oom_kill"]
			}
		}
	}
	if d := g.dir(CPU); d != "" {
		if g.m.place[CPU].v2 {
			if kv, err := readKV(d, "cpu.stat"); err == nil {
				s.CPU = time.Duration(kv["usage_usec"]) * time.Microsecond
				s.CPUThrottled = kv["nr_throttled"]
			}
		} else {
			if kv, err := readKV(d, "cpu.stat"); err == nil {
				s.CPUThrottled = kv["nr_throttled"]
			}
			if a := g.dirOf("cpuacct"); a != "" {
				if ns, err := readUint(a, "cpuacct.usage"); err == nil {
					s.CPU = time.Duration(ns)
				}
			}
		}
	}
	if d := g.dir(PIDs); d != "" {
		s.PIDs, _ = readUint(d, "pids.current")
		if kv, err := readKV(d, "pids.events"); err == nil {
			s.PIDsRefused = kv["max"]
		}
	}
	return s, nil
}

// readUint reads a control file holding one number ("max" reads as 0).
func readUint(dir, file string) (uint64, error) {
	b, err := os.ReadFile(filepath.Join(dir, file))
	if err != nil {
		return 0, err
	}
	v := strings.TrimSpace(string(b))
	if v == "max" {
		return 0, nil
	}
	return strconv.ParseUint(v, 10, 64)
}

// readKV reads a flat-keyed control file ("key value" per line).
func readKV(dir, file string) (map[string]uint64, error) {
	f, err := os.Open(filepath.Join(dir, file))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]uint64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if !ok {
			continue
		}
		if n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64); err == nil {
			out[k] = n
		}
	}
	return out, sc.Err()
}
