package kernel

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image/deb"
	"github.com/forkd/forkd/internal/testutil"
)

// fakeModule returns a minimal ELF64 relocatable file whose .modinfo
// section holds the given key=value pairs.
func fakeModule(kv ...string) []byte {
	var modinfo []byte
	for _, s := range kv {
		modinfo = append(append(modinfo, s...), 0)
	}
	shstr := []byte("\x00.modinfo\x00.shstrtab\x00")
	const ehsize, shentsize = 64, 64
	modOff := uint64(ehsize)
	strOff := modOff + uint64(len(modinfo))
	shOff := (strOff + uint64(len(shstr)) + 7) &^ 7
	var b bytes.Buffer
	le := binary.LittleEndian
	b.Write([]byte{0x7f, 'E', 'L', 'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	binary.Write(&b, le, uint16(1))  // ET_REL
	binary.Write(&b, le, uint16(62)) // EM_X86_64
	binary.Write(&b, le, uint32(1))
	binary.Write(&b, le, uint64(0)) // entry
	binary.Write(&b, le, uint64(0)) // phoff
	binary.Write(&b, le, shOff)
	binary.Write(&b, le, uint32(0))
	binary.Write(&b, le, uint16(ehsize))
	binary.Write(&b, le, uint16(0))
	binary.Write(&b, le, uint16(0))
	binary.Write(&b, le, uint16(shentsize))
	binary.Write(&b, le, uint16(3)) // shnum
	binary.Write(&b, le, uint16(2)) // shstrndx
	b.Write(modinfo)
	b.Write(shstr)
	for uint64(b.Len()) < shOff {
		b.WriteByte(0)
	}
	sh := func(name, typ uint32, off, size uint64) {
		binary.Write(&b, le, name)
		binary.Write(&b, le, typ)
		binary.Write(&b, le, uint64(0)) // flags
		binary.Write(&b, le, uint64(0)) // addr
		binary.Write(&b, le, off)
		binary.Write(&b, le, size)
		binary.Write(&b, le, uint32(0))
		binary.Write(&b, le, uint32(0))
		binary.Write(&b, le, uint64(1))
		binary.Write(&b, le, uint64(0))
	}
	sh(0, 0, 0, 0)
	sh(1, 1, modOff, uint64(len(modinfo))) // .modinfo, SHT_PROGBITS
	sh(10, 3, strOff, uint64(len(shstr)))  // .shstrtab, SHT_STRTAB
	return b.Bytes()
}

func compress(t *testing.T, suffix string, data []byte) []byte {
	t.Helper()
	var b bytes.Buffer
	switch suffix {
	case ".ko":
		return data
	case ".ko.zst":
		w, err := zstd.NewWriter(&b)
		if err != nil {
			t.Fatal(err)
		}
		testutil.Write(t, suffix, w, data)
		testutil.Close(t, suffix, w)
	case ".ko.xz":
		w, err := xz.NewWriter(&b)
		if err != nil {
			t.Fatal(err)
		}
		testutil.Write(t, suffix, w, data)
		testutil.Close(t, suffix, w)
	case ".ko.gz":
		w := gzip.NewWriter(&b)
		testutil.Write(t, suffix, w, data)
		testutil.Close(t, suffix, w)
	}
	return b.Bytes()
}

// writeTree writes fake modules: file name -> depends.
func writeTree(t *testing.T, mods map[string]string, builtin ...string) *Tree {
	t.Helper()
	dir := t.TempDir()
	for file, deps := range mods {
		name, _ := ModuleName(file)
		suffix := strings.TrimPrefix(filepath.Base(file), strings.SplitN(filepath.Base(file), ".", 2)[0])
		p := filepath.Join(dir, "kernel", file)
		testutil.MkdirAll(t, filepath.Dir(p), 0o755)
		data := compress(t, suffix, fakeModule("license=GPL", "depends="+deps, "name="+name, "alias=a", "alias=b"))
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var bl []byte
	for _, b := range builtin {
		bl = append(bl, "kernel/"+b+".ko\n"...)
	}
	testutil.WriteFile(t, filepath.Join(dir, "modules.builtin"), bl, 0o644)
	tree, err := ScanTree(dir)
	if err != nil {
		t.Fatal(err)
	}
	return tree
}

func names(ms []Module) []string {
	var out []string
	for _, m := range ms {
		out = append(out, m.Name)
	}
	return out
}

func TestModinfoCompressed(t *testing.T) {
	for _, suffix := range []string{".ko", ".ko.zst", ".ko.xz", ".ko.gz"} {
		t.Run(suffix, func(t *testing.T) {
			tree := writeTree(t, map[string]string{"drivers/virtio-rng" + suffix: "virtio,virtio_ring"})
			info, err := ReadModinfo(tree.Files["virtio_rng"])
			if err != nil {
				t.Fatal(err)
			}
			if info["depends"] != "virtio,virtio_ring" || info["name"] != "virtio_rng" || info["alias"] != "a\nb" {
				t.Errorf("modinfo %v", info)
			}
		})
	}
	p := filepath.Join(t.TempDir(), "bad.ko")
	testutil.WriteFile(t, p, []byte("not an elf"), 0o644)
	if _, err := ReadModinfo(p); !errdefs.IsInvalidArgument(err) {
		t.Errorf("garbage module: %v, want InvalidArgument", err)
	}
}

func TestLoadOrderSynthetic(t *testing.T) {
	tree := writeTree(t, map[string]string{
		"a.ko":       "b,c",
		"b.ko.zst":   "d",
		"c.ko.xz":    "d,builtin_x",
		"d.ko":       "",
		"e-dash.ko":  "a",
		"cyc1.ko":    "cyc2",
		"cyc2.ko":    "cyc1",
		"broken.ko":  "missing",
		"lonely.ko":  "",
		"other.ko":   "d",
		"zz_last.ko": "",
	}, "builtin_x", "ext4")
	got, err := tree.LoadOrder([]string{"e-dash", "ext4", "other", "d"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"d", "b", "c", "a", "e_dash", "other"}
	if !slices.Equal(names(got), want) {
		t.Errorf("order %v, want %v", names(got), want)
	}
	if got[1].File() != "b.ko.zst" {
		t.Errorf("file of b: %s", got[1].File())
	}
	if _, err := tree.LoadOrder([]string{"cyc1"}); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "cyc1 -> cyc2 -> cyc1") {
		t.Errorf("cycle: %v", err)
	}
	if _, err := tree.LoadOrder([]string{"broken"}); !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "needed by broken") {
		t.Errorf("missing dependency: %v", err)
	}
	if _, err := tree.LoadOrder([]string{"nosuch"}); !errdefs.IsNotFound(err) {
		t.Errorf("missing module: %v", err)
	}
}

// testCache is the directory tests share across runs for downloads.
func testCache(t *testing.T) string {
	if d := os.Getenv("FORKD_TEST_CACHE"); d != "" {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		return d
	}
	return t.TempDir()
}

// realKernelDeb returns the host distribution's current cloud kernel .deb,
// downloaded into the shared test cache (once).
func realKernelDeb(t *testing.T) (string, deb.Package) {
	testutil.RequireCommand(t, "apt-get", "apt-cache", "dpkg-deb")
	ctx := context.Background()
	src := Source{}
	pkg, err := src.Resolve(ctx)
	if err != nil {
		t.Fatalf("resolve kernel package: %v", err)
	}
	dir := filepath.Join(testCache(t), "debs")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if m, _ := filepath.Glob(filepath.Join(dir, pkg.Name+"_*.deb")); len(m) == 1 {
		return m[0], pkg
	}
	p, err := src.Tools.Download(ctx, pkg, dir)
	if err != nil {
		t.Fatal(err)
	}
	return p, pkg
}

// TestRealKernelModules checks dependency ordering on the real modules of
// the distribution's cloud kernel.
func TestRealKernelModules(t *testing.T) {
	debPath, pkg := realKernelDeb(t)
	x := t.TempDir()
	if err := (deb.Tools{}).Extract(context.Background(), debPath, x); err != nil {
		t.Fatal(err)
	}
	_, release, err := findVmlinuz(x)
	if err != nil {
		t.Fatal(err)
	}
	dir := findModuleDir(x, release)
	if dir == "" {
		t.Fatalf("%s: no modules", pkg.Name)
	}
	tree, err := ScanTree(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(tree.Files) < 100 || len(tree.Builtin) < 100 {
		t.Fatalf("only %d modules, %d built in", len(tree.Files), len(tree.Builtin))
	}
	order, err := tree.LoadOrder(DefaultModules)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s load order: %v", release, names(order))
	pos := map[string]int{}
	for i, m := range order {
		if _, dup := pos[m.Name]; dup {
			t.Errorf("%s twice", m.Name)
		}
		pos[m.Name] = i
		for _, d := range m.Depends {
			j, ok := pos[strings.ReplaceAll(d, "-", "_")]
			if !ok && !tree.Builtin[d] {
				t.Errorf("%s loaded before its dependency %s", m.Name, d)
			}
			if ok && j >= i {
				t.Errorf("%s at %d, dependency %s at %d", m.Name, i, d, j)
			}
		}
	}
	for _, w := range DefaultModules {
		if _, ok := pos[w]; !ok && !tree.Builtin[w] {
			t.Errorf("wanted module %s neither loaded nor built in", w)
		}
	}
	if strings.Contains(pkg.Name, "cloud-amd64") && strings.HasPrefix(release, "6.1.") {
		// Debian 12's cloud kernel: the order the QEMU prototype used, plus
		// overlay and virtio_rng (ext4 is built in).
		want := []string{"virtio_ring", "virtio", "virtio_mmio", "virtio_pci_modern_dev", "virtio_pci_legacy_dev",
			"virtio_pci", "virtio_console", "virtio_blk", "failover", "net_failover", "virtio_net", "overlay",
			"vsock", "vmw_vsock_virtio_transport_common", "vmw_vsock_virtio_transport", "virtio_rng"}
		if !slices.Equal(names(order), want) {
			t.Errorf("order %v\nwant  %v", names(order), want)
		}
	}
}

// TestFetch runs Fetch from the real package (offline, from Debs) and
// checks the directory it leaves.
func TestFetch(t *testing.T) {
	debPath, pkg := realKernelDeb(t)
	dir := t.TempDir()
	m, err := Fetch(context.Background(), Source{Debs: []string{debPath}}, pkg, dir, DefaultModules)
	if err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(dir)
	var got []string
	for _, e := range entries {
		got = append(got, e.Name())
	}
	if !slices.Equal(got, []string{"config", "kernel.json", "modules", "vmlinuz"}) {
		t.Errorf("dir holds %v", got)
	}
	m2, err := ReadManifest(dir)
	if err != nil {
		t.Fatal(err)
	}
	if m2.Release != m.Release || !slices.Equal(m2.Modules, m.Modules) || len(m.Modules) == 0 || len(m.VmlinuzSHA256) != 64 {
		t.Errorf("manifest %+v vs %+v", m2, m)
	}
	b, _ := os.ReadFile(filepath.Join(dir, "vmlinuz"))
	if len(b) < 1<<20 || string(b[0x202:0x206]) != "HdrS" {
		t.Errorf("vmlinuz is not a bzImage (%d bytes)", len(b))
	}
	testutil.Remove(t, filepath.Join(dir, "modules", m.Modules[0]))
	if _, err := ReadManifest(dir); !errdefs.IsNotFound(err) {
		t.Errorf("manifest with a missing module: %v", err)
	}
}

// buildDeb makes a .deb named pkg from the files (path -> content).
func buildDeb(t *testing.T, pkg, version string, depends string, files map[string][]byte) string {
	t.Helper()
	testutil.RequireCommand(t, "dpkg-deb")
	root := filepath.Join(t.TempDir(), pkg)
	testutil.MkdirAll(t, filepath.Join(root, "DEBIAN"), 0o755)
	control := "Package: " + pkg + "\nVersion: " + version + "\nArchitecture: amd64\nMaintainer: t <t@example.com>\nDescription: test\n"
	if depends != "" {
		control += "Depends: " + depends + "\n"
	}
	testutil.WriteFile(t, filepath.Join(root, "DEBIAN", "control"), []byte(control), 0o644)
	for p, data := range files {
		testutil.MkdirAll(t, filepath.Dir(filepath.Join(root, p)), 0o755)
		if err := os.WriteFile(filepath.Join(root, p), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out := root + ".deb"
	if b, err := exec.Command("dpkg-deb", "--root-owner-group", "-Zgzip", "--build", root, out).CombinedOutput(); err != nil {
		t.Fatalf("dpkg-deb --build: %v\n%s", err, b)
	}
	return out
}

// TestFetchUbuntuLayout fetches offline from an Ubuntu-style pair of
// packages: the image package holds only vmlinuz, the modules package
// holds zstd-compressed modules; some of the wanted modules are built in.
func TestFetchUbuntuLayout(t *testing.T) {
	const rel = "6.8.0-40-kvm"
	mod := func(deps string) []byte { return compress(t, ".ko.zst", fakeModule("depends="+deps)) }
	img := buildDeb(t, "linux-image-"+rel, "6.8.0-40.40", "linux-modules-"+rel, map[string][]byte{
		"boot/vmlinuz-" + rel: []byte("not really a kernel"),
		"boot/config-" + rel:  []byte("CONFIG_VIRTIO=y\n"),
	})
	kdir := "lib/modules/" + rel + "/"
	mods := buildDeb(t, "linux-modules-"+rel, "6.8.0-40.40", "", map[string][]byte{
		kdir + "kernel/fs/overlayfs/overlay.ko.zst":                            mod(""),
		kdir + "kernel/net/vmw_vsock/vsock.ko.zst":                             mod(""),
		kdir + "kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko.zst": mod("vsock"),
		kdir + "kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko.zst":        mod("vmw_vsock_virtio_transport_common,vsock"),
		kdir + "modules.builtin": []byte("kernel/drivers/virtio/virtio.ko\nkernel/drivers/virtio/virtio_ring.ko\n" +
			"kernel/drivers/block/virtio_blk.ko\nkernel/drivers/net/virtio_net.ko\nkernel/drivers/char/virtio_console.ko\n" +
			"kernel/drivers/virtio/virtio_pci.ko\nkernel/drivers/virtio/virtio_mmio.ko\nkernel/fs/ext4/ext4.ko\n" +
			"kernel/drivers/char/hw_random/virtio-rng.ko\n"),
	})
	src := Source{Debs: []string{img, mods}}
	pkg, err := src.Resolve(context.Background())
	if err != nil || pkg.Name != "linux-image-"+rel {
		t.Fatalf("resolve: %+v %v", pkg, err)
	}
	dir := t.TempDir()
	m, err := Fetch(context.Background(), src, pkg, dir, DefaultModules)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"overlay.ko.zst", "vsock.ko.zst", "vmw_vsock_virtio_transport_common.ko.zst", "vmw_vsock_virtio_transport.ko.zst"}
	if !slices.Equal(m.Modules, want) || m.Release != rel {
		t.Errorf("manifest %+v, want modules %v", m, want)
	}
	if _, err := ReadManifest(dir); err != nil {
		t.Error(err)
	}
	// Without the modules package the module tree is missing.
	if _, err := Fetch(context.Background(), Source{Debs: []string{img}}, pkg, t.TempDir(), DefaultModules); !errdefs.IsNotFound(err) {
		t.Errorf("no modules package: %v", err)
	}
}
