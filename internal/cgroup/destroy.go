package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
)

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
	// The manager's parent directory goes with its last group; it fails
	// harmlessly while other groups (or other processes' groups) are in it.
	for _, d := range g.dirs() {
		_ = unix.Rmdir(filepath.Dir(d)) // never recursive, even in tests
	}
	return nil
}

// Close releases the group's open directory, if any, once the VMM has
// been started in it (or inspecting it is done). The group itself stays;
// Destroy removes it.
func (g *Group) Close() error {
	g.closeFD()
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
		// A task frozen by the v1 freezer dies of SIGKILL only once
		// thawed. What fails here shows as a group that stays busy.
		_ = thawDir(dir)
		if exists(dir, "cgroup.kill") {
			// v2 (5.14+): kills atomically. On failure killAll still kills
			// each process, and rmdir reports what stays.
			_ = write(dir, "cgroup.kill", "1")
		}
		killAll(dir)
		err := m.rmdir(dir)
		if err == nil || isNotExist(err) {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			pids, _ := readPIDs(dir)
			return errdefs.Unavailable("remove cgroup %s (processes %v): %w", dir, pids, err)
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
		if pid == os.Getpid() {
			continue // a thread of ours left behind by a failed move back
		}
		fd, err := unix.PidfdOpen(pid, 0)
		if err != nil {
			continue
		}
		if now, err := readPIDs(dir); err == nil && slices.Contains(now, pid) {
			// Fails for a process already gone; one that stays keeps
			// the group busy, which removeDir reports.
			_ = unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
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
