package proc

import (
	"context"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
)

func TestParseStartTime(t *testing.T) {
	line := []byte("1234 (weird) name)) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 10")
	got, err := parseStartTime(line)
	if err != nil {
		t.Fatal(err)
	}
	if got != 98765 {
		t.Fatalf("start time = %d, want 98765", got)
	}
	if _, err := parseStartTime([]byte("garbage")); err == nil {
		t.Fatal("malformed line accepted")
	}
}

func TestOpenKillAndReuse(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	id, err := Self(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if !Alive(id) {
		t.Fatal("fresh process not alive")
	}
	// A wrong start time must never match, even for a live pid.
	if Alive(Identity{PID: id.PID, StartTime: id.StartTime + 1}) {
		t.Fatal("identity with wrong start time reported alive")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := Kill(ctx, id); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	if Alive(id) {
		t.Fatal("killed process still alive")
	}
	// Killing again is not an error.
	if err := Kill(ctx, id); err != nil {
		t.Fatal(err)
	}
}

func TestSelf(t *testing.T) {
	id, err := Self(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if id.StartTime == 0 || !Alive(id) {
		t.Fatalf("self identity %+v not alive", id)
	}
	if _, err := Self(1 << 30); err == nil {
		t.Fatal("nonexistent pid accepted")
	}
}

// TestCPUTime: a busy process's CPU time grows, an idle one's does not,
// and a wrong start time never reads another process's counters.
func TestCPUTime(t *testing.T) {
	busy := exec.Command("sh", "-c", "while :; do :; done")
	idle := exec.Command("sleep", "60")
	for _, c := range []*exec.Cmd{busy, idle} {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Process.Kill(); c.Wait() })
	}
	ids := make([]Identity, 2)
	before := make([]time.Duration, 2)
	for i, c := range []*exec.Cmd{busy, idle} {
		var err error
		if ids[i], err = Self(c.Process.Pid); err != nil {
			t.Fatal(err)
		}
		if before[i], err = CPUTime(ids[i]); err != nil {
			t.Fatal(err)
		}
	}
	// The busy one runs until it has used 10 ms (a loaded host may make
	// it wait).
	after := make([]time.Duration, 2)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		for i := range ids {
			var err error
			if after[i], err = CPUTime(ids[i]); err != nil {
				t.Fatal(err)
			}
		}
		if after[0] > before[0] || time.Now().After(deadline) {
			break
		}
	}
	if after[0] <= before[0] {
		t.Errorf("busy process: %v of CPU, then %v", before[0], after[0])
	}
	if after[1] != before[1] {
		t.Errorf("sleeping process: %v of CPU, then %v", before[1], after[1])
	}
	wrong := Identity{PID: ids[1].PID, StartTime: ids[1].StartTime + 1}
	if _, err := CPUTime(wrong); !errdefs.IsNotFound(err) {
		t.Errorf("wrong start time: %v", err)
	}
}
