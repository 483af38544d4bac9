package doctor

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/cgroup"
	"github.com/forkd/forkd/internal/image/kernel"
	"github.com/forkd/forkd/internal/proc"
)

func (r *run) root() bool { return r.opts.EUID() == 0 }

func (r *run) proc(p ...string) string {
	return filepath.Join(append([]string{r.opts.ProcRoot}, p...)...)
}

func (r *run) sys(p ...string) string {
	return filepath.Join(append([]string{r.opts.SysRoot}, p...)...)
}

func readTrim(path string) (string, error) {
	b, err := os.ReadFile(path)
	return strings.TrimSpace(string(b)), err
}

func (r *run) platform(ctx context.Context) Check {
	p := r.opts.GOOS + "/" + r.opts.GOARCH
	switch {
	case r.opts.GOOS != "linux":
		return Check{Status: Fail, Detail: p, Hint: "forkd runs on Linux only"}
	case r.opts.GOARCH != "amd64":
		return Check{Status: Warn, Detail: p + ": only linux/amd64 is tested", Hint: "use an x86_64 host"}
	}
	return Check{Status: Pass, Detail: p}
}

func (r *run) cpuVirt(ctx context.Context) Check {
	f, err := os.Open(r.proc("cpuinfo"))
	if err != nil {
		return Check{Status: Skip, Detail: "cannot read cpuinfo: " + err.Error()}
	}
	defer f.Close()
	hyper := false
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || strings.TrimSpace(k) != "flags" {
			continue
		}
		for _, fl := range strings.Fields(v) {
			switch fl {
			case "vmx", "svm":
				r.virtFlag = fl
			case "hypervisor":
				hyper = true
			}
		}
		break
	}
	if r.virtFlag != "" {
		return Check{Status: Pass, Detail: "CPU has " + r.virtFlag}
	}
	d := "CPU shows no vmx/svm flag"
	if hyper {
		d += " (this is a VM whose hypervisor does not expose nested virtualisation)"
	}
	return Check{Status: Warn, Detail: d + ": no KVM, QEMU runs with TCG",
		Hint: "enable VT-x/AMD-V in the firmware, or nested virtualisation on the hypervisor"}
}

func (r *run) kvm(ctx context.Context) Check {
	dev := filepath.Join(r.opts.DevRoot, "kvm")
	if _, err := os.Stat(dev); err != nil {
		r.kvmWhy = "no " + dev
		return Check{Status: Warn, Detail: r.kvmWhy + ": QEMU runs with TCG",
			Hint: "load kvm_intel or kvm_amd (modprobe), on a CPU with vmx/svm"}
	}
	api, err := r.opts.Probes.KVM(dev)
	if err != nil {
		r.kvmWhy = dev + ": " + err.Error()
		if errors.Is(err, os.ErrPermission) {
			return Check{Status: Warn, Detail: "no permission on " + dev,
				Hint: "run forkd as root, or add its user to the group owning " + dev}
		}
		return Check{Status: Warn, Detail: r.kvmWhy + ": QEMU runs with TCG",
			Hint: "check dmesg for kvm errors; the CPU needs vmx/svm"}
	}
	r.kvmOK = true
	if r.virtFlag == "" {
		r.kvmWhy = dev + " creates VMs but the CPU shows no vmx/svm, and QEMU's KVM hangs on such hosts"
		return Check{Status: Warn, Detail: fmt.Sprintf("%s answers (API %d, KVM_CREATE_VM works) but the CPU shows no vmx/svm: QEMU with -accel kvm hangs on such hosts, forkd will not use KVM", dev, api),
			Hint: "expose vmx/svm to this machine (nested virtualisation) to use KVM"}
	}
	return Check{Status: Pass, Detail: fmt.Sprintf("%s works (API %d, KVM_CREATE_VM and a vCPU)", dev, api)}
}

var qemuVersionRE = regexp.MustCompile(`version (\d+)\.(\d+)\.(\d+)`)

func (r *run) qemu(ctx context.Context) Check {
	bin, err := r.opts.LookPath(r.opts.QEMU)
	if err != nil {
		return Check{Status: Fail, Detail: r.opts.QEMU + " not found",
			Hint: "apt-get install qemu-system-x86"}
	}
	out, err := r.opts.Output(ctx, bin, "--version")
	line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	if err != nil {
		return Check{Status: Fail, Detail: fmt.Sprintf("%s --version: %v %s", bin, err, line),
			Hint: "reinstall qemu-system-x86"}
	}
	r.qemuDetail = bin + ": " + line
	m := qemuVersionRE.FindStringSubmatch(line)
	if m == nil {
		return Check{Status: Warn, Detail: r.qemuDetail + " (version not understood)"}
	}
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	if major < 7 || major == 7 && minor < 2 {
		return Check{Status: Warn, Detail: r.qemuDetail + ": older than 7.2, the version forkd is tested with",
			Hint: "use the distribution's QEMU 7.2 or newer"}
	}
	accels, err := r.opts.Output(ctx, bin, "-accel", "help")
	if err == nil && !bytes.Contains(accels, []byte("tcg")) && (!r.kvmOK || r.virtFlag == "") {
		return Check{Status: Fail, Detail: r.qemuDetail + ": built without TCG, and KVM is not usable here",
			Hint: "install the distribution's qemu-system-x86"}
	}
	r.qemuOK = true
	return Check{Status: Pass, Detail: r.qemuDetail}
}

var fcVersionRE = regexp.MustCompile(`v(\d+)\.(\d+)\.(\d+)`)

func (r *run) firecracker(ctx context.Context) Check {
	bin, err := r.opts.LookPath(r.opts.Firecracker)
	if err != nil {
		return Check{Status: Skip, Detail: r.opts.Firecracker + " not installed (optional: the Firecracker backend needs KVM)"}
	}
	out, err := r.opts.Output(ctx, bin, "--version")
	line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	if err != nil {
		return Check{Status: Warn, Detail: fmt.Sprintf("%s --version: %v", bin, err), Hint: "reinstall Firecracker"}
	}
	d := bin + ": " + line
	if m := fcVersionRE.FindStringSubmatch(line); m != nil {
		v := [3]int{}
		for i := range v {
			v[i], _ = strconv.Atoi(m[i+1])
		}
		if v[0] < 1 || v[0] == 1 && (v[1] < 16 || v[1] == 16 && v[2] < 1) {
			return Check{Status: Warn, Detail: d + ": older than 1.16.1", Hint: "install Firecracker 1.16.1 or newer"}
		}
	}
	if !r.kvmOK || r.virtFlag == "" {
		return Check{Status: Warn, Detail: d + ", but KVM is unusable here, so it cannot run",
			Hint: "Firecracker needs a host whose CPU exposes vmx/svm"}
	}
	return Check{Status: Pass, Detail: d + " (forkd has no Firecracker backend yet: QEMU runs the VMs)"}
}

func (r *run) guestKernel(ctx context.Context) Check {
	dirs, _ := filepath.Glob(filepath.Join(r.opts.CacheDir, "kernel", "*", kernel.ManifestFile))
	for _, mf := range dirs {
		m, err := kernel.ReadManifest(filepath.Dir(mf))
		if err == nil {
			return Check{Status: Pass, Detail: fmt.Sprintf("cached: %s %s (%s) in %s", m.Package, m.Version, m.Release, filepath.Dir(mf))}
		}
	}
	aptCache, err := r.opts.LookPath("apt-cache")
	if err != nil {
		return Check{Status: Warn, Detail: "no kernel cached and no apt-cache to find one",
			Hint: "set FORKD_KERNEL_DEB to a local linux-image-*-cloud-amd64 .deb"}
	}
	arch := r.opts.GOARCH
	var tried []string
	for _, meta := range kernel.DefaultMetas(arch) {
		p, err := r.aptShow(ctx, aptCache, meta)
		if err != nil {
			tried = append(tried, meta)
			continue
		}
		for _, d := range p.depends {
			if strings.HasPrefix(d, "linux-image-") {
				if img, err := r.aptShow(ctx, aptCache, d); err == nil {
					return Check{Status: Pass, Detail: fmt.Sprintf("not cached yet; apt resolves %s to %s %s (downloaded on first use, never installed)", meta, img.name, img.version)}
				}
			}
		}
		return Check{Status: Pass, Detail: fmt.Sprintf("not cached yet; apt resolves %s %s (downloaded on first use)", p.name, p.version)}
	}
	return Check{Status: Fail, Detail: "no kernel cached, and apt knows none of " + strings.Join(tried, ", "),
		Hint: "apt-get update (with Debian's main component), or set FORKD_KERNEL_DEB to a local kernel .deb"}
}

type aptPkg struct {
	name, version string
	depends       []string
}

// aptShow asks apt-cache for the candidate of name, without ever updating
// apt's lists.
func (r *run) aptShow(ctx context.Context, aptCache, name string) (aptPkg, error) {
	out, err := r.opts.Output(ctx, aptCache, "show", "--no-all-versions", name)
	if err != nil {
		return aptPkg{}, err
	}
	var p aptPkg
	for _, line := range strings.Split(string(out), "\n") {
		k, v, ok := strings.Cut(line, ": ")
		if !ok {
			continue
		}
		switch k {
		case "Package":
			p.name = v
		case "Version":
			p.version = v
		case "Depends":
			for _, d := range strings.Split(v, ",") {
				d, _, _ = strings.Cut(strings.TrimSpace(d), " ")
				p.depends = append(p.depends, d)
			}
		}
	}
	if p.name == "" || p.version == "" {
		return aptPkg{}, fmt.Errorf("apt knows no candidate for %s", name)
	}
	return p, nil
}

func (r *run) cgroups(ctx context.Context) Check {
	m, err := cgroup.New(cgroup.Options{MountInfo: r.proc("self", "mountinfo"), SelfCgroup: r.proc("self", "cgroup"),
		Parent: "forkd-doctor"})
	if err != nil {
		// forkd runs without limits then (sandboxes asking for some are
		// refused): a warning, not a failure.
		return Check{Status: Warn, Detail: err.Error() + "; resource limits unavailable",
			Hint: "mount cgroup v2 (or v1 memory, cpu, pids hierarchies)"}
	}
	var parts, missing []string
	for _, kind := range []string{cgroup.Memory, cgroup.CPU, cgroup.PIDs, cgroup.IO} {
		switch v := m.Version(kind); v {
		case 0:
			missing = append(missing, kind)
		default:
			parts = append(parts, fmt.Sprintf("%s on v%d", kind, v))
		}
	}
	for _, h := range m.Hierarchies() {
		if h.Version == 2 {
			parts = append(parts, fmt.Sprintf("v2 at %s offers [%s]", h.Mount, strings.Join(h.Controllers, " ")))
		}
	}
	detail := strings.Join(parts, ", ")
	c := Check{Status: Pass, Detail: detail}
	if len(missing) > 0 {
		c.Status = Warn
		c.Detail += "; no " + strings.Join(missing, ", ") + " controller: those limits are refused"
		c.Hint = "enable the missing controllers (cgroup v2 with delegation, or their v1 hierarchies)"
	}
	if !r.root() {
		c.Detail += "; creating a group not tried (needs root)"
		return c
	}
	name := fmt.Sprintf("probe-%d", os.Getpid())
	var l cgroup.Limits
	if m.Version(cgroup.Memory) > 0 {
		l.MemoryMiB = 64
	}
	if m.Version(cgroup.PIDs) > 0 {
		l.PIDs = 64
	}
	g, err := m.Create(name, l)
	if err != nil {
		return Check{Status: Fail, Detail: detail + "; creating a group failed: " + err.Error(),
			Hint: "forkd must be able to create cgroups below its own (root, or a delegated v2 cgroup)"}
	}
	if err := g.Destroy(); err != nil {
		return Check{Status: Fail, Detail: detail + "; removing a group failed: " + err.Error()}
	}
	for _, h := range m.Hierarchies() {
		os.Remove(filepath.Join(h.Own, "forkd-doctor"))
	}
	c.Detail += "; created and removed a limited group"
	return c
}

func (r *run) ipForward(ctx context.Context) Check {
	v, err := readTrim(r.proc("sys", "net", "ipv4", "ip_forward"))
	if err != nil {
		return Check{Status: Skip, Detail: err.Error()}
	}
	if v == "1" {
		return Check{Status: Pass, Detail: "net.ipv4.ip_forward=1"}
	}
	return Check{Status: Warn, Detail: "net.ipv4.ip_forward=" + v + ": forkd turns it on when it creates the first sandbox network",
		Hint: "echo net.ipv4.ip_forward=1 > /etc/sysctl.d/60-forkd.conf && sysctl --system, so the change is deliberate and lasts"}
}

func (r *run) nftables(ctx context.Context) Check {
	if !r.root() {
		return Check{Status: Skip, Detail: "needs root (CAP_NET_ADMIN)"}
	}
	if err := r.opts.Probes.Nftables(ctx); err != nil {
		return Check{Status: Fail, Detail: "nftables over netlink: " + err.Error(),
			Hint: "the kernel needs nf_tables with nat, masq, fib, reject and ct (CONFIG_NF_TABLES, CONFIG_NFT_NAT, ...)"}
	}
	return Check{Status: Pass, Detail: "nftables over netlink works (created and deleted a scratch table)"}
}

func (r *run) netnsTap(ctx context.Context) Check {
	tun := filepath.Join(r.opts.DevRoot, "net", "tun")
	st, err := os.Stat(tun)
	if err != nil {
		return Check{Status: Fail, Detail: "no " + tun, Hint: "load the tun module (modprobe tun)"}
	}
	var notes []string
	if st.Mode().Perm()&0o006 == 0 {
		notes = append(notes, fmt.Sprintf("%s is %v: an unprivileged VMM must be handed its tap (netns.OpenTap)", tun, st.Mode().Perm()))
	}
	if _, err := os.Stat(filepath.Join(r.opts.DevRoot, "vhost-net")); err != nil {
		notes = append(notes, "no /dev/vhost-net: virtio-net is served by QEMU itself")
	}
	note := ""
	if len(notes) > 0 {
		note = "; " + strings.Join(notes, "; ")
	}
	if !r.root() {
		return Check{Status: Skip, Detail: "needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN)" + note}
	}
	if err := r.opts.Probes.NetNS(ctx); err != nil {
		return Check{Status: Fail, Detail: "scratch netns with a tap: " + err.Error(),
			Hint: "the kernel needs network namespaces, veth and tun; /run/netns must be writable"}
	}
	return Check{Status: Pass, Detail: "created and deleted a scratch netns with a tap" + note}
}

func (r *run) userfaultfd(ctx context.Context) Check {
	sysctl, serr := readTrim(r.proc("sys", "vm", "unprivileged_userfaultfd"))
	if serr == nil {
		sysctl = "vm.unprivileged_userfaultfd=" + sysctl
	}
	err := r.opts.Probes.Userfaultfd()
	switch {
	case err == nil:
		return Check{Status: Pass, Detail: strings.TrimSuffix("userfaultfd works; "+sysctl, "; ")}
	case errors.Is(err, unix.ENOSYS):
		return Check{Status: Warn, Detail: "kernel without userfaultfd (CONFIG_USERFAULTFD)",
			Hint: "only lazy snapshot loading needs it; a kernel with CONFIG_USERFAULTFD=y"}
	case errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES):
		return Check{Status: Warn, Detail: "userfaultfd refused (" + sysctl + ")",
			Hint: "run as root, or sysctl -w vm.unprivileged_userfaultfd=1, or grant access to /dev/userfaultfd"}
	}
	return Check{Status: Warn, Detail: "userfaultfd: " + err.Error()}
}

func (r *run) memfd(ctx context.Context) Check {
	if err := r.opts.Probes.Memfd(); err != nil {
		return Check{Status: Warn, Detail: "memfd_create: " + err.Error(), Hint: "a kernel with memfd_create (3.17+)"}
	}
	return Check{Status: Pass, Detail: "memfd_create works"}
}

func (r *run) ksm(ctx context.Context) Check {
	run, err := readTrim(r.sys("kernel", "mm", "ksm", "run"))
	if err != nil {
		return Check{Status: Skip, Detail: "kernel has no KSM (optional: children share unwritten pages through the snapshot file anyway)"}
	}
	if run != "1" {
		return Check{Status: Pass, Detail: "KSM available, off (run=" + run + "); optional: children share unwritten pages through the snapshot file"}
	}
	sharing, _ := readTrim(r.sys("kernel", "mm", "ksm", "pages_sharing"))
	return Check{Status: Pass, Detail: "KSM on, pages_sharing=" + sharing}
}

// swap: forkd serve --idle-reclaim pages frozen sandboxes out to swap.
func (r *run) swap(ctx context.Context) Check {
	b, err := os.ReadFile(r.proc("swaps"))
	if err != nil {
		return Check{Status: Skip, Detail: "no /proc/swaps: " + err.Error()}
	}
	var zram, other []string
	for _, d := range proc.ParseSwaps(b) {
		if d.Zram() {
			zram = append(zram, d.Path)
		} else {
			other = append(other, d.Path)
		}
	}
	switch {
	case len(zram) > 0:
		return Check{Status: Pass, Detail: "compressed swap in RAM (" + strings.Join(append(zram, other...), ", ") + "): serve --idle-reclaim pages idle sandboxes out to it"}
	case len(other) > 0:
		return Check{Status: Pass, Detail: "swap on " + strings.Join(other, ", ") + ": serve --idle-reclaim pages idle sandboxes out to it (their next wake reads it back)"}
	}
	return Check{Status: Warn, Detail: "no swap: idle sandboxes stay resident (serve --idle-reclaim has nowhere to page them out)",
		Hint: "as root: scripts/zram-swap.sh (compressed swap in RAM, sized half of RAM uncompressed)"}
}

func (r *run) hugepages(ctx context.Context) Check {
	kv := map[string]string{}
	if b, err := os.ReadFile(r.proc("meminfo")); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok {
				kv[k] = strings.TrimSpace(v)
			}
		}
	}
	var parts []string
	if t, ok := kv["HugePages_Total"]; ok {
		parts = append(parts, fmt.Sprintf("hugetlb pages: %s of %s (%s free)", t, kv["Hugepagesize"], kv["HugePages_Free"]))
	}
	if thp, err := readTrim(r.sys("kernel", "mm", "transparent_hugepage", "enabled")); err == nil {
		sel := thp
		if i, j := strings.Index(thp, "["), strings.Index(thp, "]"); i >= 0 && j > i {
			sel = thp[i+1 : j]
		}
		parts = append(parts, "transparent hugepages: "+sel)
		if sel == "never" {
			return Check{Status: Warn, Detail: strings.Join(parts, "; ") + ": QEMU's code buffers get no THP",
				Hint: "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled"}
		}
	}
	if len(parts) == 0 {
		return Check{Status: Skip, Detail: "no hugepage information in meminfo or sysfs"}
	}
	return Check{Status: Pass, Detail: strings.Join(parts, "; ")}
}

const (
	tmpfsMagic = 0x01021994
	ramfsMagic = 0x858458f6
)

func (r *run) dataDir(ctx context.Context) Check {
	dir := r.opts.DataDir
	probe, exists := dir, true
	for {
		st, err := os.Stat(probe)
		if err == nil {
			if !st.IsDir() {
				return Check{Status: Fail, Detail: probe + " is not a directory", Hint: "point --data-dir at a directory"}
			}
			break
		}
		exists = false
		parent := filepath.Dir(probe)
		if parent == probe {
			return Check{Status: Fail, Detail: err.Error()}
		}
		probe = parent
	}
	var detail string
	if exists {
		f, err := os.CreateTemp(dir, ".doctor-*")
		if err != nil {
			return Check{Status: Fail, Detail: dir + " is not writable: " + err.Error(),
				Hint: "run as the user owning " + dir + ", or choose another --data-dir"}
		}
		f.Close()
		os.Remove(f.Name())
		detail = dir + " writable"
	} else {
		if err := unix.Access(probe, unix.W_OK); err != nil {
			return Check{Status: Fail, Detail: dir + " does not exist and " + probe + " is not writable",
				Hint: "mkdir -p " + dir + " as root and give it to forkd's user, or choose another --data-dir"}
		}
		detail = dir + " does not exist yet (created on first use under " + probe + ")"
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(probe, &fs); err != nil {
		return Check{Status: Warn, Detail: detail + "; statfs: " + err.Error()}
	}
	free := fs.Bavail * uint64(fs.Bsize)
	detail += fmt.Sprintf(", %.1f GiB free", float64(free)/(1<<30))
	switch {
	case fs.Type == tmpfsMagic || fs.Type == ramfsMagic:
		return Check{Status: Warn, Detail: detail + ", on tmpfs: snapshot memory files grow as children touch pages the parent never wrote, and are lost at reboot",
			Hint: "put the data dir on a disk filesystem (ext4, xfs)"}
	case free < 1<<30:
		return Check{Status: Fail, Detail: detail, Hint: "free space: a snapshot takes its guest RAM size on disk"}
	case free < 5<<30:
		return Check{Status: Warn, Detail: detail, Hint: "keep several GiB free: a snapshot takes its guest RAM size on disk"}
	}
	return Check{Status: Pass, Detail: detail}
}

func (r *run) controller(ctx context.Context) Check {
	c := r.opts.Controller
	if c == "" {
		return Check{Status: Skip, Detail: "no controller address given"}
	}
	network, addr := "unix", c
	switch {
	case strings.HasPrefix(c, "unix://"):
		addr = strings.TrimPrefix(c, "unix://")
	case strings.HasPrefix(c, "unix:"):
		addr = strings.TrimPrefix(c, "unix:")
	case strings.HasPrefix(c, "http://"), strings.HasPrefix(c, "https://"):
		u, err := url.Parse(c)
		if err != nil {
			return Check{Status: Fail, Detail: "controller address " + c + ": " + err.Error()}
		}
		network, addr = "tcp", u.Host
		if u.Port() == "" {
			addr = net.JoinHostPort(u.Hostname(), map[string]string{"http": "80", "https": "443"}[u.Scheme])
		}
	case !strings.HasPrefix(c, "/") && !strings.HasPrefix(c, "."):
		network = "tcp"
	}
	dctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	conn, err := r.opts.Dial(dctx, network, addr)
	if err != nil {
		return Check{Status: Fail, Detail: fmt.Sprintf("cannot reach the controller at %s %s: %v", network, addr, err),
			Hint: "start it (forkd serve), or check the address"}
	}
	conn.Close()
	return Check{Status: Pass, Detail: fmt.Sprintf("controller reachable at %s %s", network, addr)}
}
