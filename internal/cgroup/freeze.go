package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
)

// A group's freezer stops every task in it at once and starts them again,
// without their knowing: cgroup v1's freezer controller (freezer.state),
// or cgroup v2's cgroup.freeze. A frozen task takes no CPU and no
// wake-ups; it keeps its memory, its files and its place in time (a clock
// it reads has moved on when it is thawed).
//
// A fatal signal does not end a task frozen by the v1 freezer until it is
// thawed: Destroy thaws a group before it kills what is in it, and whoever
// kills a process that may be frozen must thaw its group too.

// freezeTimeout bounds how long Freeze waits for every task of a group to
// be frozen (a task in uninterruptible sleep freezes when it leaves it).
const freezeTimeout = 2 * time.Second

// CanFreeze reports whether this host has a freezer for groups (v1's
// freezer controller, else a v2 hierarchy that holds us).
func (m *Manager) CanFreeze() bool { return m.freezer != nil }

// freezerDir is group name's directory in the freezer's hierarchy.
func (m *Manager) freezerDir(name string) string {
	return filepath.Join(m.freezer.own, m.opts.Parent, name)
}

// Freeze moves process pid, with all its threads, into group name's
// freezer cgroup (made when missing; other hierarchies are untouched) and
// freezes the group. It returns once every task in it is frozen; past
// about two seconds it thaws the group again and fails with an
// Unavailable-class error. Freezing a frozen group is a no-op. The caller
// makes sure pid is the process it means (by pidfd or start time) before
// and after: a pid is a number.
func (m *Manager) Freeze(name string, pid int) error {
	if m.freezer == nil {
		return errdefs.FailedPrecondition("this host has no cgroup freezer")
	}
	if err := checkName(name); err != nil {
		return err
	}
	dir := m.freezerDir(name)
	if err := m.mkdirParent(filepath.Dir(dir)); err != nil {
		return err
	}
	if err := m.mkdir(dir); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("create freezer cgroup: %w", err)
	}
	if err := write(dir, "cgroup.procs", strconv.Itoa(pid)); err != nil {
		return fmt.Errorf("freeze %s: %w", name, err)
	}
	on, file := "FROZEN", "freezer.state"
	if m.freezer.v2 {
		on, file = "1", "cgroup.freeze"
	}
	if err := write(dir, file, on); err != nil {
		return fmt.Errorf("freeze %s: %w", name, err)
	}
	deadline := time.Now().Add(freezeTimeout)
	for {
		done, err := frozenDone(dir, m.freezer.v2)
		if err != nil {
			return errors.Join(fmt.Errorf("freeze %s: %w", name, err), thawDir(dir))
		}
		if done {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.Join(errdefs.Unavailable("freeze %s: its tasks did not all stop within %v", name, freezeTimeout), thawDir(dir))
		}
		time.Sleep(time.Millisecond)
	}
}

// Thaw thaws group name's freezer cgroup. Idempotent; a group that does
// not exist is thawed already.
func (m *Manager) Thaw(name string) error {
	if m.freezer == nil {
		return nil
	}
	if err := checkName(name); err != nil {
		return err
	}
	if err := thawDir(m.freezerDir(name)); err != nil {
		return fmt.Errorf("thaw %s: %w", name, err)
	}
	return nil
}

// Frozen reports whether group name is frozen, or being frozen (a Freeze
// cut short by a crash). A group that does not exist is not.
func (m *Manager) Frozen(name string) (bool, error) {
	if m.freezer == nil {
		return false, nil
	}
	if err := checkName(name); err != nil {
		return false, err
	}
	dir := m.freezerDir(name)
	var b []byte
	var err error
	if m.freezer.v2 {
		b, err = os.ReadFile(filepath.Join(dir, "cgroup.freeze"))
	} else {
		b, err = os.ReadFile(filepath.Join(dir, "freezer.state"))
	}
	if isNotExist(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	s := strings.TrimSpace(string(b))
	return s == "1" || s == "FROZEN" || s == "FREEZING", nil
}

// frozenDone reports whether every task of the freezer cgroup dir is
// frozen.
func frozenDone(dir string, v2 bool) (bool, error) {
	if v2 {
		kv, err := readKV(dir, "cgroup.events")
		if err != nil {
			return false, err
		}
		return kv["frozen"] == 1, nil
	}
	b, err := os.ReadFile(filepath.Join(dir, "freezer.state"))
	if err != nil {
		return false, err
	}
	return strings.TrimSpace(string(b)) == "FROZEN", nil
}

// thawDir thaws the cgroup dir if it has a freezer (v1 or v2); a missing
// dir or file is nothing to thaw.
func thawDir(dir string) error {
	for file, off := range map[string]string{"freezer.state": "THAWED", "cgroup.freeze": "0"} {
		if !exists(dir, file) {
			continue
		}
		if err := write(dir, file, off); err != nil && !isNotExist(err) {
			return err
		}
	}
	return nil
}
