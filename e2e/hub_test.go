package e2e

import (
	"bytes"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/testutil"
)

// hubForks is how many children fork from a pulled snapshot.
const hubForks = 10

// transfer is the --json summary of push, pull, pack and unpack.
type transfer struct {
	Tag             string `json:"tag"`
	Digest          string `json:"digest"`
	BlobBytes       int64  `json:"blob_bytes"`
	MovedBytes      int64  `json:"moved_bytes"`
	NetSentBytes    int64  `json:"net_sent_bytes"`
	NetReceived     int64  `json:"net_received_bytes"`
	MemoryBytes     int64  `json:"memory_bytes"`
	MemoryBlobBytes int64  `json:"memory_blob_bytes"`
	CachedBytes     int64  `json:"cached_bytes"`
	Links           []struct {
		Tag string `json:"tag"`
		New bool   `json:"new"`
	} `json:"links"`
	Seconds float64 `json:"seconds"`
}

// hubOK runs forkd args... --json with stdin and returns its summary.
func (c *cli) hubOK(stdin string, args ...string) transfer {
	c.t.Helper()
	cmd := exec.Command(forkdBin, append(args, "--json")...)
	cmd.Env = c.env
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		c.t.Fatalf("forkd %s: %v\n%s", strings.Join(args, " "), err, errb.String())
	}
	var tr transfer
	testutil.Check(c.t, json.Unmarshal(out.Bytes(), &tr))
	return tr
}

// forkEvalNumpy forks n children of tag and checks each evaluates numpy.
func (c *cli) forkEvalNumpy(tag string, n int) {
	c.t.Helper()
	for _, id := range c.forkIDs("--tag", tag, "-n", strconv.Itoa(n)) {
		c.evalIs(id, "numpy.zeros(5).sum()", "0.0")
	}
}

// TestHubPushPullFork is the hub's acceptance path through the CLI: the
// python snapshot pushed to a real registry (Debian's docker-registry,
// self-signed TLS, htpasswd) and pulled by digest into an empty data dir,
// whose children eval numpy; a missing password refused; a second
// snapshot of the image not sending its root filesystem again; a
// depth-2 chain pulled where its base is moving only its links; a pull
// killed half-way leaves no tag and the next one resumes; pack and unpack
// into another data dir, which forks too. Sizes and times are logged for
// docs/benchmarks.md, not asserted.
func TestHubPushPullFork(t *testing.T) {
	src := newCLI(t)
	testutil.RequireRoot(t)
	reg := testutil.StartRegistryWith(t, testutil.RegistryOptions{TLS: true, Auth: true})
	auth := []string{"--username", reg.User, "--password-stdin", "--ca-file", reg.CAFile}
	start := time.Now()
	src.ok("snapshot", "--tag", "py", "--image", "python")
	t.Logf("python snapshot built in %.1fs", time.Since(start).Seconds())

	ref := reg.Addr + "/forkd/python:v1"
	if _, errs, code := src.run("push", "py", ref, "--username", reg.User, "--ca-file", reg.CAFile); code == 0 || !strings.Contains(errs, "401") {
		t.Errorf("push without the password: exit %d, %q", code, errs)
	}
	push := src.hubOK(reg.Password, append([]string{"push", "py", ref}, auth...)...)
	t.Logf("push python: %d MiB RAM -> %d bytes of memory blobs (%.0fx RAM), %d bytes in all, %.1fs",
		push.MemoryBytes>>20, push.MemoryBlobBytes, float64(push.MemoryBytes)/float64(push.MemoryBlobBytes), push.MovedBytes, push.Seconds)

	// A second snapshot of the image, with the RAM of the original forkd's
	// python snapshot: the registry gains its memory and state only.
	src.ok("snapshot", "--tag", "py512", "--image", "python", "--mem-size-mib", "512")
	n1, size1 := reg.Blobs(t)
	push2 := src.hubOK(reg.Password, append([]string{"push", "py512", reg.Addr + "/forkd/python:v512"}, auth...)...)
	n2, size2 := reg.Blobs(t)
	t.Logf("push python 512 MiB: %d bytes of memory blobs (%.0fx RAM), %d bytes sent of %d, %.1fs; registry +%d blobs, +%d bytes",
		push2.MemoryBlobBytes, float64(push2.MemoryBytes)/float64(push2.MemoryBlobBytes), push2.MovedBytes, push2.BlobBytes, push2.Seconds, n2-n1, size2-size1)
	if size2-size1 >= push.BlobBytes-push.MemoryBlobBytes {
		t.Errorf("the second snapshot of the image grew the registry by %d bytes: its root filesystem went again", size2-size1)
	}
	src.ok("snapshot", "--tag", "mini", "--image", "minimal")
	mini := src.hubOK(reg.Password, append([]string{"push", "mini", reg.Addr + "/forkd/minimal:v1"}, auth...)...)
	t.Logf("push minimal: %d MiB RAM -> %d bytes of memory blobs (%.0fx RAM), %d bytes in all, %.1fs",
		mini.MemoryBytes>>20, mini.MemoryBlobBytes, float64(mini.MemoryBytes)/float64(mini.MemoryBlobBytes), mini.MovedBytes, mini.Seconds)

	dst := newCLI(t)
	start = time.Now()
	pull := dst.hubOK(reg.Password, append([]string{"pull", reg.Addr + "/forkd/python@" + push.Digest}, auth...)...)
	if pull.Tag != "py" || pull.Digest != push.Digest {
		t.Fatalf("pull: %+v; pushed %s", pull, push.Digest)
	}
	if images := dst.ok("images"); !strings.Contains(images, "forkd/python@"+push.Digest+" ("+push.Digest[:len("sha256:")+12]+")") {
		t.Errorf("images does not say where py came from:\n%s", images)
	}
	dst.forkEvalNumpy("py", hubForks)
	t.Logf("pull python: %d bytes received, %.1fs; pull to %d children answering: %.1fs",
		pull.NetReceived, pull.Seconds, hubForks, time.Since(start).Seconds())

	// A depth-2 chain of branches, pulled where its base is: only the
	// links move, and its children see both links' state.
	c1 := src.forkIDs("--tag", "py", "-n", "1")[0]
	src.ok("eval", c1, "--", "y = 1")
	src.ok("branch", c1, "--tag", "l1", "--mode", "diff")
	c2 := src.forkIDs("--tag", "l1", "-n", "1")[0]
	src.ok("eval", c2, "--", "z = 2")
	src.ok("branch", c2, "--tag", "l2", "--mode", "diff")
	chain := src.hubOK(reg.Password, append([]string{"push", "l2", reg.Addr + "/forkd/python:l2"}, auth...)...)
	cpull := dst.hubOK(reg.Password, append([]string{"pull", reg.Addr + "/forkd/python:l2"}, auth...)...)
	if len(cpull.Links) != 3 || cpull.Links[0].New || !cpull.Links[1].New || !cpull.Links[2].New ||
		cpull.MovedBytes >= push.MemoryBlobBytes {
		t.Errorf("chain pull where its base is: links %+v, %d bytes moved (the base's memory alone is %d)", cpull.Links, cpull.MovedBytes, push.MemoryBlobBytes)
	}
	dst.evalIs(dst.forkIDs("--tag", "l2", "-n", "1")[0], "(y, z, numpy.zeros(5).sum())", "(1, 2, 0.0)")
	t.Logf("depth-2 chain: push %d bytes sent, %.1fs; pull where the base is: %d bytes moved, %.1fs",
		chain.MovedBytes, chain.Seconds, cpull.MovedBytes, cpull.Seconds)

	// A pull killed half-way leaves no tag; run again, it fetches only
	// the blobs it had not verified.
	cut := newCLI(t)
	byDigest := reg.Addr + "/forkd/python@" + push.Digest
	cmd := exec.Command(forkdBin, append([]string{"pull", byDigest}, auth...)...)
	cmd.Env, cmd.Stdin = cut.env, strings.NewReader(reg.Password)
	testutil.Check(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	for verified(t, filepath.Join(cut.data, "hub", "blobs", "sha256")) < 3 {
		select {
		case err := <-exited:
			t.Fatalf("the pull ended (%v) before it could be killed half-way", err)
		case <-time.After(20 * time.Millisecond):
		}
	}
	testutil.Check(t, cmd.Process.Kill())
	<-exited
	if out, _, code := cut.run("snapshot-info", "py"); code == 0 {
		t.Fatalf("a killed pull left its tag:\n%s", out)
	}
	resumed := cut.hubOK(reg.Password, append([]string{"pull", byDigest}, auth...)...)
	if resumed.CachedBytes == 0 || resumed.MovedBytes+resumed.CachedBytes > resumed.BlobBytes {
		t.Errorf("resumed pull: %d bytes fetched, %d from its cache, of %d", resumed.MovedBytes, resumed.CachedBytes, resumed.BlobBytes)
	}
	t.Logf("resumed pull: %d bytes fetched, %d verified from the killed pull", resumed.MovedBytes, resumed.CachedBytes)

	pack := filepath.Join(t.TempDir(), "py.tar")
	src.hubOK("", "pack", "py", pack)
	third := newCLI(t)
	third.hubOK("", "unpack", pack, "--tag", "unpacked")
	third.forkEvalNumpy("unpacked", 1)
}

// verified counts the blobs in a pull cache (not the temporary files).
func verified(t *testing.T, dir string) int {
	ents, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), ".") {
			n++
		}
	}
	return n
}
