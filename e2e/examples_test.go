package e2e

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/testutil"
)

// TestExamples runs the Python examples as a user would, each with its one
// command, against a real daemon; they check their own results and exit
// non-zero when a check fails. The first builds the examples' snapshot from
// the python image, the second reuses it.
func TestExamples(t *testing.T) {
	testutil.RequireRoot(t) // the python image is built with debootstrap
	// A daemon and data dir of its own, mostly waiting on guests and
	// other processes: it runs beside the other SDK, MCP and example
	// tests (go test -parallel, GOMAXPROCS at a time).
	t.Parallel()
	py := sdkPython(t)
	c := newCLI(t)
	d := startServe(t, c)
	for _, ex := range []string{"parallel-eval", "speculative-repair"} {
		t.Run(ex, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, filepath.Join("..", "examples", ex, "run"))
			// On timeout, interrupt: the example kills its sandboxes.
			cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
			cmd.WaitDelay = time.Minute
			cmd.Env = append(os.Environ(), "FORKD_URL=unix://"+d.sock, "PYTHON="+py, "PYTHONDONTWRITEBYTECODE=1")
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			start := time.Now()
			err := cmd.Run()
			t.Logf("examples/%s/run (%s):\n%s", ex, time.Since(start).Round(time.Second), out.String())
			if err != nil {
				t.Fatalf("examples/%s: %v\ndaemon log:\n%s", ex, err, d.output())
			}
		})
	}
	// The examples kill what they start.
	left, err := d.client(d.token).ListSandboxes(context.Background(), client.ListOptions{})
	if err != nil || len(left) != 0 {
		t.Fatalf("sandboxes left by the examples: %+v, %v", left, err)
	}
}
