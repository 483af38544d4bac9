package proc

import (
	"context"
	"os"
	"os/exec"
	"testing"
	"time"
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
