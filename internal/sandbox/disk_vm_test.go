package sandbox_test

import (
	"bufio"
	"context"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/disk"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/memimage"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
)

// sh runs cmd in sandbox id and returns its output, failing on a
// non-zero exit.
func sh(t *testing.T, e *sandbox.Engine, id, cmd string) string {
	t.Helper()
	out, code := run(t, e, id, cmd)
	if code != 0 {
		t.Fatalf("%s in %s: exit %d: %s", cmd, id, code, out)
	}
	return strings.TrimSpace(out)
}

// anonKiB is the anonymous memory of process pid (its private copies of
// guest pages included), from smaps_rollup.
func anonKiB(t *testing.T, pid int) int {
	t.Helper()
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	testutil.Check(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "Anonymous:"); ok {
			n, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(rest), " kB"))
			testutil.Check(t, err)
			return n
		}
	}
	t.Fatalf("no Anonymous in smaps_rollup of %d", pid)
	return 0
}

// eval evaluates code in sandbox id's warm interpreter.
func eval(t *testing.T, e *sandbox.Engine, id, code string) string {
	t.Helper()
	var v string
	withAgent(t, e, id, func(ctx context.Context, c *agent.Client) {
		res, err := c.Eval(ctx, proto.EvalRequest{Code: code})
		if err != nil || res.Error != nil {
			t.Fatalf("eval %q in %s: %v %+v", code, id, err, res)
		}
		v = res.Value
	})
	return v
}

func dataHash(t *testing.T, path string) string {
	t.Helper()
	h, err := memimage.DataHash(path)
	testutil.Check(t, err)
	return hex.EncodeToString(h)
}

// bigFile is written with O_DIRECT, and read back that way, so that the
// guest's page cache (which the host cannot take back from a guest) holds
// none of it: what the VMM's memory shows is where the file lives.
const (
	writeBig = "dd if=/dev/urandom of=/root/big bs=1M count=200 iflag=fullblock oflag=direct status=none"
	sumBig   = "dd if=/root/big bs=1M iflag=direct status=none | md5sum"
)

// TestDisk is the writable disk on the python image: a child forked with a
// disk writes 200 MiB under /root without its VMM's memory growing by as
// much; it is branched in each mode; five children of each branch see the
// file as it was and diverge privately while the source deletes it; a
// branch's children outlive the source; rmi --force of a parent keeps
// what a dependent's disk needs; compaction flattens a chain's disk into
// one layer; and once all is gone, so are the disk layers. The disk base
// and the layers never change once made.
func TestDisk(t *testing.T) {
	testutil.RequireCommand(t, "qemu-img")
	e := testvm.Engine(t)
	ctx := ctxT(t, 40*time.Minute)
	if _, err := e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: "py", Image: "python"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "py", N: 1, DiskMiB: 32}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("fork with a 32 MiB disk = %v, want InvalidArgument", err)
	}
	const mib = 512
	base, err := e.Images().DiskBase(ctx, mib)
	testutil.Check(t, err)
	baseSum := dataHash(t, base)
	res, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "py", N: 1, DiskMiB: mib})
	if err != nil {
		t.Fatal(err)
	}
	src := res.Children[0].Sandbox
	t.Logf("child with a %d MiB disk ready in %.0f ms", mib, res.Children[0].ReadyMS)
	if got := sh(t, e, src.ID, "df -m / | awk 'NR==2 {print $2}'"); got == "" || got[0] == '0' {
		t.Fatalf("the root's size: %q", got)
	}
	if sh(t, e, src.ID, "df --output=source /tmp | tail -1") != "tmpfs" {
		t.Error("/tmp left RAM")
	}

	before := anonKiB(t, src.Handle.Process.PID)
	t0 := time.Now()
	sh(t, e, src.ID, writeBig)
	sum := sh(t, e, src.ID, sumBig)
	after := anonKiB(t, src.Handle.Process.PID)
	image := filepath.Join(src.Handle.RunDir, "disk.qcow2")
	fi, err := os.Stat(image)
	testutil.Check(t, err)
	t.Logf("200 MiB written and read back in %v: VMM anonymous memory %d -> %d MiB; disk image %d MiB",
		time.Since(t0).Round(time.Millisecond), before>>10, after>>10, fi.Size()>>20)
	if after-before > 64<<10 {
		t.Errorf("the VMM's memory grew by %d MiB writing 200 MiB to the disk", (after-before)>>10)
	}
	if fi.Size() < 200<<20 {
		t.Errorf("the disk image holds %d MiB after a 200 MiB write", fi.Size()>>20)
	}
	eval(t, e, src.ID, "x = 41")

	modes := []string{sandbox.BranchFull, sandbox.BranchDiff, sandbox.BranchLive}
	// Layer path -> the hash of its contents once made. Contents, not
	// data extents: qemu-img leaves unwritten extents, which read as data
	// while their pages are cached and as holes once they are not.
	layers := map[string]string{}
	for _, mode := range modes {
		snap, err := e.Branch(ctx, sandbox.BranchSpec{ID: src.ID, Tag: "b-" + mode, Mode: mode})
		if err != nil {
			t.Fatalf("branch %s: %v", mode, err)
		}
		b := snap.Branch
		if b.Disk == "" || b.DiskMiB != mib {
			t.Fatalf("branch %s: disk %q of %d MiB", mode, b.Disk, b.DiskMiB)
		}
		p := filepath.Join(e.Config().DataDir, "disks", b.Disk+".qcow2")
		layers[p] = testutil.FileSHA256(t, p)
		t.Logf("%s branch: pause %.1f ms (disk switch %.1f ms), %.1f MiB of RAM written, total %.0f ms",
			mode, b.PauseMS, b.DiskSwitchMS, float64(b.DirtyBytes)/(1<<20), b.TotalMS)
	}
	// The source moves on: what it does never reaches its branches.
	sh(t, e, src.ID, "rm /root/big && echo src > /root/own")

	for _, mode := range modes {
		t.Run(mode, func(t *testing.T) {
			res, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "b-" + mode, N: 5})
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range res.Children {
				if c.Sandbox.Disk == nil || c.Sandbox.Disk.MiB != mib {
					t.Fatalf("child %s of %s has disk %+v", c.ID, mode, c.Sandbox.Disk)
				}
				if got := sh(t, e, c.ID, sumBig); got != sum {
					t.Fatalf("child %s of %s: /root/big %q, want %q", c.ID, mode, got, sum)
				}
				if v := eval(t, e, c.ID, "x"); v != "41" {
					t.Fatalf("child %s of %s: x = %s", c.ID, mode, v)
				}
				sh(t, e, c.ID, "echo "+c.ID+" > /root/own && rm /root/big")
			}
			// Each diverged privately.
			for _, c := range res.Children {
				if got := sh(t, e, c.ID, "cat /root/own; test -e /root/big || echo gone"); got != c.ID+"\ngone" {
					t.Fatalf("child %s of %s: %q", c.ID, mode, got)
				}
			}
			for _, c := range res.Children {
				testutil.Check(t, e.Kill(ctx, c.ID))
			}
		})
	}
	if got := sh(t, e, src.ID, "cat /root/own; test -e /root/big || echo gone"); got != "src\ngone" {
		t.Fatalf("the source: %q", got)
	}

	// A chain: a child of the diff branch, branched; its parent removed by
	// force (a dependent's disk backs onto the parent's layer); the
	// source gone.
	c1, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "b-diff", N: 1})
	testutil.Check(t, err)
	sh(t, e, c1.Children[0].ID, "echo chained > /root/own")
	b2, err := e.Branch(ctx, sandbox.BranchSpec{ID: c1.Children[0].ID, Tag: "b2"})
	testutil.Check(t, err)
	p2 := filepath.Join(e.Config().DataDir, "disks", b2.Branch.Disk+".qcow2")
	layers[p2] = testutil.FileSHA256(t, p2)
	testutil.Check(t, e.Kill(ctx, c1.Children[0].ID))
	testutil.Check(t, e.Kill(ctx, src.ID))
	if _, err := e.RemoveSnapshotWith("b-diff", snapshot.RemoveOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	c2, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "b2", N: 1})
	testutil.Check(t, err)
	if got := sh(t, e, c2.Children[0].ID, "cat /root/own; "+sumBig); got != "chained\n"+sum {
		t.Fatalf("child of b2 after rmi --force of its parent: %q", got)
	}
	testutil.Check(t, e.Kill(ctx, c2.Children[0].ID))
	// Compacted, b2's disk stands alone: one layer, which reads the same.
	bc, err := e.Compact(ctx, "b2", "b2c")
	testutil.Check(t, err)
	pc := filepath.Join(e.Config().DataDir, "disks", bc.Branch.Disk+".qcow2")
	if bc.Branch.Disk == b2.Branch.Disk {
		t.Fatalf("compact kept the layer %s", bc.Branch.Disk)
	}
	if back, err := disk.BackingFile(pc); err != nil || back != "" {
		t.Fatalf("the compacted layer backs onto %q (%v)", back, err)
	}
	layers[pc] = testutil.FileSHA256(t, pc)
	c3, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "b2c", N: 1})
	testutil.Check(t, err)
	if got := sh(t, e, c3.Children[0].ID, "cat /root/own; "+sumBig); got != "chained\n"+sum {
		t.Fatalf("child of the compacted b2: %q", got)
	}
	testutil.Check(t, e.Kill(ctx, c3.Children[0].ID))

	for p, h := range layers {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("layer %s: %v", filepath.Base(p), err)
			continue
		}
		if testutil.FileSHA256(t, p) != h {
			t.Errorf("layer %s changed after it was made", filepath.Base(p))
		}
	}
	if dataHash(t, base) != baseSum {
		t.Error("the disk base changed")
	}
	for _, tag := range []string{"b-full", "b-live", "b2", "b2c"} {
		testutil.Check(t, e.RemoveSnapshot(tag))
	}
	left, _ := filepath.Glob(filepath.Join(e.Config().DataDir, "disks", "*.qcow2"))
	if len(left) > 0 {
		t.Errorf("disk layers left once nothing uses them: %v", left)
	}
}

// diskCrashEnv tells a re-executed test binary to be the forkd process
// that dies branching a sandbox's disk: "<data dir>|<sandbox id>".
const diskCrashEnv = "FORKD_TEST_DISK_CRASH"

// TestDiskCrash SIGKILLs a real forkd process (this test binary,
// re-executed) branching a sandbox with a disk, right after the switch
// to the new overlay and before its outcome is recorded. The next
// daemon's reconcile adopts the source, whose record still reads, asks
// its VMM which image its disk writes to and records the new overlay:
// the source keeps its file, a new branch of it carries what it wrote
// after the crash, the cut-short branch is failed, and once all are gone
// no disk layer or image is left.
func TestDiskCrash(t *testing.T) {
	if v := os.Getenv(diskCrashEnv); v != "" {
		dir, id, _ := strings.Cut(v, "|")
		cfg := testvm.Config(t, dir)
		cfg.Fault = func(s string) error {
			if s == "disk-switched" {
				syscall.Kill(os.Getpid(), syscall.SIGKILL)
				select {}
			}
			return nil
		}
		e, err := sandbox.New(cfg)
		testutil.Check(t, err)
		_, err = e.Branch(context.Background(), sandbox.BranchSpec{ID: id, Tag: "crashed"})
		t.Fatalf("still alive after the branch: %v", err)
	}
	testutil.RequireCommand(t, "qemu-img")
	dir := t.TempDir()
	ctx := ctxT(t, 20*time.Minute)
	cli := newEngine(t, dir, false)
	defer cli.Close()
	t.Cleanup(func() {
		d := newEngine(t, dir, true)
		defer d.Close()
		cctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		d.Reconcile(cctx)
		d.KillAll(cctx, "")
	})
	if _, err := cli.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: "py", Image: "python"}); err != nil {
		t.Fatal(err)
	}
	res, err := cli.Fork(ctx, sandbox.ForkSpec{Tag: "py", N: 1, DiskMiB: 64})
	testutil.Check(t, err)
	id := res.Children[0].ID
	sh(t, cli, id, "echo kept > /root/own && sync")

	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), diskCrashEnv+"="+dir+"|"+id)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	testutil.Check(t, cmd.Start())
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	cmd.Wait()
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("the forkd process was not killed (%v):\n%s", cmd.ProcessState, out.String())
	}

	d := newEngine(t, dir, true)
	defer d.Close()
	rep, err := d.Reconcile(ctx)
	testutil.Check(t, err)
	if !slices.Contains(rep.Adopted, id) {
		t.Fatalf("reconcile %+v: the source %s not adopted", rep, id)
	}
	crashed, err := d.Snapshots().Get("crashed")
	if err != nil || crashed.Status != snapshot.StatusFailed {
		t.Fatalf("the cut-short branch: %v, want it failed", err)
	}
	layer, _ := crashed.DiskLayer()
	sb, err := d.State().Get(id)
	testutil.Check(t, err)
	if want := filepath.Join(filepath.Dir(sb.Disk.Image), "disk-"+layer+disk.Ext); sb.Disk.Next != "" || sb.Disk.Image != want {
		t.Fatalf("the source's record after the crash: disk %+v, want it settled on %s", sb.Disk, want)
	}
	if got := sh(t, d, id, "cat /root/own && echo more >> /root/own && sync && cat /root/own"); got != "kept\nkept\nmore" {
		t.Fatalf("the source's disk after the crash: %q", got)
	}
	// Branched again, from the image it writes to.
	if _, err := d.Branch(ctx, sandbox.BranchSpec{ID: id, Tag: "again"}); err != nil {
		t.Fatalf("branch of a source whose disk was settled: %v", err)
	}
	res, err = d.Fork(ctx, sandbox.ForkSpec{Tag: "again", N: 1})
	testutil.Check(t, err)
	if got := sh(t, d, res.Children[0].ID, "cat /root/own"); got != "kept\nmore" {
		t.Errorf("the branch's child reads %q", got)
	}
	// The failed branch names its disk layer until it is removed.
	testutil.Check(t, d.Kill(ctx, res.Children[0].ID))
	testutil.Check(t, d.Kill(ctx, id))
	testutil.Check(t, d.RemoveSnapshot("again"))
	testutil.Check(t, d.RemoveSnapshot("crashed"))
	if _, err := d.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	for _, glob := range []string{"disks/*.qcow2", "run/*", "snapshots/.staging-*", "snapshots/crashed", "snapshots/again"} {
		if left, _ := filepath.Glob(filepath.Join(dir, glob)); len(left) > 0 {
			t.Errorf("left after the kill: %v", left)
		}
	}
}
