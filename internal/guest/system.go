package guest

import (
	"cmp"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"golang.org/x/sys/unix"
)

// System performs init's effects on the machine. Tests inject fakes so that
// they never change the host's clock or hostname.
type System struct {
	// SetTime sets CLOCK_REALTIME.
	SetTime func(time.Time) error
	// AddEntropy mixes bytes, credited as entropy, into the kernel RNG and
	// reseeds it.
	AddEntropy func([]byte) error
	// SetHostname sets the kernel hostname (and /etc/hostname when
	// writable).
	SetHostname func(string) error
	// AttachDisk moves the root's writable layer onto a disk (see
	// proto.Disk): once it returns, files written to the root go there.
	AttachDisk func(proto.Disk) error
	// Clocksource names the kernel's current clocksource ("" when it
	// cannot be read).
	Clocksource func() string
}

// RealSystem acts on the machine the agent runs on.
func RealSystem() System {
	return System{SetTime: setClock, AddEntropy: addEntropy, SetHostname: setHostname, AttachDisk: attachDiskRoot,
		Clocksource: clocksource}
}

func (s System) withDefaults() System {
	r := RealSystem()
	if s.SetTime == nil {
		s.SetTime = r.SetTime
	}
	if s.AddEntropy == nil {
		s.AddEntropy = r.AddEntropy
	}
	if s.SetHostname == nil {
		s.SetHostname = r.SetHostname
	}
	if s.AttachDisk == nil {
		s.AttachDisk = r.AttachDisk
	}
	if s.Clocksource == nil {
		s.Clocksource = r.Clocksource
	}
	return s
}

func setClock(t time.Time) error {
	ts := unix.NsecToTimespec(t.UnixNano())
	return unix.ClockSettime(unix.CLOCK_REALTIME, &ts)
}

// currentClocksource is where the kernel names the clocksource it reads.
const currentClocksource = "/sys/devices/system/clocksource/clocksource0/current_clocksource"

func clocksource() string {
	b, err := os.ReadFile(currentClocksource)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// addEntropy credits b to the kernel pool with RNDADDENTROPY (struct
// rand_pool_info: int entropy_count in bits, int buf_size in bytes, the
// bytes) and forces a CRNG reseed with RNDRESEEDCRNG.
func addEntropy(b []byte) error {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	info := make([]byte, 8+len(b))
	binary.NativeEndian.PutUint32(info[0:4], uint32(len(b)*8))
	binary.NativeEndian.PutUint32(info[4:8], uint32(len(b)))
	copy(info[8:], b)
	raw, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ioErr error
	err = raw.Control(func(fd uintptr) {
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, fd, unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&info[0]))); e != 0 {
			ioErr = fmt.Errorf("RNDADDENTROPY: %w", e)
			return
		}
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, fd, unix.RNDRESEEDCRNG, 0); e != 0 {
			ioErr = fmt.Errorf("RNDRESEEDCRNG: %w", e)
		}
	})
	return errors.Join(err, ioErr)
}

func setHostname(name string) error {
	if err := unix.Sethostname([]byte(name)); err != nil {
		return err
	}
	// Best effort: a read-only or absent /etc keeps its hostname file.
	_ = os.WriteFile("/etc/hostname", []byte(name+"\n"), 0o644)
	return nil
}

// maxEntropy bounds InitRequest.Entropy.
const maxEntropy = 64 << 10

func (a *Agent) init(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.InitRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	if len(req.Entropy) > maxEntropy {
		return nil, errdefs.InvalidArgument("init: %d bytes of entropy, at most %d", len(req.Entropy), maxEntropy)
	}
	if len(req.Hostname) > 64 {
		return nil, errdefs.InvalidArgument("init: hostname %q longer than 64 bytes", req.Hostname)
	}
	if req.PIDsLimit < 0 {
		return nil, errdefs.InvalidArgument("init: pids limit %d is negative", req.PIDsLimit)
	}
	if req.PIDsLimit > 0 && a.cgroupFD < 0 {
		return nil, errdefs.FailedPrecondition("init: pids limit %d: this agent has no workload cgroup to apply it to", req.PIDsLimit)
	}
	var errs []error
	if !req.Time.IsZero() {
		if err := a.sys.SetTime(req.Time); err != nil {
			errs = append(errs, sysError("set clock", err))
		}
	}
	if len(req.Entropy) > 0 {
		if err := a.sys.AddEntropy(req.Entropy); err != nil {
			errs = append(errs, sysError("add entropy", err))
		}
	}
	if req.Hostname != "" {
		if err := a.sys.SetHostname(req.Hostname); err != nil {
			errs = append(errs, sysError("set hostname", err))
		}
	}
	if n := cmp.Or(req.PIDsLimit, a.cfg.PIDsLimit); a.cgroupFD >= 0 && n > 0 {
		if err := setPIDsMax(a.cfg.Cgroup, n); err != nil {
			errs = append(errs, sysError("set pids limit", err))
		}
	}
	a.idMu.Lock()
	if req.SandboxID != "" {
		a.sandboxID = req.SandboxID
	}
	if req.Hostname != "" {
		a.hostname = req.Hostname
	}
	a.idMu.Unlock()
	if a.py != nil {
		// A parent is snapshotted after its init: its interpreter must be
		// warm by then.
		a.py.waitStarted(ctx)
	}
	if req.Disk != nil {
		if err := a.attachDisk(ctx, *req.Disk); err != nil {
			errs = append(errs, err)
		}
	}
	if a.py != nil && len(req.Entropy) > 0 {
		a.py.reseed(req.Entropy)
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("init: %w", errors.Join(errs...))
	}
	return nil, nil
}

// sysError classes an error from a system call made for the host.
func sysError(what string, err error) error {
	var errno syscall.Errno
	if errors.As(err, &errno) && (errno == syscall.EPERM || errno == syscall.EACCES) {
		return errdefs.FailedPrecondition("%s: %w", what, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}
