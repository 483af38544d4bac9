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

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
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
	fi := fileInfo(p, st)
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
	mode := fs.FileMode(0o644)
	uid, gid := -1, -1
	if st, err := os.Stat(p); err == nil {
		if st.IsDir() {
			return nil, errdefs.InvalidArgument("write %s: is a directory", p)
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
	if err := os.MkdirAll(dir, 0o755); err != nil {
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
	var total int64
	for {
		f, err := r.recvData(ctx)
		if err != nil {
			return nil, errdefs.Unavailable("write %s: cancelled before the data ended", p)
		}
		if len(f.Payload) > 0 {
			if _, err := tmp.Write(f.Payload); err != nil {
				return nil, pathError("write", p, err)
			}
			total += int64(len(f.Payload))
		}
		r.consumed(len(f.Payload))
		if f.EOF() {
			break
		}
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
	fi := fileInfo(p, st)
	return &fi, nil
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
			fi := fileInfo(child, info)
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
	fi := fileInfo(p, st)
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
	if err := os.MkdirAll(p, 0o755); err != nil {
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
	if err := os.Rename(from, to); err != nil {
		return nil, pathError("rename", from, err)
	}
	return nil, nil
}
