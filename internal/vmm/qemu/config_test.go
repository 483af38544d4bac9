package qemu

import (
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/vmm"
)

func TestIdentityArgsStable(t *testing.T) {
	c := machineConfig{Version: "7.2.22", Machine: "microvm", Accel: "tcg", TBSizeMiB: 16, CPU: "qemu64,+arat",
		MemoryMiB: 256, VCPUs: 1, Disks: 1, NICs: []string{"52:54:00:00:00:01"}}
	c.Argv = c.identityArgs()
	got := strings.Join(c.identityArgs(), " ")
	want := "-M microvm,pit=on,pic=on,rtc=on,memory-backend=mem -accel tcg,tb-size=16 -cpu qemu64,+arat -m 256M -smp 1 " +
		"-nodefaults -no-user-config -display none -device virtio-serial-device -device virtconsole,chardev=agent,id=con0 " +
		"-device virtio-blk-device,drive=disk0,id=blk0 -device virtio-net-device,netdev=net0,mac=52:54:00:00:00:01,id=nic0"
	if got != want {
		t.Fatalf("identity args\n got %s\nwant %s", got, want)
	}
	// The config round-trips through its encoding.
	d, err := decodeConfig(c.encode())
	if err != nil || strings.Join(d.identityArgs(), " ") != want {
		t.Fatalf("decode: %v", err)
	}
	// A config whose argv this forkd would not build again (an older
	// forkd's): no restore from it, but a running VM still attaches.
	c.Argv = append(c.Argv, "-old-option")
	if _, err := decodeConfig(c.encode()); err == nil {
		t.Fatal("restore from a changed identity accepted")
	}
	if _, err := decodeShape(c.encode()); err != nil {
		t.Fatalf("attach to a VM of a changed identity: %v", err)
	}
	// Newer snapshots leave the PIT out; older ones keep it.
	c.NoPIT = true
	c.Argv = c.identityArgs()
	if !strings.HasPrefix(strings.Join(c.Argv, " "), "-M microvm,pit=off,pic=on,rtc=on,memory-backend=mem ") {
		t.Fatalf("no PIT: %s", strings.Join(c.Argv, " "))
	}
	if _, err := decodeConfig(c.encode()); err != nil {
		t.Fatalf("decode without PIT: %v", err)
	}
	// Newer snapshots carry only the device slots they use: one serial
	// port, and a microvm without its second IOAPIC while its devices fit
	// in the first one's transports.
	c.Lean = true
	c.Argv = c.identityArgs()
	args := strings.Join(c.Argv, " ")
	for _, want := range []string{"-M microvm,pit=off,pic=on,rtc=on,ioapic2=off,memory-backend=mem ",
		"-device virtio-serial-device,max_ports=1 "} {
		if !strings.Contains(args, want) {
			t.Errorf("lean machine lacks %q: %s", want, args)
		}
	}
	if _, err := decodeConfig(c.encode()); err != nil {
		t.Fatalf("decode lean: %v", err)
	}
	c.Disks = microvmTransports - 1 // with the serial bus and the NIC: one too many
	if args := strings.Join(c.identityArgs(), " "); strings.Contains(args, "ioapic2") {
		t.Errorf("9 virtio devices on 8 transports: %s", args)
	}
	q := machineConfig{Machine: "q35", Lean: true}
	if args := strings.Join(q.identityArgs(), " "); !strings.Contains(args, "-device virtio-serial-pci,max_ports=1 ") {
		t.Errorf("lean q35: %s", args)
	}
}

// TestJailArgs checks the options that drop QEMU's privileges follow its
// version: 9.0 refuses -chroot and 10.0 -runas; 8.0 has no -run-with, and
// 9.0 no -run-with user=.
func TestJailArgs(t *testing.T) {
	for _, c := range []struct{ ver, want string }{
		{"7.2.22", "-runas forkd-vmm -chroot /run/a,b/jail"},
		{"8.0.5", "-runas forkd-vmm -chroot /run/a,b/jail"},
		{"8.1.0", "-runas forkd-vmm -run-with chroot=/run/a,,b/jail"},
		{"9.0.4", "-runas forkd-vmm -run-with chroot=/run/a,,b/jail"},
		{"9.1.0", "-run-with user=forkd-vmm,chroot=/run/a,,b/jail"},
		{"10.0.2", "-run-with user=forkd-vmm,chroot=/run/a,,b/jail"},
		{"11.1", "-run-with user=forkd-vmm,chroot=/run/a,,b/jail"},
		{"", "-runas forkd-vmm -chroot /run/a,b/jail"},
		{"x.y", "-runas forkd-vmm -chroot /run/a,b/jail"},
	} {
		if got := strings.Join(jailArgs(c.ver, "forkd-vmm", "/run/a,b/jail"), " "); got != c.want {
			t.Errorf("QEMU %q: %s, want %s", c.ver, got, c.want)
		}
	}
}

func TestInstanceArgs(t *testing.T) {
	c := machineConfig{Machine: "q35", Accel: "kvm", CPU: "host", MemoryMiB: 512, VCPUs: 2}
	args := strings.Join(c.instanceArgs(instance{
		name: "sb-x", memoryFile: "/data/a,b/memory", shared: false,
		disks: []vmm.Disk{{Path: "/img/root.ext4", ReadOnly: true}}, incoming: true,
	}), " ")
	for _, want := range []string{
		"mem-path=/data/a,,b/memory,share=off", // commas escaped
		"file=/img/root.ext4,if=none,id=disk0,format=raw,readonly=on",
		"-serial null", "-incoming defer", "-qmp unix:qmp.sock,server=on,wait=off",
	} {
		if !strings.Contains(args, want) {
			t.Errorf("instance args lack %q:\n%s", want, args)
		}
	}
}

func TestDecodeConfigRejects(t *testing.T) {
	for _, c := range []struct{ name, config string }{
		{"truncated", "{"},
		{"machine pc", `{"machine":"pc","memory_mib":256,"vcpus":1}`},
		{"no memory", `{"machine":"microvm","memory_mib":0,"vcpus":1}`},
		{"argv", `{"machine":"microvm","accel":"tcg","cpu":"qemu64","memory_mib":256,"vcpus":1,"argv":["-M","pc"]}`},
	} {
		t.Run(c.name, func(t *testing.T) {
			if _, err := decodeConfig([]byte(c.config)); err == nil {
				t.Errorf("decodeConfig(%s) accepted", c.config)
			}
		})
	}
}

func TestCPUInfo(t *testing.T) {
	info := []byte("processor\t: 0\ncpu MHz\t\t: 2596.150\nflags\t\t: fpu constant_tsc svm\n\nprocessor\t: 1\ncpu MHz\t\t: 1000.0\n")
	if k := cpuinfoTSCkHz(info); k != 2596150 {
		t.Errorf("tsc kHz = %d", k)
	}
	if !cpuHasVirt(info) {
		t.Error("svm not seen")
	}
	if cpuinfoTSCkHz([]byte("cpu MHz : 2000\nflags : fpu\n")) != 0 {
		t.Error("TSC rate trusted without constant_tsc")
	}
}

func TestValidateRefusesSmuggledOptions(t *testing.T) {
	ok := machineConfig{Version: "7.2.22", Machine: "microvm", Accel: "tcg", TBSizeMiB: 16, CPU: tcgCPU,
		MemoryMiB: 256, VCPUs: 1, Disks: 1, NICs: []string{"52:54:00:00:00:01"}, TSCkHz: 2_000_000}
	if err := ok.validate(); err != nil {
		t.Fatalf("a config this forkd makes: %v", err)
	}
	for name, tune := range map[string]func(*machineConfig){
		"cpu property":  func(c *machineConfig) { c.CPU = "qemu64,+arat,romfile=/etc/shadow" },
		"mac property":  func(c *machineConfig) { c.NICs = []string{"52:54:00:00:00:01,romfile=/etc/shadow"} },
		"version":       func(c *machineConfig) { c.Version = "7.2 -device x" },
		"kvm cpu":       func(c *machineConfig) { c.Accel, c.CPU = "kvm", "qemu64" },
		"accel":         func(c *machineConfig) { c.Accel = "hvf" },
		"huge memory":   func(c *machineConfig) { c.MemoryMiB = 1 << 30 },
		"many vcpus":    func(c *machineConfig) { c.VCPUs = 100000 },
		"many disks":    func(c *machineConfig) { c.Disks = 1000 },
		"negative tb":   func(c *machineConfig) { c.TBSizeMiB = -1 },
		"tsc":           func(c *machineConfig) { c.TSCkHz = -5 },
		"too many nics": func(c *machineConfig) { c.NICs = make([]string, 9) },
	} {
		c := ok
		c.NICs = append([]string(nil), ok.NICs...)
		tune(&c)
		if err := c.validate(); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%s: %v, want invalid argument", name, err)
		}
	}
}

func TestDiskArgs(t *testing.T) {
	c := machineConfig{Machine: "microvm", Accel: "tcg", CPU: "qemu64", MemoryMiB: 256, VCPUs: 1, Disks: 2,
		DiskSerials: []string{"", "forkd-scratch"}}
	id := strings.Join(c.identityArgs(), " ")
	for _, want := range []string{
		"-device virtio-blk-device,drive=disk0,id=blk0 ",
		"-device virtio-blk-device,drive=disk1,id=blk1,serial=forkd-scratch",
	} {
		if !strings.Contains(id+" ", want) {
			t.Errorf("identity args lack %q:\n%s", want, id)
		}
	}
	args := strings.Join(c.instanceArgs(instance{name: "sb-x", disks: []vmm.Disk{
		{Path: "/img/root.ext4", ReadOnly: true},
		{Path: "/run/sb-x/scratch.qcow2", Format: vmm.FormatQCOW2, SharedBacking: true},
	}}), " ")
	for _, want := range []string{
		"file=/img/root.ext4,if=none,id=disk0,format=raw,readonly=on ",
		// A writable drive is never reopened by path: QEMU is chrooted.
		"file=/run/sb-x/scratch.qcow2,if=none,id=disk1,format=qcow2,backing.force-share=on,auto-read-only=off ",
	} {
		if !strings.Contains(args+" ", want) {
			t.Errorf("instance args lack %q:\n%s", want, args)
		}
	}
	for _, d := range []vmm.Disk{{Format: "vmdk"}, {Serial: "a,b"}, {Serial: strings.Repeat("s", 21)}, {SharedBacking: true}} {
		if err := checkDisks([]vmm.Disk{d}); err == nil {
			t.Errorf("checkDisks(%+v) accepted", d)
		}
	}
	if err := checkDisks([]vmm.Disk{{Format: "qcow2", Serial: "forkd-scratch"}, {}}); err != nil {
		t.Error(err)
	}
}
