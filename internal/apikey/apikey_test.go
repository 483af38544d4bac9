package apikey_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/apikey"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

func TestKeys(t *testing.T) {
	path := filepath.Join(t.TempDir(), "e2b-keys.json")
	s, err := apikey.Open(path)
	testutil.Check(t, err)
	key, k, err := s.Create("ci")
	testutil.Check(t, err)
	if !apikey.Valid(key) || len(key) != 44 || !strings.HasPrefix(k.Hint, key[:8]) || k.Name != "ci" {
		t.Fatalf("key %q, %+v", key, k)
	}
	st, err := os.Stat(path)
	testutil.Check(t, err)
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("key file mode %v", st.Mode())
	}
	b, _ := os.ReadFile(path)
	if strings.Contains(string(b), key[4:]) {
		t.Fatal("the key itself is in the file")
	}
	if got, ok := s.Check(key); !ok || got.ID != k.ID {
		t.Fatalf("check = %+v %v", got, ok)
	}
	for _, bad := range []string{"", key[:43], key + "0", strings.ToUpper(key), "e2b_" + strings.Repeat("0", 40)} {
		if _, ok := s.Check(bad); ok {
			t.Fatalf("%q accepted", bad)
		}
	}
	// Another process's store sees the key, then its revocation.
	other, err := apikey.Open(path)
	testutil.Check(t, err)
	if _, ok := other.Check(key); !ok {
		t.Fatal("a second store does not see the key")
	}
	key2, _, err := s.Create("")
	testutil.Check(t, err)
	testutil.Check(t, other.Revoke(k.ID))
	if _, ok := s.Check(key); ok {
		t.Fatal("revoked key still accepted")
	}
	if _, ok := s.Check(key2); !ok {
		t.Fatal("the other key went with the revoked one")
	}
	if err := s.Revoke(k.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("revoke twice = %v", err)
	}
	l, err := s.List()
	if err != nil || len(l) != 1 {
		t.Fatalf("list = %+v, %v", l, err)
	}
	testutil.Check(t, os.Chmod(path, 0o644))
	if _, err := apikey.Open(path); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("open of a readable key file = %v", err)
	}
}
