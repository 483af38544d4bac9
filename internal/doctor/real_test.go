package doctor

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/testutil"
)

// TestRealHost runs every check on this machine. It is written for the
// machines forkd is developed and tested on (QEMU installed, memory
// controller on cgroup v1, no usable KVM) and asserts exactly that.
func TestRealHost(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommand(t, "qemu-system-x86_64")
	start := time.Now()
	rep := Run(context.Background(), Options{DataDir: t.TempDir()})
	var sb strings.Builder
	rep.WriteText(&sb)
	t.Logf("doctor took %v:\n%s", time.Since(start).Round(time.Millisecond), sb.String())
	want := map[string]Status{"platform": Pass, "qemu": Pass, "nftables": Pass, "netns-tap": Pass, "memfd": Pass}
	// make deps (scripts/zram-swap.sh) gives swap to a host without any,
	// where the host lets it: CI's does.
	if testutil.Strict() {
		want["swap"] = Pass
	}
	for name, st := range want {
		if c, _ := rep.Get(name); c.Status != st {
			t.Errorf("%s: %s %q, want %s", name, c.Status, c.Detail, st)
		}
	}
	if c, _ := rep.Get("kvm"); c.Status == Pass && !strings.Contains(readCPUFlags(t), " vmx") && !strings.Contains(readCPUFlags(t), " svm") {
		t.Errorf("kvm PASS on a CPU without vmx/svm: %q", c.Detail)
	}
	c, _ := rep.Get("cgroups")
	if c.Status == Fail || c.Status == Skip {
		t.Errorf("cgroups: %s %q", c.Status, c.Detail)
	}
	if memV1() && !strings.Contains(c.Detail, "memory on v1") {
		t.Errorf("cgroups detail %q does not say memory is on v1", c.Detail)
	}
	if rep.Backend != "qemu" {
		t.Errorf("backend %q: %s", rep.Backend, rep.BackendReason)
	}
	b, err := rep.JSON()
	if err != nil {
		t.Fatal(err)
	}
	var back struct {
		Checks  []Check `json:"checks"`
		Backend string  `json:"backend"`
		Failed  bool    `json:"failed"`
	}
	if err := json.Unmarshal(b, &back); err != nil || len(back.Checks) != len(rep.Checks) || back.Backend != "qemu" || back.Failed != rep.Failed() {
		t.Fatalf("JSON round trip: %v\n%s", err, b)
	}
}

func readCPUFlags(t *testing.T) string {
	b, _ := os.ReadFile("/proc/cpuinfo")
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "flags") {
			return l + " "
		}
	}
	return ""
}

// memV1 reports whether this host's memory controller is a v1 hierarchy.
func memV1() bool {
	b, _ := os.ReadFile("/proc/self/cgroup")
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.SplitN(l, ":", 3); len(f) == 3 && strings.Contains(","+f[1]+",", ",memory,") {
			return true
		}
	}
	return false
}
