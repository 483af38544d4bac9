package initramfs

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image/cpio"
	"github.com/forkd/forkd/internal/testutil"
)

type member struct {
	hdr  cpio.Header
	data string
}

func readAll(t *testing.T, b []byte) (map[string]member, []string) {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	r := cpio.NewReader(zr)
	got := map[string]member{}
	var order []string
	for {
		h, err := r.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		data, _ := io.ReadAll(r)
		got[h.Name] = member{*h, string(data)}
		order = append(order, h.Name)
	}
	return got, order
}

func writeFile(t *testing.T, dir, name, content string) string {
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func build(t *testing.T, s Spec) []byte {
	t.Helper()
	var b bytes.Buffer
	if err := Write(&b, s); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

func TestLayout(t *testing.T) {
	dir := t.TempDir()
	spec := Spec{
		Agent: writeFile(t, dir, "agent", "AGENT"),
		Modules: []Module{
			{File: "virtio_ring.ko", Path: writeFile(t, dir, "m1", "ring")},
			{File: "virtio.ko.zst", Path: writeFile(t, dir, "m2", "virtio")},
			{File: "a_first_alphabetically.ko", Path: writeFile(t, dir, "m3", "third")},
		},
	}
	b := build(t, spec)
	if !bytes.Equal(b, build(t, spec)) {
		t.Fatal("initramfs is not deterministic")
	}
	got, order := readAll(t, b)
	if !sort.StringsAreSorted(order) {
		t.Errorf("entries not sorted: %v", order)
	}
	want := map[string]uint32{
		"init":                                  cpio.TypeReg | 0o755,
		"etc/forkd/modules":                     cpio.TypeReg | 0o644,
		"lib/modules/virtio_ring.ko":            cpio.TypeReg | 0o644,
		"lib/modules/virtio.ko.zst":             cpio.TypeReg | 0o644,
		"lib/modules/a_first_alphabetically.ko": cpio.TypeReg | 0o644,
		"proc":                                  cpio.TypeDir | 0o755, "sys": cpio.TypeDir | 0o755, "dev": cpio.TypeDir | 0o755,
		"tmp": cpio.TypeDir | 0o1777, "run": cpio.TypeDir | 0o755, "mnt": cpio.TypeDir | 0o755,
		"dev/console": cpio.TypeChar | 0o600, "dev/null": cpio.TypeChar | 0o666,
	}
	for name, mode := range want {
		m, ok := got[name]
		if !ok {
			t.Errorf("missing /%s", name)
			continue
		}
		if m.hdr.Mode != mode || m.hdr.UID != 0 || m.hdr.GID != 0 || m.hdr.ModTime != 0 {
			t.Errorf("/%s: mode %o uid %d mtime %d", name, m.hdr.Mode, m.hdr.UID, m.hdr.ModTime)
		}
	}
	if got["init"].data != "AGENT" || got["lib/modules/virtio.ko.zst"].data != "virtio" {
		t.Error("file contents differ")
	}
	if l := got["etc/forkd/modules"].data; l != "virtio_ring.ko\nvirtio.ko.zst\na_first_alphabetically.ko\n" {
		t.Errorf("modules list %q: not in load order", l)
	}
	if c := got["dev/console"].hdr; c.RDevMajor != 5 || c.RDevMinor != 1 {
		t.Errorf("dev/console is %d,%d", c.RDevMajor, c.RDevMinor)
	}
	for _, absent := range []string{"bin/busybox", "etc/passwd", "bin/sh"} {
		if _, ok := got[absent]; ok {
			t.Errorf("/%s present without busybox", absent)
		}
	}
}

func TestBusybox(t *testing.T) {
	bb := testutil.RequireCommand(t, "busybox")
	applets, err := Applets(context.Background(), bb)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(applets, "bin/sh") {
		t.Fatalf("busybox lists no bin/sh: %v", applets)
	}
	dir := t.TempDir()
	b := build(t, Spec{Agent: writeFile(t, dir, "agent", "A"), Busybox: bb, Applets: applets})
	got, _ := readAll(t, b)
	if m := got["bin/busybox"]; m.hdr.Mode != cpio.TypeReg|0o755 || len(m.data) < 100000 {
		t.Errorf("bin/busybox: mode %o, %d bytes", m.hdr.Mode, len(m.data))
	}
	links := 0
	for name, m := range got {
		if m.hdr.Mode&cpio.TypeMask != cpio.TypeSymlink {
			continue
		}
		links++
		if m.hdr.Linkname != "/bin/busybox" || !(strings.HasPrefix(name, "bin/") || strings.HasPrefix(name, "sbin/")) {
			t.Errorf("/%s -> %s", name, m.hdr.Linkname)
		}
	}
	if links < 100 {
		t.Errorf("only %d applet links", links)
	}
	for _, name := range []string{"bin/sh", "bin/ls", "sbin/ifconfig", "bin/env"} {
		if got[name].hdr.Linkname != "/bin/busybox" {
			t.Errorf("/%s is not an applet link", name)
		}
	}
	if !strings.HasPrefix(got["etc/passwd"].data, "root:x:0:0:") || !strings.HasPrefix(got["etc/group"].data, "root:x:0:") {
		t.Errorf("passwd %q group %q", got["etc/passwd"].data, got["etc/group"].data)
	}
}

func TestRefuses(t *testing.T) {
	dir := t.TempDir()
	agent := writeFile(t, dir, "agent", "A")
	for name, s := range map[string]Spec{
		"no agent":      {},
		"slash module":  {Agent: agent, Modules: []Module{{File: "../x.ko", Path: agent}}},
		"dup module":    {Agent: agent, Modules: []Module{{File: "x.ko", Path: agent}, {File: "x.ko", Path: agent}}},
		"missing agent": {Agent: filepath.Join(dir, "nope")},
		"dir as agent":  {Agent: dir},
	} {
		t.Run(name, func(t *testing.T) {
			err := Write(io.Discard, s)
			if !errdefs.IsInvalidArgument(err) && !errdefs.IsNotFound(err) {
				t.Errorf("got %v, want InvalidArgument or NotFound", err)
			}
		})
	}
}

func TestAppletPath(t *testing.T) {
	for in, want := range map[string]string{
		"bin/sh": "bin/sh", "usr/bin/env": "bin/env", "sbin/ip": "sbin/ip", "usr/sbin/chroot": "sbin/chroot",
		"ls": "bin/ls", "/bin/cat": "bin/cat", "etc/x": "", "bin/busybox": "", "bin/..": "",
	} {
		t.Run(in, func(t *testing.T) {
			got, ok := appletPath(in)
			if got != want || ok != (want != "") {
				t.Errorf("appletPath(%q) = %q, %v; want %q", in, got, ok, want)
			}
		})
	}
}
