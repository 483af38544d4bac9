package bench

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
)

func TestRunRefusesBadOptions(t *testing.T) {
	good := Options{N: 10, Image: "minimal", MemoryMiB: 256, ColdRuns: 3, ExecRuns: 30, IdleFor: 5 * time.Second}
	if err := good.Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	for _, c := range []struct {
		tune func(*Options)
		want string
	}{
		{func(o *Options) { o.N = -1 }, "-n -1"},
		{func(o *Options) { o.MemoryMiB = -256 }, "--mem-size-mib -256"},
		{func(o *Options) { o.ColdRuns = -1 }, "--cold-runs -1"},
		{func(o *Options) { o.ExecRuns = -30 }, "--exec-runs -30"},
		{func(o *Options) { o.IdleFor = -time.Second }, "--idle -1s"},
	} {
		t.Run(c.want, func(t *testing.T) {
			o := good
			c.tune(&o)
			// Run checks before it uses the engine: a nil engine is never
			// reached.
			_, err := Run(context.Background(), nil, o)
			if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), c.want) {
				t.Errorf("%v, want InvalidArgument naming %q", err, c.want)
			}
		})
	}
}

// living keeps the processes that still run and counts the others, the
// most seen so far; none left is an error.
func TestLiving(t *testing.T) {
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	self, dead := os.Getpid(), gone.Process.Pid
	lost := 0
	live, err := living([]int{self, dead}, &lost)
	if err != nil || len(live) != 1 || live[0] != self || lost != 1 {
		t.Fatalf("living(self, a dead one) = %v, %v, lost %d; want [%d], nil, 1", live, err, lost, self)
	}
	if _, err := living([]int{self}, &lost); err != nil || lost != 1 {
		t.Fatalf("living(self) after one was lost: %v, lost %d; want nil, 1 (the most so far)", err, lost)
	}
	if live, err := living([]int{dead}, &lost); err == nil {
		t.Fatalf("living(a dead one) = %v, nil; want an error", live)
	}
}
