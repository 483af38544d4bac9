package snapshot

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

func TestValidateTag(t *testing.T) {
	good := []string{"a", "base", "py-3.11_numpy", "A1", strings.Repeat("x", MaxTagLen)}
	for _, tag := range good {
		t.Run(tag, func(t *testing.T) {
			if err := ValidateTag(tag); err != nil {
				t.Errorf("ValidateTag(%q) = %v, want nil", tag, err)
			}
		})
	}
	bad := []string{"", "../x", "/etc", "a/b", "..", ".", ".hidden", "-x", "a b", "a\x00b", "tag\n",
		strings.Repeat("x", 200), strings.Repeat("x", MaxTagLen+1), "ü"}
	for _, tag := range bad {
		t.Run("bad "+tag, func(t *testing.T) {
			err := ValidateTag(tag)
			if err == nil {
				t.Errorf("ValidateTag(%q) = nil, want error", tag)
			} else if !errdefs.IsInvalidArgument(err) {
				t.Errorf("ValidateTag(%q) = %v, want InvalidArgument", tag, err)
			}
		})
	}
}

// openStore opens a store in a fresh directory.
func openStore(t *testing.T) *Store {
	t.Helper()
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func writeSnapshot(t *testing.T, s *Store, tag string) *Snapshot {
	t.Helper()
	w, err := s.Create(tag)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{w.MemoryPath(), w.StatePath()} {
		if err := os.WriteFile(p, []byte("data of "+tag), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	snap, err := w.Commit(Metadata{Backend: "test", MemoryMiB: 256, VCPUs: 1})
	if err != nil {
		t.Fatal(err)
	}
	return snap
}

func TestCreateCommitGetList(t *testing.T) {
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	snap := writeSnapshot(t, s, "base")
	if snap.Status != StatusReady || snap.Tag != "base" || snap.FormatVersion != FormatVersion {
		t.Fatalf("committed snapshot %+v", snap.Metadata)
	}
	got, err := s.Get("base")
	if err != nil {
		t.Fatal(err)
	}
	if got.MemoryMiB != 256 || got.Dir != filepath.Join(s.Root(), "base") {
		t.Fatalf("Get = %+v", got)
	}
	if _, err := s.Create("base"); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("second Create = %v, want AlreadyExists", err)
	}
	writeSnapshot(t, s, "other")
	list, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 2 || list[0].Tag != "base" || list[1].Tag != "other" {
		t.Fatalf("List = %v", list)
	}
	if _, err := s.Get("missing"); !errdefs.IsNotFound(err) {
		t.Fatalf("Get(missing) = %v", err)
	}
	for _, tag := range []string{"../x", "/etc", "a/b", ""} {
		t.Run("bad "+tag, func(t *testing.T) {
			if _, err := s.Get(tag); !errdefs.IsInvalidArgument(err) {
				t.Errorf("Get(%q) = %v, want InvalidArgument", tag, err)
			}
			if _, err := s.Create(tag); !errdefs.IsInvalidArgument(err) {
				t.Errorf("Create(%q) = %v, want InvalidArgument", tag, err)
			}
			if err := s.Remove(tag); !errdefs.IsInvalidArgument(err) {
				t.Errorf("Remove(%q) = %v, want InvalidArgument", tag, err)
			}
		})
	}
}

func TestConcurrentCommitSameTag(t *testing.T) {
	s := openStore(t)
	w1, err := s.Create("t")
	if err != nil {
		t.Fatal(err)
	}
	w2, err := s.Create("t")
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []*Writer{w1, w2} {
		testutil.WriteFile(t, w.MemoryPath(), nil, 0o600)
		testutil.WriteFile(t, w.StatePath(), nil, 0o600)
	}
	if _, err := w1.Commit(Metadata{}); err != nil {
		t.Fatal(err)
	}
	if _, err := w2.Commit(Metadata{}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("second commit = %v, want AlreadyExists", err)
	}
	if _, err := os.Stat(w2.Dir()); !os.IsNotExist(err) {
		t.Fatalf("losing staging dir left behind: %v", err)
	}
}

func TestRemoveRefusedWhileReferenced(t *testing.T) {
	s := openStore(t)
	writeSnapshot(t, s, "base")
	_, ref, err := s.Acquire("base")
	if err != nil {
		t.Fatal(err)
	}
	if inUse, _ := s.InUse("base"); !inUse {
		t.Fatal("InUse = false with a live reference")
	}
	err = s.Remove("base")
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("Remove while referenced = %v", err)
	}
	ref.Close()
	if err := s.Remove("base"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get("base"); !errdefs.IsNotFound(err) {
		t.Fatalf("Get after Remove = %v", err)
	}
	if err := s.Remove("base"); !errdefs.IsNotFound(err) {
		t.Fatalf("second Remove = %v", err)
	}
	entries, _ := os.ReadDir(s.Root())
	if len(entries) != 0 {
		t.Fatalf("store not empty after remove: %v", entries)
	}
}

func TestAbortAndReclaim(t *testing.T) {
	s := openStore(t)
	w, err := s.Create("x")
	if err != nil {
		t.Fatal(err)
	}
	// A live writer's staging dir survives Reclaim.
	if err := s.Reclaim(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(w.Dir()); err != nil {
		t.Fatalf("live staging dir reclaimed: %v", err)
	}
	// A dead writer's (lock released without cleanup) is removed.
	w.lock.Close()
	if err := s.Reclaim(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(w.Dir()); !os.IsNotExist(err) {
		t.Fatalf("stale staging dir kept: %v", err)
	}
	w2, err := s.Create("y")
	if err != nil {
		t.Fatal(err)
	}
	w2.Abort()
	if _, err := os.Stat(w2.Dir()); !os.IsNotExist(err) {
		t.Fatal("Abort left the staging dir")
	}
	if _, err := s.Get("y"); !errdefs.IsNotFound(err) {
		t.Fatalf("aborted snapshot visible: %v", err)
	}
}

func TestCorruptTagsListedAndRemovable(t *testing.T) {
	s := openStore(t)
	writeSnapshot(t, s, "good")
	mk := func(tag string, files map[string]string) {
		dir := filepath.Join(s.Root(), tag)
		testutil.Mkdir(t, dir, 0o700)
		for name, data := range files {
			testutil.WriteFile(t, filepath.Join(dir, name), []byte(data), 0o600)
		}
	}
	mk("nometa", map[string]string{LockFile: "", MemoryFile: "m"})
	mk("garbage", map[string]string{MetadataFile: "{not json", LockFile: ""})
	mk("nolock", map[string]string{MetadataFile: "{"})
	mk("future", map[string]string{MetadataFile: `{"format_version": 99, "tag": "future", "status": "ready"}`, LockFile: ""})
	mk("wrongtag", map[string]string{MetadataFile: `{"format_version": 1, "tag": "other", "status": "ready"}`, LockFile: ""})
	testutil.WriteFile(t, filepath.Join(s.Root(), "afile"), []byte("x"), 0o600)

	list, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{ // tag: a word of Error
		"afile": "not a directory", "future": "format version 99", "garbage": "corrupt metadata.json",
		"nolock": "corrupt metadata.json", "nometa": "no such file", "wrongtag": `names tag "other"`,
	}
	var tags []string
	for _, sn := range list {
		tags = append(tags, sn.Tag)
		if sn.Tag == "good" {
			if sn.Status != StatusReady {
				t.Errorf("good: status %s", sn.Status)
			}
			continue
		}
		if sn.Status != StatusCorrupt || !strings.Contains(sn.Error, want[sn.Tag]) {
			t.Errorf("%s: status %s, error %q; want corrupt, %q", sn.Tag, sn.Status, sn.Error, want[sn.Tag])
		}
		if sn.Dir != filepath.Join(s.Root(), sn.Tag) {
			t.Errorf("%s: dir %s", sn.Tag, sn.Dir)
		}
	}
	if strings.Join(tags, " ") != "afile future garbage good nolock nometa wrongtag" {
		t.Fatalf("List tags = %v", tags)
	}

	_, err = s.Get("nometa")
	wantPrecondition(t, "Get(nometa)", err, "corrupt", "forkd rmi nometa")
	_, err = s.Get("future")
	wantPrecondition(t, "Get(future)", err, "format version 99")
	if _, _, err := s.Acquire("garbage"); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("Acquire(garbage) = %v", err)
	}
	_, err = s.Create("garbage")
	if !errdefs.IsAlreadyExists(err) || !strings.Contains(err.Error(), "unusable") || !strings.Contains(err.Error(), "forkd rmi garbage") {
		t.Fatalf("Create over a corrupt tag = %v", err)
	}

	// A holder of the lock (a live child) still blocks removal.
	f, err := os.Open(filepath.Join(s.Root(), "garbage", LockFile))
	if err != nil {
		t.Fatal(err)
	}
	ref := &Ref{File: f}
	if err := lockShared(f); err != nil {
		t.Fatal(err)
	}
	err = s.Remove("garbage")
	wantPrecondition(t, "Remove(garbage) while held", err, "in use")
	ref.Close()

	for tag := range want {
		if err := s.Remove(tag); err != nil {
			t.Errorf("Remove(%s) = %v", tag, err)
		}
		if err := s.Remove(tag); !errdefs.IsNotFound(err) {
			t.Errorf("second Remove(%s) = %v, want NotFound", tag, err)
		}
	}
	list, _ = s.List()
	if len(list) != 1 || list[0].Tag != "good" {
		t.Fatalf("List after removals = %v", list)
	}
	entries, _ := os.ReadDir(s.Root())
	if len(entries) != 1 {
		t.Fatalf("store holds %v after removals", entries)
	}
	if _, err := s.Create("garbage"); err != nil {
		t.Fatalf("Create after removing the corrupt tag = %v", err)
	}
}

func lockShared(f *os.File) error { return unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB) }
