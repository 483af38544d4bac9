package sandbox

import (
	"context"
	"time"

	"github.com/forkd/forkd/internal/vmm"
)

// ErrStuck is errStuck, for the tests of package sandbox_test.
var ErrStuck = errStuck

// WaitStuck is the boot watch's judgement with the given times, for a test
// on a real guest.
func WaitStuck(ctx context.Context, m vmm.Machine, after, every, window time.Duration) error {
	return stuckWatch{after: after, every: every, window: window}.wait(ctx, m)
}
