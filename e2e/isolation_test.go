package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/testutil"
)

// TestNetworkFlags drives per-child networking and limits through the CLI:
// snapshot with a NIC, fork with a published port and limits, reach the
// child, change its egress live.
func TestNetworkFlags(t *testing.T) {
	c := newCLI(t)
	testutil.RequireRoot(t)
	c.ok("snapshot", "--tag", "web", "--image", "minimal", "--per-child-netns", "--warmup", "busybox httpd -p 80 -h /etc")
	var fork struct {
		Children []struct{ ID string } `json:"children"`
	}
	out := c.ok("fork", "--tag", "web", "-n", "2", "--publish", "80", "--egress", "allowlist",
		"--allow", "198.51.100.0/24:tcp:80,443", "--memory-limit-mib", "512", "--cpus", "1", "--pids-limit", "256", "--json")
	if err := json.Unmarshal([]byte(out), &fork); err != nil || len(fork.Children) != 2 {
		t.Fatalf("fork: %v %s", err, out)
	}
	type listing struct {
		Sandboxes []struct {
			ID      string `json:"id"`
			Network *struct {
				Address string `json:"address"`
				Egress  string `json:"egress"`
				Allow   []struct {
					CIDR  string   `json:"cidr"`
					Proto string   `json:"proto"`
					Ports []string `json:"ports"`
				} `json:"allow"`
				Ports []struct {
					GuestPort int `json:"guest_port"`
					HostPort  int `json:"host_port"`
				} `json:"ports"`
			} `json:"network"`
			MemoryLimitMiB int     `json:"memory_limit_mib"`
			CPUs           float64 `json:"cpus"`
			PIDsLimit      int     `json:"pids_limit"`
		} `json:"sandboxes"`
	}
	list := func() listing {
		t.Helper()
		var ls listing
		if err := json.Unmarshal([]byte(c.ok("ls", "--json")), &ls); err != nil || len(ls.Sandboxes) != 2 {
			t.Fatalf("ls: %v %+v", err, ls)
		}
		return ls
	}
	// hostname GETs /hostname from a child's web server.
	hostname := func(url string) string {
		t.Helper()
		hc := http.Client{Timeout: 5 * time.Second}
		resp, err := hc.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return strings.TrimSpace(string(b))
	}
	ls := list()
	for _, sb := range ls.Sandboxes {
		n := sb.Network
		if n == nil || n.Address == "" || n.Egress != "allowlist" || len(n.Allow) != 1 || n.Allow[0].CIDR != "198.51.100.0/24" ||
			len(n.Ports) != 1 || n.Ports[0].GuestPort != 80 {
			t.Fatalf("%s network %+v", sb.ID, n)
		}
		if sb.MemoryLimitMiB != 512 || sb.CPUs != 1 || sb.PIDsLimit != 256 {
			t.Fatalf("%s limits %d %g %d", sb.ID, sb.MemoryLimitMiB, sb.CPUs, sb.PIDsLimit)
		}
		for _, url := range []string{
			"http://" + n.Address + "/hostname",
			fmt.Sprintf("http://127.0.0.1:%d/hostname", n.Ports[0].HostPort),
		} {
			if got := hostname(url); got != sb.ID {
				t.Fatalf("GET %s = %q, want %s", url, got, sb.ID)
			}
		}
	}
	id := ls.Sandboxes[0].ID
	if out := c.ok("net", id, "--egress", "deny"); !strings.Contains(out, "egress deny") {
		t.Fatalf("net: %q", out)
	}
	// The change is recorded for that child only. (Its effect on the
	// guest's traffic is tested by the sandbox VM tier, TestIsolation's
	// Egress in internal/sandbox: nothing this test sets up is reachable
	// under the allowlist but not under deny.)
	for _, sb := range list().Sandboxes {
		n := sb.Network
		switch {
		case n == nil:
			t.Fatalf("%s lost its network", sb.ID)
		case sb.ID == id && (n.Egress != "deny" || len(n.Allow) != 0):
			t.Fatalf("%s after net --egress deny: egress %q, allow %+v", sb.ID, n.Egress, n.Allow)
		case sb.ID != id && (n.Egress != "allowlist" || len(n.Allow) != 1):
			t.Fatalf("sibling %s's policy changed: egress %q, allow %+v", sb.ID, n.Egress, n.Allow)
		}
	}
	// Egress deny stops only connections the guest starts: its published
	// port still answers.
	if got := hostname(fmt.Sprintf("http://127.0.0.1:%d/hostname", ls.Sandboxes[0].Network.Ports[0].HostPort)); got != id {
		t.Fatalf("GET after egress deny = %q, want %s", got, id)
	}
	// Publishing again returns the port already published; a new port
	// gets its own.
	if hp := strings.TrimSpace(c.ok("publish", id, "80")); hp != strconv.Itoa(ls.Sandboxes[0].Network.Ports[0].HostPort) {
		t.Fatalf("publish 80 again = %s", hp)
	}
	if hp := strings.TrimSpace(c.ok("publish", id, "8080")); hp == "" || hp == strconv.Itoa(ls.Sandboxes[0].Network.Ports[0].HostPort) {
		t.Fatalf("publish 8080 = %q", hp)
	}
	// Bad input is refused before anything happens.
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"bad egress", []string{"fork", "--tag", "web", "--egress", "sometimes"}},
		{"bad allow", []string{"fork", "--tag", "web", "--allow", "not-a-cidr"}},
		{"bad publish", []string{"fork", "--tag", "web", "--publish", "70000"}},
		{"bad cpus", []string{"fork", "--tag", "web", "--cpus", "-1"}},
		{"net bad prefix", []string{"net", id, "--egress", "deny", "--allow", "1.2.3.4/40"}},
		{"publish 0", []string{"publish", id, "0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, errs, code := c.in(t).run(tc.args...); code != 2 {
				t.Errorf("forkd %q: exit %d (%s), want 2", tc.args, code, errs)
			}
		})
	}
}
