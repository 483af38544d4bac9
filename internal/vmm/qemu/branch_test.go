package qemu_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
	"github.com/forkd/forkd/internal/vmm"
	"github.com/forkd/forkd/internal/vmm/qemu"
)

// branchEnv is a parent snapshot and what its tests share.
type branchEnv struct {
	be   *qemu.Backend
	dir  string
	root vmm.RestoreSpec // the parent snapshot
	n    int
}

// TestBranch branches running children of a real snapshot, paused
// (SaveDevices + their private pages) and live (SaveLive), restores
// children of the branches and checks they carry the branched guest's
// files and keep running.
func TestBranch(t *testing.T) {
	e := &branchEnv{be: testvm.Backend(t), dir: t.TempDir()}
	img := testvm.Image(t, "minimal")
	e.root = e.snapshot(t, img)
	rootSum := testutil.FileSHA256(t, e.root.MemoryFile)
	t.Run("SaveDevices", e.saveDevices)
	t.Run("SaveLiveFailures", e.saveLiveFailures)
	t.Run("SaveLive", e.saveLive)
	if got := testutil.FileSHA256(t, e.root.MemoryFile); got != rootSum {
		t.Fatal("the parent snapshot's memory file changed")
	}
}

func testCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func (e *branchEnv) name() string {
	e.n++
	return fmt.Sprintf("br%d-%d", os.Getpid(), e.n)
}

// snapshot boots the parent and saves it. A booted machine cannot be
// saved live: its RAM is the memory file.
func (e *branchEnv) snapshot(t *testing.T, img *image.Image) vmm.RestoreSpec {
	t.Helper()
	ctx := testCtx(t, 5*time.Minute)
	name := e.name()
	spec := vmm.BootSpec{
		Name:       name,
		RunDir:     filepath.Join(e.dir, name),
		Resources:  vmm.Resources{MemoryMiB: 256, VCPUs: 1},
		Kernel:     img.Kernel,
		Initrd:     img.Initrd,
		Cmdline:    img.Cmdline,
		MemoryFile: filepath.Join(e.dir, "root.mem"),
		ConsoleLog: filepath.Join(e.dir, name+".console"),
	}
	m, err := e.be.Boot(ctx, spec)
	if err != nil {
		t.Fatalf("Boot: %v", err)
	}
	defer stopMachine(t, m)
	c, err := sandbox.DialAgent(ctx, m, agent.Options{})
	if err != nil {
		b, _ := os.ReadFile(spec.ConsoleLog)
		t.Fatalf("parent agent: %v\nconsole:\n%s", err, b)
	}
	c.Close()
	_, err = m.(vmm.LiveSaver).SaveLive(ctx, vmm.LiveSaveSpec{
		StateFile: filepath.Join(e.dir, "never.state"),
		Page:      func(uint64, []byte) error { return nil },
	})
	if !errdefs.IsFailedPrecondition(err) {
		t.Errorf("SaveLive of a booted machine = %v, want FailedPrecondition", err)
	}
	if err := m.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(e.dir, "root.state")
	if err := m.SaveState(ctx, vmm.SaveSpec{StateFile: state}); err != nil {
		t.Fatalf("SaveState: %v", err)
	}
	return vmm.RestoreSpec{Config: m.Handle().Config, MemoryFile: spec.MemoryFile, StateFile: state}
}

func stopMachine(t *testing.T, m vmm.Machine) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := m.Stop(ctx); err != nil {
		t.Logf("Stop: %v", err)
	}
}

// child restores a machine from snap and connects to its agent.
func (e *branchEnv) child(t *testing.T, snap vmm.RestoreSpec) (vmm.Machine, *agent.Client) {
	t.Helper()
	ctx := testCtx(t, 3*time.Minute)
	spec := snap
	spec.Name = e.name()
	spec.RunDir = filepath.Join(e.dir, spec.Name)
	m, err := e.be.Restore(ctx, spec)
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	t.Cleanup(func() { stopMachine(t, m) })
	c, err := sandbox.DialAgent(ctx, m, agent.Options{})
	if err != nil {
		t.Fatalf("agent of restored child: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return m, c
}

// sh runs a shell command in the guest and returns its stdout.
func sh(t *testing.T, c *agent.Client, cmd string) string {
	t.Helper()
	ctx := testCtx(t, time.Minute)
	var out, errb bytes.Buffer
	res, err := c.Exec(ctx, agent.ExecRequest{Shell: cmd, Stdout: &out, Stderr: &errb})
	if err != nil {
		t.Fatalf("exec %q: %v", cmd, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("exec %q: exit %d: %s", cmd, res.ExitCode, errb.String())
	}
	return strings.TrimSpace(out.String())
}

// guestState is what a branch must carry over.
type guestState struct {
	marker, blobSum string
}

// writeState writes files into the guest's RAM-backed root and starts a
// counter that shows whether the guest runs.
func writeState(t *testing.T, c *agent.Client, marker string, churn bool) guestState {
	t.Helper()
	sh(t, c, "echo "+marker+" > /tmp/marker && head -c 6291456 /dev/urandom > /tmp/blob")
	st := guestState{marker: marker, blobSum: sh(t, c, "md5sum /tmp/blob")}
	loop := "i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done"
	if churn {
		// Keeps rewriting 8 MiB of fresh random data for a while, so
		// that a live save must chase dirty pages.
		loop = "i=0; while [ $i -lt 400 ]; do i=$((i+1)); echo $i > /tmp/counter; head -c 8388608 /dev/urandom > /tmp/churn; done; " + loop
	}
	ctx := testCtx(t, time.Minute)
	if _, err := c.Exec(ctx, agent.ExecRequest{Shell: loop, Background: true}); err != nil {
		t.Fatalf("start counter: %v", err)
	}
	counter(t, c) // it runs
	return st
}

// counter returns the guest's counter once it has moved on.
func counter(t *testing.T, c *agent.Client) int {
	t.Helper()
	read := func() int {
		n, _ := strconv.Atoi(sh(t, c, "cat /tmp/counter 2>/dev/null || echo 0"))
		return n
	}
	first := read()
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		if n := read(); n > first {
			return n
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("guest counter stuck at %d", first)
	return 0
}

// checkBranch restores two children of snap and checks each sees want and
// runs.
func (e *branchEnv) checkBranch(t *testing.T, snap vmm.RestoreSpec, want guestState) {
	t.Helper()
	memSum := testutil.FileSHA256(t, snap.MemoryFile)
	for i := range 2 {
		_, c := e.child(t, snap)
		if got := sh(t, c, "cat /tmp/marker"); got != want.marker {
			t.Errorf("child %d of the branch: marker %q, want %q", i, got, want.marker)
		}
		if got := sh(t, c, "md5sum /tmp/blob"); got != want.blobSum {
			t.Errorf("child %d of the branch: blob %q, want %q", i, got, want.blobSum)
		}
		counter(t, c)
		sh(t, c, "echo child"+strconv.Itoa(i)+" > /tmp/own")
	}
	if testutil.FileSHA256(t, snap.MemoryFile) != memSum {
		t.Error("the branch's memory file changed while its children ran")
	}
}

func (e *branchEnv) saveDevices(t *testing.T) {
	m, c := e.child(t, e.root)
	want := writeState(t, c, "paused-branch-"+e.name(), false)
	c.Close() // the snapshot records the agent channel as the parent's: closed
	ctx := testCtx(t, 3*time.Minute)
	ds := m.(vmm.DeviceSaver)
	out := filepath.Join(e.dir, "devices.state")
	err := ds.SaveDevices(ctx, vmm.DeviceSaveSpec{StateFile: out, BaseState: e.root.StateFile})
	if !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("SaveDevices of a running machine = %v, want FailedPrecondition", err)
	}
	mem := filepath.Join(e.dir, "devices.mem")
	sparseCopy(t, e.root.MemoryFile, mem)

	t0 := time.Now()
	if err := m.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	t1 := time.Now()
	if err := ds.SaveDevices(ctx, vmm.DeviceSaveSpec{StateFile: out, BaseState: e.root.StateFile}); err != nil {
		t.Fatalf("SaveDevices: %v", err)
	}
	t2 := time.Now()
	pages := copyPrivatePages(t, m, mem)
	t3 := time.Now()
	if err := m.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	t4 := time.Now()
	t.Logf("paused branch: pause %v, SaveDevices %v, %d private pages copied in %v, resume %v: guest paused %v",
		t1.Sub(t0), t2.Sub(t1), pages, t3.Sub(t2), t4.Sub(t3), t4.Sub(t0))

	// A bad or missing base state is the caller's error.
	bad := filepath.Join(e.dir, "bad.state")
	testutil.WriteFile(t, bad, []byte("QEVM\x00\x00\x00\x03\x07\xff\xff\xff\xff"), 0o600)
	if err := m.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	if err := ds.SaveDevices(ctx, vmm.DeviceSaveSpec{StateFile: bad + ".out", BaseState: bad}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("SaveDevices on a malformed base = %v, want InvalidArgument", err)
	}
	if err := ds.SaveDevices(ctx, vmm.DeviceSaveSpec{StateFile: bad + ".out", BaseState: bad + ".missing"}); !errdefs.IsNotFound(err) {
		t.Errorf("SaveDevices on a missing base = %v, want NotFound", err)
	}
	if _, err := os.Stat(bad + ".out"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("failed SaveDevices left a state file (%v)", err)
	}
	if err := m.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	c2, err := sandbox.DialAgent(ctx, m, agent.Options{})
	if err != nil {
		t.Fatalf("agent of the branched child: %v", err)
	}
	defer c2.Close()
	counter(t, c2) // the branched child runs on

	snap := vmm.RestoreSpec{Config: e.root.Config, MemoryFile: mem, StateFile: out}
	e.checkBranch(t, snap, want)

	// A branch of the branch: its base state is itself spliced.
	m3, c3 := e.child(t, snap)
	want3 := writeState(t, c3, "second-generation-"+e.name(), false)
	c3.Close()
	mem3 := filepath.Join(e.dir, "devices3.mem")
	sparseCopy(t, mem, mem3)
	if err := m3.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	out3 := filepath.Join(e.dir, "devices3.state")
	if err := m3.(vmm.DeviceSaver).SaveDevices(ctx, vmm.DeviceSaveSpec{StateFile: out3, BaseState: out}); err != nil {
		t.Fatalf("SaveDevices of a grandchild: %v", err)
	}
	copyPrivatePages(t, m3, mem3)
	if err := m3.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	e.checkBranch(t, vmm.RestoreSpec{Config: e.root.Config, MemoryFile: mem3, StateFile: out3}, want3)
}

func (e *branchEnv) saveLive(t *testing.T) {
	m, c := e.child(t, e.root)
	want := writeState(t, c, "live-branch-"+e.name(), true)
	c.Close()
	ctx := testCtx(t, 5*time.Minute)
	mem := filepath.Join(e.dir, "live.mem")
	sparseCopy(t, e.root.MemoryFile, mem)
	f, err := os.OpenFile(mem, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	// Pages with data are written at once; zero pages are punched out
	// of the copy once the save is done, in runs, so that the sink stays
	// fast: under TCG the final pause waits for it.
	seen := make([]bool, fi.Size()/4096)
	zero := make([]bool, len(seen))
	page := func(off uint64, data []byte) error {
		i := off / 4096
		if off%4096 != 0 || i >= uint64(len(seen)) {
			return fmt.Errorf("page offset %#x out of range", off)
		}
		seen[i], zero[i] = true, data == nil
		if data == nil {
			return nil
		}
		_, err := f.WriteAt(data, int64(off))
		return err
	}
	out := filepath.Join(e.dir, "live.state")
	start := time.Now()
	st, err := m.(vmm.LiveSaver).SaveLive(ctx, vmm.LiveSaveSpec{StateFile: out, Page: page})
	if err != nil {
		t.Fatalf("SaveLive: %v", err)
	}
	t.Logf("live branch of a guest rewriting 8 MiB in a loop: downtime %v, total %v (call %v), %d MiB transferred, %d pages, %d resent by the final check",
		st.Downtime, st.Total, time.Since(start), st.Transferred>>20, st.Pages, st.Resent)
	for i, ok := range seen {
		if !ok {
			t.Fatalf("page %d of guest RAM never delivered", i)
		}
	}
	if st.Pages < int64(len(seen)) || st.Transferred <= 0 || st.Total <= 0 || st.Downtime <= 0 {
		t.Errorf("stats %+v for %d pages", st, len(seen))
	}
	for i := 0; i < len(zero); {
		j := i
		for j < len(zero) && zero[j] {
			j++
		}
		if j > i {
			if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(i)*4096, int64(j-i)*4096); err != nil {
				t.Fatal(err)
			}
		}
		i = j + 1
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	c2, err := sandbox.DialAgent(ctx, m, agent.Options{})
	if err != nil {
		t.Fatalf("agent after SaveLive: %v", err)
	}
	defer c2.Close()
	counter(t, c2) // the source runs on
	e.checkBranch(t, vmm.RestoreSpec{Config: e.root.Config, MemoryFile: mem, StateFile: out}, want)
}

// saveLiveFailures checks that a live save that fails leaves the machine
// running and no state file.
func (e *branchEnv) saveLiveFailures(t *testing.T) {
	m, c := e.child(t, e.root)
	defer c.Close()
	ls := m.(vmm.LiveSaver)
	out := filepath.Join(e.dir, "failed.state")
	ctx := testCtx(t, 5*time.Minute)
	running := func(what string) {
		t.Helper()
		if _, err := os.Stat(out); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s: state file left (%v)", what, err)
		}
		counter(t, c)
	}
	writeState(t, c, "failures", false)

	boom := errors.New("boom")
	n := 0
	_, err := ls.SaveLive(ctx, vmm.LiveSaveSpec{StateFile: out, Page: func(uint64, []byte) error {
		if n++; n > 2000 {
			return boom
		}
		return nil
	}})
	if !errors.Is(err, boom) {
		t.Fatalf("SaveLive with a failing sink = %v, want boom", err)
	}
	running("failing sink")

	cctx, cancel := context.WithCancel(ctx)
	n = 0
	_, err = ls.SaveLive(cctx, vmm.LiveSaveSpec{StateFile: out, Page: func(uint64, []byte) error {
		if n++; n == 2000 {
			cancel()
		}
		return nil
	}})
	cancel()
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("SaveLive whose ctx ended = %v, want context.Canceled", err)
	}
	running("ctx ended")

	_, err = ls.SaveLive(ctx, vmm.LiveSaveSpec{StateFile: out, Timeout: 300 * time.Millisecond,
		Page: func(uint64, []byte) error { time.Sleep(50 * time.Microsecond); return nil }})
	if !errdefs.IsDeadlineExceeded(err) {
		t.Fatalf("SaveLive past its timeout = %v, want DeadlineExceeded", err)
	}
	running("timeout")

	if err := m.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	_, err = ls.SaveLive(ctx, vmm.LiveSaveSpec{StateFile: out, Page: func(uint64, []byte) error { return nil }})
	if !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("SaveLive of a paused machine = %v, want FailedPrecondition", err)
	}
	if err := m.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	running("paused")
}

// sparseCopy copies src to dst, leaving src's holes as holes.
func sparseCopy(t *testing.T, src, dst string) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		t.Fatal(err)
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if err := out.Truncate(fi.Size()); err != nil {
		t.Fatal(err)
	}
	for off := int64(0); off < fi.Size(); {
		data, err := unix.Seek(int(in.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		hole, err := unix.Seek(int(in.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := out.Seek(data, io.SeekStart); err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(out, io.NewSectionReader(in, data, hole-data)); err != nil {
			t.Fatal(err)
		}
		off = hole
	}
	if err := out.Sync(); err != nil {
		t.Fatal(err)
	}
}

// copyPrivatePages copies the pages m's guest wrote (its private pages,
// found in /proc/PID/pagemap) from /proc/PID/mem into the memory file mem,
// and returns how many.
func copyPrivatePages(t *testing.T, m vmm.Machine, mem string) int {
	t.Helper()
	mm, err := m.Memory(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	r := mm.Regions[0]
	pid := strconv.Itoa(mm.PID)
	pm, err := os.Open(filepath.Join(proc.Root, pid, "pagemap"))
	if err != nil {
		t.Fatal(err)
	}
	defer pm.Close()
	src, err := os.Open(filepath.Join(proc.Root, pid, "mem"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := os.OpenFile(mem, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	n := int(r.Size / 4096)
	entries := make([]byte, n*8)
	if _, err := pm.ReadAt(entries, int64(r.HostAddr/4096*8)); err != nil {
		t.Fatalf("pagemap: %v", err)
	}
	private := func(i int) bool {
		e := binary.LittleEndian.Uint64(entries[i*8:])
		present, swapped, file := e>>63&1 == 1, e>>62&1 == 1, e>>61&1 == 1
		return (present && !file) || swapped
	}
	buf := make([]byte, 256*4096)
	count := 0
	for i := 0; i < n; {
		if !private(i) {
			i++
			continue
		}
		j := i
		for j < n && j-i < 256 && private(j) {
			j++
		}
		b := buf[:(j-i)*4096]
		if _, err := src.ReadAt(b, int64(r.HostAddr)+int64(i)*4096); err != nil {
			t.Fatalf("guest memory: %v", err)
		}
		if _, err := dst.WriteAt(b, int64(i)*4096); err != nil {
			t.Fatal(err)
		}
		count += j - i
		i = j
	}
	if err := dst.Sync(); err != nil {
		t.Fatal(err)
	}
	return count
}
