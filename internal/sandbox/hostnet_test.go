package sandbox

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/nftables"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/launch"
	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/testutil"
)

// TestHostNetReclaimsLeftNamespaces: what a data dir that is gone left
// under its index is reclaimed when another data dir claims its share,
// and the index is then free; an index whose leftovers cannot be
// reclaimed is not given out, nor is one a live data dir holds; a data
// dir keeps its own index, and its own namespaces are never reclaimed.
// (reclaimLeft, which changes the host, is TestReclaimLeft's.)
func TestHostNetReclaimsLeftNamespaces(t *testing.T) {
	claims, nsDir := t.TempDir(), t.TempDir()
	oldClaims, oldNS, oldReclaim := hostNetClaims, hostNetNSDir, reclaimHostNet
	t.Cleanup(func() { hostNetClaims, hostNetNSDir, reclaimHostNet = oldClaims, oldNS, oldReclaim })
	hostNetClaims, hostNetNSDir = claims, nsDir
	var reclaimed []string
	reclaimHostNet = func(hn HostNet, _ *slog.Logger) error {
		reclaimed = append(reclaimed, hn.Prefix)
		if hn.Prefix == "fk02" {
			return errors.New("a shell runs in fk02-0")
		}
		ents, err := os.ReadDir(nsDir)
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), hn.Prefix+"-") {
				err = errors.Join(err, os.Remove(filepath.Join(nsDir, e.Name())))
			}
		}
		return err
	}
	log := slog.New(slog.DiscardHandler)

	live := t.TempDir()
	a, err := hostNetFor(live, log)
	testutil.Check(t, err)
	if a.Index != 0 || a.Prefix != "fk00" {
		t.Fatalf("first data dir got %+v", a)
	}
	testutil.WriteFile(t, filepath.Join(nsDir, "fk00-0"), nil, 0o600)
	// Index 1: claimed by a data dir that is gone, its namespace left.
	gone := filepath.Join(t.TempDir(), "gone")
	testutil.WriteFile(t, filepath.Join(claims, "1"), []byte(gone), 0o600)
	testutil.WriteFile(t, filepath.Join(nsDir, "fk01-3"), nil, 0o600)
	// Index 2: nothing claims it, a namespace of its prefix is left, and
	// reclaiming it fails.
	testutil.WriteFile(t, filepath.Join(nsDir, "fk02-0"), nil, 0o600)
	// Index 3: another prefix's names do not count.
	testutil.WriteFile(t, filepath.Join(nsDir, "fk030-0"), nil, 0o600)

	b, err := hostNetFor(t.TempDir(), log)
	testutil.Check(t, err)
	if !slices.Equal(reclaimed, []string{"fk01", "fk02"}) {
		t.Errorf("reclaimed %v, want fk01 and fk02 (fk00 is live)", reclaimed)
	}
	if b.Index != 1 {
		t.Fatalf("second data dir got index %d, want 1 (0 live, 1 reclaimed)", b.Index)
	}
	c, err := hostNetFor(t.TempDir(), log)
	testutil.Check(t, err)
	if c.Index != 3 {
		t.Fatalf("third data dir got index %d, want 3 (2 holds namespaces)", c.Index)
	}

	// Its claim lost (the claims dir emptied), the first data dir keeps
	// its index and its namespace.
	testutil.Check(t, os.Remove(filepath.Join(claims, "0")))
	reclaimed = nil
	again, err := hostNetFor(live, log)
	testutil.Check(t, err)
	if again != a {
		t.Fatalf("the first data dir's share changed: %+v, was %+v", again, a)
	}
	if slices.Contains(reclaimed, "fk00") {
		t.Errorf("a data dir reclaimed its own namespaces")
	}
}

// TestReclaimLeft: what a removed data dir left under a prefix goes, its
// VMMs (those whose run dir was deleted) first; while another process is
// in one of its namespaces (a VMM whose run dir is still there), nothing
// goes. Root: real namespaces, veths and nftables; the VMMs are sleep
// processes named as forkd names QEMU.
func TestReclaimLeft(t *testing.T) {
	testutil.RequireRoot(t)
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	hn := HostNet{Index: -1, Prefix: "fdtl", Network: "10.180.128.0/20", Ports: "28800-28899"}
	nm, err := hn.netManager(log)
	testutil.Check(t, err)
	reclaim := func() {
		if err := nm.Reclaim(ctx, func(int) bool { return false }); err != nil {
			t.Errorf("reclaim: %v", err)
		}
	}
	reclaim()
	t.Cleanup(reclaim)
	sleep, err := exec.LookPath("sleep")
	testutil.Check(t, err)
	run := t.TempDir()
	vmm := func(slot int, name string) (*exec.Cmd, proc.Identity) {
		n, err := nm.Create(ctx, slot, netns.DefaultPolicy)
		testutil.Check(t, err)
		dir := filepath.Join(run, name)
		testutil.MkdirAll(t, dir, 0o700)
		cmd := &exec.Cmd{Path: sleep, Args: []string{"qemu-system-x86_64 -name guest=x,process=forkd-" + name, "600"}, Dir: dir}
		testutil.Check(t, launch.Start(n.NetNSPath, cmd))
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		id, err := proc.Self(cmd.Process.Pid)
		testutil.Check(t, err)
		return cmd, id
	}
	_, orphan := vmm(0, "sb-aaaaaaaaaa")
	testutil.Check(t, os.RemoveAll(filepath.Join(run, "sb-aaaaaaaaaa")))
	kept, keptID := vmm(1, "sb-bbbbbbbbbb")

	if err := reclaimLeft(hn, log); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("with a VMM whose run dir exists: %v, want failed precondition", err)
	}
	if slots, err := nm.List(ctx); err != nil || !slices.Equal(slots, []int{0, 1}) {
		t.Fatalf("slots after a refused reclaim: %v %v", slots, err)
	}
	if !proc.Alive(orphan) || !proc.Alive(keptID) {
		t.Fatal("a refused reclaim killed a VMM")
	}

	kept.Process.Kill()
	kept.Wait()
	testutil.Check(t, reclaimLeft(hn, log))
	if proc.Alive(orphan) {
		t.Error("the VMM of the removed run dir still runs")
	}
	if slots, err := nm.List(ctx); err != nil || len(slots) > 0 {
		t.Errorf("slots left: %v %v", slots, err)
	}
	c, err := nftables.New()
	testutil.Check(t, err)
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyIPv4)
	testutil.Check(t, err)
	for _, tb := range tables {
		if tb.Name == hn.Prefix {
			t.Errorf("nft table %s left", tb.Name)
		}
	}
}
