package qemu

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/vmm"
)

// machineConfig is a machine's identity: everything a restored child must
// repeat exactly for QEMU to accept the saved device state. It is stored
// with a snapshot (vmm.Handle.Config) and never includes host paths.
type machineConfig struct {
	Version   string `json:"qemu_version"`
	Machine   string `json:"machine"` // "microvm" or "q35"
	Accel     string `json:"accel"`   // "tcg" or "kvm"
	TBSizeMiB int    `json:"tb_size_mib,omitempty"`
	CPU       string `json:"cpu"`
	MemoryMiB int    `json:"memory_mib"`
	VCPUs     int    `json:"vcpus"`
	Disks     int    `json:"disks"`
	// DiskSerials are the disks' serial numbers by index ("" for none;
	// absent when no disk has one).
	DiskSerials []string `json:"disk_serials,omitempty"`
	NICs        []string `json:"nic_macs,omitempty"`
	TSCkHz      int      `json:"tsc_khz,omitempty"`
	// NoPIT leaves the i8254 out of a microvm. Snapshots made before it
	// existed have a PIT (false), and keep it in their children.
	NoPIT bool `json:"no_pit,omitempty"`
	// Lean gives the machine only the device slots forkd uses: a
	// virtio-serial bus of one port (31 by default, two queues each) and,
	// for a microvm whose devices fit, the 8 virtio-mmio transports of its
	// first IOAPIC (24 with the second). Each child's QEMU holds 1.1 MiB
	// less. Snapshots made before it keep the full machine.
	Lean bool `json:"lean,omitempty"`
	// Argv is identityArgs() as it was when the machine booted; a restore
	// refuses a snapshot whose identity this code would now spell
	// differently.
	Argv []string `json:"argv"`
}

// decodeConfig reads a snapshot's machine config for a restore, which
// needs this forkd to build the very argv the parent ran with.
func decodeConfig(b []byte) (machineConfig, error) {
	c, err := decodeShape(b)
	if err != nil {
		return c, err
	}
	if got := strings.Join(c.identityArgs(), " "); got != strings.Join(c.Argv, " ") {
		return c, errdefs.FailedPrecondition("qemu machine identity changed since the snapshot was made:\n was %s\n now %s",
			strings.Join(c.Argv, " "), got)
	}
	return c, nil
}

// decodeShape reads a machine config without the identity check: enough
// to attach to a VM already running (started by an older forkd, say).
func decodeShape(b []byte) (machineConfig, error) {
	var c machineConfig
	if err := json.Unmarshal(b, &c); err != nil {
		return c, errdefs.InvalidArgument("qemu machine config: %w", err)
	}
	if c.Machine != "microvm" && c.Machine != "q35" {
		return c, errdefs.InvalidArgument("qemu machine config: unknown machine %q", c.Machine)
	}
	if c.MemoryMiB <= 0 || c.VCPUs <= 0 {
		return c, errdefs.InvalidArgument("qemu machine config: bad shape %d MiB / %d vCPUs", c.MemoryMiB, c.VCPUs)
	}
	return c, nil
}

func (c machineConfig) encode() []byte {
	b, _ := json.Marshal(c)
	return b
}

// argv is a QEMU command line under construction.
type argv []string

func (a *argv) add(args ...string) { *a = append(*a, args...) }

// identityArgs are the options that define the machine. Boot and restore
// share them byte for byte.
func (c machineConfig) identityArgs() argv {
	var a argv
	mtype := c.Machine + ",memory-backend=mem"
	if c.Machine == "microvm" {
		pit := "on"
		if c.NoPIT {
			pit = "off"
		}
		ioapic := ""
		if c.Lean && 1+c.Disks+len(c.NICs) <= microvmTransports {
			ioapic = ",ioapic2=off"
		}
		mtype = "microvm,pit=" + pit + ",pic=on,rtc=on" + ioapic + ",memory-backend=mem"
	}
	accel := c.Accel
	if c.Accel == "tcg" && c.TBSizeMiB > 0 {
		accel += ",tb-size=" + strconv.Itoa(c.TBSizeMiB)
	}
	a.add("-M", mtype, "-accel", accel, "-cpu", c.CPU,
		"-m", strconv.Itoa(c.MemoryMiB)+"M", "-smp", strconv.Itoa(c.VCPUs),
		"-nodefaults", "-no-user-config", "-display", "none")
	bus := c.bus()
	serial := "virtio-serial-" + bus
	if c.Lean {
		serial += ",max_ports=1"
	}
	a.add("-device", serial, "-device", "virtconsole,chardev=agent,id=con0")
	for i := 0; i < c.Disks; i++ {
		dev := fmt.Sprintf("virtio-blk-%s,drive=disk%d,id=blk%d", bus, i, i)
		if i < len(c.DiskSerials) && c.DiskSerials[i] != "" {
			dev += ",serial=" + c.DiskSerials[i]
		}
		a.add("-device", dev)
	}
	for i, mac := range c.NICs {
		a.add("-device", fmt.Sprintf("virtio-net-%s,netdev=net%d,mac=%s,id=nic%d", bus, i, mac, i))
	}
	return a
}

// microvmTransports is how many virtio-mmio transports a microvm has
// without its second IOAPIC: one per virtio device.
const microvmTransports = 8

func (c machineConfig) bus() string {
	if c.Machine == "microvm" {
		return "device"
	}
	return "pci"
}

// instance holds the per-process parts of a command line.
type instance struct {
	name       string
	memoryFile string // "" for anonymous RAM
	shared     bool   // MAP_SHARED (boot) or MAP_PRIVATE (restore)
	console    string // serial log file, "" for none
	disks      []vmm.Disk
	nics       []vmm.NIC
	incoming   bool
}

const (
	qmpSocket   = "qmp.sock"
	agentSocket = "agent.sock"
	logFile     = "qemu.log"
)

// instanceArgs are the options that bind a machine to host resources.
// Socket paths are relative: QEMU runs with its run dir as working
// directory, which keeps them short whatever the data dir.
func (c machineConfig) instanceArgs(in instance) argv {
	var a argv
	a.add("-name", in.name+",process=forkd-"+in.name)
	size := strconv.Itoa(c.MemoryMiB) + "M"
	if in.memoryFile == "" {
		a.add("-object", "memory-backend-ram,id=mem,size="+size)
	} else {
		share := "off"
		if in.shared {
			share = "on"
		}
		a.add("-object", "memory-backend-file,id=mem,size="+size+",mem-path="+escapeOpt(in.memoryFile)+",share="+share)
	}
	a.add("-chardev", "socket,id=agent,path="+agentSocket+",server=on,wait=off")
	a.add("-qmp", "unix:"+qmpSocket+",server=on,wait=off")
	if in.console != "" {
		a.add("-serial", "file:"+in.console)
	} else {
		a.add("-serial", "null")
	}
	for i, d := range in.disks {
		format := d.Format
		if format == "" {
			format = vmm.FormatRaw
		}
		opt := fmt.Sprintf("file=%s,if=none,id=disk%d,format=%s", escapeOpt(d.Path), i, format)
		if d.SharedBacking {
			// Inherited down the chain. A layer that another machine's
			// disk was holds that machine's write lock.
			opt += ",backing.force-share=on"
		}
		if d.ReadOnly {
			opt += ",readonly=on"
		} else {
			// With auto-read-only, QEMU reopens a file by its path
			// when it drops write access (a migration's end, an image
			// becoming a backing file): impossible from its chroot.
			opt += ",auto-read-only=off"
		}
		a.add("-drive", opt)
	}
	for i, n := range in.nics {
		a.add("-netdev", fmt.Sprintf("tap,id=net%d,ifname=%s,script=no,downscript=no", i, n.Tap))
	}
	if in.incoming {
		// No announcements once the state is in: after a migration QEMU
		// announces the NICs' addresses, five rounds over 0.8 s (a
		// virtio-net guest is asked to: a config interrupt, and the guest
		// sends a gratuitous ARP, rejoins its multicast groups, notifies
		// its own netlink listeners and acknowledges; other NICs have
		// QEMU send a RARP for them). That tells switches where a machine
		// that moved is now. A restored child has not moved: its link is
		// a tap of its own, whose end never saw it elsewhere, so each
		// announcement only cost its guest interrupts and code it
		// translated under TCG.
		a.add("-incoming", "defer", "-global", "migration.announce-rounds=0")
	}
	return a
}

// checkDisks checks what of disks QEMU reads as options.
func checkDisks(disks []vmm.Disk) error {
	for i, d := range disks {
		switch d.Format {
		case "", vmm.FormatRaw, vmm.FormatQCOW2:
		default:
			return errdefs.InvalidArgument("disk %d: format %q: want raw or qcow2", i, d.Format)
		}
		if d.SharedBacking && d.Format != vmm.FormatQCOW2 {
			return errdefs.InvalidArgument("disk %d: a shared backing needs a qcow2 image", i)
		}
		if !serialRE.MatchString(d.Serial) {
			return errdefs.InvalidArgument("disk %d: serial %q: want at most 20 of [A-Za-z0-9._-]", i, d.Serial)
		}
	}
	return nil
}

var serialRE = regexp.MustCompile(`^[A-Za-z0-9._-]{0,20}$`)

// escapeOpt doubles commas, QEMU's option-value escape.
func escapeOpt(s string) string { return strings.ReplaceAll(s, ",", ",,") }
