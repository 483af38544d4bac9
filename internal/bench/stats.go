package bench

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"

	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/vmm"
)

// Summary is a sample's median, 90th and 99th percentiles.
type Summary struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50"`
	P90 float64 `json:"p90"`
	P99 float64 `json:"p99"`
	Min float64 `json:"min"`
	Max float64 `json:"max"`
}

// Summarize computes nearest-rank percentiles of xs.
func Summarize(xs []float64) Summary {
	if len(xs) == 0 {
		return Summary{}
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return Summary{N: len(s), P50: percentile(s, 50), P90: percentile(s, 90), P99: percentile(s, 99), Min: s[0], Max: s[len(s)-1]}
}

// percentile returns the nearest-rank p-th percentile of sorted s.
func percentile(s []float64, p float64) float64 {
	rank := int(math.Ceil(p / 100 * float64(len(s))))
	if rank < 1 {
		rank = 1
	}
	return s[rank-1]
}

// Machine describes the host a benchmark ran on.
type Machine struct {
	CPUModel    string `json:"cpu_model"`
	Cores       int    `json:"cores"`
	MemoryMiB   int    `json:"memory_mib"`
	Kernel      string `json:"kernel"`
	OS          string `json:"os"`
	Backend     string `json:"backend"`
	Version     string `json:"backend_version"`
	Accelerator string `json:"accelerator"`
}

// DescribeRun describes the host and e's backend.
func DescribeRun(ctx context.Context, be vmm.Backend) Machine {
	m := DescribeHost()
	m.Backend, m.Accelerator = be.Name(), be.Capabilities().Accelerator
	m.Version, _ = be.Version(ctx)
	return m
}

// DescribeHost describes the host.
func DescribeHost() Machine {
	m := Machine{Cores: runtime.NumCPU()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "MemTotal:" {
				kb, _ := strconv.Atoi(f[1])
				m.MemoryMiB = kb / 1024
			}
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile("/etc/os-release"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "PRETTY_NAME="); ok {
				m.OS = strings.Trim(v, `"`)
			}
		}
	}
	return m
}

// smapsPrivate returns a process's private memory (Private_Clean +
// Private_Dirty) in KiB, in total and within mappings of file.
func smapsPrivate(pid int, file string) (total, inFile int64, err error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps")
	if err != nil {
		return 0, 0, err
	}
	inside := false
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":") {
			inside = len(f) >= 6 && strings.Join(f[5:], " ") == file
			continue
		}
		if f[0] == "Private_Clean:" || f[0] == "Private_Dirty:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			total += kb
			if inside {
				inFile += kb
			}
		}
	}
	return total, inFile, nil
}

// zramUsedPerOrig returns the RAM the host's zram devices hold per byte
// stored in them (mm_stat mem_used_total / orig_data_size), 0 when they
// store nothing; with compact, after asking each that is swap to compact
// its pool first.
func zramUsedPerOrig(compact bool) float64 {
	if compact {
		// Best effort: an old kernel has no compact; used stays.
		_, _, _ = proc.CompactZramSwap()
	}
	devs, _ := proc.ZramDevices()
	var stored, used int64
	for _, z := range devs {
		stored, used = stored+z.Stored, used+z.Used
	}
	if stored == 0 {
		return 0
	}
	return float64(used) / float64(stored)
}

// cpuTicks returns a process's utime+stime in clock ticks.
func cpuTicks(pid int) (int64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	i := bytes.LastIndexByte(b, ')')
	f := strings.Fields(string(b[i+1:]))
	// utime is field 14, stime 15; f[0] is field 3.
	ut, _ := strconv.ParseInt(f[14-3], 10, 64)
	st, _ := strconv.ParseInt(f[15-3], 10, 64)
	return ut + st, nil
}

// clockTicks is USER_HZ, 100 on every Linux forkd supports.
const clockTicks = 100

// progress returns a printf to w for a run's progress lines.
func progress(w io.Writer) func(format string, args ...any) {
	if w == nil {
		w = io.Discard
	}
	return func(format string, args ...any) { fmt.Fprintf(w, "bench: "+format+"\n", args...) }
}
