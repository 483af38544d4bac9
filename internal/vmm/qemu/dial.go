package qemu

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"

	"golang.org/x/sys/unix"
)

// maxSunPath is the longest unix socket path we pass to connect(2) as is.
const maxSunPath = 100

// dialUnix connects to the unix socket at path. Paths too long for
// sockaddr_un are reached through /proc/self/fd/N of their directory.
func dialUnix(ctx context.Context, path string) (*net.UnixConn, error) {
	var d net.Dialer
	if len(path) <= maxSunPath {
		c, err := d.DialContext(ctx, "unix", path)
		if err != nil {
			return nil, err
		}
		return c.(*net.UnixConn), nil
	}
	dir, err := os.Open(filepath.Dir(path))
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	short := fmt.Sprintf("/proc/self/fd/%d/%s", dir.Fd(), filepath.Base(path))
	if len(short) > maxSunPath {
		return nil, fmt.Errorf("socket name too long: %s", path)
	}
	c, err := d.DialContext(ctx, "unix", short)
	runtime.KeepAlive(dir)
	if err != nil {
		return nil, err
	}
	return c.(*net.UnixConn), nil
}

// hostTSCkHz returns the host's TSC rate in kHz, or 0 if unknown. Under TCG
// the guest TSC counts host TSC ticks, and microvm has no timer the guest
// can calibrate against, so the rate is passed as tsc_early_khz.
func hostTSCkHz() int {
	if v := os.Getenv("FORKD_TSC_KHZ"); v != "" {
		var k int
		if _, err := fmt.Sscan(v, &k); err == nil && k > 0 {
			return k
		}
	}
	if b, err := os.ReadFile("/sys/devices/system/cpu/cpu0/tsc_freq_khz"); err == nil {
		var k int
		if _, err := fmt.Sscan(string(b), &k); err == nil && k > 0 {
			return k
		}
	}
	return cpuinfoTSCkHz(readFile("/proc/cpuinfo"))
}

func readFile(path string) []byte {
	b, _ := os.ReadFile(path)
	return b
}

// kvmUsable reports whether /dev/kvm can create a VM and the CPU advertises
// hardware virtualisation. Some nested hosts expose a /dev/kvm whose VMs
// never run; the CPU flag check keeps forkd on TCG there.
func kvmUsable() (bool, string) {
	if !cpuHasVirt(readFile("/proc/cpuinfo")) {
		return false, "the CPU advertises no vmx/svm"
	}
	fd, err := unix.Open("/dev/kvm", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, fmt.Sprintf("open /dev/kvm: %v", err)
	}
	defer unix.Close(fd)
	const kvmCreateVM = 0xAE01
	vm, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), kvmCreateVM, 0)
	if errno != 0 {
		return false, fmt.Sprintf("KVM_CREATE_VM: %v", errno)
	}
	unix.Close(int(vm))
	return true, "/dev/kvm creates VMs"
}
