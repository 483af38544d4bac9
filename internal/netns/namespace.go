package netns

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"

	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/launch"
)

// inNetNS runs fn on an OS thread inside the network namespace at path,
// then moves the thread back. Should moving back fail, the goroutine exits
// still locked and the runtime discards the thread (or, for the main
// thread, parks it for good), so nothing else ever runs in that namespace
// by accident.
func inNetNS(path string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		restore, err := launch.EnterNetNS(path)
		if err != nil {
			errc <- err
			return
		}
		err = fn()
		if rerr := restore(); rerr != nil {
			err = errors.Join(err, rerr) // the thread stays locked: see Enter
		}
		errc <- err
	}()
	return <-errc
}

// createNamed creates a new network namespace and bind-mounts it at path,
// as `ip netns add` does; dir (path's parent) is made a shared mount point
// so the namespace is visible in other mount namespaces. It fails with an
// AlreadyExists-class error when path exists.
func createNamed(path string) error {
	if err := ensureNetNSDir(filepath.Dir(path)); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		if errors.Is(err, os.ErrExist) {
			return errdefs.AlreadyExists("netns %s exists", path)
		}
		return fmt.Errorf("create netns file: %w", err)
	}
	f.Close()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := vnetns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("open own netns: %w", err)
			return
		}
		defer orig.Close()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("unshare netns: %w", err)
			return
		}
		src := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
		err = unix.Mount(src, path, "none", unix.MS_BIND, "")
		if err != nil {
			err = fmt.Errorf("bind-mount netns at %s: %w", path, err)
		}
		if serr := vnetns.Set(orig); serr != nil {
			// Stay locked: the runtime discards the thread.
			errc <- errors.Join(err, fmt.Errorf("setns back: %w", serr))
			return
		}
		runtime.UnlockOSThread()
		errc <- err
	}()
	if err := <-errc; err != nil {
		os.Remove(path)
		return err
	}
	return nil
}

// ensureNetNSDir makes dir exist and be a shared mount point.
func ensureNetNSDir(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("netns dir: %w", err)
	}
	bound := false
	for {
		err := unix.Mount("", dir, "none", unix.MS_SHARED|unix.MS_REC, "")
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EINVAL) || bound {
			return fmt.Errorf("make %s a shared mount: %w", dir, err)
		}
		// Not a mount point yet: bind it onto itself, then retry.
		if err := unix.Mount(dir, dir, "none", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s: %w", dir, err)
		}
		bound = true
	}
}

// deleteNamed unmounts and removes the namespace file at path. The
// namespace itself lives on while a process is inside it. Idempotent.
func deleteNamed(path string) error {
	var errs []error
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil &&
		!errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		errs = append(errs, fmt.Errorf("unmount netns %s: %w", path, err))
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("remove netns %s: %w", path, err))
	}
	return errors.Join(errs...)
}
