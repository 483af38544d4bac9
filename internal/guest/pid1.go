package guest

import (
	"bufio"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// mountSpec is one mount made at boot.
type mountSpec struct {
	source, target, fstype string
	flags                  uintptr
	data                   string
	mode                   os.FileMode
}

// baseMounts are the pseudo file systems PID 1 mounts in the initramfs.
// /tmp, /run and /dev/shm are not file systems of their own: they share
// the root's in-RAM file system and its size (sharedDirs).
var baseMounts = []mountSpec{
	{"proc", "/proc", "proc", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, "", 0o555},
	{"sysfs", "/sys", "sysfs", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, "", 0o555},
	{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755", 0o755},
	{"devpts", "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "gid=5,mode=0620,ptmxmode=0666", 0o755},
}

// sharedDir is a directory of the shared in-RAM file system bind-mounted
// (nosuid, nodev) at a path of the root.
type sharedDir struct {
	name, target string
	mode         os.FileMode
}

// sharedDirs are the writable directories that live in the shared tmpfs
// beside the overlay's upper layer, so that all of them together never
// hold more than memBudget.shared.
var sharedDirs = []sharedDir{
	{"tmp", "/tmp", 0o777 | os.ModeSticky},
	{"run", "/run", 0o755},
	{"shm", "/dev/shm", 0o777 | os.ModeSticky},
}

// bindShared makes each of sharedDirs under src and bind-mounts it at
// its target under root.
func bindShared(src, root string) error {
	for _, d := range sharedDirs {
		from, to := filepath.Join(src, d.name), root+d.target
		for _, dir := range []string{from, to} {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return err
			}
		}
		// Chmod: MkdirAll's mode passes through the umask and drops the
		// sticky bit.
		if err := os.Chmod(from, d.mode); err != nil {
			return err
		}
		if err := unix.Mount(from, to, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind %s on %s: %w", from, to, err)
		}
		if err := unix.Mount("", to, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
			return fmt.Errorf("remount %s nosuid,nodev: %w", to, err)
		}
	}
	return nil
}

// sizeInitramfs is the set-up without a root device: the initramfs (a
// tmpfs) is the root, capped at shared bytes, and holds sharedDirs.
func sizeInitramfs(shared uint64) error {
	var errs []error
	if opt := tmpfsSize(shared); opt != "" {
		if err := unix.Mount("", "/", "", unix.MS_REMOUNT, opt); err != nil {
			errs = append(errs, fmt.Errorf("cap the initramfs: %w", err))
		}
	}
	if err := bindShared("/mnt/rw", ""); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// mountBase mounts baseMounts, tolerating ones already there (EBUSY).
func mountBase(log *slog.Logger) error {
	var errs []error
	for _, m := range baseMounts {
		if err := os.MkdirAll(m.target, m.mode); err != nil {
			errs = append(errs, err)
			continue
		}
		err := unix.Mount(m.source, m.target, m.fstype, m.flags, m.data)
		if err != nil && !errors.Is(err, unix.EBUSY) {
			errs = append(errs, fmt.Errorf("mount %s on %s: %w", m.fstype, m.target, err))
		}
	}
	for _, l := range [][2]string{{"pts/ptmx", "/dev/ptmx"}, {"/proc/self/fd", "/dev/fd"}, {"/proc/self/fd/0", "/dev/stdin"}, {"/proc/self/fd/1", "/dev/stdout"}, {"/proc/self/fd/2", "/dev/stderr"}} {
		if _, err := os.Lstat(l[1]); os.IsNotExist(err) {
			if err := os.Symlink(l[0], l[1]); err != nil {
				log.Warn("link", "link", l[1], "target", l[0], "err", err)
			}
		}
	}
	return errors.Join(errs...)
}

// loadModules loads the modules listed in listPath from modDir, in order.
// A module already loaded (or built in) is not an error; other failures
// are logged and loading goes on.
func loadModules(log *slog.Logger, listPath, modDir string) {
	f, err := os.Open(listPath)
	if err != nil {
		if !os.IsNotExist(err) {
			log.Warn("modules list", "err", err)
		}
		return
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if err := loadModule(filepath.Join(modDir, line)); err != nil {
			log.Warn("load module", "module", line, "err", err)
		}
	}
}

// loadModule loads one .ko, .ko.xz or .ko.zst file with finit_module; the
// kernel decompresses the compressed ones.
func loadModule(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	flags := 0
	if strings.HasSuffix(path, ".zst") || strings.HasSuffix(path, ".xz") || strings.HasSuffix(path, ".gz") {
		flags |= unix.MODULE_INIT_COMPRESSED_FILE
	}
	err = unix.FinitModule(int(f.Fd()), "", flags)
	if errors.Is(err, unix.EEXIST) {
		return nil
	}
	return err
}

// waitFor polls for path to appear, up to timeout. Boot only.
func waitFor(path string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		if _, err := os.Stat(path); err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not appear within %v", path, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// switchRoot mounts dev read-only under an overlay whose upper layer is in
// a tmpfs of shared bytes, which also holds sharedDirs, moves the pseudo
// file systems into it and makes it the root: chdir, mount --move . /,
// chroot . — the initramfs cannot be pivoted.
func switchRoot(log *slog.Logger, dev, fstype string, shared uint64) error {
	const lower, rw, root = "/mnt/lower", "/mnt/rw", "/mnt/root"
	if err := waitFor(dev, 5*time.Second); err != nil {
		return err
	}
	for _, d := range []string{lower, rw, root} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := unix.Mount(dev, lower, fstype, unix.MS_RDONLY, ""); err != nil {
		return fmt.Errorf("mount %s (%s) on %s: %w", dev, fstype, lower, err)
	}
	if err := unix.Mount("tmpfs", rw, "tmpfs", 0, strings.TrimSuffix("mode=0755,"+tmpfsSize(shared), ",")); err != nil {
		return fmt.Errorf("mount tmpfs on %s: %w", rw, err)
	}
	for _, d := range []string{rw + "/upper", rw + "/work"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	opts := "lowerdir=" + lower + ",upperdir=" + rw + "/upper,workdir=" + rw + "/work"
	if err := unix.Mount("overlay", root, "overlay", 0, opts); err != nil {
		return fmt.Errorf("mount overlay on %s: %w", root, err)
	}
	for _, m := range []string{"/proc", "/sys", "/dev"} {
		target := root + m
		if err := os.MkdirAll(target, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m, target, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move %s into the new root: %w", m, err)
		}
	}
	if err := bindShared(rw, root); err != nil {
		return err
	}
	if err := os.Chdir(root); err != nil {
		return err
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("move the new root onto /: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("chroot: %w", err)
	}
	if err := os.Chdir("/"); err != nil {
		return err
	}
	log.Info("switched root", "device", dev, "fstype", fstype)
	return nil
}

// loopbackUp brings up the lo interface.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

// absorbSignals keeps signals sent from inside the guest from ending PID 1,
// which would panic the kernel: Go installs handlers for every signal, so
// the kernel's PID 1 protection does not apply. They are caught, not
// ignored, because ignored dispositions would be inherited by every
// process the agent starts.
func absorbSignals(log *slog.Logger) {
	ch := make(chan os.Signal, 4)
	signal.Notify(ch, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT,
		syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU)
	go func() {
		for s := range ch {
			log.Info("ignored signal", "signal", s)
		}
	}()
}
