// Package doctor checks whether a host can run forkd, for `forkd doctor`.
//
// Run performs every check in a fixed order and returns a Report: one
// Check per item with a status (PASS, WARN, FAIL, SKIP), what was found,
// and for anything short of PASS a concrete fix. The report also says which
// backend forkd will use on this host and why. Checks that need root are
// skipped, with that reason, when not run as root. Everything host-specific
// (proc and sys roots, binaries, probes, the dialer) is an Option, so the
// checks run against fake trees in tests.
package doctor

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"time"

	"github.com/forkd/forkd/internal/image/deb"
)

// Status is the outcome of one check.
type Status string

const (
	Pass Status = "PASS" // fine
	Warn Status = "WARN" // works, but degraded or worth fixing
	Fail Status = "FAIL" // forkd cannot work this way
	Skip Status = "SKIP" // not checked; Detail says why
)

// Check is one item of the report.
type Check struct {
	Name   string `json:"name"`
	Status Status `json:"status"`
	Detail string `json:"detail"`
	Hint   string `json:"hint,omitempty"`
}

// Report is the result of Run.
type Report struct {
	Checks []Check `json:"checks"`
	// Backend is the VMM forkd will use ("qemu" — the only backend so far — or ""
	// when none can run), Accelerator "kvm" or "tcg", and BackendReason
	// why.
	Backend       string `json:"backend"`
	Accelerator   string `json:"accelerator,omitempty"`
	BackendReason string `json:"backend_reason"`
}

// Failed reports whether any check failed.
func (r Report) Failed() bool {
	for _, c := range r.Checks {
		if c.Status == Fail {
			return true
		}
	}
	return false
}

// ExitCode is 1 when a check failed, else 0.
func (r Report) ExitCode() int {
	if r.Failed() {
		return 1
	}
	return 0
}

// Get returns the check called name, and whether there is one.
func (r Report) Get(name string) (Check, bool) {
	for _, c := range r.Checks {
		if c.Name == name {
			return c, true
		}
	}
	return Check{}, false
}

// JSON returns the report as indented JSON (stable field names; fields
// are only ever added), with "failed" set as Failed says.
func (r Report) JSON() ([]byte, error) {
	return json.MarshalIndent(struct {
		Report
		Failed bool `json:"failed"`
	}{r, r.Failed()}, "", "  ")
}

// WriteText writes the report for people: one line per check, the fix
// indented below it, and a summary line.
func (r Report) WriteText(w io.Writer) error {
	width := 0
	for _, c := range r.Checks {
		width = max(width, len(c.Name))
	}
	var b strings.Builder
	for _, c := range r.Checks {
		fmt.Fprintf(&b, "%-4s  %-*s  %s\n", c.Status, width, c.Name, c.Detail)
		if c.Hint != "" {
			fmt.Fprintf(&b, "      %-*s  fix: %s\n", width, "", c.Hint)
		}
	}
	n := map[Status]int{}
	for _, c := range r.Checks {
		n[c.Status]++
	}
	backend := "none"
	if r.Backend != "" {
		backend = r.Backend + "/" + r.Accelerator
	}
	fmt.Fprintf(&b, "\n%d pass, %d warn, %d fail, %d skip; backend %s\n", n[Pass], n[Warn], n[Fail], n[Skip], backend)
	_, err := io.WriteString(w, b.String())
	return err
}

// Options describe the host to check. Zero values mean the real host.
type Options struct {
	// ProcRoot, SysRoot and DevRoot stand for /proc, /sys and /dev.
	ProcRoot, SysRoot, DevRoot string
	// GOOS and GOARCH are the platform (runtime's by default).
	GOOS, GOARCH string
	// EUID returns the effective user id (os.Geteuid by default).
	EUID func() int
	// QEMU and Firecracker are the VMM binaries, by name or path.
	QEMU, Firecracker string
	// DataDir is forkd's data directory; CacheDir its image cache
	// (default DataDir/cache).
	DataDir, CacheDir string
	// Controller is where the controller listens: a unix socket path
	// ("/run/forkd.sock", "unix:///run/forkd.sock") or "http://host:port"
	// / "host:port". Empty: not configured, the check is skipped.
	Controller string
	// CheckTimeout bounds each check (default 20 s).
	CheckTimeout time.Duration
	// AgentPath is the forkd-agent binary images are built with.
	AgentPath string
	// VMMUser is the user QEMU drops to ("" when it keeps ours).
	VMMUser string

	// Host actions; nil means the real ones.
	LookPath func(name string) (string, error)
	// Output runs a binary and returns its combined output.
	Output func(ctx context.Context, name string, args ...string) ([]byte, error)
	Dial   func(ctx context.Context, network, addr string) (net.Conn, error)
	Probes Probes
}

// Probes are the checks that act on the host rather than read it.
type Probes struct {
	// KVM opens the KVM device, checks its API version and creates a VM
	// and a vCPU, returning the API version.
	KVM func(dev string) (int, error)
	// Userfaultfd and Memfd create (and close) one userfaultfd and one
	// memfd.
	Userfaultfd func() error
	Memfd       func() error
	// Nftables creates and deletes a scratch nft table (root).
	Nftables func(ctx context.Context) error
	// NetNS creates and deletes a scratch netns with a tap (root).
	NetNS func(ctx context.Context) error
}

// DefaultDataDir is forkd's data directory when run as root.
const DefaultDataDir = "/var/lib/forkd"

func (o *Options) defaults() {
	def := func(p *string, v string) {
		if *p == "" {
			*p = v
		}
	}
	def(&o.ProcRoot, "/proc")
	def(&o.SysRoot, "/sys")
	def(&o.DevRoot, "/dev")
	def(&o.GOOS, runtime.GOOS)
	def(&o.GOARCH, runtime.GOARCH)
	def(&o.QEMU, "qemu-system-x86_64")
	def(&o.Firecracker, "firecracker")
	def(&o.DataDir, DefaultDataDir)
	if o.CacheDir == "" {
		o.CacheDir = o.DataDir + "/cache"
	}
	if o.EUID == nil {
		o.EUID = os.Geteuid
	}
	if o.CheckTimeout == 0 {
		o.CheckTimeout = 20 * time.Second
	}
	if o.LookPath == nil {
		o.LookPath = deb.LookPath
	}
	if o.Output == nil {
		o.Output = func(ctx context.Context, name string, args ...string) ([]byte, error) {
			return exec.CommandContext(ctx, name, args...).CombinedOutput()
		}
	}
	if o.Dial == nil {
		var d net.Dialer
		o.Dial = d.DialContext
	}
	o.Probes.defaults()
}

// Run performs every check on the host opts describes. ctx bounds the
// whole run; each check also has opts.CheckTimeout.
func Run(ctx context.Context, opts Options) Report {
	opts.defaults()
	r := &run{opts: opts}
	for _, c := range checks {
		cctx, cancel := context.WithTimeout(ctx, opts.CheckTimeout)
		ch := c.fn(r, cctx)
		cancel()
		ch.Name = c.name
		r.report.Checks = append(r.report.Checks, ch)
	}
	r.chooseBackend()
	return r.report
}

// run is the state of one Run: later checks read what earlier ones found.
type run struct {
	opts   Options
	report Report

	virtFlag   string // "vmx", "svm" or ""
	kvmOK      bool   // /dev/kvm created a VM
	kvmWhy     string
	qemuOK     bool
	qemuDetail string
}

var checks = []struct {
	name string
	fn   func(*run, context.Context) Check
}{
	{"platform", (*run).platform},
	{"cpu-virtualisation", (*run).cpuVirt},
	{"kvm", (*run).kvm},
	{"qemu", (*run).qemu},
	{"firecracker", (*run).firecracker},
	{"guest-kernel", (*run).guestKernel},
	{"cgroups", (*run).cgroups},
	{"ip-forward", (*run).ipForward},
	{"nftables", (*run).nftables},
	{"netns-tap", (*run).netnsTap},
	{"userfaultfd", (*run).userfaultfd},
	{"memfd", (*run).memfd},
	{"ksm", (*run).ksm},
	{"swap", (*run).swap},
	{"hugepages", (*run).hugepages},
	{"data-dir", (*run).dataDir},
	{"image-tools", (*run).imageTools},
	{"agent", (*run).agent},
	{"vmm-user", (*run).vmmUser},
	{"controller", (*run).controller},
}

// chooseBackend states the backend, as the QEMU backend's "auto" mode and
// the engine would pick it.
func (r *run) chooseBackend() {
	rep := &r.report
	kvm := r.kvmOK && r.virtFlag != ""
	switch {
	case r.qemuOK && kvm:
		rep.Backend, rep.Accelerator = "qemu", "kvm"
		rep.BackendReason = "KVM works and the CPU has " + r.virtFlag
	case r.qemuOK:
		rep.Backend, rep.Accelerator = "qemu", "tcg"
		rep.BackendReason = "KVM unusable (" + r.kvmWhy + "): QEMU emulates the CPU with TCG, every feature works, CPU-bound work is much slower"
	default:
		// The Firecracker backend is not written yet: whatever the
		// firecracker check says, without QEMU nothing runs.
		rep.BackendReason = "no QEMU, the only backend forkd has"
	}
	st, hint := Pass, ""
	switch {
	case rep.Backend == "":
		st, hint = Fail, "apt-get install qemu-system-x86"
	case rep.Accelerator == "tcg" && r.virtFlag != "":
		st, hint = Warn, "make /dev/kvm usable by forkd (root, or the kvm group) to run guests with KVM"
	case rep.Accelerator == "tcg":
		st, hint = Warn, "run on a host (or a VM with nested virtualisation) whose CPU exposes vmx/svm for KVM"
	}
	detail := rep.BackendReason
	if rep.Backend != "" {
		detail = rep.Backend + " with " + rep.Accelerator + ": " + rep.BackendReason
	}
	rep.Checks = append(rep.Checks, Check{Name: "backend", Status: st, Detail: detail, Hint: hint})
}
