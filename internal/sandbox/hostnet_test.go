package sandbox

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/forkd/forkd/internal/testutil"
)

// TestHostNetSkipsLeftNamespaces: a new data dir is not given an index
// whose claim is stale but whose namespaces are still on the host, nor one
// a live data dir holds; a data dir keeps its own index.
func TestHostNetSkipsLeftNamespaces(t *testing.T) {
	claims, nsDir := t.TempDir(), t.TempDir()
	oldClaims, oldNS := hostNetClaims, hostNetNSDir
	hostNetClaims, hostNetNSDir = claims, nsDir
	t.Cleanup(func() { hostNetClaims, hostNetNSDir = oldClaims, oldNS })

	live := t.TempDir()
	a, err := hostNetFor(live)
	testutil.Check(t, err)
	if a.Index != 0 || a.Prefix != "fk00" {
		t.Fatalf("first data dir got %+v", a)
	}
	// Index 1: claimed by a data dir that is gone, its namespace left.
	gone := filepath.Join(t.TempDir(), "gone")
	testutil.WriteFile(t, filepath.Join(claims, "1"), []byte(gone), 0o600)
	testutil.WriteFile(t, filepath.Join(nsDir, "fk01-3"), nil, 0o600)
	// Index 2: nothing claims it, but a namespace of its prefix is left.
	testutil.WriteFile(t, filepath.Join(nsDir, "fk02-0"), nil, 0o600)
	// Index 3: another prefix's names do not count.
	testutil.WriteFile(t, filepath.Join(nsDir, "fk030-0"), nil, 0o600)

	b, err := hostNetFor(t.TempDir())
	testutil.Check(t, err)
	if b.Index != 3 {
		t.Fatalf("second data dir got index %d, want 3 (0 live, 1 and 2 hold namespaces)", b.Index)
	}
	again, err := hostNetFor(live)
	testutil.Check(t, err)
	if again != a {
		t.Fatalf("the first data dir's share changed: %+v, was %+v", again, a)
	}
	// Once the namespaces are gone, the stale claim's index is free.
	testutil.Check(t, os.Remove(filepath.Join(nsDir, "fk01-3")))
	c, err := hostNetFor(t.TempDir())
	testutil.Check(t, err)
	if c.Index != 1 {
		t.Fatalf("third data dir got index %d, want 1", c.Index)
	}
}
