package image

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/image/cpio"
	"github.com/forkd/forkd/internal/image/initramfs"
	"github.com/forkd/forkd/internal/testutil"
)

// requireAptHost skips (or fails, strict) unless the host can fetch
// Debian packages.
func requireAptHost(t *testing.T) {
	t.Helper()
	testutil.RequireCommand(t, "apt-get", "apt-cache", "dpkg-deb")
}

func readInitramfs(t *testing.T, path string) map[string]cpio.Header {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	r := cpio.NewReader(zr)
	out := map[string]cpio.Header{}
	for {
		h, err := r.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out[h.Name] = *h
	}
}

func checkSHA(t *testing.T, path, want string) {
	t.Helper()
	got, err := sha256File(path)
	if err != nil || got != want {
		t.Errorf("sha256 of %s = %s, %v; image says %s", path, got, err, want)
	}
}

func TestBuildMinimal(t *testing.T) {
	requireAptHost(t)
	cache := testCacheDir(t)
	b := newBuilder(t, cache)
	ctx := context.Background()
	start := time.Now()
	img, err := b.Build(ctx, "minimal")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("minimal build: %s (cache %s)", time.Since(start).Round(time.Millisecond), cache)
	if img.Name != "minimal" || img.Rootfs != "" || img.Python != "" || len(img.Cmdline) != 0 {
		t.Errorf("image %+v", img)
	}
	checkSHA(t, img.Kernel, img.KernelSHA256)
	checkSHA(t, img.Initrd, img.InitrdSHA256)
	if !strings.HasPrefix(img.Kernel, filepath.Join(cache, "kernel")+"/") ||
		!strings.HasPrefix(img.Initrd, filepath.Join(cache, "initramfs")+"/") {
		t.Errorf("paths outside the cache: %s %s", img.Kernel, img.Initrd)
	}

	files := readInitramfs(t, img.Initrd)
	if h := files["init"]; h.Mode != cpio.TypeReg|0o755 {
		t.Errorf("/init mode %o", h.Mode)
	}
	if h := files["bin/busybox"]; h.Mode != cpio.TypeReg|0o755 || h.Size < 1<<20 {
		t.Errorf("/bin/busybox: %+v", h)
	}
	for _, l := range []string{"bin/sh", "bin/mount", "sbin/ifconfig"} {
		if files[l].Linkname != "/bin/busybox" {
			t.Errorf("/%s is no busybox link", l)
		}
	}
	for _, p := range []string{"etc/passwd", "etc/group", "etc/forkd/modules", "proc", "sys", "dev", "tmp", "run", "mnt"} {
		if _, ok := files[p]; !ok {
			t.Errorf("/%s missing", p)
		}
	}
	mods := 0
	for name := range files {
		if strings.HasPrefix(name, "lib/modules/") && strings.Contains(name, ".ko") {
			mods++
		}
	}
	k, err := b.ensureKernel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if mods != len(k.manifest.Modules) || mods < 10 {
		t.Errorf("%d modules in the initramfs, %d in the kernel manifest", mods, len(k.manifest.Modules))
	}

	// Cached: the same files, quickly.
	start = time.Now()
	again, err := b.Build(ctx, "minimal")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("minimal build, cached: %s", time.Since(start).Round(time.Millisecond))
	if !reflect.DeepEqual(again, img) {
		t.Errorf("rebuild differs:\n%+v\n%+v", again, img)
	}

	// Deterministic: rewriting the initramfs gives the same bytes.
	testutil.Remove(t, img.Initrd)
	third, err := b.Build(ctx, "minimal")
	if err != nil {
		t.Fatal(err)
	}
	if third.InitrdSHA256 != img.InitrdSHA256 {
		t.Errorf("initramfs not deterministic: %s then %s", img.InitrdSHA256, third.InitrdSHA256)
	}
	assertNoLeftovers(t, cache)
}

// TestKernelDebOverride fetches the kernel offline from FORKD_KERNEL_DEB.
func TestKernelDebOverride(t *testing.T) {
	requireAptHost(t)
	ctx := context.Background()
	b := newBuilder(t, testCacheDir(t))
	k, err := b.ensureKernel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Download the same package to a file, and fetch from it into a fresh cache.
	dir := t.TempDir()
	src := b.kernelSource()
	pkg, err := src.Resolve(ctx)
	if err != nil {
		t.Fatal(err)
	}
	debPath, err := src.Tools.Download(ctx, pkg, dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(KernelDebEnv, debPath)
	off := &Builder{CacheDir: t.TempDir(), AgentPath: fakeAgent(t), AptListsDir: t.TempDir(), Tools: Tools{AptGet: "/nonexistent/apt-get"}}
	k2, err := off.ensureKernel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if k2.manifest.VmlinuzSHA256 != k.manifest.VmlinuzSHA256 || !slices.Equal(k2.manifest.Modules, k.manifest.Modules) {
		t.Errorf("offline kernel differs: %+v vs %+v", k2.manifest, k.manifest)
	}
	if filepath.Base(k2.dir) != pkg.Key() {
		t.Errorf("cache dir %s, want %s", k2.dir, pkg.Key())
	}
}

// bootOutput boots img in QEMU (TCG) and returns the console output.
func bootOutput(t *testing.T, img *Image) string {
	t.Helper()
	qemu := testutil.RequireCommand(t, "qemu-system-x86_64")
	args := []string{"-M", "q35", "-accel", "tcg,tb-size=64", "-cpu", "qemu64,+arat", "-m", "512M", "-smp", "1",
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-kernel", img.Kernel, "-initrd", img.Initrd, "-serial", "stdio",
		"-append", strings.Join(append([]string{"console=ttyS0", "panic=-1", "quiet", "nowatchdog"}, img.Cmdline...), " "),
		"-device", "virtio-rng-pci", "-device", "virtio-serial-pci",
	}
	if img.Rootfs != "" {
		args = append(args, "-drive", "file="+img.Rootfs+",if=none,id=root,format=raw,readonly=on",
			"-device", "virtio-blk-pci,drive=root")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start := time.Now()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, qemu, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	t.Logf("boot of %s: %s", img.Name, time.Since(start).Round(time.Millisecond))
	if err != nil {
		t.Fatalf("qemu: %v\n%s", err, out.String())
	}
	return out.String()
}

// TestBootMinimal boots the minimal image with a stand-in agent that loads
// every module of /etc/forkd/modules in order.
func TestBootMinimal(t *testing.T) {
	requireAptHost(t)
	b := newBuilder(t, testCacheDir(t))
	img, err := b.Build(context.Background(), "minimal")
	if err != nil {
		t.Fatal(err)
	}
	out := bootOutput(t, img)
	k, _ := b.ensureKernel(context.Background())
	for _, want := range []string{
		"FORKD-TEST modules=" + strconv.Itoa(len(k.manifest.Modules)), "FORKD-TEST busybox=yes", "FORKD-TEST done",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("console lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "FORKD-TEST error") {
		t.Errorf("agent reported an error:\n%s", out)
	}
}

// requireDebootstrap checks for what building a root filesystem needs.
func requireDebootstrap(t *testing.T) {
	t.Helper()
	testutil.RequireRoot(t)
	requireAptHost(t)
	testutil.RequireCommand(t, "debootstrap", "mkfs.ext4", "debugfs", "unshare")
}

// debugfs runs a debugfs request against an ext4 image.
func debugfs(t *testing.T, image, request string) string {
	t.Helper()
	out, err := exec.Command("debugfs", "-R", request, image).CombinedOutput()
	if err != nil {
		t.Fatalf("debugfs %q: %v\n%s", request, err, out)
	}
	return string(out)
}

func TestBuildPython(t *testing.T) {
	requireDebootstrap(t)
	cache := testCacheDir(t)
	b := newBuilder(t, cache)
	ctx := context.Background()
	start := time.Now()
	img, err := b.Build(ctx, "python")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("python build: %s", time.Since(start).Round(time.Millisecond))
	want := []string{"forkd.root=/dev/vda", "forkd.rootfstype=ext4", "forkd.python=/usr/bin/python3", "forkd.preload=numpy"}
	if !slices.Equal(img.Cmdline, want) || img.Python != "/usr/bin/python3" || !slices.Equal(img.Preload, []string{"numpy"}) {
		t.Errorf("image %+v", img)
	}
	checkSHA(t, img.Rootfs, img.RootfsSHA256)
	checkSHA(t, img.Initrd, img.InitrdSHA256)
	files := readInitramfs(t, img.Initrd)
	if _, ok := files["bin/busybox"]; ok {
		t.Error("rootfs image's initramfs carries busybox")
	}
	if _, ok := files["init"]; !ok {
		t.Error("no /init")
	}

	if out, err := exec.Command("e2fsck", "-fn", img.Rootfs).CombinedOutput(); err != nil {
		t.Errorf("e2fsck: %v\n%s", err, out)
	}
	if out := debugfs(t, img.Rootfs, "stat /usr/bin/python3"); !strings.Contains(out, "Type: symlink") && !strings.Contains(out, "Type: regular") {
		t.Errorf("no /usr/bin/python3:\n%s", out)
	}
	if out := debugfs(t, img.Rootfs, "ls /usr/lib/python3/dist-packages"); !strings.Contains(out, "numpy") {
		t.Errorf("no numpy:\n%s", out)
	}
	if out := debugfs(t, img.Rootfs, "stat /"); !strings.Contains(out, "User:     0   Group:     0") {
		t.Errorf("root not owned by 0:0:\n%s", out)
	}
	if out := debugfs(t, img.Rootfs, "stat /usr/bin/passwd"); !strings.Contains(out, "Mode:  04755") {
		t.Errorf("setuid lost:\n%s", out)
	}
	if out := debugfs(t, img.Rootfs, "ls /var/cache/apt/archives"); strings.Contains(out, ".deb") {
		t.Errorf("downloaded packages left in the image:\n%s", out)
	}
	if out := debugfs(t, img.Rootfs, "stats"); !strings.Contains(out, "Filesystem volume name:   forkd-root") || strings.Contains(out, "has_journal") {
		t.Errorf("superblock:\n%s", out)
	}

	start = time.Now()
	again, err := b.Build(ctx, "python")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("python build, cached: %s", time.Since(start).Round(time.Millisecond))
	if again.Rootfs != img.Rootfs || again.RootfsSHA256 != img.RootfsSHA256 {
		t.Errorf("cached build differs")
	}
	assertNoLeftovers(t, cache)

	if _, err := exec.LookPath("qemu-system-x86_64"); err == nil {
		out := bootOutput(t, img)
		for _, w := range []string{"FORKD-TEST root=mounted", "FORKD-TEST python=ok", "FORKD-TEST done"} {
			if !strings.Contains(out, w) {
				t.Errorf("console lacks %q:\n%s", w, out)
			}
		}
	}
}

// TestInitramfsLayoutContract pins the paths the guest agent relies on.
func TestInitramfsLayoutContract(t *testing.T) {
	if initramfs.ModulesList != "etc/forkd/modules" {
		t.Errorf("modules list moved to %s", initramfs.ModulesList)
	}
}
