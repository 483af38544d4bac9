package rootfs

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
)

// Tree is a directory tree whose path lookups are confined to its root, as
// if the process were chrooted there: every path is resolved with openat2
// RESOLVE_IN_ROOT, so ".." and absolute symlinks stop at the root, and
// magic links (/proc/self/fd/...) are refused. The final component of a
// path that is created, changed or removed is never followed.
//
// Paths given to a Tree are relative ("etc/passwd", "./etc"); absolute
// paths and ".." components are errdefs.ErrInvalidArgument. A Tree is safe
// for concurrent use as far as the kernel's *at calls are; its methods hold
// no locks.
type Tree struct {
	path string
	fd   int // O_PATH|O_DIRECTORY descriptor of the root
}

// OpenTree opens the directory at dir as a Tree. Close releases it.
func OpenTree(dir string) (*Tree, error) {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: dir, Err: err}
	}
	return &Tree{path: dir, fd: fd}, nil
}

// Path is the host path of the tree's root.
func (t *Tree) Path() string { return t.path }

// Close releases the tree's descriptor.
func (t *Tree) Close() error { return unix.Close(t.fd) }

// Clean validates a path inside a tree and returns it cleaned, "." for the
// root. Absolute paths, ".." components and NUL bytes are
// errdefs.ErrInvalidArgument.
func Clean(name string) (string, error) {
	if name == "" || strings.IndexByte(name, 0) >= 0 {
		return "", errdefs.InvalidArgument("path %q is empty or contains NUL", name)
	}
	if strings.HasPrefix(name, "/") {
		return "", errdefs.InvalidArgument("path %q is absolute", name)
	}
	for _, c := range strings.Split(name, "/") {
		if c == ".." {
			return "", errdefs.InvalidArgument("path %q has a .. component", name)
		}
	}
	return path.Clean(name), nil
}

func (t *Tree) err(op, name string, err error) error {
	if errors.Is(err, unix.ENOSYS) {
		return errdefs.FailedPrecondition("%s %s: openat2 is unavailable (Linux >= 5.6 needed)", op, name)
	}
	return &os.PathError{Op: op, Path: path.Join(t.path, name), Err: err}
}

// open resolves name inside the tree, following symlinks within it.
func (t *Tree) open(name string, flags uint64, mode uint64) (int, error) {
	how := unix.OpenHow{
		Flags:   flags | unix.O_CLOEXEC,
		Mode:    mode,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	}
	for i := 0; ; i++ {
		fd, err := unix.Openat2(t.fd, name, &how)
		if err == unix.EAGAIN && i < 32 {
			continue // a concurrent rename; the kernel asks to retry
		}
		if err == unix.EINTR {
			continue
		}
		return fd, err
	}
}

// parent returns a descriptor of name's parent directory and name's last
// component. The caller closes the descriptor.
func (t *Tree) parent(name string) (int, string, error) {
	c, err := Clean(name)
	if err != nil {
		return -1, "", err
	}
	if c == "." {
		return -1, "", errdefs.InvalidArgument("path %q is the root itself", name)
	}
	dir, base := path.Split(c)
	if dir == "" {
		dir = "."
	}
	fd, err := t.open(dir, unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		return -1, "", t.err("open", dir, err)
	}
	return fd, base, nil
}

// Lstat returns the status of name without following a final symlink.
func (t *Tree) Lstat(name string) (unix.Stat_t, error) {
	var st unix.Stat_t
	if c, err := Clean(name); err != nil {
		return st, err
	} else if c == "." {
		return st, unix.Fstat(t.fd, &st)
	}
	dfd, base, err := t.parent(name)
	if err != nil {
		return st, err
	}
	defer unix.Close(dfd)
	if err := unix.Fstatat(dfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return st, t.err("lstat", name, err)
	}
	return st, nil
}

// Stat returns the status of name, following symlinks inside the tree.
func (t *Tree) Stat(name string) (unix.Stat_t, error) {
	var st unix.Stat_t
	c, err := Clean(name)
	if err != nil {
		return st, err
	}
	fd, err := t.open(c, unix.O_PATH, 0)
	if err != nil {
		return st, t.err("stat", name, err)
	}
	defer unix.Close(fd)
	return st, unix.Fstat(fd, &st)
}

// ReadFile reads at most max bytes of name, following symlinks inside the
// tree; a longer file is an error.
func (t *Tree) ReadFile(name string, max int64) ([]byte, error) {
	c, err := Clean(name)
	if err != nil {
		return nil, err
	}
	fd, err := t.open(c, unix.O_RDONLY|unix.O_NOCTTY|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, t.err("open", name, err)
	}
	f := os.NewFile(uintptr(fd), path.Join(t.path, c))
	defer f.Close()
	if fi, err := f.Stat(); err != nil {
		return nil, err
	} else if !fi.Mode().IsRegular() {
		return nil, t.err("read", name, unix.EINVAL)
	}
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, t.err("read", name, unix.EFBIG)
	}
	return b, nil
}

// Readlink returns the target of the symlink name.
func (t *Tree) Readlink(name string) (string, error) {
	dfd, base, err := t.parent(name)
	if err != nil {
		return "", err
	}
	defer unix.Close(dfd)
	buf := make([]byte, unix.PathMax)
	n, err := unix.Readlinkat(dfd, base, buf)
	if err != nil {
		return "", t.err("readlink", name, err)
	}
	return string(buf[:n]), nil
}

// Mkdir creates the directory name with mode perm (umask not applied).
func (t *Tree) Mkdir(name string, perm uint32) error {
	dfd, base, err := t.parent(name)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	if err := unix.Mkdirat(dfd, base, perm); err != nil {
		return t.err("mkdir", name, err)
	}
	return t.err0("chmod", name, unix.Fchmodat(dfd, base, perm, 0))
}

// MkdirAll creates name and any missing parents with mode perm. Existing
// components may be symlinks to directories inside the tree.
func (t *Tree) MkdirAll(name string, perm uint32) error {
	c, err := Clean(name)
	if err != nil || c == "." {
		return err
	}
	parts := strings.Split(c, "/")
	for i := range parts {
		p := strings.Join(parts[:i+1], "/")
		st, err := t.Stat(p)
		if err == nil {
			if st.Mode&unix.S_IFMT != unix.S_IFDIR {
				return t.err("mkdir", p, unix.ENOTDIR)
			}
			continue
		}
		if !errors.Is(err, unix.ENOENT) {
			return err
		}
		if err := t.Mkdir(p, perm); err != nil && !errors.Is(err, unix.EEXIST) {
			return err
		}
	}
	return nil
}

// Create creates the regular file name, which must not exist, opened for
// writing, with mode perm (umask not applied).
func (t *Tree) Create(name string, perm uint32) (*os.File, error) {
	dfd, base, err := t.parent(name)
	if err != nil {
		return nil, err
	}
	defer unix.Close(dfd)
	fd, err := unix.Openat(dfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, perm)
	if err != nil {
		return nil, t.err("create", name, err)
	}
	f := os.NewFile(uintptr(fd), path.Join(t.path, name))
	if err := f.Chmod(os.FileMode(perm&0o777) | modeBits(perm)); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// WriteFile writes data to name, replacing a file or symlink already there
// (never writing through it).
func (t *Tree) WriteFile(name string, data []byte, perm uint32) error {
	if st, err := t.Lstat(name); err == nil && st.Mode&unix.S_IFMT != unix.S_IFDIR {
		if err := t.Remove(name); err != nil {
			return err
		}
	}
	f, err := t.Create(name, perm)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Symlink creates name as a symlink to target. The target is stored as is;
// it is only ever resolved inside the tree.
func (t *Tree) Symlink(target, name string) error {
	dfd, base, err := t.parent(name)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	return t.err0("symlink", name, unix.Symlinkat(target, dfd, base))
}

// Link creates newname as a hard link to oldname (a final symlink in
// oldname is linked itself, not followed).
func (t *Tree) Link(oldname, newname string) error {
	ofd, obase, err := t.parent(oldname)
	if err != nil {
		return err
	}
	defer unix.Close(ofd)
	nfd, nbase, err := t.parent(newname)
	if err != nil {
		return err
	}
	defer unix.Close(nfd)
	return t.err0("link", newname, unix.Linkat(ofd, obase, nfd, nbase, 0))
}

// Mknod creates a device node or FIFO; mode includes the S_IF* type.
func (t *Tree) Mknod(name string, mode uint32, dev uint64) error {
	dfd, base, err := t.parent(name)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	if err := unix.Mknodat(dfd, base, mode, int(dev)); err != nil {
		return t.err("mknod", name, err)
	}
	return t.err0("chmod", name, unix.Fchmodat(dfd, base, mode&0o7777, 0))
}

// Lchown changes the owner of name itself (not of a symlink's target).
func (t *Tree) Lchown(name string, uid, gid int) error {
	if c, err := Clean(name); err != nil {
		return err
	} else if c == "." {
		return t.err0("chown", name, unix.Fchownat(t.fd, "", uid, gid, unix.AT_EMPTY_PATH))
	}
	dfd, base, err := t.parent(name)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	return t.err0("lchown", name, unix.Fchownat(dfd, base, uid, gid, unix.AT_SYMLINK_NOFOLLOW))
}

// Chmod sets the mode bits (permissions, setuid, setgid, sticky) of name.
// On a symlink it does nothing: Linux has no symlink modes.
func (t *Tree) Chmod(name string, mode uint32) error {
	dfd, base, err := t.parent(name)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return t.err("chmod", name, err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		return nil
	}
	return t.err0("chmod", name, unix.Fchmodat(dfd, base, mode&0o7777, 0))
}

// Lchtimes sets the access and modification times of name itself.
func (t *Tree) Lchtimes(name string, atime, mtime time.Time) error {
	dfd, base, err := t.parent(name)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	ts := []unix.Timespec{unix.NsecToTimespec(atime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
	return t.err0("chtimes", name, unix.UtimesNanoAt(dfd, base, ts, unix.AT_SYMLINK_NOFOLLOW))
}

// SetXattr sets an extended attribute on the regular file or directory
// name (not following a final symlink). Other kinds of file are left alone:
// opening a device node to reach its inode would open the device.
func (t *Tree) SetXattr(name, attr string, value []byte) error {
	dfd, base, err := t.parent(name)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return t.err("setxattr", name, err)
	}
	if m := st.Mode & unix.S_IFMT; m != unix.S_IFREG && m != unix.S_IFDIR {
		return nil
	}
	fd, err := unix.Openat(dfd, base, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return t.err("setxattr", name, err)
	}
	defer unix.Close(fd)
	return t.err0("setxattr", name, unix.Fsetxattr(fd, attr, value, 0))
}

// Remove removes the file, symlink or empty directory name.
func (t *Tree) Remove(name string) error {
	dfd, base, err := t.parent(name)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	err = unix.Unlinkat(dfd, base, 0)
	if errors.Is(err, unix.EISDIR) {
		err = unix.Unlinkat(dfd, base, unix.AT_REMOVEDIR)
	}
	return t.err0("remove", name, err)
}

// RemoveAll removes name and everything below it, never following a
// symlink. A name that does not exist, or whose parent does not, is not an
// error.
func (t *Tree) RemoveAll(name string) error {
	dfd, base, err := t.parent(name)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
		return nil
	}
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	return t.err0("remove", name, removeAllAt(dfd, base))
}

func removeAllAt(dfd int, name string) error {
	err := unix.Unlinkat(dfd, name, 0)
	if err == nil || errors.Is(err, unix.ENOENT) {
		return nil
	}
	if !errors.Is(err, unix.EISDIR) {
		return err
	}
	fd, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), name)
	names, err := f.Readdirnames(-1)
	if err != nil {
		f.Close()
		return err
	}
	for _, n := range names {
		if err := removeAllAt(fd, n); err != nil {
			f.Close()
			return fmt.Errorf("%s/%s: %w", name, n, err)
		}
	}
	f.Close()
	err = unix.Unlinkat(dfd, name, unix.AT_REMOVEDIR)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	return err
}

// ReadDirNames returns the names in directory name (following symlinks
// inside the tree), unsorted.
func (t *Tree) ReadDirNames(name string) ([]string, error) {
	c, err := Clean(name)
	if err != nil {
		return nil, err
	}
	fd, err := t.open(c, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil, t.err("open", name, err)
	}
	f := os.NewFile(uintptr(fd), path.Join(t.path, c))
	defer f.Close()
	return f.Readdirnames(-1)
}

func (t *Tree) err0(op, name string, err error) error {
	if err == nil {
		return nil
	}
	return t.err(op, name, err)
}

// modeBits converts setuid/setgid/sticky from unix bits to os.FileMode.
func modeBits(perm uint32) os.FileMode {
	var m os.FileMode
	if perm&unix.S_ISUID != 0 {
		m |= os.ModeSetuid
	}
	if perm&unix.S_ISGID != 0 {
		m |= os.ModeSetgid
	}
	if perm&unix.S_ISVTX != 0 {
		m |= os.ModeSticky
	}
	return m
}
