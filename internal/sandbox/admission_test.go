package sandbox

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/vmm"
)

// fakeBackend is a fake vmm.Backend that starts nothing: Boot and Restore
// fail with NotImplemented and Attach finds nothing. It is enough because
// the admission, expiry and starter logic tested with it works on the
// engine's records and counters, never on a running VM; the VM paths are
// tested against QEMU in the *_vm_test.go files.
type fakeBackend struct{}

func (fakeBackend) Name() string                            { return "fake" }
func (fakeBackend) Version(context.Context) (string, error) { return "0", nil }
func (fakeBackend) Capabilities() vmm.Capabilities          { return vmm.Capabilities{} }
func (fakeBackend) Boot(context.Context, vmm.BootSpec) (vmm.Machine, error) {
	return nil, errdefs.NotImplemented("fake")
}
func (fakeBackend) Restore(context.Context, vmm.RestoreSpec) (vmm.Machine, error) {
	return nil, errdefs.NotImplemented("fake")
}
func (fakeBackend) Attach(context.Context, vmm.Handle) (vmm.Machine, error) {
	return nil, errdefs.NotFound("fake")
}

func fakeEngine(t *testing.T) *Engine {
	t.Helper()
	e, err := New(Config{DataDir: t.TempDir(), Backend: fakeBackend{}, Daemon: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

func TestAdmissionIsExact(t *testing.T) {
	e := fakeEngine(t)
	// Of these records the two starting ones count; the running one whose
	// VMM is gone does not.
	testutil.Check(t, e.state.Put(&state.Sandbox{ID: "sb-aaaaaaaaaa", Status: state.StatusStarting}))
	testutil.Check(t, e.state.Put(&state.Sandbox{ID: "sb-bbbbbbbbbb", Status: state.StatusRunning}))
	testutil.Check(t, e.state.Put(&state.Sandbox{ID: "sb-cccccccccc", Status: state.StatusStarting}))
	a := NewAdmitter(e, Admission{MaxSandboxes: 20, MaxPending: 100})
	var mu sync.Mutex
	var ok, refused int
	var wg sync.WaitGroup
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := a.reserve(1)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				ok++
			case errdefs.IsResourceExhausted(err):
				refused++
			default:
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if ok != 18 || refused != 32 {
		t.Errorf("%d admitted, %d refused; want 18 and 32", ok, refused)
	}
	if n, _ := a.Live(); n != 20 {
		t.Errorf("live %d, want 20", n)
	}
	if _, err := a.reserve(21); !errdefs.IsInvalidArgument(err) {
		t.Errorf("a batch over the limit by itself: %v", err)
	}
	b := NewAdmitter(e, Admission{MaxPending: 3})
	ids, err := b.reserve(3)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.reserve(1); !errdefs.IsResourceExhausted(err) {
		t.Errorf("over the pending limit: %v", err)
	}
	b.release(ids)
	if _, err := b.reserve(1); err != nil {
		t.Errorf("after release: %v", err)
	}
}

func TestExpirerKillsDueRecords(t *testing.T) {
	e := fakeEngine(t)
	x := NewExpirer(e)
	for _, id := range []string{"sb-aaaaaaaaaa", "sb-bbbbbbbbbb"} {
		testutil.Check(t, e.state.Put(&state.Sandbox{ID: id, Status: state.StatusDead}))
	}
	if _, err := x.SetTimeout(context.Background(), "sb-aaaaaaaaaa", time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := x.SetTimeout(context.Background(), "sb-bbbbbbbbbb", -time.Second); !errdefs.IsInvalidArgument(err) {
		t.Errorf("negative timeout: %v", err)
	}
	if _, err := x.SetTimeout(context.Background(), "sb-cccccccccc", time.Second); !errdefs.IsNotFound(err) {
		t.Errorf("timeout of a missing sandbox: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() { x.Run(ctx); close(done) }()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := e.state.Get("sb-aaaaaaaaaa"); errdefs.IsNotFound(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("expired record still there")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := e.state.Get("sb-bbbbbbbbbb"); err != nil {
		t.Errorf("record without a deadline: %v", err)
	}
	cancel()
	<-done
}
