package snapshot

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/testutil"
)

// writeBranch commits a branch of parent (nil: none) named tag.
func writeBranch(t *testing.T, s *Store, tag string, parent *Snapshot) *Snapshot {
	t.Helper()
	md := Metadata{Branch: &BranchInfo{Mode: "diff", Source: "sb-aaaaaaaaaa", Depth: 1}}
	if parent != nil {
		md.Parent, md.ParentHash = parent.Tag, parent.ContentHash
		if parent.Branch != nil {
			md.Branch.Depth = parent.Branch.Depth + 1
		}
	}
	w, err := s.CreateBranch(tag, md)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{w.MemoryPath(), w.StatePath(), w.LayerPath()} {
		testutil.WriteFile(t, p, []byte("data of "+tag), 0o600)
	}
	md.ContentHash = "hash-of-" + tag
	md.Kind = KindBranch
	md.MemoryMiB, md.VCPUs, md.Backend = 256, 1, "test"
	snap, err := w.Commit(md)
	if err != nil {
		t.Fatal(err)
	}
	return snap
}

func TestChainAncestorsAndDependents(t *testing.T) {
	s := openStore(t)
	root := writeSnapshot(t, s, "root")
	a := writeBranch(t, s, "a", root)
	b := writeBranch(t, s, "b", a)
	c := writeBranch(t, s, "c", b)
	writeBranch(t, s, "a2", root)
	anc, err := s.Ancestors(c)
	if err != nil {
		t.Fatal(err)
	}
	var tags []string
	for _, x := range anc {
		tags = append(tags, x.Tag)
	}
	if strings.Join(tags, ",") != "b,a,root" {
		t.Fatalf("ancestors of c: %v", tags)
	}
	if deps, err := s.Dependents("root"); err != nil || strings.Join(deps, ",") != "a,a2" {
		t.Fatalf("dependents of root: %v, %v", deps, err)
	}
	in, err := s.Info("c")
	if err != nil || in.ChainError != "" || len(in.Ancestors) != 3 || in.LogicalBytes != 256<<20 || in.LayerBytes == 0 {
		t.Fatalf("info of c: %+v, %v", in, err)
	}
	if c.Branch.Depth != 3 {
		t.Fatalf("depth of c: %d", c.Branch.Depth)
	}
}

func TestChainBrokenParents(t *testing.T) {
	s := openStore(t)
	root := writeSnapshot(t, s, "root")
	root.ContentHash = "first"
	testutil.Check(t, writeMetadataFile(root))
	a := writeBranch(t, s, "a", root)
	// Altered: the parent made again under its tag, with other content.
	if _, err := s.RemoveTree("root", RemoveOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	again := writeSnapshot(t, s, "root")
	again.ContentHash = "second"
	testutil.Check(t, writeMetadataFile(again))
	if _, err := s.Ancestors(a); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "altered") {
		t.Fatalf("altered parent: %v", err)
	}
	// Missing.
	if _, err := s.RemoveTree("root", RemoveOptions{}); err != nil {
		t.Fatal(err)
	}
	in, err := s.Info("a")
	if err != nil || !strings.Contains(in.ChainError, "missing") {
		t.Fatalf("missing parent: %+v, %v", in, err)
	}
	// A cycle (only hand-edited metadata can make one).
	x := writeBranch(t, s, "x", nil)
	y := writeBranch(t, s, "y", x)
	x.Parent = "y"
	testutil.Check(t, writeMetadataFile(x))
	if _, err := s.Ancestors(y); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "cycle") {
		t.Fatalf("cycle: %v", err)
	}
}

// writeMetadataFile rewrites sn's metadata.json as it stands.
func writeMetadataFile(sn *Snapshot) error {
	return fsutil.WriteJSON(filepath.Join(sn.Dir, MetadataFile), sn.Metadata, 0o600)
}

func TestRemoveTree(t *testing.T) {
	s := openStore(t)
	root := writeSnapshot(t, s, "root")
	a := writeBranch(t, s, "a", root)
	writeBranch(t, s, "b", a)
	if _, err := s.RemoveTree("root", RemoveOptions{}); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "(a)") {
		t.Fatalf("plain rmi of a parent: %v", err)
	}
	if _, err := s.Get("root"); err != nil {
		t.Fatalf("root lost by a refused rmi: %v", err)
	}
	removed, err := s.RemoveTree("a", RemoveOptions{Cascade: true})
	if err != nil || strings.Join(removed, ",") != "b,a" {
		t.Fatalf("cascade: %v, %v", removed, err)
	}
	if deps, _ := s.Dependents("root"); len(deps) != 0 {
		t.Fatalf("dependents left: %v", deps)
	}
}

// A branch whose writer died mid-way becomes a failed, removable snapshot;
// while its writer lives it is listed as writing.
func TestInterruptedBranchFails(t *testing.T) {
	s := openStore(t)
	root := writeSnapshot(t, s, "root")
	w, err := s.CreateBranch("br", Metadata{Parent: root.Tag, Branch: &BranchInfo{Mode: "diff"}})
	if err != nil {
		t.Fatal(err)
	}
	testutil.WriteFile(t, w.LayerPath(), []byte("half"), 0o600)
	list, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, sn := range list {
		if sn.Tag == "br" {
			found = sn.Status == StatusWriting
		}
	}
	if !found {
		t.Fatalf("branch being written not listed as writing: %+v", list)
	}
	// The writer dies: its flock goes with it (here: a closed file).
	w.lock.Close()
	testutil.Check(t, s.Reclaim())
	sn, err := s.Get("br")
	if err != nil || sn.Status != StatusFailed || !strings.Contains(sn.Error, "interrupted") {
		t.Fatalf("after reclaim: %+v, %v", sn, err)
	}
	if _, err := os.Stat(filepath.Join(sn.Dir, LayerFile)); !os.IsNotExist(err) {
		t.Fatalf("layer of a failed branch kept: %v", err)
	}
	if _, err := s.RemoveTree("br", RemoveOptions{}); err != nil {
		t.Fatalf("rmi of a failed branch: %v", err)
	}
}
