package sandbox_test

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/testvm"
	"github.com/forkd/forkd/internal/vmm"
)

// TestStuckWatchOnARealGuest watches a real guest from its boot on, with
// short times: while it boots it computes and is not judged stuck; once
// its agent has answered and it idles, every vCPU halted and its VMM idle,
// it looks as a stuck guest does, and the watch says so, naming where the
// vCPU is. (No guest can be made to hang at boot on demand: an idle one
// that has answered stands in for it.)
func TestStuckWatchOnARealGuest(t *testing.T) {
	img := testvm.Image(t, "minimal")
	b := testvm.Backend(t)
	ctx := ctxT(t, 3*time.Minute)
	m, err := b.Boot(ctx, vmm.BootSpec{
		Name:      "stuck-watch",
		RunDir:    filepath.Join(t.TempDir(), "run"),
		Resources: vmm.Resources{MemoryMiB: 256, VCPUs: 1},
		Kernel:    img.Kernel,
		Initrd:    img.Initrd,
		Cmdline:   img.Cmdline,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Stop(ctxT(t, 30*time.Second)) })
	answered := make(chan time.Time, 1)
	go func() {
		c, err := sandbox.DialAgent(ctx, m, agent.Options{})
		if err != nil {
			t.Errorf("agent: %v", err)
			close(answered)
			return
		}
		answered <- time.Now()
		c.Close()
	}()
	err = sandbox.WaitStuck(ctx, m, 0, 500*time.Millisecond, 3*time.Second)
	judged := time.Now()
	if !errors.Is(err, sandbox.ErrStuck) {
		t.Fatalf("watch of an idle guest: %v, want a stuck guest", err)
	}
	select {
	case at, ok := <-answered:
		if ok && judged.Before(at) {
			t.Fatalf("judged stuck %s before the agent answered", at.Sub(judged))
		}
	default:
		t.Fatalf("judged stuck while booting, before its agent answered: %v", err)
	}
	t.Logf("%v", err)
	if !strings.Contains(err.Error(), "vCPU 0 halted at 0xffff") {
		t.Errorf("stuck error names no halted vCPU in the kernel: %v", err)
	}
	if r := sandbox.GuestReport(ctx, m); !strings.Contains(r, "vCPU 0 ") || !strings.Contains(r, "of CPU in that second") {
		t.Errorf("guest report: %q", r)
	} else {
		t.Logf("guest report: %s", r)
	}
}
