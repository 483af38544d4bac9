package state

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

func TestStoreModes(t *testing.T) {
	for _, c := range []struct {
		name       string
		persistent bool
	}{{"per transaction", false}, {"persistent", true}} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "state.db")
			s, err := Open(path, Options{Persistent: c.persistent})
			if err != nil {
				t.Fatal(err)
			}
			now := time.Now()
			if err := s.PutAll([]*Sandbox{
				{ID: "b", Snapshot: "base", Status: StatusRunning, Created: now},
				{ID: "a", Snapshot: "base", Status: StatusRunning, Created: now.Add(-time.Second)},
			}); err != nil {
				t.Fatal(err)
			}
			list, err := s.List()
			if err != nil || len(list) != 2 || list[0].ID != "a" {
				t.Fatalf("List = %v, %v", list, err)
			}
			sb, err := s.Update("b", func(sb *Sandbox) error { sb.Status = StatusDead; return nil })
			if err != nil || sb.Status != StatusDead {
				t.Fatalf("Update = %+v, %v", sb, err)
			}
			got, err := s.Get("b")
			if err != nil || got.Status != StatusDead {
				t.Fatalf("Get = %+v, %v", got, err)
			}
			if _, err := s.Get("zz"); !errdefs.IsNotFound(err) {
				t.Fatalf("Get(missing) = %v", err)
			}
			if _, err := s.Update("zz", func(*Sandbox) error { return nil }); !errdefs.IsNotFound(err) {
				t.Fatalf("Update(missing) = %v", err)
			}
			if err := s.Delete("a"); err != nil {
				t.Fatal(err)
			}
			s.Close()
			// Records survive reopening.
			s2, err := Open(path, Options{})
			if err != nil {
				t.Fatal(err)
			}
			list, err = s2.List()
			if err != nil || len(list) != 1 || list[0].ID != "b" {
				t.Fatalf("after reopen: %v, %v", list, err)
			}
		})
	}
}

func TestPersistentStoreLocksOthersOut(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	s, err := Open(path, Options{Persistent: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	other, err := Open(path, Options{LockTimeout: 100 * time.Millisecond})
	if err == nil {
		_, err = other.List()
	}
	if !errdefs.IsUnavailable(err) {
		t.Fatalf("second opener = %v, want Unavailable", err)
	}
}

func TestPutWithSlot(t *testing.T) {
	s, err := Open(filepath.Join(t.TempDir(), "state.db"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i, id := range []string{"a", "b", "c"} {
		sb := &Sandbox{ID: id}
		if err := s.PutWithSlot(sb, 3); err != nil {
			t.Fatal(err)
		}
		if sb.Net.Slot != i {
			t.Fatalf("%s got slot %d, want %d", id, sb.Net.Slot, i)
		}
	}
	if err := s.PutWithSlot(&Sandbox{ID: "d"}, 3); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("fourth slot of three = %v", err)
	}
	// A freed slot is reused; records without a network hold none.
	testutil.Check(t, s.Delete("b"))
	testutil.Check(t, s.Put(&Sandbox{ID: "plain"}))
	sb := &Sandbox{ID: "e"}
	if err := s.PutWithSlot(sb, 3); err != nil || sb.Net.Slot != 1 {
		t.Fatalf("reuse: slot %+v, %v", sb.Net, err)
	}
	got, _ := s.Get("e")
	if got.Net == nil || got.Net.Slot != 1 {
		t.Fatalf("stored record %+v", got.Net)
	}
}

func TestRename(t *testing.T) {
	s, err := Open(filepath.Join(t.TempDir(), "state.db"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	testutil.Check(t, s.Put(&Sandbox{ID: "old", Status: StatusParked}))
	testutil.Check(t, s.Put(&Sandbox{ID: "taken"}))
	if err := s.Rename("old", &Sandbox{ID: "taken"}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("rename onto an existing id = %v", err)
	}
	if err := s.Rename("missing", &Sandbox{ID: "x"}); !errdefs.IsNotFound(err) {
		t.Fatalf("rename of a missing id = %v", err)
	}
	if err := s.Rename("old", &Sandbox{ID: "new", Status: StatusStarting}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get("old"); !errdefs.IsNotFound(err) {
		t.Fatalf("old id still there: %v", err)
	}
	if sb, err := s.Get("new"); err != nil || sb.Status != StatusStarting {
		t.Fatalf("new = %+v, %v", sb, err)
	}
}
