package doctor

import (
	"context"
	"fmt"
	"os"
	"strconv"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/netns"
)

// The KVM ioctls used (linux/kvm.h).
const (
	kvmGetAPIVersion = 0xAE00
	kvmCreateVM      = 0xAE01
	kvmCreateVCPU    = 0xAE41
	kvmAPIVersion    = 12
)

func (p *Probes) defaults() {
	if p.KVM == nil {
		p.KVM = probeKVM
	}
	if p.Userfaultfd == nil {
		p.Userfaultfd = probeUserfaultfd
	}
	if p.Memfd == nil {
		p.Memfd = probeMemfd
	}
	if p.Nftables == nil {
		p.Nftables = probeNftables
	}
	if p.NetNS == nil {
		p.NetNS = func(ctx context.Context) error { return netns.Probe(ctx, "") }
	}
}

// probeKVM opens dev, checks the API version, and creates a VM with one
// vCPU, closing everything again.
func probeKVM(dev string) (int, error) {
	fd, err := unix.Open(dev, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, &os.PathError{Op: "open", Path: dev, Err: err}
	}
	defer unix.Close(fd)
	api, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), kvmGetAPIVersion, 0)
	if errno != 0 {
		return 0, fmt.Errorf("KVM_GET_API_VERSION: %w", errno)
	}
	if api != kvmAPIVersion {
		return int(api), fmt.Errorf("KVM API version %d, want %d", api, kvmAPIVersion)
	}
	vm, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), kvmCreateVM, 0)
	if errno != 0 {
		return int(api), fmt.Errorf("KVM_CREATE_VM: %w", errno)
	}
	defer unix.Close(int(vm))
	vcpu, _, errno := unix.Syscall(unix.SYS_IOCTL, vm, kvmCreateVCPU, 0)
	if errno != 0 {
		return int(api), fmt.Errorf("KVM_CREATE_VCPU: %w", errno)
	}
	unix.Close(int(vcpu))
	return int(api), nil
}

func probeUserfaultfd() error {
	fd, _, errno := unix.Syscall(unix.SYS_USERFAULTFD, unix.O_CLOEXEC|unix.O_NONBLOCK, 0, 0)
	if errno != 0 {
		return errno
	}
	return unix.Close(int(fd))
}

func probeMemfd() error {
	fd, err := unix.MemfdCreate("forkd-doctor", unix.MFD_CLOEXEC)
	if err != nil {
		return err
	}
	return unix.Close(fd)
}

// probeNftables creates and deletes a scratch table in the host's
// namespace.
func probeNftables(ctx context.Context) error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	t := &nftables.Table{Name: "forkd-doctor-" + strconv.Itoa(os.Getpid()), Family: nftables.TableFamilyIPv4}
	c.AddTable(t)
	c.AddChain(&nftables.Chain{Name: "probe", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("create table: %w", err)
	}
	c.DelTable(t)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("delete table %s: %w", t.Name, err)
	}
	return nil
}
