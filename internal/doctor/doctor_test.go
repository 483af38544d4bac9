package doctor

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/testutil"
)

// fakeHost is a host made of files and stubs.
type fakeHost struct {
	proc, sys, dev string
	bins           map[string]string // name -> output of --version ("" = absent)
	apt            map[string]string // package -> apt-cache show output
	tools          bool              // the image-building commands exist
	dialed         []string
}

func write(t *testing.T, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

// newFakeHost is this project's CI machine, in files: no vmx, a /dev/kvm
// that answers, memory on cgroup v1 nested in /process_api/x, v2 with
// hugetlb only.
func newFakeHost(t *testing.T) *fakeHost {
	root := t.TempDir()
	h := &fakeHost{proc: filepath.Join(root, "proc"), sys: filepath.Join(root, "sys"), dev: filepath.Join(root, "dev"),
		bins: map[string]string{"qemu-system-x86_64": "QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\nCopyright"},
		apt: map[string]string{
			"linux-image-cloud-amd64":          "Package: linux-image-cloud-amd64\nVersion: 6.1.192-2\nDepends: linux-image-6.1.0-56-cloud-amd64 (= 6.1.192-2)\n",
			"linux-image-6.1.0-56-cloud-amd64": "Package: linux-image-6.1.0-56-cloud-amd64\nVersion: 6.1.192-2\n",
		}}
	write(t, filepath.Join(h.proc, "cpuinfo"), "processor\t: 0\nflags\t\t: fpu vme sse2 hypervisor lahf_lm\n\nprocessor\t: 1\nflags\t\t: fpu\n")
	cg := filepath.Join(root, "cgroup")
	var mi strings.Builder
	for i, c := range []string{"cpu", "cpuacct", "memory", "pids", "blkio"} {
		testutil.MkdirAll(t, filepath.Join(cg, c, "process_api/x"), 0o755)
		fmt.Fprintf(&mi, "%d 31 0:%d / %s rw - cgroup cgroup rw,%s\n", 40+i, 40+i, filepath.Join(cg, c), c)
	}
	write(t, filepath.Join(cg, "unified", "cgroup.controllers"), "hugetlb\n")
	fmt.Fprintf(&mi, "50 31 0:50 / %s rw - cgroup2 cgroup2 rw\n", filepath.Join(cg, "unified"))
	write(t, filepath.Join(h.proc, "self", "mountinfo"), mi.String())
	write(t, filepath.Join(h.proc, "self", "cgroup"), "1:cpu:/\n2:cpuacct:/\n3:memory:/process_api/x\n4:pids:/\n5:blkio:/\n0::/\n")
	write(t, filepath.Join(h.proc, "sys/net/ipv4/ip_forward"), "0\n")
	write(t, filepath.Join(h.proc, "sys/vm/unprivileged_userfaultfd"), "0\n")
	write(t, filepath.Join(h.proc, "swaps"), "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n")
	write(t, filepath.Join(h.proc, "meminfo"), "MemTotal: 1 kB\nHugePages_Total:       0\nHugePages_Free:        0\nHugepagesize:       2048 kB\n")
	write(t, filepath.Join(h.sys, "kernel/mm/ksm/run"), "1\n")
	write(t, filepath.Join(h.sys, "kernel/mm/ksm/pages_sharing"), "5\n")
	write(t, filepath.Join(h.sys, "kernel/mm/transparent_hugepage/enabled"), "always madvise [never]\n")
	write(t, filepath.Join(h.dev, "kvm"), "")
	write(t, filepath.Join(h.dev, "net/tun"), "")
	testutil.Chmod(t, filepath.Join(h.dev, "net/tun"), 0o600)
	return h
}

func (h *fakeHost) options(t *testing.T) Options {
	return Options{
		ProcRoot: h.proc, SysRoot: h.sys, DevRoot: h.dev, GOOS: "linux", GOARCH: "amd64",
		EUID:    func() int { return 1000 },
		DataDir: t.TempDir(),
		LookPath: func(name string) (string, error) {
			if name == "apt-cache" || h.bins[name] != "" || (h.tools && imageTool[name]) {
				return "/fake/" + name, nil
			}
			return "", errors.New("not found")
		},
		Output: func(ctx context.Context, name string, args ...string) ([]byte, error) {
			base := filepath.Base(name)
			switch {
			case base == "apt-cache":
				if out, ok := h.apt[args[len(args)-1]]; ok {
					return []byte(out), nil
				}
				return []byte("N: Unable to locate package"), errors.New("exit status 100")
			case len(args) == 1 && args[0] == "--version":
				return []byte(h.bins[base]), nil
			case len(args) == 2 && args[0] == "-accel":
				return []byte("Accelerators supported in QEMU binary:\ntcg\nkvm\n"), nil
			}
			return nil, fmt.Errorf("unexpected command %s %v", name, args)
		},
		Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
			h.dialed = append(h.dialed, network+" "+addr)
			if addr == "/run/forkd.sock" || addr == "127.0.0.1:8889" {
				c1, c2 := net.Pipe()
				c2.Close()
				return c1, nil
			}
			return nil, unix.ECONNREFUSED
		},
		Probes: Probes{
			KVM:         func(string) (int, error) { return 12, nil },
			Userfaultfd: func() error { return unix.EPERM },
			Memfd:       func() error { return nil },
			Nftables:    func(context.Context) error { t.Error("nftables probed without root"); return nil },
			NetNS:       func(context.Context) error { t.Error("netns probed without root"); return nil },
		},
	}
}

func expect(t *testing.T, rep Report, want map[string]Status, contains map[string]string) {
	t.Helper()
	for name, st := range want {
		c, ok := rep.Get(name)
		if !ok || c.Status != st {
			t.Errorf("%s: %s %q, want %s", name, c.Status, c.Detail, st)
		}
		if c.Status != Pass && c.Status != Skip && c.Hint == "" {
			t.Errorf("%s: %s without a fix", name, c.Status)
		}
	}
	for name, sub := range contains {
		if c, _ := rep.Get(name); !strings.Contains(c.Detail, sub) {
			t.Errorf("%s: %q does not say %q", name, c.Detail, sub)
		}
	}
}

// imageTool names the commands the image-tools check looks for.
var imageTool = map[string]bool{"dpkg-deb": true, "apt-get": true, "busybox": true, "mkfs.ext4": true, "debootstrap": true, "qemu-img": true}

func TestThisKindOfHost(t *testing.T) {
	h := newFakeHost(t)
	h.tools = true
	opts := h.options(t)
	opts.Controller = "unix:///run/forkd.sock"
	rep := Run(context.Background(), opts)
	expect(t, rep, map[string]Status{
		"platform": Pass, "cpu-virtualisation": Warn, "kvm": Warn, "qemu": Pass, "firecracker": Skip,
		"guest-kernel": Pass, "cgroups": Pass, "ip-forward": Warn, "nftables": Skip, "netns-tap": Skip,
		"userfaultfd": Warn, "memfd": Pass, "ksm": Pass, "swap": Warn, "hugepages": Warn, "data-dir": Pass,
		"image-tools": Pass, "agent": Skip, "vmm-user": Skip, "controller": Pass, "backend": Warn,
	}, map[string]string{
		"swap":         "no swap",
		"kvm":          "KVM_CREATE_VM works) but the CPU shows no vmx/svm",
		"cgroups":      "memory on v1",
		"guest-kernel": "linux-image-6.1.0-56-cloud-amd64 6.1.192-2",
		"netns-tap":    "needs root",
		"userfaultfd":  "vm.unprivileged_userfaultfd=0",
		"backend":      "qemu with tcg",
		"qemu":         "7.2.22",
	})
	if c, _ := rep.Get("cgroups"); !strings.Contains(c.Detail, "v2 at") || !strings.Contains(c.Detail, "[hugetlb]") || !strings.Contains(c.Detail, "needs root") {
		t.Errorf("cgroups: %q", c.Detail)
	}
	if rep.Backend != "qemu" || rep.Accelerator != "tcg" || !strings.Contains(rep.BackendReason, "no vmx/svm") {
		t.Errorf("backend %+v", rep)
	}
	if rep.Failed() || rep.ExitCode() != 0 {
		t.Error("failed")
	}
	if len(h.dialed) != 1 || h.dialed[0] != "unix /run/forkd.sock" {
		t.Errorf("dialed %v", h.dialed)
	}
	var sb strings.Builder
	rep.WriteText(&sb)
	if !strings.Contains(sb.String(), "WARN  kvm") || !strings.Contains(sb.String(), "fix: ") || !strings.Contains(sb.String(), "backend qemu/tcg") {
		t.Errorf("text:\n%s", sb.String())
	}
}

func TestKVMHostWithoutQEMU(t *testing.T) {
	h := newFakeHost(t)
	write(t, filepath.Join(h.proc, "cpuinfo"), "flags\t\t: fpu vmx sse2\n")
	h.bins = map[string]string{"firecracker": "Firecracker v1.16.1\n"}
	write(t, filepath.Join(h.proc, "swaps"), "Filename\tType\tSize\tUsed\tPriority\n/dev/zram0 partition\t6170624\t0\t100\n")
	opts := h.options(t)
	opts.Controller = "http://127.0.0.1:8889"
	rep := Run(context.Background(), opts)
	if c, _ := rep.Get("swap"); c.Status != Pass || !strings.Contains(c.Detail, "compressed swap in RAM (/dev/zram0)") {
		t.Errorf("swap: %s %q", c.Status, c.Detail)
	}
	// Firecracker and KVM work, but forkd has no Firecracker backend yet:
	// without QEMU no backend runs, and doctor says so.
	expect(t, rep, map[string]Status{"cpu-virtualisation": Pass, "kvm": Pass, "qemu": Fail, "firecracker": Pass,
		"controller": Pass, "backend": Fail}, nil)
	if rep.Backend != "" || rep.Accelerator != "" {
		t.Errorf("backend %q %q, want none", rep.Backend, rep.Accelerator)
	}
	if !rep.Failed() || rep.ExitCode() != 1 {
		t.Error("a missing QEMU is a failure")
	}
	if h.dialed[0] != "tcp 127.0.0.1:8889" {
		t.Errorf("dialed %v", h.dialed)
	}
}

func TestNothingWorks(t *testing.T) {
	h := newFakeHost(t)
	testutil.Remove(t, filepath.Join(h.dev, "kvm"))
	h.bins = map[string]string{"firecracker": "Firecracker v1.10.0\n"}
	h.apt = nil
	opts := h.options(t)
	opts.GOOS = "darwin"
	opts.Controller = "/run/elsewhere.sock"
	opts.DataDir = "/proc/forkd-cannot-be-here"
	opts.AgentPath = "/proc/forkd-no-agent"
	rep := Run(context.Background(), opts)
	expect(t, rep, map[string]Status{"platform": Fail, "kvm": Warn, "qemu": Fail, "firecracker": Warn,
		"guest-kernel": Fail, "data-dir": Fail, "image-tools": Fail, "agent": Fail, "controller": Fail, "backend": Fail}, map[string]string{
		"kvm": "no " + filepath.Join(h.dev, "kvm"), "firecracker": "older than 1.16.1"})
	if rep.Backend != "" || rep.ExitCode() != 1 {
		t.Errorf("backend %q exit %d", rep.Backend, rep.ExitCode())
	}
	b, err := rep.JSON()
	if err != nil || !strings.Contains(string(b), `"failed": true`) {
		t.Fatalf("%s %v", b, err)
	}
}

func TestDataDir(t *testing.T) {
	h := newFakeHost(t)
	opts := h.options(t)
	opts.DataDir = filepath.Join(t.TempDir(), "a", "b")
	rep := Run(context.Background(), opts)
	expect(t, rep, map[string]Status{"data-dir": Pass}, map[string]string{"data-dir": "does not exist yet"})
	if _, err := os.Stat("/dev/shm"); err == nil {
		shm, err := os.MkdirTemp("/dev/shm", "forkd-doctor-test-")
		if err == nil {
			defer os.RemoveAll(shm)
			opts.DataDir = shm
			rep = Run(context.Background(), opts)
			expect(t, rep, map[string]Status{"data-dir": Warn}, map[string]string{"data-dir": "tmpfs"})
		}
	}
	// A cached kernel is found without asking apt.
	opts.CacheDir = t.TempDir()
	kd := filepath.Join(opts.CacheDir, "kernel", "linux-image-x_1")
	write(t, filepath.Join(kd, "vmlinuz"), "x")
	write(t, filepath.Join(kd, "kernel.json"), `{"format":1,"package":"linux-image-x","version":"1","release":"6.1.0-x"}`)
	h.apt = nil
	rep = Run(context.Background(), opts)
	expect(t, rep, map[string]Status{"guest-kernel": Pass}, map[string]string{"guest-kernel": "cached: linux-image-x 1 (6.1.0-x)"})
}

func TestRootProbes(t *testing.T) {
	h := newFakeHost(t)
	opts := h.options(t)
	opts.EUID = func() int { return 0 }
	called := 0
	opts.Probes.Nftables = func(context.Context) error { called++; return errors.New("no nf_tables") }
	opts.Probes.NetNS = func(context.Context) error { called++; return nil }
	opts.ProcRoot = h.proc
	// Group creation on the fake tree fails (no control files): reported.
	rep := Run(context.Background(), opts)
	expect(t, rep, map[string]Status{"nftables": Fail, "netns-tap": Pass, "cgroups": Fail}, map[string]string{
		"netns-tap": "unprivileged VMM must be handed its tap"})
	if called != 2 {
		t.Errorf("probes called %d times", called)
	}
}
