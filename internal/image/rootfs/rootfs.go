// Package rootfs makes guest root filesystems: a directory tree built with
// debootstrap or unpacked by the caller, optionally with more Debian
// packages installed from a chroot, written to an ext4 image without loop
// mounts (mkfs.ext4 -d).
//
// Everything that mounts (debootstrap, the chroot) runs inside a private
// mount namespace made by unshare(1), so no mount outlives its process, even
// when forkd is killed. Paths inside a tree are only reached through Tree,
// which confines them to the tree's root.
package rootfs

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/image/deb"
)

// Tools names the host commands used. A zero field means the command of
// that name, found in PATH, /usr/sbin or /sbin.
type Tools struct {
	Debootstrap string // debootstrap
	MkfsExt4    string // mkfs.ext4
	Unshare     string // unshare (util-linux)
	// ResolvConf is the host's resolver configuration, copied into a tree
	// while packages are installed ("" means /etc/resolv.conf).
	ResolvConf string
}

func (tl Tools) path(p, name string) (string, error) {
	if p == "" {
		p = name
	}
	return deb.LookPath(p)
}

// Bootstrap says what debootstrap builds.
type Bootstrap struct {
	Suite      string   // e.g. "bookworm"
	Mirror     string   // e.g. "http://deb.debian.org/debian"
	Variant    string   // e.g. "minbase"
	Components []string // nil means main
	Include    []string // extra packages
}

// Bootstrap runs debootstrap into dir, which must exist and be empty. It
// needs root. Phase lines go to progress (may be nil). On failure the error
// carries the tail of debootstrap's log; dir is left for the caller to
// remove.
func (tl Tools) Bootstrap(ctx context.Context, d Bootstrap, dir string, progress io.Writer) error {
	if os.Geteuid() != 0 {
		return errdefs.FailedPrecondition("debootstrap needs root")
	}
	for _, p := range d.Include {
		if !deb.ValidName(p) {
			return errdefs.InvalidArgument("package name %q is not valid", p)
		}
	}
	if d.Suite == "" || strings.ContainsAny(d.Suite, "/ \t\n") || strings.HasPrefix(d.Suite, "-") {
		return errdefs.InvalidArgument("debootstrap suite %q is not valid", d.Suite)
	}
	if !strings.HasPrefix(d.Mirror, "http://") && !strings.HasPrefix(d.Mirror, "https://") && !strings.HasPrefix(d.Mirror, "file:/") {
		return errdefs.InvalidArgument("debootstrap mirror %q is not a URL", d.Mirror)
	}
	unshare, err := tl.path(tl.Unshare, "unshare")
	if err != nil {
		return err
	}
	debootstrap, err := tl.path(tl.Debootstrap, "debootstrap")
	if err != nil {
		return err
	}
	args := []string{"--mount", "--propagation", "private", "--", debootstrap}
	if d.Variant != "" {
		args = append(args, "--variant="+d.Variant)
	}
	comps := d.Components
	if len(comps) == 0 {
		comps = []string{"main"}
	}
	args = append(args, "--components="+strings.Join(comps, ","))
	if len(d.Include) > 0 {
		args = append(args, "--include="+strings.Join(d.Include, ","))
	}
	args = append(args, d.Suite, dir, d.Mirror)
	tail := &tailWriter{max: 4096}
	lines := &lineFilter{w: progress, keep: debootstrapPhase}
	err = runGroup(ctx, unshare, args, nil, io.MultiWriter(tail, lines))
	if err != nil {
		msg := tail.String()
		if log, lerr := os.ReadFile(filepath.Join(dir, "debootstrap", "debootstrap.log")); lerr == nil {
			msg = lastBytes(string(log), 4096)
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return errdefs.Unavailable("debootstrap %s from %s: %w\n%s", d.Suite, d.Mirror, err, msg)
	}
	return nil
}

// debootstrapPhase keeps the lines that mark a phase ("I: Installing core
// packages..."), warnings and errors, not those about one package ("I:
// Extracting zlib1g...").
func debootstrapPhase(l string) bool {
	if strings.HasPrefix(l, "W:") || strings.HasPrefix(l, "E:") || strings.Contains(l, "successfully") {
		return true
	}
	return strings.HasSuffix(l, "...") && len(strings.Fields(l)) > 3
}

// Ext4Options tune MakeExt4.
type Ext4Options struct {
	Label string // filesystem label; "" means "forkd-root"
	// UUIDSeed, when set, makes the filesystem UUID and directory hash seed
	// a function of it, so rebuilding the same tree gives the same UUID.
	UUIDSeed string
}

// MakeExt4 writes the tree at dir to a new ext4 image file out (which must
// not exist), without mounting anything: mkfs.ext4 -d, no journal (the
// image is attached read-only), no reserved blocks, root owned by 0:0. The
// size is the tree's usage plus headroom for metadata. It returns the image
// size in bytes. On error out may exist; the caller removes it.
func (tl Tools) MakeExt4(ctx context.Context, dir, out string, o Ext4Options) (int64, error) {
	mkfs, err := tl.path(tl.MkfsExt4, "mkfs.ext4")
	if err != nil {
		return 0, err
	}
	usage, inodes, err := treeUsage(dir)
	if err != nil {
		return 0, err
	}
	// ext4 metadata: inode tables (256 B per inode), bitmaps and group
	// descriptors (~1/32768 of blocks each), directory blocks (counted in
	// usage) and slack for the allocator: 10 % + 32 MiB.
	ninodes := inodes + inodes/5 + 1024
	size := usage + usage/10 + ninodes*256 + 32<<20
	size = (size + 1<<20 - 1) &^ (1<<20 - 1)
	f, err := os.OpenFile(out, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return 0, err
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return 0, err
	}
	if err := f.Close(); err != nil {
		return 0, err
	}
	label := o.Label
	if label == "" {
		label = "forkd-root"
	}
	ext := "root_owner=0:0"
	args := []string{"-q", "-F", "-t", "ext4", "-b", "4096", "-L", label, "-d", dir,
		"-N", strconv.FormatInt(ninodes, 10), "-m", "0", "-O", "^has_journal"}
	if o.UUIDSeed != "" {
		u := seededUUID(o.UUIDSeed)
		args = append(args, "-U", u)
		ext += ",hash_seed=" + u
	}
	args = append(args, "-E", ext, out)
	tail := &tailWriter{max: 4096}
	if err := runGroup(ctx, mkfs, args, nil, tail); err != nil {
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		return 0, fmt.Errorf("mkfs.ext4 (%d MiB, %d inodes): %w: %s", size>>20, ninodes, err, tail.String())
	}
	return size, fsutil.SyncFile(out)
}

// treeUsage returns the bytes the tree's files occupy in 4 KiB blocks
// (hard links counted once) and the number of inodes.
func treeUsage(dir string) (bytes, inodes int64, err error) {
	type ino struct{ dev, ino uint64 }
	seen := map[ino]bool{}
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if ok && st.Nlink > 1 && !d.IsDir() {
			k := ino{st.Dev, st.Ino}
			if seen[k] {
				return nil
			}
			seen[k] = true
		}
		inodes++
		switch {
		case d.IsDir(), fi.Mode().IsRegular():
			bytes += (fi.Size() + 4095) &^ 4095
			if d.IsDir() && fi.Size() == 0 {
				bytes += 4096
			}
		case fi.Mode()&fs.ModeSymlink != 0 && fi.Size() >= 60:
			bytes += 4096 // too long to live in the inode
		}
		return nil
	})
	return bytes, inodes, err
}

func seededUUID(seed string) string {
	h := sha256.Sum256([]byte("forkd-ext4-uuid\x00" + seed))
	h[6] = h[6]&0x0f | 0x40 // version 4 layout, deterministic content
	h[8] = h[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", h[0:4], h[4:6], h[6:8], h[8:10], h[10:16])
}

// OSRelease returns the fields of the tree's os-release file
// (etc/os-release, else usr/lib/os-release), unquoted. A tree without one
// gives an empty map.
func OSRelease(t *Tree) (map[string]string, error) {
	out := map[string]string{}
	var b []byte
	var err error
	for _, p := range []string{"etc/os-release", "usr/lib/os-release"} {
		if b, err = t.ReadFile(p, 64<<10); err == nil {
			break
		}
	}
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return out, nil
		}
		return nil, err
	}
	return ParseOSRelease(b), nil
}

// ParseOSRelease parses os-release(5) content.
func ParseOSRelease(b []byte) map[string]string {
	out := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		k, v, ok := strings.Cut(line, "=")
		if !ok || strings.HasPrefix(line, "#") {
			continue
		}
		if u, err := strconv.Unquote(v); err == nil {
			v = u
		} else {
			v = strings.Trim(v, `"'`)
		}
		out[k] = v
	}
	return out
}

// IsDebianLike reports whether os-release fields name Debian, Ubuntu or a
// derivative of either.
func IsDebianLike(osr map[string]string) bool {
	for _, f := range append([]string{osr["ID"]}, strings.Fields(osr["ID_LIKE"])...) {
		if f == "debian" || f == "ubuntu" {
			return true
		}
	}
	return false
}

// FindPython returns the guest path of an executable python3 in the tree
// ("/usr/local/bin/python3" first, as the official Python images have it,
// then "/usr/bin/python3"), or "" if there is none.
func FindPython(t *Tree) string {
	for _, p := range []string{"usr/local/bin/python3", "usr/bin/python3"} {
		st, err := t.Stat(p)
		if err == nil && st.Mode&unix.S_IFMT == unix.S_IFREG && st.Mode&0o111 != 0 {
			return "/" + p
		}
	}
	return ""
}

// Mountpoints are the directories the guest mounts on; EnsureMountpoints
// creates those missing.
var Mountpoints = []struct {
	Name string
	Perm uint32
}{{"dev", 0o755}, {"mnt", 0o755}, {"proc", 0o555}, {"run", 0o755}, {"sys", 0o555}, {"tmp", 0o1777}}

// EnsureMountpoints creates the Mountpoints the tree lacks, owned by root.
func EnsureMountpoints(t *Tree) error {
	for _, m := range Mountpoints {
		if _, err := t.Lstat(m.Name); err == nil {
			continue
		} else if !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		if err := t.Mkdir(m.Name, m.Perm); err != nil {
			return err
		}
		if os.Geteuid() == 0 {
			if err := t.Lchown(m.Name, 0, 0); err != nil {
				return err
			}
		}
	}
	return nil
}

// runGroup runs a command in its own process group, which is killed as a
// whole when ctx is done (and when forkd dies, through PDEATHSIG on the
// leader). stdout and stderr both go to out.
func runGroup(ctx context.Context, name string, args, env []string, out io.Writer) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(append(os.Environ(), "LC_ALL=C", "LANG=C", "DEBIAN_FRONTEND=noninteractive"), env...)
	cmd.Stdout = out
	cmd.Stderr = out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 10 * time.Second
	err := cmd.Run()
	if cmd.Process != nil {
		// Whatever the group left behind (apt's download methods) goes too.
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	return err
}

// tailWriter keeps the last max bytes written to it.
type tailWriter struct {
	mu  sync.Mutex
	buf []byte
	max int
}

func (w *tailWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	if len(w.buf) > w.max {
		w.buf = append([]byte(nil), w.buf[len(w.buf)-w.max:]...)
	}
	return len(p), nil
}

func (w *tailWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return string(w.buf)
}

// lineFilter writes to w the complete lines for which keep is true,
// prefixed with two spaces.
type lineFilter struct {
	mu      sync.Mutex
	w       io.Writer
	keep    func(string) bool
	partial []byte
}

func (f *lineFilter) Write(p []byte) (int, error) {
	if f.w == nil {
		return len(p), nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.partial = append(f.partial, p...)
	for {
		i := bytes.IndexByte(f.partial, '\n')
		if i < 0 {
			break
		}
		line := strings.TrimRight(string(f.partial[:i]), "\r")
		f.partial = f.partial[i+1:]
		if f.keep == nil || f.keep(line) {
			fmt.Fprintf(f.w, "  %s\n", line)
		}
	}
	return len(p), nil
}

func lastBytes(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
