package cgroup

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/testutil"
)

// realManager returns a Manager on the real host, with a parent directory
// of its own so concurrent test runs never meet; the parent directories
// are removed when the test ends, and the test fails if a group is left.
func realManager(t *testing.T) *Manager {
	t.Helper()
	testutil.RequireRoot(t)
	m, err := New(Options{Parent: fmt.Sprintf("forkd-test-%d-%s", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "_"))})
	if err != nil {
		testutil.Unavailable(t, "no cgroups: "+err.Error())
	}
	for _, kind := range []string{Memory, PIDs, CPU} {
		if m.Version(kind) == 0 {
			testutil.Unavailable(t, "host has no "+kind+" cgroup controller")
		}
	}
	t.Cleanup(func() {
		names, err := m.List()
		if err != nil || len(names) > 0 {
			t.Errorf("groups left: %v %v", names, err)
		}
		m.Reclaim(func(string) bool { return false })
		for _, h := range append(append([]*hierarchy(nil), m.v1...), m.v2) {
			if h != nil {
				os.Remove(filepath.Join(h.own, m.opts.Parent))
			}
		}
	})
	return m
}

// startIn starts cmd inside g the way a VMM is started: forked from a
// thread that was moved into the group (v1), or with UseCgroupFD (v2).
func startIn(t *testing.T, m *Manager, g *Group, cmd *exec.Cmd) {
	t.Helper()
	p := g.Placement()
	if p.CgroupFD >= 0 {
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: p.CgroupFD}
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // released only when restore worked
		restore, err := m.EnterProcs(p.Procs)
		if err != nil {
			errc <- err
			return
		}
		err = cmd.Start()
		if rerr := restore(); rerr != nil {
			err = errors.Join(err, rerr)
		} else {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
}

// groupGone checks that none of g's directories exists.
func groupGone(t *testing.T, g *Group) {
	t.Helper()
	for _, d := range g.dirs() {
		if _, err := os.Stat(d); err == nil {
			t.Errorf("%s left", d)
		}
	}
}

func TestRootOOMKill(t *testing.T) {
	m := realManager(t)
	t.Parallel()
	hog, err := m.Create("hog", Limits{MemoryMiB: 64, PIDs: 32})
	if err != nil {
		t.Fatal(err)
	}
	calm, err := m.Create("calm", Limits{MemoryMiB: 64, PIDs: 32})
	if err != nil {
		t.Fatal(err)
	}
	// The sibling is placed after start, as Add does it.
	sleeper := exec.Command("sleep", "60")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { sleeper.Process.Kill(); sleeper.Wait() }()
	if err := calm.Add(sleeper.Process.Pid); err != nil {
		t.Fatal(err)
	}
	// tail keeps the whole newline-free stream in memory: 200 MiB.
	eater := exec.Command("sh", "-c", "head -c 200M /dev/zero | tail")
	startIn(t, m, hog, eater)
	err = eater.Wait()
	if err == nil {
		t.Fatal("200 MiB fitted in 64 MiB")
	}
	oom, err := hog.OOMKilled()
	if err != nil || !oom {
		t.Fatalf("OOMKilled = %v, %v", oom, err)
	}
	s, err := hog.Stats()
	if err != nil || s.OOMKills == 0 || s.MemoryPeakBytes > 64<<20 || s.MemoryLimitBytes != 64<<20 {
		t.Fatalf("stats %+v, %v", s, err)
	}
	if oom, _ := calm.OOMKilled(); oom {
		t.Fatal("sibling reports an OOM kill")
	}
	if !running(sleeper) {
		t.Fatal("sibling died")
	}
	procs, _ := readPIDs(calm.dir(Memory))
	if len(procs) != 1 || procs[0] != sleeper.Process.Pid {
		t.Fatalf("sibling group holds %v", procs)
	}
	// Destroy kills what is left (the sleeper) and removes everything.
	for _, g := range []*Group{hog, calm} {
		if err := g.Destroy(); err != nil {
			t.Fatal(err)
		}
		groupGone(t, g)
	}
	if err := sleeper.Wait(); err == nil {
		t.Fatal("sleeper survived destroy")
	}
}

func TestRootPIDsLimit(t *testing.T) {
	m := realManager(t)
	t.Parallel()
	g, err := m.Create("bomb", Limits{PIDs: 16})
	if err != nil {
		t.Fatal(err)
	}
	// A bounded fork bomb: 200 background sleepers, most refused.
	bomb := exec.Command("sh", "-c", "i=0; while [ $i -lt 200 ]; do sleep 60 & i=$((i+1)); done; wait")
	startIn(t, m, g, bomb)
	deadline := time.Now().Add(10 * time.Second)
	var s Stats
	for time.Now().Before(deadline) {
		if s, err = g.Stats(); err != nil {
			t.Fatal(err)
		}
		if s.PIDsRefused > 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if s.PIDsRefused == 0 || s.PIDs > 16 {
		t.Fatalf("stats %+v: want refused forks and at most 16 tasks", s)
	}
	if err := g.Destroy(); err != nil {
		t.Fatal(err)
	}
	groupGone(t, g)
	bomb.Wait()
}

func TestRootCPULimit(t *testing.T) {
	m := realManager(t)
	t.Parallel()
	g, err := m.Create("spin", Limits{CPUs: 0.1, PIDs: 8})
	if err != nil {
		t.Fatal(err)
	}
	spin := exec.Command("sh", "-c", "while :; do :; done")
	startIn(t, m, g, spin)
	time.Sleep(time.Second)
	s, err := g.Stats()
	if err != nil {
		t.Fatal(err)
	}
	// 0.1 CPU for ~1 s: about 100 ms; unthrottled it would be ~1 s.
	if s.CPU > 400*time.Millisecond || s.CPU == 0 || s.CPUThrottled == 0 {
		t.Fatalf("stats %+v: want ~100ms of CPU, throttled", s)
	}
	// Destroy kills the spinner even though it is our child (not yet
	// waited for): a dead child does not pin the group.
	if err := g.Destroy(); err != nil {
		t.Fatal(err)
	}
	groupGone(t, g)
	if err := spin.Wait(); err == nil {
		t.Fatal("spinner survived")
	}
}

func TestRootReclaim(t *testing.T) {
	m := realManager(t)
	t.Parallel()
	var procs []*exec.Cmd
	for _, n := range []string{"r1", "r2", "r3"} {
		g, err := m.Create(n, Limits{MemoryMiB: 32})
		if err != nil {
			t.Fatal(err)
		}
		c := exec.Command("sleep", "60")
		startIn(t, m, g, c)
		procs = append(procs, c)
	}
	if err := m.Reclaim(func(n string) bool { return n == "r2" }); err != nil {
		t.Fatal(err)
	}
	if names, _ := m.List(); len(names) != 1 || names[0] != "r2" {
		t.Fatalf("after reclaim: %v", names)
	}
	if !running(procs[1]) {
		t.Fatal("live group's process killed")
	}
	for _, i := range []int{0, 2} {
		if running(procs[i]) {
			t.Fatalf("process of reclaimed group r%d still runs", i+1)
		}
	}
	if err := m.Reclaim(func(string) bool { return false }); err != nil {
		t.Fatal(err)
	}
	for _, c := range procs {
		if c.Wait() == nil {
			t.Fatal("process survived reclaim")
		}
	}
}

// running reports whether cmd's process still runs. Signal 0 cannot tell:
// a child that exited but was not waited for lingers as a zombie, which
// signal 0 still reaches (and ProcessState is set only by Wait). proc.Alive
// counts a zombie as exited.
func running(cmd *exec.Cmd) bool {
	id, err := proc.Self(cmd.Process.Pid)
	return err == nil && proc.Alive(id)
}
