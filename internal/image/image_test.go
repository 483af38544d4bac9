package image

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/testutil"
)

// testCacheDir is the builder cache integration tests share: a directory
// that survives test runs when FORKD_TEST_CACHE is set (CI sets it to
// /var/tmp/forkd-test-cache), else a fresh temporary one.
func testCacheDir(t *testing.T) string {
	t.Helper()
	if d := os.Getenv("FORKD_TEST_CACHE"); d != "" {
		dir := filepath.Join(d, "image-tests") // apart from the VM tiers' cache, which they change meanwhile
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		seedOnce.Do(func() { seedCache(t, dir, filepath.Join(d, "image")) })
		return dir
	}
	return t.TempDir()
}

var seedOnce sync.Once

// seedCache copies into the image tests' cache dst what the VM tiers'
// cache src holds, and dst not, of what these tests fetch or debootstrap:
// the kernel, busybox and python's root filesystem. On a fresh machine
// scripts/prefetch-images.sh built those in src minutes before; building
// them again here took this package 290 s of CI instead of ~70. Best
// effort: a copy is staged and renamed into place, and an entry that did
// not copy whole (src changed meanwhile) is one the builder finds invalid
// and builds.
func seedCache(t *testing.T, dst, src string) {
	registryMu.Lock()
	py, ok := registry["python"]
	registryMu.Unlock()
	if !ok || py.Rootfs == nil {
		return
	}
	key, _, _ := (&Builder{CacheDir: dst}).debootstrapKey(*py.Rootfs)
	want := map[string][]string{kindRootfs: {key}}
	for _, kind := range []string{kindKernel, kindBusybox} {
		ents, _ := os.ReadDir(filepath.Join(src, kind))
		for _, e := range ents {
			if e.IsDir() && !strings.HasPrefix(e.Name(), ".") {
				want[kind] = append(want[kind], e.Name())
			}
		}
	}
	for kind, names := range want {
		for _, name := range names {
			from, to := filepath.Join(src, kind, name), filepath.Join(dst, kind, name)
			if _, err := os.Stat(from); err != nil {
				continue
			}
			if _, err := os.Lstat(to); err == nil {
				continue
			}
			if err := copyEntry(dst, kind, from, to); err != nil {
				t.Logf("seed the image tests' cache: %v", err)
				continue
			}
			t.Logf("seeded the image tests' cache with %s/%s", kind, name)
		}
	}
}

// copyEntry copies the cache entry from to to, in dst's cache, under
// the builder's lock on it, by way of a staging directory the builder
// removes if it is left behind.
func copyEntry(dst, kind, from, to string) error {
	unlock, err := (&Builder{CacheDir: dst}).lock(context.Background(), kind, filepath.Base(to))
	if err != nil {
		return err
	}
	defer unlock()
	if _, err := os.Lstat(to); err == nil {
		return nil // a builder made it meanwhile
	}
	parent := filepath.Dir(to)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return err
	}
	staging, err := os.MkdirTemp(parent, ".staging-"+filepath.Base(to)+"-")
	if err != nil {
		return err
	}
	if out, err := exec.Command("cp", "-a", "--sparse=always", from+"/.", staging).CombinedOutput(); err != nil {
		return errors.Join(fmt.Errorf("cp %s: %v: %s", from, err, out), os.RemoveAll(staging))
	}
	if err := fsutil.SyncDir(staging); err != nil {
		return errors.Join(err, os.RemoveAll(staging))
	}
	if err := os.Chmod(staging, 0o755); err != nil {
		return errors.Join(err, os.RemoveAll(staging))
	}
	if err := os.Rename(staging, to); err != nil {
		return errors.Join(err, os.RemoveAll(staging))
	}
	return fsutil.SyncDir(parent)
}

var (
	agentOnce sync.Once
	agentPath string
	agentErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if agentPath != "" {
		os.RemoveAll(filepath.Dir(agentPath))
	}
	os.Exit(code)
}

// fakeAgent builds testdata/fakeagent, a static stand-in for forkd-agent.
func fakeAgent(t *testing.T) string {
	t.Helper()
	agentOnce.Do(func() {
		dir, err := os.MkdirTemp("", "forkd-fakeagent-")
		if err != nil {
			agentErr = err
			return
		}
		agentPath = filepath.Join(dir, "forkd-agent")
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", agentPath, "./testdata/fakeagent")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			agentErr = errors.New(string(out))
		}
	})
	if agentErr != nil {
		t.Fatalf("build fake agent: %v", agentErr)
	}
	return agentPath
}

// progressLog is a concurrency-safe progress sink that also logs.
type progressLog struct {
	t  *testing.T
	mu sync.Mutex
	b  bytes.Buffer
}

func (p *progressLog) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.t.Logf("progress: %s", strings.TrimRight(string(b), "\n"))
	return p.b.Write(b)
}

func newBuilder(t *testing.T, cache string) *Builder {
	return &Builder{CacheDir: cache, AgentPath: fakeAgent(t), Progress: &progressLog{t: t}}
}

func TestValidateName(t *testing.T) {
	for _, ok := range []string{"a", "minimal", "python", "my-image_1.2", "A9", strings.Repeat("x", 63)} {
		t.Run(ok, func(t *testing.T) {
			if err := ValidateName(ok); err != nil {
				t.Errorf("ValidateName(%q): %v", ok, err)
			}
		})
	}
	for _, bad := range []string{"", "../x", "..", ".", "/etc", "a/b", "-x", ".hidden", "_x", "a..b", "x..",
		"a b", "a\x00", "ä", strings.Repeat("x", 64), strings.Repeat("y", 200), "a\n"} {
		t.Run("bad "+bad, func(t *testing.T) {
			if err := ValidateName(bad); !errdefs.IsInvalidArgument(err) {
				t.Errorf("ValidateName(%q) = %v, want InvalidArgument", bad, err)
			}
		})
	}
}

func TestRegistry(t *testing.T) {
	if got := BuiltinNames(); strings.Join(got, ",") != "code-interpreter,minimal,python" {
		t.Errorf("BuiltinNames() = %v", got)
	}
	if err := Register(Spec{Name: "minimal"}); !errdefs.IsAlreadyExists(err) {
		t.Errorf("duplicate: %v", err)
	}
	if err := Register(Spec{Name: "../evil"}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("bad name: %v", err)
	}
	if err := Register(Spec{Name: "badpkg", Rootfs: &RootfsSpec{Packages: []string{"-o=Dpkg::x"}}}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("bad package: %v", err)
	}
	if err := Register(Spec{Name: "badpre", Rootfs: &RootfsSpec{Preload: []string{"os; import x"}}}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("bad preload: %v", err)
	}
	b := &Builder{CacheDir: t.TempDir(), AgentPath: fakeAgent(t)}
	if _, err := b.Build(context.Background(), "nosuchimage"); !errdefs.IsNotFound(err) {
		t.Errorf("unknown image: %v", err)
	}
	if _, err := b.Build(context.Background(), "../etc"); !errdefs.IsInvalidArgument(err) {
		t.Errorf("bad name: %v", err)
	}
}

func TestCheckAgent(t *testing.T) {
	if err := checkAgent(""); !errdefs.IsInvalidArgument(err) {
		t.Errorf("empty: %v", err)
	}
	if err := checkAgent(filepath.Join(t.TempDir(), "nope")); !errdefs.IsNotFound(err) {
		t.Errorf("missing: %v", err)
	}
	if err := checkAgent("/bin/ls"); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "dynamically linked") {
		t.Errorf("dynamic: %v", err)
	}
	if err := checkAgent(fakeAgent(t)); err != nil {
		t.Errorf("static: %v", err)
	}
}

func TestHostDistro(t *testing.T) {
	etc := t.TempDir()
	testutil.MkdirAll(t, filepath.Join(etc, "apt", "sources.list.d"), 0o755)
	write := func(p, s string) { testutil.WriteFile(t, filepath.Join(etc, p), []byte(s), 0o644) }

	b := &Builder{EtcDir: etc}
	if d := b.hostDistro(); d.suite != "bookworm" || d.mirror != "http://deb.debian.org/debian" {
		t.Errorf("no os-release: %+v", d)
	}
	write("os-release", "ID=debian\nVERSION_CODENAME=trixie\n")
	write("apt/sources.list", "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian/ trixie main\n")
	if d := b.hostDistro(); d.suite != "trixie" || d.mirror != "http://mirror.example/debian" {
		t.Errorf("one-line: %+v", d)
	}
	testutil.Remove(t, filepath.Join(etc, "apt/sources.list"))
	write("apt/sources.list.d/debian.sources", "Types: deb\nURIs: http://sec.example/debian-security\nSuites: trixie-security\n\n"+
		"Types: deb deb-src\nURIs: https://deb822.example/debian\nSuites: trixie trixie-updates\nComponents: main\n")
	if d := b.hostDistro(); d.mirror != "https://deb822.example/debian" {
		t.Errorf("deb822: %+v", d)
	}
	write("os-release", `ID=ubuntu`+"\n"+`VERSION_CODENAME="noble"`+"\n")
	if d := b.hostDistro(); d.suite != "noble" || d.mirror != "http://archive.ubuntu.com/ubuntu" || len(d.components) != 2 {
		t.Errorf("ubuntu: %+v", d)
	}
	write("os-release", "ID=fedora\n")
	if d := b.hostDistro(); d.id != "debian" || d.suite != "bookworm" || d.mirror != defaultDistro.mirror {
		t.Errorf("fedora: %+v", d)
	}
}

// listCache returns the entries of the cache's directories, without locks.
func listCache(t *testing.T, cache string) []string {
	t.Helper()
	var out []string
	for _, kind := range []string{kindKernel, kindBusybox, kindInitramfs, kindRootfs, kindImages} {
		entries, err := os.ReadDir(filepath.Join(cache, kind))
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		for _, e := range entries {
			out = append(out, kind+"/"+e.Name())
		}
	}
	return out
}

// assertNoLeftovers fails t if the cache holds staging or temporary
// entries.
func assertNoLeftovers(t *testing.T, cache string) {
	t.Helper()
	for _, e := range listCache(t, cache) {
		if strings.Contains(e, "/.staging-") || strings.Contains(e, "/.tmp-") {
			t.Errorf("left behind in the cache: %s", e)
		}
	}
}

func TestEnsureDir(t *testing.T) {
	b := &Builder{CacheDir: t.TempDir()}
	ctx := context.Background()
	ok := func(dir string) error {
		_, err := os.Stat(filepath.Join(dir, "done"))
		return err
	}

	// A failing build leaves nothing, and its error comes first.
	boom := errors.New("boom")
	_, err := b.ensureDir(ctx, "thing", "k1", ok, func(ctx context.Context, staging string) error {
		testutil.WriteFile(t, filepath.Join(staging, "partial"), []byte("x"), 0o644)
		testutil.MkdirAll(t, filepath.Join(staging, "deep/er"), 0o755)
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("got %v", err)
	}
	if entries, _ := os.ReadDir(filepath.Join(b.CacheDir, "thing")); len(entries) != 0 {
		t.Errorf("left behind: %v", entries)
	}

	// Concurrent builders of one key: one builds, all get the result.
	var builds atomic.Int32
	var wg sync.WaitGroup
	dirs := make([]string, 8)
	for i := range dirs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d, err := b.ensureDir(ctx, "thing", "k2", ok, func(ctx context.Context, staging string) error {
				builds.Add(1)
				if fi, err := os.Stat(staging); err != nil || fi.Mode().Perm() != 0o700 {
					t.Errorf("staging %v while built, want 0700 (%v)", fi.Mode(), err)
				}
				return os.WriteFile(filepath.Join(staging, "done"), nil, 0o644)
			})
			if err != nil {
				t.Error(err)
			}
			dirs[i] = d
		}()
	}
	wg.Wait()
	if builds.Load() != 1 {
		t.Errorf("%d builds, want 1", builds.Load())
	}
	for _, d := range dirs {
		if d != filepath.Join(b.CacheDir, "thing", "k2") {
			t.Errorf("dir %s", d)
		}
	}
	if fi, err := os.Stat(dirs[0]); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("entry %v, want 0755 (%v)", fi.Mode(), err)
	}

	// An invalid entry is rebuilt and replaced; a stale staging dir goes.
	bad := filepath.Join(b.CacheDir, "thing", "k3")
	testutil.MkdirAll(t, bad, 0o755)
	testutil.WriteFile(t, filepath.Join(bad, "junk"), nil, 0o644)
	testutil.MkdirAll(t, filepath.Join(b.CacheDir, "thing", ".staging-k3-crashed"), 0o755)
	d, err := b.ensureDir(ctx, "thing", "k3", ok, func(ctx context.Context, staging string) error {
		return os.WriteFile(filepath.Join(staging, "done"), nil, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(d, "junk")); err == nil {
		t.Error("invalid entry not replaced")
	}
	entries, _ := os.ReadDir(filepath.Join(b.CacheDir, "thing"))
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if strings.Join(names, ",") != "k2,k3" {
		t.Errorf("cache holds %v", names)
	}

	// Keys are single safe path components.
	for _, key := range []string{"../x", "a/b", "", ".hidden", "x..y"} {
		t.Run("key "+key, func(t *testing.T) {
			if _, err := b.ensureDir(ctx, "thing", key, ok, nil); !errdefs.IsInvalidArgument(err) {
				t.Errorf("key %q: %v", key, err)
			}
		})
	}

	// Waiting for a lock gives up when the context ends.
	unlock, err := b.lock(ctx, "thing", "k4")
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := b.ensureDir(cctx, "thing", "k4", ok, nil); !errors.Is(err, context.Canceled) {
		t.Errorf("locked and cancelled: %v", err)
	}
	unlock()
}

func TestEnsureFile(t *testing.T) {
	b := &Builder{CacheDir: t.TempDir()}
	ctx := context.Background()
	if _, err := b.ensureFile(ctx, "f", "x.bin", func(w io.Writer) error {
		if _, err := w.Write([]byte("partial")); err != nil {
			return err
		}
		return errors.New("fail")
	}); err == nil {
		t.Fatal("no error")
	}
	if entries, _ := os.ReadDir(filepath.Join(b.CacheDir, "f")); len(entries) != 0 {
		t.Errorf("left behind: %v", entries)
	}
	p, err := b.ensureFile(ctx, "f", "x.bin", func(w io.Writer) error { _, err := w.Write([]byte("ok")); return err })
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(p); string(got) != "ok" {
		t.Errorf("content %q", got)
	}
}

// TestRemoveTreeMounts checks that removing a staging tree never descends
// into a mount left in it, but detaches it first.
func TestRemoveTreeMounts(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	mnt := filepath.Join(dir, "tree", "proc")
	testutil.MkdirAll(t, mnt, 0o755)
	if out, err := exec.Command("mount", "-t", "tmpfs", "tmpfs", mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v %s", err, out)
	}
	testutil.WriteFile(t, filepath.Join(mnt, "in-mount"), nil, 0o644)
	if err := removeTree(filepath.Join(dir, "tree")); err != nil {
		exec.Command("umount", "-l", mnt).Run()
		t.Fatal(err)
	}
	if m, _ := mountsBelow(dir); len(m) != 0 {
		t.Errorf("still mounted: %v", m)
	}
	if _, err := os.Stat(filepath.Join(dir, "tree")); !os.IsNotExist(err) {
		t.Errorf("tree not removed: %v", err)
	}
}
