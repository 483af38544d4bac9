package guest

import (
	"path/filepath"
	"testing"

	"github.com/forkd/forkd/internal/testutil"
)

func TestMemBudget(t *testing.T) {
	const mib = 1 << 20
	for _, c := range []struct {
		ram, reserve uint64
	}{
		{ram: 64 * mib, reserve: 32 * mib},  // at most half
		{ram: 218 * mib, reserve: 48 * mib}, // a 256 MiB guest
		{ram: 256 * mib, reserve: 51 * mib},
		{ram: 4096 * mib, reserve: 819 * mib},
	} {
		b := newMemBudget(c.ram, 2*mib)
		if b.reserve/mib != c.reserve/mib {
			t.Errorf("ram %d MiB: reserve %d MiB, want %d", c.ram/mib, b.reserve/mib, c.reserve/mib)
		}
		// Every in-RAM file system full still leaves the workload's
		// processes room inside its cgroup, and the agent its reserve.
		if b.workload+b.reserve != b.ram || b.files > b.workload*5/8 || b.shared >= b.files ||
			b.workload-b.files < b.workload/3 {
			t.Errorf("ram %d MiB: %+v", c.ram/mib, b)
		}
		if b.minFree < 2*mib || b.minFree > 16*mib {
			t.Errorf("ram %d MiB: min_free %d", c.ram/mib, b.minFree)
		}
		// A fork bomb of shells meets pids.max before memory.max.
		if b.pids < 64 || b.pids > 4096 || uint64(b.pids)*256<<10 > b.workload && b.pids > 64 {
			t.Errorf("ram %d MiB: pids %d", c.ram/mib, b.pids)
		}
	}
}

func TestMemTotal(t *testing.T) {
	p := filepath.Join(t.TempDir(), "meminfo")
	testutil.WriteFile(t, p, []byte("MemFree:  1 kB\nMemTotal:         223768 kB\n"), 0o644)
	if n, err := memTotal(p); err != nil || n != 223768<<10 {
		t.Fatalf("memTotal = %d, %v", n, err)
	}
	testutil.WriteFile(t, p, []byte("MemFree:  1 kB\n"), 0o644)
	if _, err := memTotal(p); err == nil {
		t.Fatal("no MemTotal accepted")
	}
}
