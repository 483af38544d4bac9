// Package cgroup puts each sandbox's VMM in cgroups that limit its memory,
// CPU, processes and IO.
//
// Each controller is used where the host offers it: cgroup v2 when the
// controller is available in our own v2 cgroup, else the v1 hierarchy that
// carries it (hosts in "hybrid" mode have memory, cpu and pids on v1 only).
// Groups are always created below our own cgroup in each hierarchy
// (<own>/<Options.Parent>/<name>), never at the root of a hierarchy we do
// not live in.
//
// A VMM is best placed in its group as it is created: on v2 with
// SysProcAttr.UseCgroupFD and Placement.CgroupFD; on v1 by forking from a
// thread moved into the group first (Manager.EnterProcs, run through
// launch.Start). Writing the pid into Placement.Procs right after start
// (Group.Add) also works, but on v1 what the process allocated before the
// move stays charged to our own cgroup unless the kernel still honours
// memory.move_charge_at_immigrate (set when possible; kernels since 6.13
// refuse it).
//
// Memory limits cover swap as well (v1 memory.memsw.limit_in_bytes = the
// limit, v2 memory.swap.max = 0, where the files exist): a VMM is never
// swapped out past its limit, and an exceeded limit ends in the OOM killer,
// which OOMKilled reports.
//
// The host is injectable (Options) so unit tests run against a fake tree.
package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/mountinfo"
)

// Kinds of resource a group controls; each maps to one controller.
const (
	Memory = "memory"
	CPU    = "cpu"
	PIDs   = "pids"
	IO     = "io"
)

// kinds in the order limits are written.
var kinds = []string{Memory, CPU, PIDs, IO}

// v1Names are the v1 controllers used for each kind; the first carries the
// limits, the others are for accounting.
var v1Names = map[string][]string{
	Memory: {"memory"},
	CPU:    {"cpu", "cpuacct"},
	PIDs:   {"pids"},
	IO:     {"blkio"},
}

// Options say where the host keeps its cgroups. Zero values take the
// defaults (the real host).
type Options struct {
	// MountInfo lists the mounts, as /proc/self/mountinfo.
	MountInfo string
	// SelfCgroup gives our own cgroups, as /proc/self/cgroup.
	SelfCgroup string
	// Parent is the directory, below our own cgroup in each hierarchy,
	// that holds the groups ("forkd").
	Parent string
}

// hierarchy is one mounted cgroup hierarchy we may use.
type hierarchy struct {
	v2          bool
	controllers []string // v1: the controllers it carries; v2: those available to us
	mount       string   // mount point
	own         string   // our own cgroup's directory in it
}

// Manager creates groups. It is safe for concurrent use; it holds no
// state beyond what it discovered in New.
type Manager struct {
	opts Options
	// place[kind] is the hierarchy chosen for kind; absent when the host
	// has no such controller.
	place map[string]*hierarchy
	// v1 lists every v1 hierarchy used (deduplicated), v2 the v2 one if
	// used.
	v1  []*hierarchy
	v2  *hierarchy
	all []*hierarchy // every hierarchy holding us, used or not
	// freezer is the hierarchy whose groups can be frozen (freeze.go): a
	// v1 freezer (also in v1), else the v2 one (also v2); nil for none.
	freezer *hierarchy

	// Test hooks: create and remove a cgroup directory (the kernel
	// populates and drops the control files; a fake tree must do so).
	mkdir func(dir string) error
	rmdir func(dir string) error
	// destroyWait bounds how long Destroy waits for processes to leave.
	destroyWait time.Duration
}

// New discovers the host's cgroup hierarchies and our place in them. It
// fails with an Unavailable-class error when no controller is usable.
func New(opts Options) (*Manager, error) {
	if opts.MountInfo == "" {
		opts.MountInfo = "/proc/self/mountinfo"
	}
	if opts.SelfCgroup == "" {
		opts.SelfCgroup = "/proc/self/cgroup"
	}
	if opts.Parent == "" {
		opts.Parent = "forkd"
	}
	if err := checkName(opts.Parent); err != nil {
		return nil, err
	}
	hs, err := discover(opts.MountInfo, opts.SelfCgroup)
	if err != nil {
		return nil, err
	}
	m := &Manager{
		all:   hs,
		opts:  opts,
		place: map[string]*hierarchy{},
		mkdir: func(dir string) error { return os.Mkdir(dir, 0o755) },
		rmdir: unix.Rmdir,

		destroyWait: 2 * time.Second,
	}
	for _, kind := range kinds {
		for _, h := range hs {
			if h.v2 && slices.Contains(h.controllers, kind) {
				m.place[kind] = h
				m.v2 = h
				break
			}
		}
		if m.place[kind] != nil {
			continue
		}
		for _, name := range v1Names[kind] {
			for _, h := range hs {
				if h.v2 || !slices.Contains(h.controllers, name) {
					continue
				}
				if name == v1Names[kind][0] {
					m.place[kind] = h
				}
				if !slices.Contains(m.v1, h) {
					m.v1 = append(m.v1, h)
				}
			}
		}
	}
	m.findFreezer()
	if len(m.place) == 0 && m.freezer == nil {
		return nil, errdefs.Unavailable("no usable cgroup controller (memory, cpu, pids, io, freezer) on this host")
	}
	return m, nil
}

// findFreezer picks the hierarchy groups are frozen in: v1's freezer
// controller where it is mounted (hosts in hybrid mode), else a v2
// hierarchy that holds us, where every cgroup has cgroup.freeze. Either
// becomes one of the group's hierarchies, so that a VMM started with
// limits is born in its freezer cgroup and Destroy removes that too.
func (m *Manager) findFreezer() {
	for _, h := range m.all {
		if !h.v2 && slices.Contains(h.controllers, "freezer") {
			m.freezer = h
			if !slices.Contains(m.v1, h) {
				m.v1 = append(m.v1, h)
			}
			return
		}
	}
	if m.v2 != nil {
		m.freezer = m.v2
		return
	}
	for _, h := range m.all {
		if h.v2 {
			m.freezer, m.v2 = h, h
			return
		}
	}
}

// Layout describes where each kind of limit lives, for reports
// ("memory": "v1 /sys/fs/cgroup/memory/..."); kinds the host lacks are
// absent.
func (m *Manager) Layout() map[string]string {
	out := map[string]string{}
	for kind, h := range m.place {
		v := "v1"
		if h.v2 {
			v = "v2"
		}
		out[kind] = v + " " + filepath.Join(h.own, m.opts.Parent)
	}
	return out
}

// Hierarchy describes a mounted cgroup hierarchy that holds our process.
type Hierarchy struct {
	Version int    `json:"version"`
	Mount   string `json:"mount"`
	// Controllers are those it carries (v1) or offers us (v2).
	Controllers []string `json:"controllers"`
	// Own is our own cgroup's directory in it.
	Own string `json:"own"`
}

// Hierarchies lists every cgroup hierarchy found, used or not.
func (m *Manager) Hierarchies() []Hierarchy {
	var out []Hierarchy
	for _, h := range m.all {
		v := 1
		if h.v2 {
			v = 2
		}
		out = append(out, Hierarchy{Version: v, Mount: h.mount, Controllers: slices.Clone(h.controllers), Own: h.own})
	}
	return out
}

// Version returns 1 or 2: the cgroup version kind is controlled with, or 0
// when the host lacks it.
func (m *Manager) Version(kind string) int {
	h := m.place[kind]
	switch {
	case h == nil:
		return 0
	case h.v2:
		return 2
	}
	return 1
}

// discover parses the mount table and our own cgroup membership.
func discover(mountInfo, selfCgroup string) ([]*hierarchy, error) {
	self, err := os.ReadFile(selfCgroup)
	if err != nil {
		return nil, fmt.Errorf("own cgroups: %w", err)
	}
	// v1: controller -> path; v2: path under "".
	paths := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(self)), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			continue
		}
		if f[1] == "" {
			paths[""] = f[2]
			continue
		}
		for _, c := range strings.Split(f[1], ",") {
			paths[c] = f[2]
		}
	}
	mounts, err := mountinfo.ParseFile(mountInfo)
	if err != nil {
		return nil, fmt.Errorf("mounts: %w", err)
	}
	var out []*hierarchy
	seen := map[string]bool{}
	for _, mt := range mounts {
		root, mnt := mt.Root, mt.MountPoint
		var h *hierarchy
		var self string
		switch mt.FSType {
		case "cgroup2":
			p, ok := paths[""]
			if !ok {
				continue
			}
			h, self = &hierarchy{v2: true, mount: mnt}, p
		case "cgroup":
			var ctrls []string
			for _, o := range strings.Split(mt.SuperOptions, ",") {
				if _, known := paths[o]; known && !strings.HasPrefix(o, "name=") {
					ctrls = append(ctrls, o)
				}
			}
			if len(ctrls) == 0 {
				continue
			}
			h, self = &hierarchy{controllers: ctrls, mount: mnt}, paths[ctrls[0]]
		default:
			continue
		}
		// A mount shows the hierarchy from root down; our cgroup must be
		// inside it.
		rel, ok := within(self, root)
		if !ok {
			continue
		}
		h.own = filepath.Join(mnt, rel)
		key := mt.FSType + ":" + strings.Join(h.controllers, ",")
		if seen[key] {
			continue
		}
		if h.v2 {
			b, err := os.ReadFile(filepath.Join(h.own, "cgroup.controllers"))
			if err != nil {
				continue
			}
			h.controllers = strings.Fields(string(b))
		}
		seen[key] = true
		out = append(out, h)
	}
	return out, nil
}

// within returns path relative to root when path is root or below it.
func within(path, root string) (string, bool) {
	path, root = filepath.Clean("/"+path), filepath.Clean("/"+root)
	if root == "/" {
		return path, true
	}
	if path == root {
		return "/", true
	}
	if rest, ok := strings.CutPrefix(path, root+"/"); ok {
		return "/" + rest, true
	}
	return "", false
}

// checkName accepts a single path element of safe characters.
func checkName(name string) error {
	if name == "" || name == "." || name == ".." || len(name) > 128 {
		return errdefs.InvalidArgument("cgroup name %q", name)
	}
	for _, c := range name {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return errdefs.InvalidArgument("cgroup name %q: only letters, digits, '-', '_' and '.'", name)
		}
	}
	return nil
}

// write writes value to an existing control file.
func write(dir, file, value string) error {
	f, err := os.OpenFile(filepath.Join(dir, file), os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return fmt.Errorf("cgroup %s: %w", file, err)
	}
	_, err = f.WriteString(value)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("cgroup %s=%q: %w", file, value, err)
	}
	return nil
}

// exists reports whether a control file exists.
func exists(dir, file string) bool {
	_, err := os.Stat(filepath.Join(dir, file))
	return err == nil
}

// isNotExist reports whether err says a file or directory is missing.
func isNotExist(err error) bool { return errors.Is(err, os.ErrNotExist) }
