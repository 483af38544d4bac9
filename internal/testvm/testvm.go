// Package testvm gives VM-tier tests what they share: the forkd-agent
// binary, built images from one cache that survives test runs, and a QEMU
// backend. Every helper skips the test (fails it under FORKD_TEST_STRICT=1)
// when the host cannot run VMs.
package testvm

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/image"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/vmm/qemu"
)

// Require skips (or fails, when strict) unless this host can build images
// and run QEMU.
func Require(t testing.TB) {
	t.Helper()
	testutil.RequireTier(t, testutil.TierVM)
	testutil.RequireCommand(t, "qemu-system-x86_64", "apt-get", "apt-cache", "dpkg-deb")
	if _, err := os.Stat("/bin/busybox"); err != nil {
		testutil.Unavailable(t, "test needs /bin/busybox (busybox-static)")
	}
}

// CacheDir is the image cache shared by VM tests: $FORKD_TEST_CACHE/image,
// default /var/tmp/forkd-test-cache/image.
func CacheDir(t testing.TB) string {
	t.Helper()
	base := os.Getenv("FORKD_TEST_CACHE")
	if base == "" {
		base = "/var/tmp/forkd-test-cache"
	}
	dir := filepath.Join(base, "image")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

var (
	agentOnce sync.Once
	agentBin  string
	agentErr  error
)

// AgentBinary returns $FORKD_AGENT, or builds cmd/forkd-agent once per test
// process.
func AgentBinary(t testing.TB) string {
	t.Helper()
	agentOnce.Do(func() {
		if p := os.Getenv("FORKD_AGENT"); p != "" {
			agentBin = p
			return
		}
		dir, err := os.MkdirTemp("", "forkd-agent-")
		if err != nil {
			agentErr = err
			return
		}
		agentBin = filepath.Join(dir, "forkd-agent")
		root, err := moduleRoot()
		if err != nil {
			agentErr = err
			return
		}
		cmd := exec.Command("go", "build", "-trimpath", "-o", agentBin, "./cmd/forkd-agent")
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			agentErr = errors.New("go build forkd-agent: " + string(out))
		}
	})
	if agentErr != nil {
		t.Fatal(agentErr)
	}
	return agentBin
}

// moduleRoot finds the directory holding go.mod above the working dir.
func moduleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", err
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", errors.New("not inside the forkd module")
	}
	return filepath.Dir(gomod), nil
}

// Builder returns an image builder over the shared cache.
func Builder(t testing.TB) *image.Builder {
	t.Helper()
	Require(t)
	return &image.Builder{CacheDir: CacheDir(t), AgentPath: AgentBinary(t), Progress: testLog{t}}
}

// Image builds (or finds in the cache) the named image.
func Image(t testing.TB, name string) *image.Image {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	img, err := Builder(t).Build(ctx, name)
	if err != nil {
		t.Fatalf("build image %s: %v", name, err)
	}
	return img
}

// Backend returns a QEMU backend with the accelerator from $FORKD_ACCEL
// (default auto).
func Backend(t testing.TB) *qemu.Backend {
	t.Helper()
	Require(t)
	be, err := qemu.New(qemu.Options{Accel: os.Getenv("FORKD_ACCEL"), Sandbox: true})
	if err != nil {
		t.Fatal(err)
	}
	return be
}

// Engine returns an engine over a fresh data dir (the image cache is the
// shared one). It kills every sandbox the test left when the test ends.
func Engine(t testing.TB) *sandbox.Engine { return EngineWith(t, nil) }

// EngineWith is Engine with its configuration adjusted by tune (if set).
func EngineWith(t testing.TB, tune func(*sandbox.Config)) *sandbox.Engine {
	t.Helper()
	cfg := Config(t, t.TempDir())
	if tune != nil {
		tune(&cfg)
	}
	e, err := sandbox.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := e.KillAll(ctx, ""); err != nil {
			t.Logf("KillAll: %v", err)
		}
		e.Close()
	})
	return e
}

// Config returns the test configuration of an engine over data dir dir,
// with the host isolation of that dir when running as root. Several
// processes given the same dir share one data dir.
func Config(t testing.TB, dir string) sandbox.Config {
	t.Helper()
	nm, cm, err := sandbox.HostIsolation(dir, slog.New(slog.NewTextHandler(testLog{t}, nil)))
	if err != nil {
		t.Fatal(err)
	}
	return sandbox.Config{
		Net:       nm,
		Cgroups:   cm,
		DataDir:   dir,
		CacheDir:  CacheDir(t),
		Backend:   Backend(t),
		AgentPath: AgentBinary(t),
		VMMUser:   VMMUser(),
		Progress:  testLog{t},
		Logger:    slog.New(slog.NewTextHandler(testLog{t}, nil)),
	}
}

// testLog writes progress into the test log.
type testLog struct{ t testing.TB }

func (l testLog) Write(p []byte) (int, error) {
	l.t.Logf("%s", strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

var _ io.Writer = testLog{}

// VMMUser is the unprivileged user VM tests run QEMU as when root:
// forkd-vmm (made by scripts/install-deps.sh), else nobody.
func VMMUser() string {
	if os.Geteuid() != 0 {
		return ""
	}
	if _, err := user.Lookup("forkd-vmm"); err == nil {
		return "forkd-vmm"
	}
	return "nobody"
}
