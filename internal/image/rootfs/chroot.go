package rootfs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/cleanup"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image/deb"
)

// chrootScript runs in a private mount namespace (unshare --mount), so its
// mounts vanish with it. It gives the tree a minimal /dev on a tmpfs (with
// its own devpts instance and a /dev/shm) and
// runs apt-get in a chroot that is also a new PID, IPC and UTS namespace
// with its own /proc: PID 1 there is the chrooted shell, so /proc/1/root
// leads nowhere outside the tree. $1 is the tree, the rest are packages.
const chrootScript = `set -eu
root=$1
shift
mount -t tmpfs -o nosuid,noexec,mode=0755,size=4m forkd-dev "$root/dev"
mknod -m 0666 "$root/dev/null" c 1 3
mknod -m 0666 "$root/dev/zero" c 1 5
mknod -m 0666 "$root/dev/full" c 1 7
mknod -m 0666 "$root/dev/random" c 1 8
mknod -m 0666 "$root/dev/urandom" c 1 9
mknod -m 0666 "$root/dev/tty" c 5 0
ln -s /proc/self/fd "$root/dev/fd"
mkdir -m 0755 "$root/dev/pts" "$root/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 forkd-pts "$root/dev/pts"
ln -s pts/ptmx "$root/dev/ptmx"
mount -t tmpfs -o nosuid,nodev,mode=1777,size=64m forkd-shm "$root/dev/shm"
ln -s /proc/self/fd/0 "$root/dev/stdin"
ln -s /proc/self/fd/1 "$root/dev/stdout"
ln -s /proc/self/fd/2 "$root/dev/stderr"
exec unshare --pid --fork --kill-child --ipc --uts --root="$root" --mount-proc=/proc -- \
	/bin/sh -c 'apt-get update -q && apt-get install -y -q --no-install-recommends "$@" && apt-get clean' sh "$@"
`

// InstallPackages installs Debian packages into the tree with the tree's
// own apt-get (apt-get install -y --no-install-recommends), chrooted. It
// needs root and a Debian or Ubuntu tree (os-release) with apt-get and
// /bin/sh.
//
// While it runs, the tree gets the host's resolv.conf, a policy-rc.d that
// keeps services from starting, and, if the tree has no apt sources, the
// host's (only when host and tree are the same release). All three are put
// back as they were afterwards, and the apt lists are removed, whether
// installation succeeds or not. The tree's /proc and /dev must be real
// directories (they are created if missing), so a mount can never land
// outside the tree. Mounts live in a private namespace: none survives the
// call, even on cancellation.
//
// This runs the image's own programs as root: do it only for images you
// trust as much as the host.
func (tl Tools) InstallPackages(ctx context.Context, t *Tree, pkgs []string, progress io.Writer) (err error) {
	if len(pkgs) == 0 {
		return nil
	}
	for _, p := range pkgs {
		if !deb.ValidName(p) {
			return errdefs.InvalidArgument("package name %q is not valid", p)
		}
	}
	if os.Geteuid() != 0 {
		return errdefs.FailedPrecondition("installing packages into an image needs root")
	}
	osr, err := OSRelease(t)
	if err != nil {
		return err
	}
	if !IsDebianLike(osr) {
		return errdefs.FailedPrecondition("extra packages need a Debian or Ubuntu image; this one is %q", osr["ID"])
	}
	for _, p := range []string{"usr/bin/apt-get", "bin/sh"} {
		if _, err := t.Stat(p); err != nil {
			return errdefs.FailedPrecondition("extra packages: the image has no /%s", p)
		}
	}
	for _, d := range []string{"proc", "dev"} {
		st, err := t.Lstat(d)
		if errors.Is(err, fs.ErrNotExist) {
			if err := t.Mkdir(d, 0o755); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			return err
		}
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			return errdefs.InvalidArgument("the image's /%s is not a directory", d)
		}
	}
	unshare, err := tl.path(tl.Unshare, "unshare")
	if err != nil {
		return err
	}

	var restores cleanup.Stack
	defer func() {
		err = errors.Join(err, restores.Run(), clearAptLists(t))
	}()
	resolv := tl.ResolvConf
	if resolv == "" {
		resolv = "/etc/resolv.conf"
	}
	if b, rerr := os.ReadFile(resolv); rerr == nil {
		r, err := swapFile(t, "etc/resolv.conf", b, 0o644)
		if err != nil {
			return err
		}
		restores.Add(r)
	}
	r, err := swapFile(t, "usr/sbin/policy-rc.d", []byte("#!/bin/sh\nexit 101\n"), 0o755)
	if err != nil {
		return err
	}
	restores.Add(r)
	if !hasAptSources(t) {
		r, err := borrowHostSources(t, osr)
		if err != nil {
			return err
		}
		restores.Add(r)
	}

	tail := &tailWriter{max: 4096}
	lines := &lineFilter{w: progress, keep: aptProgress}
	args := append([]string{"--mount", "--propagation", "private", "--", "/bin/sh", "-c", chrootScript, "sh", t.Path()}, pkgs...)
	env := []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"}
	if err := runGroup(ctx, unshare, args, env, io.MultiWriter(tail, lines)); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		msg := tail.String()
		if strings.Contains(msg, "Unable to locate package") {
			return errdefs.NotFound("apt-get install %s: %w\n%s", strings.Join(pkgs, " "), err, msg)
		}
		return errdefs.Unavailable("apt-get install %s: %w\n%s", strings.Join(pkgs, " "), err, msg)
	}
	return nil
}

func aptProgress(l string) bool {
	return strings.HasPrefix(l, "Setting up ") || strings.HasPrefix(l, "E:") || strings.HasPrefix(l, "W:")
}

// swapFile puts data at name and returns a function that restores what was
// there before: a file (content and mode), a symlink, or nothing.
func swapFile(t *Tree, name string, data []byte, perm uint32) (func() error, error) {
	if err := t.MkdirAll(path.Dir(name), 0o755); err != nil {
		return nil, err
	}
	var restore func() error
	st, err := t.Lstat(name)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		restore = func() error { return t.RemoveAll(name) }
	case err != nil:
		return nil, err
	case st.Mode&unix.S_IFMT == unix.S_IFLNK:
		target, err := t.Readlink(name)
		if err != nil {
			return nil, err
		}
		restore = func() error {
			if err := t.RemoveAll(name); err != nil {
				return err
			}
			return t.Symlink(target, name)
		}
	case st.Mode&unix.S_IFMT == unix.S_IFREG:
		old, err := t.ReadFile(name, 1<<20)
		if err != nil {
			return nil, err
		}
		mode, uid, gid := st.Mode&0o7777, int(st.Uid), int(st.Gid)
		restore = func() error {
			if err := t.WriteFile(name, old, mode); err != nil {
				return err
			}
			return t.Lchown(name, uid, gid)
		}
	default:
		return nil, errdefs.InvalidArgument("the image's /%s is neither a file nor a symlink", name)
	}
	if err := t.RemoveAll(name); err != nil {
		return nil, err
	}
	if err := t.WriteFile(name, data, perm); err != nil {
		return nil, errors.Join(err, restore())
	}
	return restore, nil
}

func hasAptSources(t *Tree) bool {
	if b, err := t.ReadFile("etc/apt/sources.list", 1<<20); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if l = strings.TrimSpace(l); strings.HasPrefix(l, "deb ") {
				return true
			}
		}
	}
	names, _ := t.ReadDirNames("etc/apt/sources.list.d")
	for _, n := range names {
		if strings.HasSuffix(n, ".list") || strings.HasSuffix(n, ".sources") {
			return true
		}
	}
	return false
}

// borrowHostSources copies the host's apt sources into a tree that has
// none, when both are the same release, and returns the undo.
func borrowHostSources(t *Tree, osr map[string]string) (func() error, error) {
	hb, err := os.ReadFile("/etc/os-release")
	if err != nil {
		return nil, errdefs.FailedPrecondition("the image has no apt sources and the host has no os-release")
	}
	host := ParseOSRelease(hb)
	if host["ID"] != osr["ID"] || host["VERSION_CODENAME"] != osr["VERSION_CODENAME"] || osr["VERSION_CODENAME"] == "" {
		return nil, errdefs.FailedPrecondition("the image (%s %s) has no apt sources and the host is another release (%s %s)",
			osr["ID"], osr["VERSION_CODENAME"], host["ID"], host["VERSION_CODENAME"])
	}
	var files []string
	if _, err := os.Stat("/etc/apt/sources.list"); err == nil {
		files = append(files, "/etc/apt/sources.list")
	}
	for _, pat := range []string{"/etc/apt/sources.list.d/*.list", "/etc/apt/sources.list.d/*.sources"} {
		m, _ := filepath.Glob(pat)
		files = append(files, m...)
	}
	if len(files) == 0 {
		return nil, errdefs.FailedPrecondition("neither the image nor the host has apt sources")
	}
	var undo cleanup.Stack
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, errors.Join(err, undo.Run())
		}
		r, err := swapFile(t, strings.TrimPrefix(f, "/"), b, 0o644)
		if err != nil {
			return nil, errors.Join(err, undo.Run())
		}
		undo.Add(r)
	}
	return undo.Release(), nil
}

// clearAptLists removes the package lists apt-get update fetched.
func clearAptLists(t *Tree) error {
	names, err := t.ReadDirNames("var/lib/apt/lists")
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, n := range names {
		if n == "lock" || n == "partial" || n == "auxfiles" {
			continue
		}
		errs = append(errs, t.RemoveAll("var/lib/apt/lists/"+n))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("clear apt lists: %w", err)
	}
	return nil
}
