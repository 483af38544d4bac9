package server

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/apikey"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
)

// Keys are issued, listed without the key and revoked over the API; the
// store on disk has their hashes only.
func TestE2BKeys(t *testing.T) {
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, nil)
	ctx := context.Background()
	k, err := d.tcp.CreateE2BKey(ctx, "ci")
	if err != nil {
		t.Fatal(err)
	}
	if !apikey.Valid(k.Key) || k.Name != "ci" || !strings.HasPrefix(k.Hint, "e2b_") {
		t.Fatalf("created %+v", k)
	}
	list, err := d.unix.ListE2BKeys(ctx)
	if err != nil || len(list) != 1 || list[0].ID != k.ID || list[0].Key != "" {
		t.Fatalf("list = %+v, %v", list, err)
	}
	b, err := os.ReadFile(filepath.Join(d.data, KeysFile))
	if err != nil || strings.Contains(string(b), k.Key[4:]) {
		t.Fatalf("key file: %v (holds the key: %v)", err, strings.Contains(string(b), k.Key[4:]))
	}
	if err := d.tcp.RevokeE2BKey(ctx, k.ID); err != nil {
		t.Fatal(err)
	}
	if err := d.tcp.RevokeE2BKey(ctx, k.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("revoke twice = %v", err)
	}
	if code, _ := d.call(t, "GET", "/v1/e2b/keys", "", nil); code != 401 {
		t.Fatalf("list without a token: %d", code)
	}
}
