package cgroup

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/cleanup"
	"github.com/forkd/forkd/internal/errdefs"
)

// Limits for one group. Zero fields mean "no limit" (or the default
// weight).
type Limits struct {
	// MemoryMiB caps memory, swap included. For a VMM: guest RAM plus the
	// VMM's own overhead (~64 MiB for QEMU/TCG), the caller's choice.
	MemoryMiB int64 `json:"memory_mib,omitempty"`
	// CPUs caps CPU time, in CPUs (1.5 = one and a half cores' worth per
	// period).
	CPUs float64 `json:"cpus,omitempty"`
	// CPUWeight is the relative share under contention, 1..10000 (v2
	// scale, default 100; v1 cpu.shares = weight*1024/100).
	CPUWeight uint64 `json:"cpu_weight,omitempty"`
	// PIDs caps processes and threads (a QEMU has ~10 threads).
	PIDs int64 `json:"pids,omitempty"`
	// IOWeight is the relative IO share, 1..10000 (v2 scale; v1
	// blkio.weight or blkio.bfq.weight 10..1000).
	IOWeight uint64 `json:"io_weight,omitempty"`
	// IO caps bandwidth and operations per block device.
	IO []IOLimit `json:"io,omitempty"`
}

// IOLimit caps IO on the block device Major:Minor; zero fields are not
// limited.
type IOLimit struct {
	Major     uint32 `json:"major"`
	Minor     uint32 `json:"minor"`
	ReadBps   uint64 `json:"read_bps,omitempty"`
	WriteBps  uint64 `json:"write_bps,omitempty"`
	ReadIOPS  uint64 `json:"read_iops,omitempty"`
	WriteIOPS uint64 `json:"write_iops,omitempty"`
}

func (l Limits) validate() error {
	switch {
	case l.MemoryMiB < 0 || l.MemoryMiB > 1<<30:
		return errdefs.InvalidArgument("memory limit %d MiB", l.MemoryMiB)
	case l.CPUs < 0 || math.IsNaN(l.CPUs) || l.CPUs > 4096 || (l.CPUs > 0 && l.CPUs < 0.01):
		return errdefs.InvalidArgument("cpu limit %v: want 0.01..4096 CPUs", l.CPUs)
	case l.CPUWeight > 10000:
		return errdefs.InvalidArgument("cpu weight %d: want 1..10000", l.CPUWeight)
	case l.PIDs < 0:
		return errdefs.InvalidArgument("pids limit %d", l.PIDs)
	case l.IOWeight > 10000:
		return errdefs.InvalidArgument("io weight %d: want 1..10000", l.IOWeight)
	}
	return nil
}

// wants reports whether l limits kind.
func (l Limits) wants(kind string) bool {
	switch kind {
	case Memory:
		return l.MemoryMiB > 0
	case CPU:
		return l.CPUs > 0 || l.CPUWeight > 0
	case PIDs:
		return l.PIDs > 0
	case IO:
		return l.IOWeight > 0 || len(l.IO) > 0
	}
	return false
}

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
		if err := m.mkdirParent(filepath.Dir(dir)); err != nil {
			return nil, err
		}
		if err := m.mkdir(dir); err != nil {
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
		return errdefs.FailedPrecondition("cgroup v2: cannot enable controllers below %s (%v): run forkd in a delegated cgroup (systemd Delegate=yes) with its own process in a leaf", m.v2.own, err)
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

// setLimits writes l into the group's control files.
func (g *Group) setLimits(l Limits) error {
	if l.MemoryMiB > 0 {
		d, bytes := g.dir(Memory), strconv.FormatInt(l.MemoryMiB<<20, 10)
		if g.m.place[Memory].v2 {
			if err := write(d, "memory.max", bytes); err != nil {
				return err
			}
			if exists(d, "memory.swap.max") {
				if err := write(d, "memory.swap.max", "0"); err != nil {
					return err
				}
			}
		} else {
			if err := write(d, "memory.limit_in_bytes", bytes); err != nil {
				return err
			}
			if exists(d, "memory.memsw.limit_in_bytes") {
				if err := write(d, "memory.memsw.limit_in_bytes", bytes); err != nil {
					return err
				}
			}
		}
	}
	if l.CPUs > 0 || l.CPUWeight > 0 {
		d, v2 := g.dir(CPU), g.m.place[CPU].v2
		const period = 100000
		quota := max(int64(l.CPUs*period), 1000)
		switch {
		case l.CPUs > 0 && v2:
			if err := write(d, "cpu.max", fmt.Sprintf("%d %d", quota, period)); err != nil {
				return err
			}
		case l.CPUs > 0:
			if err := write(d, "cpu.cfs_period_us", strconv.Itoa(period)); err != nil {
				return err
			}
			if err := write(d, "cpu.cfs_quota_us", strconv.FormatInt(quota, 10)); err != nil {
				return err
			}
		}
		switch {
		case l.CPUWeight > 0 && v2:
			if err := write(d, "cpu.weight", strconv.FormatUint(l.CPUWeight, 10)); err != nil {
				return err
			}
		case l.CPUWeight > 0:
			if err := write(d, "cpu.shares", strconv.FormatUint(max(l.CPUWeight*1024/100, 2), 10)); err != nil {
				return err
			}
		}
	}
	if l.PIDs > 0 {
		if err := write(g.dir(PIDs), "pids.max", strconv.FormatInt(l.PIDs, 10)); err != nil {
			return err
		}
	}
	if l.IOWeight > 0 || len(l.IO) > 0 {
		if err := g.setIO(l); err != nil {
			return err
		}
	}
	return nil
}

func (g *Group) setIO(l Limits) error {
	d := g.dir(IO)
	if g.m.place[IO].v2 {
		if l.IOWeight > 0 {
			if err := write(d, "io.weight", "default "+strconv.FormatUint(l.IOWeight, 10)); err != nil {
				return err
			}
		}
		for _, io := range l.IO {
			var parts []string
			for _, kv := range []struct {
				k string
				v uint64
			}{{"rbps", io.ReadBps}, {"wbps", io.WriteBps}, {"riops", io.ReadIOPS}, {"wiops", io.WriteIOPS}} {
				if kv.v > 0 {
					parts = append(parts, fmt.Sprintf("%s=%d", kv.k, kv.v))
				}
			}
			if len(parts) == 0 {
				continue
			}
			if err := write(d, "io.max", fmt.Sprintf("%d:%d %s", io.Major, io.Minor, strings.Join(parts, " "))); err != nil {
				return err
			}
		}
		return nil
	}
	if l.IOWeight > 0 {
		w := strconv.FormatUint(min(max(l.IOWeight/10, 10), 1000), 10)
		switch {
		case exists(d, "blkio.weight"):
			if err := write(d, "blkio.weight", w); err != nil {
				return err
			}
		case exists(d, "blkio.bfq.weight"):
			if err := write(d, "blkio.bfq.weight", w); err != nil {
				return err
			}
		default:
			return errdefs.FailedPrecondition("io weight: the host's blkio controller has no weight (no CFQ/BFQ scheduler)")
		}
	}
	for _, io := range l.IO {
		for _, kv := range []struct {
			file string
			v    uint64
		}{{"blkio.throttle.read_bps_device", io.ReadBps}, {"blkio.throttle.write_bps_device", io.WriteBps},
			{"blkio.throttle.read_iops_device", io.ReadIOPS}, {"blkio.throttle.write_iops_device", io.WriteIOPS}} {
			if kv.v == 0 {
				continue
			}
			if err := write(d, kv.file, fmt.Sprintf("%d:%d %d", io.Major, io.Minor, kv.v)); err != nil {
				return err
			}
		}
	}
	return nil
}

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

// EnterProcs moves the calling goroutine's OS thread, locked to it, into
// the v1 cgroups whose cgroup.procs files are procs (a Placement's Procs),
// so that a process forked from it starts inside them: nothing it does is
// ever charged elsewhere. restore moves the thread back into our own
// cgroups and unlocks it; if that fails the thread stays locked and is
// discarded when its goroutine exits. It has the shape of
// netns.EnterFunc. The thread counts against the groups' pids limit while
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

// Destroy kills every process left in the group, waits for them to leave
// and removes the group's directories (a dead child not yet waited for
// does not hold the group). Idempotent; it gives up with an
// Unavailable-class error after about two seconds.
func (g *Group) Destroy() error {
	g.closeFD()
	deadline := time.Now().Add(g.m.destroyWait)
	var errs []error
	for _, d := range g.dirs() {
		if err := g.m.removeDir(d, deadline); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("destroy cgroup %s: %w", g.name, err)
	}
	return nil
}

func (g *Group) closeFD() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.fd >= 0 {
		unix.Close(g.fd)
		g.fd = -1
	}
}

// removeDir kills what is in the cgroup dir, then removes it.
func (m *Manager) removeDir(dir string, deadline time.Time) error {
	if _, err := os.Stat(dir); isNotExist(err) {
		return nil
	}
	for {
		if exists(dir, "cgroup.kill") {
			write(dir, "cgroup.kill", "1") // v2 (5.14+): kills atomically
		}
		killAll(dir)
		err := m.rmdir(dir)
		if err == nil || isNotExist(err) {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			pids, _ := readPIDs(dir)
			return errdefs.Unavailable("remove cgroup %s (processes %v): %v", dir, pids, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// killAll sends SIGKILL to every process in the cgroup dir. A pid is
// signalled through a pidfd opened while the pid is still listed in the
// cgroup, so a recycled pid is never hit.
func killAll(dir string) {
	pids, err := readPIDs(dir)
	if err != nil {
		return
	}
	for _, pid := range pids {
		fd, err := unix.PidfdOpen(pid, 0)
		if err != nil {
			continue
		}
		if now, err := readPIDs(dir); err == nil && slices.Contains(now, pid) {
			unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
		}
		unix.Close(fd)
	}
}

// readPIDs lists the processes in the cgroup dir.
func readPIDs(dir string) ([]int, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil, err
	}
	var out []int
	for _, f := range strings.Fields(string(b)) {
		if n, err := strconv.Atoi(f); err == nil {
			out = append(out, n)
		}
	}
	return out, nil
}

// List returns the names of the groups that exist in any hierarchy.
func (m *Manager) List() ([]string, error) {
	seen := map[string]bool{}
	var hs []*hierarchy
	hs = append(hs, m.v1...)
	if m.v2 != nil {
		hs = append(hs, m.v2)
	}
	for _, h := range hs {
		ents, err := os.ReadDir(filepath.Join(h.own, m.opts.Parent))
		if isNotExist(err) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, e := range ents {
			if e.IsDir() && checkName(e.Name()) == nil {
				seen[e.Name()] = true
			}
		}
	}
	out := make([]string, 0, len(seen))
	for n := range seen {
		out = append(out, n)
	}
	slices.Sort(out)
	return out, nil
}

// Reclaim destroys every group for which live returns false (crash
// recovery). Errors are joined; it goes on past a group it cannot remove.
func (m *Manager) Reclaim(live func(name string) bool) error {
	names, err := m.List()
	if err != nil {
		return err
	}
	var errs []error
	for _, n := range names {
		if live(n) {
			continue
		}
		errs = append(errs, m.group(n).Destroy())
	}
	return errors.Join(errs...)
}
