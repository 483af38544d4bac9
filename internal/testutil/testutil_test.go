package testutil

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestFileSHA256(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, []byte("abc"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, want := FileSHA256(t, p), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"; got != want {
		t.Fatalf("FileSHA256 = %s, want %s", got, want)
	}
}

func TestProcessesUnder(t *testing.T) {
	dir := t.TempDir()
	work := filepath.Join(dir, "run", "x")
	if err := os.MkdirAll(work, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "60")
	cmd.Dir = work
	if err := cmd.Start(); err != nil {
		Unavailable(t, "no sleep: "+err.Error())
	}
	pid := strconv.Itoa(cmd.Process.Pid)
	found := func() bool {
		return slices.ContainsFunc(ProcessesUnder(filepath.Join(dir, "run")), func(p string) bool {
			return strings.HasPrefix(p, pid+" ")
		})
	}
	if !found() {
		t.Errorf("ProcessesUnder misses %s working in %s", pid, work)
	}
	if got := ProcessesUnder(work); len(got) != 0 {
		t.Errorf("ProcessesUnder(%s) = %v: a process working in dir itself is not below it", work, got)
	}
	cmd.Process.Kill()
	// Killed but not yet waited for: a zombie, which does not count.
	for range 100 {
		if !found() {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if found() {
		t.Errorf("ProcessesUnder lists the zombie %s", pid)
	}
	cmd.Wait()
}
