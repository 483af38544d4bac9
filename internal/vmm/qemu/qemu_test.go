package qemu_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"testing"
	"time"

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
		b := testvm.Backend(t)
		return vmmtest.Env{
			Backend: b,
			Boot: vmm.BootSpec{
				Resources: vmm.Resources{MemoryMiB: 256, VCPUs: 1},
				Kernel:    img.Kernel,
				Initrd:    img.Initrd,
				Cmdline:   img.Cmdline,
			},
			Probe: func(ctx context.Context, m vmm.Machine) error {
				if b.Capabilities().Accelerator == "tcg" {
					if err := noHugePages(m); err != nil {
						return err
					}
				}
				if err := probe(ctx, m); err != nil {
					return err
				}
				return kernelCPU(ctx, m)
			},
			Dir: t.TempDir(),
		}
	})
}

// noHugePages checks that m's QEMU runs without transparent huge pages,
// as the backend starts it under TCG.
func noHugePages(m vmm.Machine) error {
	pid := m.Handle().Process.PID
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return err
	}
	if !regexp.MustCompile(`(?m)^THP_enabled:\s+0$`).Match(status) {
		return fmt.Errorf("qemu %d runs with transparent huge pages (want THP_enabled: 0 under TCG)", pid)
	}
	return nil
}

// kernelCPU checks that m tells where its one vCPU is: in the guest
// kernel (the top half of the address space), where an idle guest waits,
// within two seconds of its answer (its agent may still be finishing).
func kernelCPU(ctx context.Context, m vmm.Machine) error {
	var cpus []vmm.CPU
	for range 20 {
		var err error
		if cpus, err = m.(vmm.CPUReader).CPUs(ctx); err != nil {
			return err
		}
		if len(cpus) == 1 && cpus[0].PC >= 0xffff800000000000 {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("vCPUs %+v: want one, in the guest kernel", cpus)
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

// A caller whose ctx is already cancelled gets its error (or, if the
// answer came first, the version itself, never another error), and the
// version is still asked and kept for the next callers.
func TestVersionOutlivesACancelledCaller(t *testing.T) {
	b := testvm.Backend(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	early, err := b.Version(ctx)
	switch {
	case errors.Is(err, context.Canceled):
		if early != "" {
			t.Fatalf("cancelled Version returned %q along with %v", early, err)
		}
	case err != nil:
		t.Fatalf("cancelled Version = %v, want context.Canceled or the version", err)
	case early == "":
		t.Fatal("cancelled Version returned neither an error nor a version")
	}
	v, err := b.Version(context.Background())
	if err != nil || v == "" {
		t.Fatalf("Version after a cancelled caller = %q, %v", v, err)
	}
	if early != "" && early != v {
		t.Fatalf("cancelled caller got version %q, the next caller %q", early, v)
	}
}
