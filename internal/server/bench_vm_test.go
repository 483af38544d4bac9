package server

import (
	"context"
	"testing"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/testvm"
)

// BenchmarkAPI measures the daemon on real VMs: GET /v1/sandboxes (5
// sandboxes listed) over the unix socket and over TCP with the token, and
// an exec round trip (`true`) through the API against the same call on
// the engine's agent client (what the CLI does without a daemon, minus
// its process start). Run: go test -run=^$ -bench=API ./internal/server
func BenchmarkAPI(b *testing.B) {
	testvm.Require(b)
	d := startDaemon(b, testvm.Backend(b), sandbox.Admission{}, func(ec *sandbox.Config, _ *Config) {
		ec.CacheDir = testvm.CacheDir(b)
		ec.AgentPath = testvm.AgentBinary(b)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	op, err := d.unix.CreateSnapshot(ctx, apiv1.CreateSnapshotRequest{Tag: "base"})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := d.unix.WaitOperation(ctx, op.ID); err != nil {
		b.Fatal(err)
	}
	res, err := d.unix.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: "base", N: 5})
	if err != nil {
		b.Fatal(err)
	}
	id := res.Sandboxes[0].ID

	list := func(c *client.Client) func(*testing.B) {
		return func(b *testing.B) {
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if l, err := c.ListSandboxes(ctx, client.ListOptions{}); err != nil || len(l) != 5 {
						b.Fatal(len(l), err)
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
		}
	}
	b.Run("list/unix", list(d.unix))
	b.Run("list/tcp", list(d.tcp))
	b.Run("exec/api-unix", func(b *testing.B) {
		for b.Loop() {
			if r, err := d.unix.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"true"}}); err != nil || r.ExitCode != 0 {
				b.Fatal(err)
			}
		}
	})
	b.Run("exec/api-tcp-stream", func(b *testing.B) {
		for b.Loop() {
			if r, err := d.tcp.ExecStream(ctx, id, apiv1.ExecRequest{Args: []string{"true"}}, nil, nil, nil); err != nil || r.ExitCode != 0 {
				b.Fatal(err)
			}
		}
	})
	b.Run("exec/engine-agent", func(b *testing.B) {
		c, release, err := d.e.Agent(ctx, id)
		if err != nil {
			b.Fatal(err)
		}
		defer release()
		for b.Loop() {
			if r, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"true"}}); err != nil || r.ExitCode != 0 {
				b.Fatal(err)
			}
		}
	})
}
