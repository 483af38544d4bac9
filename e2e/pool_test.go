package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"

	"github.com/forkd/forkd/internal/cgroup"
	"github.com/forkd/forkd/internal/testutil"
)

// TestServePoolLeavesNothing: a daemon with a warm pool, stopped with
// SIGTERM, leaves nothing of its parked VMMs on the host: no VMM, and no
// namespace, host veth, nft table or cgroup of its data dir's prefix.
// Killed with SIGKILL it leaves them running, for the next daemon of the
// data dir; when that data dir is deleted instead, the next forkd command
// on the host, with a data dir of its own, reclaims them.
func TestServePoolLeavesNothing(t *testing.T) {
	c := newCLI(t)
	testutil.RequireRoot(t) // parked VMMs have namespaces only as root
	t.Parallel()
	c.ok("snapshot", "--tag", "base", "--image", "minimal")
	var hn struct {
		Prefix string `json:"prefix"`
	}
	b, err := os.ReadFile(filepath.Join(c.data, "network.json"))
	testutil.Check(t, err)
	testutil.Check(t, json.Unmarshal(b, &hn))
	run := filepath.Join(c.data, "run")

	// A fork through the daemon fills the pool: 2 parked VMMs in their
	// own namespaces once the child is killed.
	d := startServe(t, c, "--pool", "2")
	park := func() {
		t.Helper()
		ids := c.forkIDs("--tag", "base")
		deadline := time.Now().Add(3 * time.Minute)
		for len(hostLeft(hn.Prefix, run).netns) < 3 {
			if time.Now().After(deadline) {
				t.Fatalf("pool not filled: %+v\n%s", hostLeft(hn.Prefix, run), d.output())
			}
			time.Sleep(200 * time.Millisecond)
		}
		c.ok("kill", ids[0])
		if left := hostLeft(hn.Prefix, run); len(left.netns) != 2 || len(left.vmms) != 2 {
			t.Fatalf("parked: %+v, want 2 VMMs in 2 namespaces", left)
		}
	}
	park()
	d.stop()
	if left := hostLeft(hn.Prefix, run); !left.empty() {
		t.Errorf("after SIGTERM: %+v", left)
	}

	d.start()
	park()
	d.kill9()
	if left := hostLeft(hn.Prefix, run); len(left.vmms) != 2 {
		t.Fatalf("after SIGKILL: %+v, want the 2 parked VMMs running", left)
	}
	testutil.Check(t, os.RemoveAll(c.data))
	other := t.TempDir()
	// Other tests' forkd processes reclaim too, and may be halfway when
	// this one looks (in CI the first ls once left one VMM and both
	// namespaces): a later command must finish the job.
	var outs []string
	for attempt := 1; ; attempt++ {
		cmd := exec.Command(forkdBin, "ls")
		cmd.Env = append(slices.Clone(c.env), "FORKD_DATA="+other)
		out, err := cmd.CombinedOutput()
		outs = append(outs, fmt.Sprintf("ls %d (%v): %s", attempt, err, out))
		left := hostLeft(hn.Prefix, run)
		if err == nil && left.empty() {
			if attempt > 1 {
				t.Logf("reclaimed by the forkd command %d after the deletion:\n%s", attempt, strings.Join(outs, "\n"))
			}
			break
		}
		if attempt == 3 {
			t.Errorf("after the data dir was deleted and %d forkd commands ran: %+v\n%s", attempt, left, strings.Join(outs, "\n"))
			break
		}
		time.Sleep(2 * time.Second)
	}
}

// leftovers are what a data dir of prefix, with run dir run, has on the
// host.
type leftovers struct {
	netns, links, tables, cgroups, vmms []string
}

func (l leftovers) empty() bool {
	return len(l.netns)+len(l.links)+len(l.tables)+len(l.cgroups)+len(l.vmms) == 0
}

func hostLeft(prefix, run string) leftovers {
	var l leftovers
	ents, _ := os.ReadDir("/run/netns")
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), prefix+"-") {
			l.netns = append(l.netns, e.Name())
		}
	}
	ifs, _ := net.Interfaces()
	for _, i := range ifs {
		if strings.HasPrefix(i.Name, prefix+"h") {
			l.links = append(l.links, i.Name)
		}
	}
	if nc, err := nftables.New(); err == nil {
		ts, _ := nc.ListTablesOfFamily(nftables.TableFamilyIPv4)
		for _, tb := range ts {
			if tb.Name == prefix {
				l.tables = append(l.tables, tb.Name)
			}
		}
	}
	if cm, err := cgroup.New(cgroup.Options{Parent: "forkd-" + prefix}); err == nil {
		l.cgroups, _ = cm.List()
	}
	l.vmms = testutil.ProcessesUnder(run)
	return l
}
