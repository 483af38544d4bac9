package cgroup

import (
	"path/filepath"
	"testing"

	"github.com/forkd/forkd/internal/testutil"
)

// TestFreezeV1 freezes a process into its v1 freezer cgroup and thaws it;
// the fake kernel's freezer.state reads back what was written, as a
// freezer whose tasks all stopped at once.
func TestFreezeV1(t *testing.T) {
	f := thisHost(t)
	m := f.manager(t)
	if !m.CanFreeze() {
		t.Fatal("no freezer on a host with the v1 freezer controller")
	}
	if err := m.Freeze("sb1", 4242); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(f.mounts["freezer"], "process_api/4ea8/forkd/sb1")
	if got := readFile(t, filepath.Join(dir, "cgroup.procs")); got != "4242" {
		t.Errorf("freezer cgroup.procs = %q", got)
	}
	if frozen, err := m.Frozen("sb1"); err != nil || !frozen {
		t.Errorf("Frozen = %v, %v after Freeze", frozen, err)
	}
	if err := m.Freeze("sb1", 4242); err != nil {
		t.Errorf("second freeze: %v", err)
	}
	if err := m.Thaw("sb1"); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(dir, "freezer.state")); got != "THAWED" {
		t.Errorf("freezer.state = %q after Thaw", got)
	}
	if frozen, _ := m.Frozen("sb1"); frozen {
		t.Error("Frozen after Thaw")
	}
	if err := m.Thaw("gone"); err != nil {
		t.Errorf("thaw of a group never made: %v", err)
	}
	if err := m.Freeze("../x", 1); err == nil {
		t.Error("froze a group named ../x")
	}
	// Destroy thaws before it kills: a frozen task ignores SIGKILL.
	g, err := m.Create("sb2", Limits{MemoryMiB: 64})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Freeze("sb2", 4243); err != nil {
		t.Fatal(err)
	}
	testutil.WriteFile(t, filepath.Join(filepath.Dir(dir), "sb2", "cgroup.procs"), nil, 0o644)
	if err := g.Destroy(); err != nil {
		t.Fatal(err)
	}
	if got, _ := m.Frozen("sb2"); got {
		t.Error("group still frozen after Destroy")
	}
}
