package guest_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/guest"
)

// Init sets the workload cgroup's pids.max: the host's limit, or the
// guest's default for 0. (A directory stands in for the cgroup: nothing is
// started in it.)
func TestInitSetsPIDsLimit(t *testing.T) {
	dir := t.TempDir()
	c := serveConfig(t, guest.Config{System: noSystem, Cgroup: dir, PIDsLimit: 341})
	ctx := testCtx(t)
	if !slices.Contains(c.Features(), proto.FeatureLimits) {
		t.Fatalf("features %v lack %q", c.Features(), proto.FeatureLimits)
	}
	pidsMax := func() string {
		b, err := os.ReadFile(filepath.Join(dir, "pids.max"))
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	if err := c.Init(ctx, proto.InitRequest{PIDsLimit: 64}); err != nil || pidsMax() != "64" {
		t.Fatalf("init with 64: %v, pids.max %s", err, pidsMax())
	}
	if err := c.Init(ctx, proto.InitRequest{}); err != nil || pidsMax() != "341" {
		t.Fatalf("init with 0: %v, pids.max %s", err, pidsMax())
	}
	if err := c.Init(ctx, proto.InitRequest{PIDsLimit: -1}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("init with -1: %v", err)
	}
}

// Without a workload cgroup the agent does not claim limits, and refuses
// one rather than ignore it.
func TestInitPIDsLimitWithoutCgroup(t *testing.T) {
	c := serveSocket(t)
	ctx := testCtx(t)
	if slices.Contains(c.Features(), proto.FeatureLimits) {
		t.Fatalf("features %v claim %q", c.Features(), proto.FeatureLimits)
	}
	if err := c.Init(ctx, proto.InitRequest{PIDsLimit: 64}); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("init with 64: %v", err)
	}
	if err := c.Init(ctx, proto.InitRequest{}); err != nil {
		t.Fatalf("init with the default: %v", err)
	}
}
