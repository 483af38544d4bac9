// Package initramfs writes forkd's guest initramfs: a gzip-compressed newc
// cpio archive.
//
// Layout contract (the guest agent relies on it exactly):
//
//	/init                    the forkd-agent static binary, mode 0755
//	/lib/modules/<file>      kernel modules, as packaged (.ko, .ko.zst, .ko.xz)
//	/etc/forkd/modules       one module file name per line, relative to
//	                         /lib/modules/, in load order
//	/proc /sys /dev /tmp /run /mnt   empty directories (/tmp mode 1777)
//	/root                    root's home, mode 0700
//	/dev/console, /dev/null  device nodes (5,1) and (1,3), so /init has a
//	                         console before devtmpfs is mounted
//
// With a busybox (the "minimal" image) also:
//
//	/bin/busybox             the static busybox, mode 0755
//	/bin/<applet>, /sbin/<applet>   symlinks to /bin/busybox
//	/etc/passwd, /etc/group  with root and user (1000:1000, shell /bin/sh)
//	/home/user               user's home, mode 0755, owned by 1000:1000
//
// The output is deterministic: entries are sorted by path, every mtime is
// 0 and owners are root, so the archive's sha256 is a key of its content.
package initramfs

import (
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strings"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image/cpio"
)

// ModulesList is the path, inside the initramfs, of the load-order file.
const ModulesList = "etc/forkd/modules"

// Module is a module file to carry.
type Module struct {
	File string // name under /lib/modules/, e.g. "virtio_ring.ko"
	Path string // host path of its content
}

// Spec is what goes into one initramfs.
type Spec struct {
	Agent   string   // host path of the static forkd-agent; becomes /init
	Modules []Module // in load order
	Busybox string   // host path of a static busybox; "" for none
	// Applets are the busybox applets to link, as "bin/sh", "sbin/ip",
	// "usr/bin/env" (busybox --list-full); /usr/bin and /usr/sbin applets
	// are linked in /bin and /sbin. Ignored without Busybox.
	Applets []string
}

type entry struct {
	hdr  cpio.Header
	src  string // host file with the content, or
	data []byte // the content itself
}

// Write writes the initramfs described by s to w.
func Write(w io.Writer, s Spec) error {
	if s.Agent == "" {
		return errdefs.InvalidArgument("initramfs: no agent binary")
	}
	entries := map[string]*entry{}
	dir := func(name string, perm uint32) {
		entries[name] = &entry{hdr: cpio.Header{Name: name, Mode: cpio.TypeDir | perm}}
	}
	for _, d := range []string{"dev", "etc", "etc/forkd", "lib", "lib/modules", "mnt", "proc", "run", "sys"} {
		dir(d, 0o755)
	}
	dir("root", 0o700)
	dir("tmp", 0o1777)
	entries["dev/console"] = &entry{hdr: cpio.Header{Name: "dev/console", Mode: cpio.TypeChar | 0o600, RDevMajor: 5, RDevMinor: 1}}
	entries["dev/null"] = &entry{hdr: cpio.Header{Name: "dev/null", Mode: cpio.TypeChar | 0o666, RDevMajor: 1, RDevMinor: 3}}
	entries["init"] = &entry{hdr: cpio.Header{Name: "init", Mode: cpio.TypeReg | 0o755}, src: s.Agent}

	var list bytes.Buffer
	for _, m := range s.Modules {
		if m.File == "" || strings.ContainsAny(m.File, "/\n") || m.File == "." || m.File == ".." {
			return errdefs.InvalidArgument("initramfs: bad module file name %q", m.File)
		}
		name := "lib/modules/" + m.File
		if _, dup := entries[name]; dup {
			return errdefs.InvalidArgument("initramfs: module %s twice", m.File)
		}
		entries[name] = &entry{hdr: cpio.Header{Name: name, Mode: cpio.TypeReg | 0o644}, src: m.Path}
		list.WriteString(m.File + "\n")
	}
	entries[ModulesList] = &entry{hdr: cpio.Header{Name: ModulesList, Mode: cpio.TypeReg | 0o644}, data: list.Bytes()}

	if s.Busybox != "" {
		dir("bin", 0o755)
		dir("sbin", 0o755)
		entries["bin/busybox"] = &entry{hdr: cpio.Header{Name: "bin/busybox", Mode: cpio.TypeReg | 0o755}, src: s.Busybox}
		for _, a := range s.Applets {
			name, ok := appletPath(a)
			if !ok {
				continue
			}
			if _, taken := entries[name]; taken {
				continue
			}
			entries[name] = &entry{hdr: cpio.Header{Name: name, Mode: cpio.TypeSymlink | 0o777, Linkname: "/bin/busybox"}}
		}
		entries["etc/passwd"] = &entry{hdr: cpio.Header{Name: "etc/passwd", Mode: cpio.TypeReg | 0o644},
			data: []byte("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")}
		entries["etc/group"] = &entry{hdr: cpio.Header{Name: "etc/group", Mode: cpio.TypeReg | 0o644},
			data: []byte("root:x:0:\nuser:x:1000:\n")}
		dir("home", 0o755)
		entries["home/user"] = &entry{hdr: cpio.Header{Name: "home/user", Mode: cpio.TypeDir | 0o755, UID: 1000, GID: 1000}}
	}

	names := make([]string, 0, len(entries))
	for n := range entries {
		names = append(names, n)
	}
	// Lexical order puts every directory before its contents.
	sort.Strings(names)

	zw, err := gzip.NewWriterLevel(w, gzip.BestCompression)
	if err != nil {
		return err
	}
	cw := cpio.NewWriter(zw)
	for _, n := range names {
		if err := writeEntry(cw, entries[n]); err != nil {
			return err
		}
	}
	if err := cw.Close(); err != nil {
		return err
	}
	return zw.Close()
}

// appletPath maps a busybox --list-full line to its place in the
// initramfs: "bin/x" and "usr/bin/x" to "bin/x", "sbin/x" and "usr/sbin/x"
// to "sbin/x". Anything else is dropped.
func appletPath(line string) (string, bool) {
	line = strings.TrimPrefix(strings.TrimSpace(line), "/")
	d, name := path.Split(line)
	if name == "" || name == "busybox" || name == "." || name == ".." || strings.ContainsAny(name, "\x00") {
		return "", false
	}
	switch d {
	case "", "bin/", "usr/bin/":
		return "bin/" + name, true
	case "sbin/", "usr/sbin/":
		return "sbin/" + name, true
	}
	return "", false
}

func writeEntry(cw *cpio.Writer, e *entry) error {
	h := e.hdr
	if e.src == "" {
		h.Size = int64(len(e.data))
		if err := cw.WriteHeader(&h); err != nil {
			return err
		}
		_, err := cw.Write(e.data)
		return err
	}
	f, err := os.Open(e.src)
	if err != nil {
		return errdefs.NotFound("initramfs /%s: %w", h.Name, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return errdefs.InvalidArgument("initramfs /%s: %s is not a regular file", h.Name, e.src)
	}
	h.Size = fi.Size()
	if err := cw.WriteHeader(&h); err != nil {
		return err
	}
	n, err := io.Copy(cw, f)
	if err != nil {
		return fmt.Errorf("initramfs /%s: %w", h.Name, err)
	}
	if n != h.Size {
		return fmt.Errorf("initramfs /%s: %s changed size while being read", h.Name, e.src)
	}
	return nil
}

// Applets runs busybox --list-full and returns its lines ("bin/sh", ...).
// Busyboxes too old for --list-full fall back to --list, all in bin/.
func Applets(ctx context.Context, busybox string) ([]string, error) {
	out, err := exec.CommandContext(ctx, busybox, "--list-full").Output()
	if err != nil || len(bytes.TrimSpace(out)) == 0 {
		out, err = exec.CommandContext(ctx, busybox, "--list").Output()
		if err != nil {
			return nil, errdefs.InvalidArgument("%s --list: %w", busybox, err)
		}
	}
	var list []string
	for _, l := range strings.Split(string(out), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			list = append(list, filepath.ToSlash(l))
		}
	}
	if len(list) == 0 {
		return nil, errdefs.InvalidArgument("%s lists no applets", busybox)
	}
	return list, nil
}
