package e2e

import (
	"bufio"
	"crypto/rand"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/testutil"
)

// forkPython snapshots the python image (once per cli) and forks n children.
func (c *cli) forkPython(n int, extra ...string) []string {
	c.t.Helper()
	testutil.RequireRoot(c.t)
	if _, _, code := c.run("images", "--json"); code != 0 {
		c.t.Fatal("images failed")
	}
	if !strings.Contains(c.ok("images", "--json"), `"tag": "py"`) {
		c.ok(append([]string{"snapshot", "--tag", "py", "--image", "python"}, extra...)...)
	}
	var fork struct {
		Children []struct{ ID string } `json:"children"`
	}
	if err := json.Unmarshal([]byte(c.ok("fork", "--tag", "py", "-n", strconv.Itoa(n), "--json")), &fork); err != nil {
		c.t.Fatal(err)
	}
	ids := make([]string, n)
	for i, ch := range fork.Children {
		ids[i] = ch.ID
	}
	return ids
}

func TestEvalWarmInterpreter(t *testing.T) {
	c := newCLI(t)
	ids := c.forkPython(2)
	a, b := ids[0], ids[1]

	c.ok("eval", a, "--", "x = 41")
	if out := c.ok("eval", a, "--", "x + 1"); out != "42\n" {
		t.Fatalf("x + 1 = %q", out)
	}
	_, errs, code := c.run("eval", b, "--", "x")
	if code != 1 || !strings.Contains(errs, "NameError") || !strings.Contains(errs, "Traceback") {
		t.Fatalf("x in a sibling: exit %d, %q", code, errs)
	}
	// numpy was imported before the snapshot: it is loaded, and importing
	// it again costs next to nothing.
	if out := c.ok("eval", b, "--", "import sys; 'numpy' in sys.modules"); out != "True\n" {
		t.Fatalf("numpy preloaded = %q", out)
	}
	out := c.ok("eval", b, "--", "import time; t0 = time.perf_counter(); import numpy; time.perf_counter() - t0")
	if secs, err := strconv.ParseFloat(strings.TrimSpace(out), 64); err != nil || secs > 0.01 {
		t.Fatalf("import numpy took %q s", out)
	}
	if out := c.ok("eval", a, "--", "numpy.zeros(5).sum()"); out != "0.0\n" {
		t.Fatalf("numpy.zeros(5).sum() = %q", out)
	}
	// A hanging eval is interrupted by its timeout; the interpreter lives.
	start := time.Now()
	_, errs, code = c.run("eval", a, "--timeout", "2", "--", "while True: pass")
	if code != 1 || !strings.Contains(strings.ToLower(errs), "timed out") {
		t.Fatalf("while True with --timeout 2: exit %d, %q", code, errs)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("timeout took %s", d)
	}
	if out := c.ok("eval", a, "--", "x"); out != "41\n" {
		t.Fatalf("state after a timeout = %q", out)
	}
	// Code on stdin, statements then an expression, captured stdout.
	cmd := exec.Command(forkdBin, "eval", a)
	cmd.Env = c.env
	cmd.Stdin = strings.NewReader("for i in range(3):\n    print(i)\nx * 2\n")
	got, err := cmd.Output()
	if err != nil || string(got) != "0\n1\n2\n82\n" {
		t.Fatalf("eval from stdin = %q, %v", got, err)
	}
}

func TestCloneHygiene(t *testing.T) {
	c := newCLI(t)
	ids := c.forkPython(2)
	var rnd []string
	for _, id := range ids {
		rnd = append(rnd, c.ok("exec", id, "--", "sh", "-c", "head -c 16 /dev/urandom | od -An -tx1"))
		before := float64(time.Now().UnixNano()) / 1e9
		out := c.ok("exec", id, "--", "date", "+%s.%N")
		after := float64(time.Now().UnixNano()) / 1e9
		guest, err := strconv.ParseFloat(strings.TrimSpace(out), 64)
		if err != nil {
			t.Fatal(err)
		}
		if guest < before-1 || guest > after+1 {
			t.Fatalf("%s clock %.3f outside host [%.3f, %.3f] ± 1 s", id, guest, before, after)
		}
		if h := strings.TrimSpace(c.ok("exec", id, "--", "hostname")); h != id {
			t.Fatalf("hostname %q, want %q", h, id)
		}
	}
	if rnd[0] == rnd[1] {
		t.Fatalf("two children read the same random bytes: %s", rnd[0])
	}
	// The warm interpreter's own RNGs were reseeded too.
	r0 := c.ok("eval", ids[0], "--", "import random; random.random()")
	r1 := c.ok("eval", ids[1], "--", "import random; random.random()")
	if r0 == r1 {
		t.Fatalf("random.random() equal in two children: %s", r0)
	}
}

func TestExecStreams(t *testing.T) {
	c := newCLI(t)
	ids := c.forkPython(1)
	cmd := exec.Command(forkdBin, "exec", ids[0], "--", "sh", "-c", "for i in 1 2 3 4 5 6 7 8 9 10; do echo line$i; sleep 0.2; done")
	cmd.Env = c.env
	stdout, _ := cmd.StdoutPipe()
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(stdout)
	var first time.Duration
	n := 0
	for sc.Scan() {
		if n == 0 {
			first = time.Since(start)
		}
		n++
	}
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	total := time.Since(start)
	if n != 10 {
		t.Fatalf("%d lines", n)
	}
	// The command runs ≥ 1.8 s; its first line must come well before the end.
	if total-first < time.Second {
		t.Fatalf("first line after %s of %s: output was not streamed", first, total)
	}
}

func TestCopyAndPrivateWrites(t *testing.T) {
	c := newCLI(t)
	testutil.RequireRoot(t)
	c.ok("snapshot", "--tag", "big", "--image", "python", "--mem-size-mib", "512")
	var fork struct {
		Children []struct{ ID string } `json:"children"`
	}
	testutil.Check(t, json.Unmarshal([]byte(c.ok("fork", "--tag", "big", "-n", "2", "--json")), &fork))
	if len(fork.Children) != 2 {
		t.Fatalf("fork -n 2 made %d children", len(fork.Children))
	}
	a, b := fork.Children[0].ID, fork.Children[1].ID
	type snapshotView struct {
		Tag       string `json:"tag"`
		Status    string `json:"status"`
		SizeBytes int64  `json:"size_bytes"`
		Refcount  int    `json:"refcount"`
		Error     string `json:"error"`
	}
	var img struct {
		Snapshots []snapshotView `json:"snapshots"`
	}
	big := func() snapshotView {
		t.Helper()
		img.Snapshots = nil
		if err := json.Unmarshal([]byte(c.ok("images", "--json")), &img); err != nil {
			t.Fatal(err)
		}
		if len(img.Snapshots) != 1 || img.Snapshots[0].Tag != "big" {
			t.Fatalf("images: %+v, want only big", img.Snapshots)
		}
		return img.Snapshots[0]
	}
	before := big()

	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.CopyN(f, rand.Reader, 100<<20); err != nil {
		t.Fatal(err)
	}
	testutil.Close(t, src, f)
	start := time.Now()
	c.ok("cp", src, a+":/root/big")
	in := time.Since(start)
	start = time.Now()
	c.ok("cp", a+":/root/big", filepath.Join(dir, "back"))
	out := time.Since(start)
	t.Logf("100 MiB cp: in %s, out %s", in, out)
	if testutil.FileSHA256(t, src) != testutil.FileSHA256(t, filepath.Join(dir, "back")) {
		t.Fatal("100 MiB file changed in the round trip")
	}
	if got := strings.Fields(c.ok("exec", a, "--", "sha256sum", "/root/big"))[0]; got != testutil.FileSHA256(t, src) {
		t.Fatalf("guest sha256 %s", got)
	}
	// Writes stay private: not in the sibling, not in the shared image.
	c.ok("exec", a, "--", "sh", "-c", "echo mine > /etc/forkd-private && rm /usr/bin/env")
	if _, _, code := c.run("exec", b, "--", "test", "-e", "/root/big"); code == 0 {
		t.Fatal("sibling sees /root/big")
	}
	if _, _, code := c.run("exec", b, "--", "test", "-e", "/etc/forkd-private"); code == 0 {
		t.Fatal("sibling sees /etc/forkd-private")
	}
	if _, _, code := c.run("exec", b, "--", "test", "-e", "/usr/bin/env"); code != 0 {
		t.Fatal("a deletion in one child reached its sibling")
	}
	// The snapshot both children run from is untouched by their writes:
	// still ready and no bigger on disk (a 100 MiB file that reached it
	// would show), used by exactly those two.
	if after := big(); after.Status != "ready" || after.Error != "" || after.SizeBytes != before.SizeBytes || after.Refcount != 2 {
		t.Fatalf("snapshot big after the children's writes: %+v, before them: %+v", after, before)
	}
	// A fresh child of the same snapshot sees the pristine image.
	testutil.Check(t, json.Unmarshal([]byte(c.ok("fork", "--tag", "big", "-n", "1", "--json")), &fork))
	if _, _, code := c.run("exec", fork.Children[0].ID, "--", "test", "-e", "/usr/bin/env"); code != 0 {
		t.Fatal("the shared image lost /usr/bin/env")
	}
}
