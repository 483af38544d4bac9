package qemu

import (
	"bufio"
	"context"
	"encoding/json"
	"net"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/vmm"
)

func TestOverlayNode(t *testing.T) {
	valid := regexp.MustCompile(`^[A-Za-z][A-Za-z0-9._-]*$`)
	a := "/run/forkd/sb-a/disk-dl-0123456789abcdef.qcow2"
	for _, index := range []int{0, 1, maxConfigDisks - 1, 999} {
		n := overlayNode(index, a)
		if !valid.MatchString(n) || len(n) > 31 {
			t.Errorf("overlayNode(%d) = %q: not a QMP node name of at most 31 characters", index, n)
		}
	}
	// Named by the file: the same from any process, whatever its dir;
	// different for another file or disk.
	if overlayNode(1, a) != overlayNode(1, "/elsewhere/disk-dl-0123456789abcdef.qcow2") {
		t.Error("the node name depends on the overlay's directory")
	}
	if overlayNode(1, a) == overlayNode(1, "/run/forkd/sb-a/disk-dl-0123456789abcdee.qcow2") {
		t.Error("two overlays have the same node name")
	}
	if overlayNode(1, a) == overlayNode(0, a) {
		t.Error("two disks have the same node name")
	}
}

// fakeMonitor serves QMP at the machine's socket, one connection: the
// greeting, then reply(command) for each command (nil: hang up).
func fakeMonitor(t *testing.T, m *Machine, reply func(cmd string) any) {
	t.Helper()
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(m.handle.RunDir, qmpSocket), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		enc, r := json.NewEncoder(c), bufio.NewScanner(c)
		if enc.Encode(map[string]any{"QMP": map[string]any{}}) != nil {
			return
		}
		for r.Scan() {
			var req struct {
				Execute string `json:"execute"`
			}
			if json.Unmarshal(r.Bytes(), &req) != nil {
				return
			}
			rep := map[string]any{"return": map[string]any{}}
			if req.Execute != "qmp_capabilities" {
				ret := reply(req.Execute)
				if ret == nil {
					return
				}
				rep["return"] = ret
			}
			if enc.Encode(rep) != nil {
				return
			}
		}
	}()
}

// TestDiskSwitched checks DiskSwitched against query-block replies shaped
// like QEMU 7.2's (BlockInfo, with the top node in inserted.node-name).
func TestDiskSwitched(t *testing.T) {
	overlay := "/run/forkd/sb-a/disk-dl-0123456789abcdef.qcow2"
	drives := func(top1 string) []any {
		return []any{
			map[string]any{"device": "disk0", "locked": false, "removable": false, "type": "unknown",
				"inserted": map[string]any{"node-name": "#block123", "ro": true, "drv": "raw", "file": "/dev/fdset/0"}},
			map[string]any{"device": "disk1", "locked": false, "removable": false, "type": "unknown",
				"inserted": map[string]any{"node-name": top1, "ro": false, "drv": "qcow2", "file": "/dev/fdset/3",
					"backing_file_depth": 2}},
		}
	}
	for _, c := range []struct {
		name  string
		index int
		reply any // nil: no answer
		want  bool
		class func(error) bool // nil: no error
		fails bool
	}{
		{name: "switched", index: 1, reply: drives(overlayNode(1, overlay)), want: true},
		{name: "not switched", index: 1, reply: drives("#block456")},
		{name: "another overlay on top", index: 1, reply: drives(overlayNode(1, "/run/forkd/sb-a/disk-dl-1111111111111111.qcow2"))},
		{name: "named by an older forkd", index: 1, reply: drives("forkd-d1-0123456789ab"), fails: true},
		{name: "no such drive", index: 1, reply: drives("x")[:1], class: errdefs.IsInvalidArgument},
		{name: "out of range", index: 2, reply: drives("x"), class: errdefs.IsInvalidArgument},
		{name: "no top node", index: 1, reply: []any{map[string]any{"device": "disk1"}}, fails: true},
		{name: "no answer", index: 1, fails: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := &Machine{handle: vmm.Handle{RunDir: t.TempDir()}, cfg: machineConfig{Disks: 2}, done: make(chan struct{})}
			fakeMonitor(t, m, func(cmd string) any {
				if cmd != "query-block" {
					t.Errorf("DiskSwitched ran %s", cmd)
					return nil
				}
				return c.reply
			})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			got, err := m.DiskSwitched(ctx, c.index, overlay)
			switch {
			case c.class != nil:
				if !c.class(err) {
					t.Errorf("DiskSwitched = %v, %v; want an error of its class", got, err)
				}
			case c.fails:
				if err == nil {
					t.Errorf("DiskSwitched = %v, want an error", got)
				}
			case err != nil || got != c.want:
				t.Errorf("DiskSwitched = %v, %v; want %v", got, err, c.want)
			}
			if err != nil && !strings.Contains(err.Error(), "disk") {
				t.Errorf("error %q does not say which disk", err)
			}
		})
	}
}
