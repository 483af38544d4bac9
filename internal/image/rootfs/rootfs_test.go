package rootfs

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

func TestClean(t *testing.T) {
	for in, want := range map[string]string{
		"etc/passwd": "etc/passwd", "./etc//x/": "etc/x", ".": ".", "./": ".", "a/./b": "a/b", "..a/b..": "..a/b..",
	} {
		t.Run(in, func(t *testing.T) {
			if got, err := Clean(in); err != nil || got != want {
				t.Errorf("Clean(%q) = %q, %v; want %q", in, got, err, want)
			}
		})
	}
	for _, bad := range []string{"", "/etc", "..", "../x", "a/../b", "a/..", "a\x00b", "//x"} {
		t.Run("bad "+bad, func(t *testing.T) {
			if _, err := Clean(bad); !errdefs.IsInvalidArgument(err) {
				t.Errorf("Clean(%q): %v, want InvalidArgument", bad, err)
			}
		})
	}
}

func newTree(t *testing.T) (*Tree, string, string) {
	t.Helper()
	base := t.TempDir()
	root, outside := filepath.Join(base, "root"), filepath.Join(base, "outside")
	testutil.Mkdir(t, root, 0o755)
	testutil.Mkdir(t, outside, 0o755)
	testutil.WriteFile(t, filepath.Join(outside, "precious"), []byte("keep"), 0o644)
	tr, err := OpenTree(root)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr, root, outside
}

func TestTreeConfined(t *testing.T) {
	tr, root, outside := newTree(t)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(tr.Symlink(outside, "out"))      // absolute, to the host's outside
	must(tr.Symlink("../../../..", "up")) // climbing past the root
	must(tr.Symlink(filepath.Join(outside, "precious"), "precious-link"))
	must(tr.MkdirAll("usr/lib", 0o755))
	must(tr.Symlink("usr/lib", "lib"))

	// Resolution inside the tree: the outside does not exist there.
	if _, err := tr.Stat("out/precious"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("stat through an escaping symlink: %v", err)
	}
	if _, err := tr.ReadFile("precious-link", 100); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("read through an escaping symlink: %v", err)
	}
	// Writing over a symlink replaces the link, never its target.
	must(tr.WriteFile("precious-link", []byte("mine"), 0o600))
	if b, _ := os.ReadFile(filepath.Join(outside, "precious")); string(b) != "keep" {
		t.Errorf("outside file rewritten: %q", b)
	}
	// Creating below an escaping symlink fails or stays inside.
	must(tr.MkdirAll("up/x", 0o755))
	must(tr.WriteFile("up/x/f", []byte("x"), 0o644))
	if _, err := os.Stat(filepath.Join(root, "x", "f")); err != nil {
		t.Errorf("write below a climbing symlink did not land at the root: %v", err)
	}
	// Symlinked directories inside the tree work.
	must(tr.WriteFile("lib/libx.so", []byte("elf"), 0o644))
	if _, err := os.Stat(filepath.Join(root, "usr/lib/libx.so")); err != nil {
		t.Error(err)
	}
	// RemoveAll removes links, not what they point at.
	must(tr.RemoveAll("out"))
	must(tr.RemoveAll("lib"))
	if entries, _ := os.ReadDir(outside); len(entries) != 1 {
		t.Errorf("outside holds %v", entries)
	}
	if _, err := os.Stat(filepath.Join(outside, "precious")); err != nil {
		t.Errorf("outside file removed: %v", err)
	}
	if _, err := os.Stat(filepath.Join(root, "usr/lib/libx.so")); err != nil {
		t.Errorf("target of a removed link removed: %v", err)
	}
	must(tr.RemoveAll("usr"))
	must(tr.RemoveAll("does/not/exist"))
	if _, err := os.Stat(filepath.Join(root, "usr")); !os.IsNotExist(err) {
		t.Errorf("usr not removed: %v", err)
	}
	for _, bad := range []string{"../x", "/etc/passwd"} {
		if err := tr.WriteFile(bad, nil, 0o644); !errdefs.IsInvalidArgument(err) {
			t.Errorf("WriteFile(%q): %v", bad, err)
		}
	}
}

func TestSwapFile(t *testing.T) {
	tr, root, _ := newTree(t)
	testutil.Check(t, tr.MkdirAll("etc", 0o755))
	testutil.Check(t, tr.WriteFile("etc/file", []byte("orig"), 0o640))
	testutil.Check(t, tr.Symlink("../run/resolv.conf", "etc/link"))
	var restores []func() error
	for _, name := range []string{"etc/file", "etc/link", "etc/absent", "usr/sbin/new"} {
		r, err := swapFile(tr, name, []byte("temporary"), 0o755)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if b, _ := os.ReadFile(filepath.Join(root, name)); string(b) != "temporary" {
			t.Errorf("%s: %q during the swap", name, b)
		}
		restores = append(restores, r)
	}
	for _, r := range restores {
		if err := r(); err != nil {
			t.Fatal(err)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(root, "etc/file")); string(b) != "orig" {
		t.Errorf("etc/file restored as %q", b)
	}
	if fi, _ := os.Stat(filepath.Join(root, "etc/file")); fi.Mode().Perm() != 0o640 {
		t.Errorf("etc/file mode %v", fi.Mode())
	}
	if l, _ := os.Readlink(filepath.Join(root, "etc/link")); l != "../run/resolv.conf" {
		t.Errorf("etc/link restored as %q", l)
	}
	for _, gone := range []string{"etc/absent", "usr/sbin/new"} {
		if _, err := os.Lstat(filepath.Join(root, gone)); !os.IsNotExist(err) {
			t.Errorf("%s left behind: %v", gone, err)
		}
	}
}

func TestOSReleaseAndPython(t *testing.T) {
	tr, _, _ := newTree(t)
	if m, err := OSRelease(tr); err != nil || len(m) != 0 {
		t.Errorf("no os-release: %v %v", m, err)
	}
	testutil.Check(t, tr.MkdirAll("usr/lib", 0o755))
	testutil.Check(t, tr.MkdirAll("etc", 0o755))
	testutil.Check(t, tr.WriteFile("usr/lib/os-release", []byte("# c\nID=ubuntu\nID_LIKE=debian\nVERSION_CODENAME=noble\nNAME=\"Ubuntu \\\"x\\\"\"\nPRETTY='single'\n"), 0o644))
	testutil.Check(t, tr.Symlink("../usr/lib/os-release", "etc/os-release"))
	m, err := OSRelease(tr)
	if err != nil || m["ID"] != "ubuntu" || m["NAME"] != `Ubuntu "x"` || m["PRETTY"] != "single" || !IsDebianLike(m) {
		t.Errorf("os-release %v, %v", m, err)
	}
	if IsDebianLike(map[string]string{"ID": "alpine"}) || !IsDebianLike(map[string]string{"ID": "pop", "ID_LIKE": "ubuntu debian"}) {
		t.Error("IsDebianLike")
	}
	if p := FindPython(tr); p != "" {
		t.Errorf("python %q in an empty tree", p)
	}
	testutil.Check(t, tr.MkdirAll("usr/bin", 0o755))
	testutil.Check(t, tr.WriteFile("usr/bin/python3.11", []byte("elf"), 0o755))
	testutil.Check(t, tr.Symlink("python3.11", "usr/bin/python3"))
	if p := FindPython(tr); p != "/usr/bin/python3" {
		t.Errorf("python %q", p)
	}
	testutil.Check(t, tr.MkdirAll("usr/local/bin", 0o755))
	testutil.Check(t, tr.WriteFile("usr/local/bin/python3", []byte("not executable"), 0o644))
	if p := FindPython(tr); p != "/usr/bin/python3" {
		t.Errorf("python %q with a non-executable /usr/local/bin/python3", p)
	}
	if err := EnsureMountpoints(tr); err != nil {
		t.Fatal(err)
	}
	for _, m := range Mountpoints {
		st, err := tr.Lstat(m.Name)
		if err != nil || st.Mode&0o7777 != m.Perm {
			t.Errorf("%s: %o %v", m.Name, st.Mode, err)
		}
	}
}

func TestMakeExt4(t *testing.T) {
	testutil.RequireCommand(t, "mkfs.ext4", "debugfs")
	dir := filepath.Join(t.TempDir(), "tree")
	// Many small files: inodes, not bytes, must fit.
	for d := 0; d < 100; d++ {
		sub := filepath.Join(dir, "many", fmt.Sprintf("d%03d", d))
		testutil.MkdirAll(t, sub, 0o755)
		for i := 0; i < 200; i++ {
			testutil.WriteFile(t, filepath.Join(sub, fmt.Sprintf("f%03d", i)), []byte("x"), 0o644)
		}
	}
	testutil.WriteFile(t, filepath.Join(dir, "big"), make([]byte, 8<<20), 0o644)
	testutil.Link(t, filepath.Join(dir, "big"), filepath.Join(dir, "big-link"))
	testutil.Symlink(t, strings.Repeat("long/", 20)+"target", filepath.Join(dir, "longlink"))
	out := filepath.Join(t.TempDir(), "root.ext4")
	size, err := Tools{}.MakeExt4(context.Background(), dir, out, Ext4Options{UUIDSeed: "seed"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("ext4 of 20000 files in 100 directories + 8 MiB: %d MiB", size>>20)
	stats, err := exec.Command("debugfs", "-R", "stats", out).CombinedOutput()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Filesystem volume name:   forkd-root", "Filesystem UUID:          " + seededUUID("seed"), "Reserved block count:     0"} {
		if !strings.Contains(string(stats), want) {
			t.Errorf("stats lack %q", want)
		}
	}
	if strings.Contains(string(stats), "has_journal") {
		t.Error("journal present")
	}
	ls, _ := exec.Command("debugfs", "-R", "ls /many/d099", out).CombinedOutput()
	if n := strings.Count(string(ls), " f"); n != 200 {
		t.Errorf("%d files in /many/d099, want 200", n)
	}
	if st, _ := exec.Command("debugfs", "-R", "stat /longlink", out).CombinedOutput(); !strings.Contains(string(st), "Type: symlink") {
		t.Errorf("long symlink:\n%s", st)
	}
	st, _ := exec.Command("debugfs", "-R", "stat /big", out).CombinedOutput()
	if !strings.Contains(string(st), "Links: 2") {
		t.Errorf("hard link lost:\n%s", st)
	}
	if _, err := (Tools{}).MakeExt4(context.Background(), dir, out, Ext4Options{}); err == nil {
		t.Error("MakeExt4 over an existing file succeeded")
	}
}

func TestDebootstrapPhase(t *testing.T) {
	for l, want := range map[string]bool{
		"I: Installing core packages...":         true,
		"I: Unpacking the base system...":        true,
		"I: Extracting zlib1g...":                false,
		"I: Retrieving libc6 2.36-9":             false,
		"W: Failure trying to run: x":            true,
		"I: Base system installed successfully.": true,
	} {
		t.Run(l, func(t *testing.T) {
			if got := debootstrapPhase(l); got != want {
				t.Errorf("debootstrapPhase(%q) = %v", l, got)
			}
		})
	}
}

func TestAddUser(t *testing.T) {
	dir := t.TempDir()
	for name, content := range map[string]string{
		"etc/passwd":        "root:x:0:0:root:/root:/bin/bash\n",
		"etc/group":         "root:x:0:\nusers:x:100:",
		"etc/shadow":        "root:*:19000:0:99999:7:::\n",
		"etc/skel/.profile": "echo hi\n",
	} {
		testutil.Check(t, os.MkdirAll(filepath.Join(dir, filepath.Dir(name)), 0o755))
		testutil.Check(t, os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644))
	}
	tr, err := OpenTree(dir)
	testutil.Check(t, err)
	defer tr.Close()
	u := User{Name: "user", UID: 1000, GID: 1000, Home: "/home/user", Shell: "/bin/bash"}
	testutil.Check(t, AddUser(tr, u))
	for name, want := range map[string]string{
		"etc/passwd":         "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n",
		"etc/group":          "root:x:0:\nusers:x:100:\nuser:x:1000:\n",
		"etc/shadow":         "root:*:19000:0:99999:7:::\nuser:!:19000:0:99999:7:::\n",
		"home/user/.profile": "echo hi\n",
	} {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil || string(b) != want {
			t.Errorf("%s = %q, %v; want %q", name, b, err, want)
		}
	}
	if os.Geteuid() == 0 {
		st, err := os.Stat(filepath.Join(dir, "home/user"))
		testutil.Check(t, err)
		if sys := st.Sys().(*syscall.Stat_t); sys.Uid != 1000 || sys.Gid != 1000 || st.Mode().Perm() != 0o755 {
			t.Errorf("home: uid %d gid %d mode %v", sys.Uid, sys.Gid, st.Mode())
		}
	}
	if err := AddUser(tr, u); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("adding the user again = %v", err)
	}
}
