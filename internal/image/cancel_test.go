package image

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image/oci/ocitest"
)

// processesIn returns the processes whose root or working directory is
// below dir.
func processesIn(dir string) []string {
	var out []string
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		for _, l := range []string{"root", "cwd"} {
			target, err := os.Readlink(filepath.Join("/proc", e.Name(), l))
			if err == nil && strings.HasPrefix(target, dir+"/") {
				cmd, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
				out = append(out, e.Name()+" "+l+"="+target+" "+strings.ReplaceAll(string(cmd), "\x00", " "))
			}
		}
	}
	return out
}

// assertCancelledClean checks what a cancelled build must leave: the
// context's error, no staging, no mount, no process working in the cache.
func assertCancelledClean(t *testing.T, err error, cache string, before []string) {
	t.Helper()
	if !errors.Is(err, context.Canceled) {
		t.Errorf("got %v, want context.Canceled", err)
	}
	assertNoLeftovers(t, cache)
	assertNoMounts(t, cache)
	if after := snapshotCache(t, cache); strings.Join(after, ",") != strings.Join(before, ",") {
		t.Errorf("cache changed: %v -> %v", before, after)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		procs := processesIn(cache)
		if len(procs) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("processes left working in the cache: %v", procs)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

var registerCancelSpec sync.Once

func TestCancelDebootstrap(t *testing.T) {
	requireDebootstrap(t)
	registerCancelSpec.Do(func() {
		err := Register(Spec{Name: "cancel-test", Rootfs: &RootfsSpec{Variant: "minbase", Packages: []string{"less"}}})
		if err != nil && !errdefs.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	})
	cache := testCacheDir(t)
	b := newBuilder(t, cache)
	if _, err := b.ensureKernel(context.Background()); err != nil { // not what is being cancelled
		t.Fatal(err)
	}
	before := snapshotCache(t, cache)
	ctx, cancel := context.WithCancel(context.Background())
	var once sync.Once
	// Cancel while debootstrap configures packages: its /proc is mounted.
	b.Progress = writerFunc(func(p []byte) (int, error) {
		t.Logf("progress: %s", strings.TrimRight(string(p), "\n"))
		if strings.Contains(string(p), "Configuring required packages") || strings.Contains(string(p), "Installing core packages") {
			once.Do(func() { time.AfterFunc(time.Second, cancel) })
		}
		return len(p), nil
	})
	time.AfterFunc(5*time.Minute, cancel)
	start := time.Now()
	_, err := b.Build(ctx, "cancel-test")
	t.Logf("cancelled after %s: %v", time.Since(start).Round(time.Millisecond), err)
	assertCancelledClean(t, err, cache, before)
}

func TestCancelExtra(t *testing.T) {
	requireImport(t)
	cache := testCacheDir(t)
	b := newBuilder(t, cache)
	layer, err := tarball.LayerFromFile(debianTar(t))
	if err != nil {
		t.Fatal(err)
	}
	dir := ocitest.Layout(t, ocitest.Image(t, layer))
	if _, err := b.ensureKernel(context.Background()); err != nil {
		t.Fatal(err)
	}
	before := snapshotCache(t, cache)
	ctx, cancel := context.WithCancel(context.Background())
	var once sync.Once
	// Cancel once apt-get runs in the chroot.
	b.Progress = writerFunc(func(p []byte) (int, error) {
		t.Logf("progress: %s", strings.TrimRight(string(p), "\n"))
		if strings.Contains(string(p), "installing") {
			once.Do(func() { time.AfterFunc(2*time.Second, cancel) })
		}
		return len(p), nil
	})
	start := time.Now()
	_, err = b.FromOCI(ctx, dir, OCIOptions{Tag: "cancel-extra", Extra: []string{"python3"}})
	t.Logf("cancelled after %s: %v", time.Since(start).Round(time.Millisecond), err)
	assertCancelledClean(t, err, cache, before)
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
