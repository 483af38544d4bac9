package bench

import (
	"context"
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
