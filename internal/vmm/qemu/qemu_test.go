package qemu_test

import (
	"context"
	"testing"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/testvm"
	"github.com/forkd/forkd/internal/vmm"
	"github.com/forkd/forkd/internal/vmm/vmmtest"
)

// TestConformance runs the vmm suite against real QEMU VMs booting the
// minimal image, probed through the real guest agent.
func TestConformance(t *testing.T) {
	vmmtest.Run(t, func(t *testing.T) vmmtest.Env {
		img := testvm.Image(t, "minimal")
		return vmmtest.Env{
			Backend: testvm.Backend(t),
			Boot: vmm.BootSpec{
				Resources: vmm.Resources{MemoryMiB: 256, VCPUs: 1},
				Kernel:    img.Kernel,
				Initrd:    img.Initrd,
				Cmdline:   img.Cmdline,
			},
			Probe: probe,
			Dir:   t.TempDir(),
		}
	})
}

// probe connects to the agent and pings it.
func probe(ctx context.Context, m vmm.Machine) error {
	for {
		conn, err := m.DialAgent(ctx)
		if err != nil {
			return err
		}
		c, err := agent.Dial(ctx, conn, agent.Options{})
		if err != nil {
			conn.Close()
			if ctx.Err() != nil {
				return err
			}
			continue
		}
		_, err = c.Ping(ctx)
		c.Close()
		return err
	}
}
