package snapshot

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

// writeRootfsSnapshot commits tag over the rootfs image at rootfs.
func writeRootfsSnapshot(t *testing.T, s *Store, tag, rootfs string) *Snapshot {
	t.Helper()
	w, err := s.Create(tag)
	if err != nil {
		t.Fatal(err)
	}
	testutil.WriteFile(t, w.MemoryPath(), []byte("memory of "+tag), 0o600)
	testutil.WriteFile(t, w.StatePath(), []byte("state of "+tag), 0o600)
	snap, err := w.Commit(Metadata{Rootfs: FileRef{Path: rootfs, SHA256: "x"}})
	if err != nil {
		t.Fatal(err)
	}
	return snap
}

// wantPrecondition fails unless err is FailedPrecondition-class and says
// every one of words.
func wantPrecondition(t *testing.T, what string, err error, words ...string) {
	t.Helper()
	if !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("%s: %v, want FailedPrecondition", what, err)
	}
	for _, w := range words {
		if !strings.Contains(err.Error(), w) {
			t.Fatalf("%s: %q does not say %q", what, err, w)
		}
	}
}

func TestAcquireRefusesReplacedRootfs(t *testing.T) {
	s := openStore(t)
	rootfs := filepath.Join(t.TempDir(), "rootfs.ext4")
	if err := os.WriteFile(rootfs, []byte("filesystem one"), 0o600); err != nil {
		t.Fatal(err)
	}
	snap := writeRootfsSnapshot(t, s, "base", rootfs)
	got, err := s.Get("base")
	if err != nil {
		t.Fatal(err)
	}
	if got.Rootfs.ID == nil || got.Rootfs.ID.Ino == 0 || got.Rootfs.ID.Size != int64(len("filesystem one")) ||
		got.MemoryBytes != int64(len("memory of base")) || got.StateBytes != int64(len("state of base")) {
		t.Fatalf("identity not recorded: rootfs %+v, memory %d, state %d", got.Rootfs.ID, got.MemoryBytes, got.StateBytes)
	}
	_, ref, err := s.Acquire("base")
	if err != nil {
		t.Fatal(err)
	}
	ref.Close()

	// The image cache rebuilds an entry at the same path: same size, new
	// inode.
	tmp := rootfs + ".new"
	testutil.WriteFile(t, tmp, []byte("filesystem two"), 0o600)
	if err := os.Rename(tmp, rootfs); err != nil {
		t.Fatal(err)
	}
	_, _, err = s.Acquire("base")
	wantPrecondition(t, "Acquire after rootfs replaced", err, `"base"`, "root filesystem image changed", rootfs, "inode", "rebuild")
	if inUse, _ := s.InUse("base"); inUse {
		t.Fatal("a refused Acquire kept its reference")
	}

	// Rewritten in place: the size changes.
	cur, _ := Identify(rootfs)
	snap.Rootfs.ID = cur
	setMetadata(t, snap)
	testutil.WriteFile(t, rootfs, []byte("filesystem two, longer"), 0o600)
	_, _, err = s.Acquire("base")
	wantPrecondition(t, "Acquire after rootfs rewritten", err, "root filesystem image changed", "size")

	// Touched: same inode and size, a new modification time.
	cur, _ = Identify(rootfs)
	snap.Rootfs.ID = cur
	setMetadata(t, snap)
	later := time.Unix(0, cur.MtimeNS).Add(time.Second)
	testutil.Chtimes(t, rootfs, later, later)
	_, _, err = s.Acquire("base")
	wantPrecondition(t, "Acquire after rootfs touched", err, "root filesystem image changed", "modified")

	testutil.Remove(t, rootfs)
	_, _, err = s.Acquire("base")
	wantPrecondition(t, "Acquire without rootfs", err, "root filesystem image", "gone")
}

func TestAcquireRefusesMissingOrResizedFiles(t *testing.T) {
	s := openStore(t)
	snap := writeSnapshot(t, s, "base")
	testutil.Remove(t, snap.StatePath())
	_, _, err := s.Acquire("base")
	wantPrecondition(t, "Acquire without state", err, `"base"`, "state file", "missing", "rebuild")

	snap = writeSnapshot(t, s, "other")
	testutil.WriteFile(t, snap.MemoryPath(), []byte("short"), 0o600)
	_, _, err = s.Acquire("other")
	wantPrecondition(t, "Acquire with truncated memory", err, "memory file", "5 bytes")
}

// setMetadata rewrites snap's metadata.json from snap.Metadata.
func setMetadata(t *testing.T, snap *Snapshot) {
	t.Helper()
	b, _ := json.Marshal(snap.Metadata)
	if err := os.WriteFile(filepath.Join(snap.Dir, MetadataFile), b, 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestAcquireAcceptsOldMetadata(t *testing.T) {
	s := openStore(t)
	rootfs := filepath.Join(t.TempDir(), "rootfs.ext4")
	testutil.WriteFile(t, rootfs, []byte("filesystem one"), 0o600)
	snap := writeRootfsSnapshot(t, s, "base", rootfs)
	// Metadata as an older forkd wrote it: no identity, no sizes.
	b, err := os.ReadFile(filepath.Join(snap.Dir, MetadataFile))
	if err != nil {
		t.Fatal(err)
	}
	var raw map[string]any
	testutil.Check(t, json.Unmarshal(b, &raw))
	delete(raw, "memory_bytes")
	delete(raw, "state_bytes")
	delete(raw["rootfs"].(map[string]any), "id")
	b, _ = json.Marshal(raw)
	testutil.WriteFile(t, filepath.Join(snap.Dir, MetadataFile), b, 0o600)

	testutil.Remove(t, rootfs)
	testutil.WriteFile(t, rootfs, []byte("filesystem two, longer"), 0o600)
	testutil.WriteFile(t, snap.MemoryPath(), []byte("m"), 0o600)
	_, ref, err := s.Acquire("base")
	if err != nil {
		t.Fatalf("Acquire of old metadata = %v", err)
	}
	ref.Close()
}

func TestCommitRefusesRootfsReplacedDuringBuild(t *testing.T) {
	s := openStore(t)
	rootfs := filepath.Join(t.TempDir(), "rootfs.ext4")
	testutil.WriteFile(t, rootfs, []byte("filesystem one"), 0o600)
	booted, err := Identify(rootfs)
	if err != nil {
		t.Fatal(err)
	}
	w, err := s.Create("base")
	if err != nil {
		t.Fatal(err)
	}
	testutil.WriteFile(t, w.MemoryPath(), []byte("m"), 0o600)
	testutil.WriteFile(t, w.StatePath(), []byte("s"), 0o600)
	testutil.Remove(t, rootfs)
	testutil.WriteFile(t, rootfs, []byte("filesystem two"), 0o600)
	_, err = w.Commit(Metadata{Rootfs: FileRef{Path: rootfs, ID: booted}})
	wantPrecondition(t, "Commit after rootfs replaced", err, "changed while the snapshot was made")
	if _, err := os.Stat(w.Dir()); !os.IsNotExist(err) {
		t.Fatalf("staging dir left behind: %v", err)
	}
	if _, err := s.Get("base"); !errdefs.IsNotFound(err) {
		t.Fatalf("Get after failed Commit = %v", err)
	}
}
