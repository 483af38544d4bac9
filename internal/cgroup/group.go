package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/cleanup"
	"github.com/forkd/forkd/internal/errdefs"
)

// Group is one sandbox's cgroups: a directory in every hierarchy used.
type Group struct {
	m    *Manager
	name string
	v1   []string // directories in the v1 hierarchies, in m.v1 order
	v2   string   // directory in the v2 hierarchy, "" if none

	mu sync.Mutex // guards fd
	fd int        // open v2 directory, -1 when none or closed
}

// Placement is where a process goes to join a group, in the shape of
// vmm.Launch: CgroupFD (v2 directory fd, -1 when the group has no v2 part;
// valid until Destroy) and Procs (the v1 cgroup.procs files).
type Placement struct {
	CgroupFD int
	Procs    []string
}

// Create makes the group name with limits l in every hierarchy used. It
// fails with AlreadyExists when the group exists, FailedPrecondition when
// l asks for a controller the host lacks, and rolls back what it created
// on any error.
func (m *Manager) Create(name string, l Limits) (_ *Group, err error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	if err := l.validate(); err != nil {
		return nil, err
	}
	for _, kind := range kinds {
		if l.wants(kind) && m.place[kind] == nil {
			return nil, errdefs.FailedPrecondition("limit on %s asked, but this host has no %s cgroup controller", kind, kind)
		}
	}
	g := m.group(name)
	var created []string
	defer func() {
		if err != nil {
			g.closeFD()
			var errs []error
			for i := len(created) - 1; i >= 0; i-- {
				errs = append(errs, m.rmdir(created[i]))
			}
			err = errors.Join(err, errors.Join(errs...))
		}
	}()
	if g.v2 != "" {
		if err := m.enableV2(); err != nil {
			return nil, err
		}
	}
	for _, dir := range g.dirs() {
		// A Destroy elsewhere may remove the shared parent once it is
		// empty, between making it and making dir in it: then again.
		var err error
		for try := 0; try < 3; try++ {
			if err = m.mkdirParent(filepath.Dir(dir)); err != nil {
				return nil, err
			}
			if err = m.mkdir(dir); !isNotExist(err) {
				break
			}
		}
		if err != nil {
			if errors.Is(err, os.ErrExist) {
				return nil, errdefs.AlreadyExists("cgroup %s exists", dir)
			}
			return nil, fmt.Errorf("create cgroup: %w", err)
		}
		created = append(created, dir)
	}
	if err := g.setLimits(l); err != nil {
		return nil, fmt.Errorf("cgroup %s: %w", name, err)
	}
	if d := g.dir(Memory); d != "" && !m.place[Memory].v2 && exists(d, "memory.move_charge_at_immigrate") {
		// Charges follow a process moved in after start (Add). Kernels
		// since 6.13 refuse it (EINVAL): charges then stay where they were
		// made, which is why placing at fork (EnterProcs) is preferred.
		if err := write(d, "memory.move_charge_at_immigrate", "3"); err != nil && !errors.Is(err, unix.EINVAL) {
			return nil, err
		}
	}
	if g.v2 != "" {
		fd, err := unix.Open(g.v2, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("open cgroup %s: %w", g.v2, err)
		}
		g.fd = fd
	}
	return g, nil
}

// Open returns the existing group name (to inspect or destroy it after a
// restart). It fails with NotFound when no part of it exists.
func (m *Manager) Open(name string) (*Group, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	g := m.group(name)
	found := false
	for _, d := range g.dirs() {
		if _, err := os.Stat(d); err == nil {
			found = true
		}
	}
	if !found {
		return nil, errdefs.NotFound("cgroup %s does not exist", name)
	}
	if g.v2 != "" {
		if fd, err := unix.Open(g.v2, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err == nil {
			g.fd = fd
		}
	}
	return g, nil
}

// group returns the (unopened) Group name.
func (m *Manager) group(name string) *Group {
	g := &Group{m: m, name: name, fd: -1}
	for _, h := range m.v1 {
		g.v1 = append(g.v1, filepath.Join(h.own, m.opts.Parent, name))
	}
	if m.v2 != nil {
		g.v2 = filepath.Join(m.v2.own, m.opts.Parent, name)
	}
	return g
}

// mkdirParent creates the Parent directory below our own cgroup if
// missing; in v2 it also delegates the controllers to its children.
func (m *Manager) mkdirParent(dir string) error {
	if err := m.mkdir(dir); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("create cgroup parent: %w", err)
	}
	if m.v2 != nil && dir == filepath.Join(m.v2.own, m.opts.Parent) {
		return m.delegate(dir)
	}
	return nil
}

// enableV2 makes sure the controllers we use on v2 are enabled for our
// own cgroup's children. The kernel refuses that while processes live in
// our own (non-root) cgroup: forkd must then run in a delegated cgroup with
// its process in a leaf.
func (m *Manager) enableV2() error {
	if err := m.delegate(m.v2.own); err != nil {
		return errdefs.FailedPrecondition("cgroup v2: cannot enable controllers below %s (%w): run forkd in a delegated cgroup (systemd Delegate=yes) with its own process in a leaf", m.v2.own, err)
	}
	return nil
}

// delegate enables our v2 controllers in dir's cgroup.subtree_control.
func (m *Manager) delegate(dir string) error {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.subtree_control"))
	if err != nil {
		return err
	}
	on := strings.Fields(string(b))
	var add []string
	for _, kind := range kinds {
		if h := m.place[kind]; h != nil && h.v2 && !slices.Contains(on, kind) {
			add = append(add, "+"+kind)
		}
	}
	if len(add) == 0 {
		return nil
	}
	return write(dir, "cgroup.subtree_control", strings.Join(add, " "))
}

// dirs lists every directory of the group.
func (g *Group) dirs() []string {
	out := slices.Clone(g.v1)
	if g.v2 != "" {
		out = append(out, g.v2)
	}
	return out
}

// dir returns the group's directory in the hierarchy that controls kind,
// "" if none.
func (g *Group) dir(kind string) string {
	h := g.m.place[kind]
	if h == nil {
		return ""
	}
	return filepath.Join(h.own, g.m.opts.Parent, g.name)
}

// dirOf returns the group's directory in the v1 hierarchy carrying
// controller, "" if none.
func (g *Group) dirOf(controller string) string {
	for i, h := range g.m.v1 {
		if slices.Contains(h.controllers, controller) {
			return g.v1[i]
		}
	}
	return ""
}

// Name is the group's name.
func (g *Group) Name() string { return g.name }

// Placement says how to start a process inside the group (see the
// package comment). The fd stays owned by the group.
func (g *Group) Placement() Placement {
	g.mu.Lock()
	defer g.mu.Unlock()
	p := Placement{CgroupFD: g.fd}
	for _, d := range g.v1 {
		p.Procs = append(p.Procs, filepath.Join(d, "cgroup.procs"))
	}
	return p
}

// Add moves the running process pid, all its threads, into the group.
func (g *Group) Add(pid int) error {
	for _, d := range g.dirs() {
		if err := write(d, "cgroup.procs", strconv.Itoa(pid)); err != nil {
			return fmt.Errorf("add %d to cgroup %s: %w", pid, g.name, err)
		}
	}
	return nil
}

// The main goroutine keeps the main thread, the thread-group leader, for
// the life of any program using this package (a LockOSThread in init makes
// main run there), so that no other goroutine ever runs on it: EnterProcs
// moves the calling goroutine's thread into a child's v1 cgroups, and on v1
// the leader's memory cgroup is the whole process's.
func init() { runtime.LockOSThread() }

// EnterProcs moves the calling goroutine's OS thread, locked to it, into
// the v1 cgroups whose cgroup.procs files are procs (a Placement's Procs),
// so that a process forked from it starts inside them: nothing it does is
// ever charged elsewhere. restore moves the thread back into our own
// cgroups and unlocks it; if that fails the thread stays locked and is
// discarded when its goroutine exits. It has the shape of
// launch.Step. The thread counts against the groups' pids limit while
// inside.
func (m *Manager) EnterProcs(procs []string) (restore func() error, err error) {
	type move struct{ to, back string }
	var moves []move
	for _, p := range procs {
		dir := filepath.Dir(p)
		var back string
		for _, h := range m.v1 {
			if strings.HasPrefix(dir+"/", h.mount+"/") {
				back = h.own
			}
		}
		if back == "" {
			return nil, errdefs.InvalidArgument("%s is in no v1 cgroup hierarchy of this manager", p)
		}
		moves = append(moves, move{dir, back})
	}
	runtime.LockOSThread()
	if unix.Gettid() == unix.Getpid() {
		// The thread-group leader: on v1 its memory cgroup is the whole
		// process's, so the daemon would be charged to (and OOM-killed
		// with) the child. main locks the main goroutine to it.
		runtime.UnlockOSThread()
		return nil, errdefs.FailedPrecondition("cgroup placement from the main thread, which must stay the main goroutine's")
	}
	tid := strconv.Itoa(unix.Gettid())
	var undo cleanup.Stack
	for _, mv := range moves {
		if err := write(mv.to, "tasks", tid); err != nil {
			if uerr := undo.Run(); uerr != nil {
				return nil, errors.Join(err, uerr) // thread stays locked
			}
			runtime.UnlockOSThread()
			return nil, err
		}
		undo.Add(func() error { return write(mv.back, "tasks", tid) })
	}
	back := undo.Release()
	return func() error {
		if err := back(); err != nil {
			return err
		}
		runtime.UnlockOSThread()
		return nil
	}, nil
}
