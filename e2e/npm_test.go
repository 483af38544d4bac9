package e2e

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"
)

// npmCI installs the locked dependencies of the npm project in dir (npm
// ci, with extra flags such as --prefer-offline), in at most ten minutes
// of ctx, failing t with npm's output.
func npmCI(ctx context.Context, t *testing.T, dir string, extra ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	runNode(ctx, t, dir, os.Environ(), "npm", append([]string{"ci", "--no-audit", "--no-fund"}, extra...)...)
}

// runNode runs name (node, npm) with args in dir, with env and npm's
// update check off, logs how long it took and returns its stdout and
// stderr. A non-zero exit fails t with both.
func runNode(ctx context.Context, t *testing.T, dir string, env []string, name string, args ...string) (stdout, stderr string) {
	t.Helper()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	cmd.Env = slices.Concat(env, []string{"npm_config_update_notifier=false"})
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	start := time.Now()
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %v in %s: %v\n%s%s", name, args, dir, err, out.String(), errb.String())
	}
	t.Logf("%s %v: %.1fs", name, args, time.Since(start).Seconds())
	return out.String(), errb.String()
}
