package e2e

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/testutil"
)

// forkJSON runs fork args... --json and returns the children's ids.
func (c *cli) forkIDs(args ...string) []string {
	c.t.Helper()
	var fork struct {
		Children []struct{ ID string } `json:"children"`
	}
	if err := json.Unmarshal([]byte(c.ok(append(append([]string{"fork"}, args...), "--json")...)), &fork); err != nil {
		c.t.Fatal(err)
	}
	ids := make([]string, len(fork.Children))
	for i, ch := range fork.Children {
		ids[i] = ch.ID
	}
	return ids
}

// evalIs checks that code evaluates to want in sandbox id.
func (c *cli) evalIs(id, code, want string) {
	c.t.Helper()
	if out := strings.TrimSpace(c.ok("eval", id, "--", code)); out != want {
		c.t.Fatalf("eval %q in %s = %q, want %q", code, id, out, want)
	}
}

// snapshotInfo returns snapshot-info --json of tag.
func (c *cli) snapshotInfo(tag string) map[string]any {
	c.t.Helper()
	var in map[string]any
	testutil.Check(c.t, json.Unmarshal([]byte(c.ok("snapshot-info", tag, "--json")), &in))
	return in
}

// TestBranch is the branch acceptance path on the python image: state in
// the warm interpreter and the in-RAM root of a running child, branched
// in each mode; the source moves on and its branches' children see the
// state as it was, each privately; chains; killing the source at once;
// fork --from and its snapshot's end; rmi of a parent.
func TestBranch(t *testing.T) {
	c := newCLI(t)
	src := c.forkPython(1)[0]
	c.ok("eval", src, "--", "x = 41")
	c.ok("exec", src, "--", "sh", "-c", "head -c 300000 /dev/urandom > /tmp/state.txt")
	sum := c.ok("exec", src, "--", "md5sum", "/tmp/state.txt")

	modes := []string{"full", "diff", "live"}
	for _, mode := range modes {
		var snap struct{ Tag, Status, Mode, Parent string }
		testutil.Check(t, json.Unmarshal([]byte(c.ok("branch", src, "--tag", "b-"+mode, "--mode", mode, "--json")), &snap))
		if snap.Tag != "b-"+mode || snap.Status != "ready" {
			t.Fatalf("branch --mode %s: %+v", mode, snap)
		}
		in := c.snapshotInfo("b-" + mode)
		t.Logf("%s branch: pause %.1f ms, dirty %.1f MiB, layer %.1f MiB, total %.0f ms", mode,
			in["pause_ms"], in["dirty_bytes"].(float64)/(1<<20), in["layer_bytes"].(float64)/(1<<20), in["total_ms"])
		wantParent := "py"
		if mode == "full" {
			wantParent = ""
		}
		if p, _ := in["parent"].(string); p != wantParent {
			t.Errorf("%s branch's parent %q, want %q", mode, p, wantParent)
		}
	}
	// The source moves on; what it does never reaches its branches.
	c.ok("eval", src, "--", "x = 0")
	c.ok("exec", src, "--", "rm", "/tmp/state.txt")

	for _, mode := range modes {
		t.Run(mode, func(t *testing.T) {
			c := c.in(t)
			kids := c.forkIDs("--tag", "b-"+mode, "-n", "5")
			for i, k := range kids {
				c.evalIs(k, "x", "41")
				if got := c.ok("exec", k, "--", "md5sum", "/tmp/state.txt"); got != sum {
					t.Fatalf("child %s of %s: state.txt %q, want %q", k, mode, got, sum)
				}
				c.ok("eval", k, "--", fmt.Sprintf("x = %d", 100+i))
			}
			// Children diverge privately.
			for i, k := range kids {
				c.evalIs(k, "x", fmt.Sprint(100+i))
			}
		})
	}
	c.evalIs(src, "x", "0")
	if _, _, code := c.run("exec", src, "--", "test", "-e", "/tmp/state.txt"); code == 0 {
		t.Fatal("the source got its deleted file back")
	}

	// A chain: a branch of a branch of a branch sees all three states.
	c1 := c.forkIDs("--tag", "b-diff", "-n", "1")[0]
	c.ok("eval", c1, "--", "y = 1")
	c.ok("branch", c1, "--tag", "chain2")
	c2 := c.forkIDs("--tag", "chain2", "-n", "1")[0]
	c.ok("eval", c2, "--", "z = 2")
	c.ok("branch", c2, "--tag", "chain3")
	c3 := c.forkIDs("--tag", "chain3", "-n", "1")[0]
	c.evalIs(c3, "(x, y, z)", "(41, 1, 2)")
	in := c.snapshotInfo("chain3")
	if in["depth"].(float64) != 3 || fmt.Sprint(in["ancestors"]) != "[chain2 b-diff py]" {
		t.Fatalf("chain3 info: depth %v, ancestors %v", in["depth"], in["ancestors"])
	}
	// A parent with dependents is not removed, and the refusal names them.
	if _, errs, code := c.run("rmi", "chain2"); code == 0 || !strings.Contains(errs, "chain3") {
		t.Fatalf("rmi of a parent: exit %d, %q", code, errs)
	}

	// Kill the source right after branching: the branch still forks.
	s2 := c.forkIDs("--tag", "py", "-n", "1")[0]
	c.ok("eval", s2, "--", "w = 'kept'")
	c.ok("branch", s2, "--tag", "orphan")
	c.ok("kill", s2)
	c.evalIs(c.forkIDs("--tag", "orphan", "-n", "1")[0], "w", "'kept'")

	// fork --from: children of the source's current state, in a snapshot
	// of their own that goes with the last of them.
	from := c.forkIDs("--from", src, "-n", "5")
	if len(from) != 5 {
		t.Fatalf("fork --from gave %d children", len(from))
	}
	var eph string
	var images struct {
		Snapshots []struct {
			Tag       string `json:"tag"`
			Ephemeral bool   `json:"ephemeral"`
		} `json:"snapshots"`
	}
	testutil.Check(t, json.Unmarshal([]byte(c.ok("images", "--json")), &images))
	for _, s := range images.Snapshots {
		if s.Ephemeral {
			eph = s.Tag
		}
	}
	if eph == "" {
		t.Fatalf("no snapshot of fork --from in %+v", images)
	}
	for _, k := range from {
		c.evalIs(k, "x", "0")
	}
	c.ok(append([]string{"kill"}, from...)...)
	for deadline := time.Now().Add(10 * time.Second); strings.Contains(c.ok("images"), eph); time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("snapshot %s of fork --from still there after its children were killed", eph)
		}
	}
}
