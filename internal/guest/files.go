package guest

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"golang.org/x/sys/unix"
)

const (
	// maxListEntries bounds one files.list answer.
	maxListEntries = 100000
	// maxListBytes bounds one files.list answer's encoded entries, with
	// room under proto.MaxMessage for the result's envelope.
	maxListBytes = proto.MaxMessage - 64<<10
)

// pathError classes a file system error about path.
func pathError(op, path string, err error) error {
	msg := err.Error()
	var pe *fs.PathError
	if errors.As(err, &pe) {
		msg = pe.Err.Error()
	}
	var le *os.LinkError
	if errors.As(err, &le) {
		msg = le.Err.Error()
	}
	var errno syscall.Errno
	errors.As(err, &errno)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return errdefs.NotFound("%s %s: %s", op, path, msg)
	case errno == syscall.ENOTEMPTY:
		return errdefs.FailedPrecondition("%s %s: %s", op, path, msg)
	case errors.Is(err, fs.ErrExist):
		return errdefs.AlreadyExists("%s %s: %s", op, path, msg)
	case errors.Is(err, fs.ErrPermission), errno == syscall.EROFS, errno == syscall.EBUSY,
		errno == syscall.EXDEV, errno == syscall.ETXTBSY:
		return errdefs.FailedPrecondition("%s %s: %s", op, path, msg)
	case errno == syscall.ENOTDIR, errno == syscall.EISDIR, errno == syscall.EINVAL,
		errno == syscall.ENAMETOOLONG, errno == syscall.ELOOP, errno == syscall.ENOEXEC:
		return errdefs.InvalidArgument("%s %s: %s", op, path, msg)
	case errno == syscall.ENOSPC, errno == syscall.EDQUOT, errno == syscall.EMFILE,
		errno == syscall.ENFILE, errno == syscall.ENOMEM, errno == syscall.EAGAIN:
		return errdefs.ResourceExhausted("%s %s: %s", op, path, msg)
	}
	return errdefs.FailedPrecondition("%s %s: %s", op, path, msg)
}

// guestPath validates an absolute guest path and cleans it.
func guestPath(op, p string) (string, error) {
	if p == "" || !filepath.IsAbs(p) {
		return "", errdefs.InvalidArgument("%s: path %q is not absolute", op, p)
	}
	if strings.IndexByte(p, 0) >= 0 {
		return "", errdefs.InvalidArgument("%s: path contains a NUL byte", op)
	}
	return filepath.Clean(p), nil
}

// fileInfo describes p from its Lstat result.
func fileInfo(p string, st fs.FileInfo) proto.FileInfo {
	fi := proto.FileInfo{
		Name:    st.Name(),
		Path:    p,
		Size:    st.Size(),
		Mode:    uint32(st.Mode().Perm()),
		ModTime: st.ModTime(),
	}
	if st.Mode()&fs.ModeSetuid != 0 {
		fi.Mode |= 0o4000
	}
	if st.Mode()&fs.ModeSetgid != 0 {
		fi.Mode |= 0o2000
	}
	if st.Mode()&fs.ModeSticky != 0 {
		fi.Mode |= 0o1000
	}
	switch {
	case st.Mode().IsRegular():
		fi.Type = proto.FileTypeFile
	case st.IsDir():
		fi.Type = proto.FileTypeDir
	case st.Mode()&fs.ModeSymlink != 0:
		fi.Type = proto.FileTypeSymlink
		fi.Target, _ = os.Readlink(p)
	default:
		fi.Type = proto.FileTypeOther
	}
	return fi
}

func (a *Agent) fileRead(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.PathRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	p, err := guestPath("read", req.Path)
	if err != nil {
		return nil, err
	}
	// Checked before opening: reading the channel would steal the host's
	// frames, and opening it at all is no business of a file read.
	if st, err := os.Stat(p); err == nil {
		if err := a.refuseChannel("read", p, st); err != nil {
			return nil, err
		}
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, pathError("read", p, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, pathError("read", p, err)
	}
	if st.IsDir() {
		return nil, errdefs.InvalidArgument("read %s: is a directory", p)
	}
	buf := make([]byte, chunkSize)
	var total int64
	for {
		n, rerr := f.Read(buf)
		if n > 0 {
			if err := r.sendData(ctx, proto.StreamFile, buf[:n], false); err != nil {
				return nil, errdefs.Unavailable("read %s: %w", p, err)
			}
			total += int64(n)
		}
		if rerr != nil {
			if errors.Is(rerr, io.EOF) {
				break
			}
			return nil, pathError("read", p, rerr)
		}
	}
	fi := a.info(p, st)
	fi.Size = total
	return &fi, nil
}

func (a *Agent) fileWrite(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.WriteRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	p, err := guestPath("write", req.Path)
	if err != nil {
		return nil, err
	}
	if req.Mode&^0o7777 != 0 {
		return nil, errdefs.InvalidArgument("write %s: mode %#o has bits beyond 07777", p, req.Mode)
	}
	// Write through a final symlink to its target, like open(2) would.
	if st, err := os.Lstat(p); err == nil && st.Mode()&fs.ModeSymlink != 0 {
		if t, err := filepath.EvalSymlinks(p); err == nil {
			p = t
		}
	}
	if err := onPseudoFS("write", p); err != nil {
		return nil, err
	}
	mode := fs.FileMode(0o644)
	uid, gid := -1, -1
	var owner *account
	if req.User != "" {
		if owner, err = lookupUser(a.cfg.Root, req.User); err != nil {
			return nil, err
		}
		uid, gid = int(owner.uid), int(owner.gid)
	}
	if st, err := os.Stat(p); err == nil {
		if st.IsDir() {
			return nil, errdefs.InvalidArgument("write %s: is a directory", p)
		}
		if !st.Mode().IsRegular() {
			return a.writeInPlace(ctx, r, p, st)
		}
		mode = st.Mode().Perm()
		if sys, ok := st.Sys().(*syscall.Stat_t); ok {
			uid, gid = int(sys.Uid), int(sys.Gid)
		}
	}
	if req.Mode != 0 {
		mode = modeFromBits(req.Mode)
	}
	dir := filepath.Dir(p)
	if err := mkdirAllOwned(dir, owner); err != nil {
		return nil, pathError("write", p, err)
	}
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(p)+".forkd-*")
	if err != nil {
		return nil, pathError("write", p, err)
	}
	committed := false
	defer func() {
		if !committed {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if _, err := receiveFile(ctx, r, p, tmp); err != nil {
		return nil, err
	}
	if uid >= 0 && os.Geteuid() == 0 {
		// The new file keeps the old one's owner where the file system
		// lets it; the write does not fail for it.
		if err := tmp.Chown(uid, gid); err != nil {
			a.log.Warn("keep owner", "path", p, "uid", uid, "gid", gid, "err", err)
		}
	}
	if err := tmp.Chmod(mode); err != nil {
		return nil, pathError("write", p, err)
	}
	if err := tmp.Sync(); err != nil {
		return nil, pathError("write", p, err)
	}
	if err := tmp.Close(); err != nil {
		return nil, pathError("write", p, err)
	}
	if err := os.Rename(tmp.Name(), p); err != nil {
		return nil, pathError("write", p, err)
	}
	committed = true
	st, err := os.Lstat(p)
	if err != nil {
		return nil, pathError("write", p, err)
	}
	fi := a.info(p, st)
	return &fi, nil
}

// receiveFile copies the host's file data frames into w until the host's
// EOF, returning credit as it goes, and returns the bytes written.
func receiveFile(ctx context.Context, r *request, p string, w io.Writer) (int64, error) {
	var total int64
	for {
		f, err := r.recvData(ctx)
		if err != nil {
			return total, errdefs.Unavailable("write %s: cancelled before the data ended", p)
		}
		if len(f.Payload) > 0 {
			if _, err := w.Write(f.Payload); err != nil {
				return total, pathError("write", p, err)
			}
			total += int64(len(f.Payload))
		}
		r.consumed(len(f.Payload))
		if f.EOF() {
			return total, nil
		}
	}
}

// writeInPlace writes the host's data into an existing file that is not a
// regular file (st is its Stat): a character or block device or a FIFO is
// opened and written, never replaced; a socket, the agent's own channel
// and the kernel console are refused. The node's mode and owner stay.
func (a *Agent) writeInPlace(ctx context.Context, r *request, p string, st fs.FileInfo) (any, error) {
	m := st.Mode()
	if m&fs.ModeSocket != 0 {
		return nil, errdefs.InvalidArgument("write %s: is a socket, not a regular file", p)
	}
	if err := a.refuseChannel("write", p, st); err != nil {
		return nil, err
	}
	flag := os.O_WRONLY
	fifo := m&fs.ModeNamedPipe != 0
	if fifo {
		// Fail now (ENXIO) rather than wait for a reader that may never come.
		flag |= syscall.O_NONBLOCK
	}
	f, err := os.OpenFile(p, flag, 0)
	if err != nil {
		if fifo && errors.Is(err, syscall.ENXIO) {
			return nil, errdefs.FailedPrecondition("write %s: a FIFO with no reader", p)
		}
		return nil, pathError("write", p, err)
	}
	defer f.Close()
	// A write blocked on a pollable FIFO or device ends with the request;
	// other devices do not block for long, and have no deadlines.
	stop := context.AfterFunc(ctx, func() { _ = f.SetWriteDeadline(time.Now()) })
	defer stop()
	total, err := receiveFile(ctx, r, p, f)
	if err != nil {
		return nil, err
	}
	if err := f.Close(); err != nil {
		return nil, pathError("write", p, err)
	}
	fi := a.info(p, st)
	fi.Size = total
	return &fi, nil
}

// consoleDev is /dev/console's device number: the kernel console, which
// may be the agent's channel itself (console=hvc0).
var consoleDev = unix.Mkdev(5, 1)

// refuseChannel refuses st (the Stat of path p) when it is the device the
// agent serves the host on, or the kernel console: data written there
// would corrupt the host's stream, and a read would steal from it.
func (a *Agent) refuseChannel(op, p string, st fs.FileInfo) error {
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok || st.Mode()&fs.ModeCharDevice == 0 {
		return nil
	}
	if ch := a.channel.Load(); sys.Rdev == consoleDev || (ch != 0 && sys.Rdev == ch) {
		return errdefs.InvalidArgument("%s %s: is the agent's channel to the host (or the kernel console); refusing to %s it", op, p, op)
	}
	return nil
}

// configfsMagic is CONFIGFS_MAGIC, which x/sys/unix lacks.
const configfsMagic = 0x62656570

// pseudoFS names the kernel pseudo file systems by statfs magic: their
// files are kernel interfaces, not files to create or replace.
var pseudoFS = map[int64]string{
	unix.PROC_SUPER_MAGIC:    "proc",
	unix.SYSFS_MAGIC:         "sysfs",
	unix.CGROUP_SUPER_MAGIC:  "cgroup",
	unix.CGROUP2_SUPER_MAGIC: "cgroup2",
	unix.DEBUGFS_MAGIC:       "debugfs",
	unix.TRACEFS_MAGIC:       "tracefs",
	unix.SECURITYFS_MAGIC:    "securityfs",
	unix.BPF_FS_MAGIC:        "bpf",
	configfsMagic:            "configfs",
	unix.EFIVARFS_MAGIC:      "efivarfs",
	unix.PSTOREFS_MAGIC:      "pstore",
}

// onPseudoFS refuses a write of p when p, or the directory that holds or
// would hold it, is on a kernel pseudo file system (/proc, /sys, ...).
// The directory is checked too because a magic link there (/proc/1/fd/N)
// resolves to a file on yet another file system.
func onPseudoFS(op, p string) error {
	var sf unix.Statfs_t
	dir := filepath.Dir(p)
	err := unix.Statfs(dir, &sf)
	for errors.Is(err, unix.ENOENT) && dir != "/" {
		dir = filepath.Dir(dir)
		err = unix.Statfs(dir, &sf)
	}
	// A directory that cannot be examined is left for the write to report.
	name, ok := "", false
	if err == nil {
		name, ok = pseudoFS[sf.Type]
	}
	if !ok && unix.Statfs(p, &sf) == nil {
		name, ok = pseudoFS[sf.Type]
	}
	if ok {
		return errdefs.InvalidArgument("%s %s: on %s, a kernel pseudo file system: not a regular file that %s can create or replace (use exec to write kernel settings)",
			op, p, name, "files."+op)
	}
	return nil
}

// modeFromBits converts Unix permission bits to an fs.FileMode.
func modeFromBits(m uint32) fs.FileMode {
	mode := fs.FileMode(m & 0o777)
	if m&0o4000 != 0 {
		mode |= fs.ModeSetuid
	}
	if m&0o2000 != 0 {
		mode |= fs.ModeSetgid
	}
	if m&0o1000 != 0 {
		mode |= fs.ModeSticky
	}
	return mode
}

func (a *Agent) fileList(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.ListRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	p, err := guestPath("list", req.Path)
	if err != nil {
		return nil, err
	}
	depth := max(req.Depth, 1)
	st, err := os.Stat(p)
	if err != nil {
		return nil, pathError("list", p, err)
	}
	if !st.IsDir() {
		return nil, errdefs.InvalidArgument("list %s: not a directory", p)
	}
	entries := []proto.FileInfo{}
	size := 0 // encoded size of entries
	var walk func(dir string, level int) error
	walk = func(dir string, level int) error {
		if err := ctx.Err(); err != nil {
			return errdefs.Unavailable("list %s: cancelled", p)
		}
		des, err := os.ReadDir(dir)
		if err != nil {
			if dir == p {
				return pathError("list", dir, err)
			}
			return nil // a subdirectory that vanished or is unreadable
		}
		for _, de := range des {
			child := filepath.Join(dir, de.Name())
			info, err := de.Info()
			if err != nil {
				continue
			}
			if len(entries) >= maxListEntries {
				return errdefs.ResourceExhausted("list %s: more than %d entries", p, maxListEntries)
			}
			fi := a.info(child, info)
			b, err := json.Marshal(fi)
			if err != nil {
				return errdefs.InvalidArgument("list %s: encode %s: %w", p, child, err)
			}
			if size += len(b) + 1; size > maxListBytes {
				return errdefs.ResourceExhausted("list %s: entries exceed %d bytes encoded after %d entries; list less depth or a smaller directory",
					p, maxListBytes, len(entries))
			}
			entries = append(entries, fi)
			if de.IsDir() && level < depth {
				if err := walk(child, level+1); err != nil {
					return err
				}
			}
		}
		return nil
	}
	if err := walk(p, 1); err != nil {
		return nil, err
	}
	sort.Slice(entries, func(i, j int) bool { return entries[i].Path < entries[j].Path })
	return &proto.ListResult{Entries: entries}, nil
}

func (a *Agent) fileStat(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.PathRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	p, err := guestPath("stat", req.Path)
	if err != nil {
		return nil, err
	}
	st, err := os.Lstat(p)
	if err != nil {
		return nil, pathError("stat", p, err)
	}
	if req.Follow && st.Mode()&fs.ModeSymlink != 0 {
		target, err := filepath.EvalSymlinks(p)
		if err != nil {
			return nil, pathError("stat", p, err)
		}
		if st, err = os.Stat(target); err != nil {
			return nil, pathError("stat", p, err)
		}
		fi := a.info(p, st)
		fi.Name, fi.Target = filepath.Base(p), target
		return &fi, nil
	}
	fi := a.info(p, st)
	return &fi, nil
}

func (a *Agent) fileMkdir(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.PathRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	p, err := guestPath("mkdir", req.Path)
	if err != nil {
		return nil, err
	}
	if st, err := os.Stat(p); err == nil {
		if st.IsDir() {
			return &proto.MkdirResult{Created: false}, nil
		}
		return nil, errdefs.AlreadyExists("mkdir %s: exists and is not a directory", p)
	}
	var owner *account
	if req.User != "" {
		if owner, err = lookupUser(a.cfg.Root, req.User); err != nil {
			return nil, err
		}
	}
	if err := mkdirAllOwned(p, owner); err != nil {
		return nil, pathError("mkdir", p, err)
	}
	return &proto.MkdirResult{Created: true}, nil
}

func (a *Agent) fileRemove(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.RemoveRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	p, err := guestPath("remove", req.Path)
	if err != nil {
		return nil, err
	}
	if p == "/" {
		return nil, errdefs.InvalidArgument("remove /: refusing to remove the root")
	}
	if _, err := os.Lstat(p); err != nil {
		return nil, pathError("remove", p, err)
	}
	if req.Recursive {
		err = os.RemoveAll(p)
	} else {
		err = os.Remove(p)
	}
	if err != nil {
		return nil, pathError("remove", p, err)
	}
	return nil, nil
}

func (a *Agent) fileRename(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.RenameRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	from, err := guestPath("rename", req.From)
	if err != nil {
		return nil, err
	}
	to, err := guestPath("rename", req.To)
	if err != nil {
		return nil, err
	}
	if st, err := os.Lstat(to); err == nil && st.Mode()&(fs.ModeDevice|fs.ModeNamedPipe) != 0 {
		return nil, errdefs.InvalidArgument("rename %s to %s: the target is a device node or FIFO; refusing to replace it", from, to)
	}
	if err := os.Rename(from, to); err != nil {
		return nil, pathError("rename", from, err)
	}
	return nil, nil
}

// mkdirAllOwned makes directory dir and its missing parents (mode 0755);
// those it makes belong to owner and its group when owner is set and the
// agent may give them away.
func mkdirAllOwned(dir string, owner *account) error {
	var made []string
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); err == nil || d == "/" || d == "." {
			break
		}
		made = append(made, d)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if owner == nil || os.Geteuid() != 0 {
		return nil
	}
	for _, d := range made {
		if err := os.Lchown(d, int(owner.uid), int(owner.gid)); err != nil {
			return err
		}
	}
	return nil
}
