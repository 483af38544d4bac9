package server

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/testutil"
)

// fakeSnapshot commits a snapshot of made-up files (no VM made it) into
// the engine's store: enough to pack, not to restore.
func fakeSnapshot(t *testing.T, e *sandbox.Engine, tag string) {
	t.Helper()
	dir := t.TempDir()
	ref := func(name string, size int) snapshot.FileRef {
		b := []byte(strings.Repeat(name, size/len(name)+1))[:size]
		p := filepath.Join(dir, name)
		testutil.WriteFile(t, p, b, 0o644)
		s := sha256.Sum256(b)
		return snapshot.FileRef{Path: p, SHA256: hex.EncodeToString(s[:])}
	}
	w, err := e.Snapshots().Create(tag)
	testutil.Check(t, err)
	testutil.WriteFile(t, w.MemoryPath(), []byte(strings.Repeat("page", 1<<18)), 0o600) // 1 MiB
	testutil.WriteFile(t, w.StatePath(), []byte("device state"), 0o600)
	sum := sha256.Sum256([]byte(tag))
	_, err = w.Commit(snapshot.Metadata{
		Backend: "none", BackendVersion: "0", Accelerator: "none", Machine: json.RawMessage(`{}`),
		Image: "minimal", Kernel: ref("kernel", 8192), Initrd: ref("initrd", 8192), Rootfs: ref("rootfs", 1<<20),
		MemoryMiB: 1, VCPUs: 1, Kind: snapshot.KindBoot, ContentHash: hex.EncodeToString(sum[:]),
	})
	testutil.Check(t, err)
}

// TestHubRoutes: pack, unpack, push and pull answer 202 with an operation
// that carries the transfer; a daemon's pack and unpack paths stay inside
// its export and import directories; bad references and plain HTTP to a
// remote registry are refused before anything starts.
func TestHubRoutes(t *testing.T) {
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, nil)
	fakeSnapshot(t, d.e, "base")
	ctx := context.Background()
	exports, imports := filepath.Join(d.data, "exports"), filepath.Join(d.data, "imports")
	testutil.Check(t, os.MkdirAll(exports, 0o700))
	testutil.Check(t, os.MkdirAll(imports, 0o700))

	op, err := d.tcp.PackSnapshot(ctx, "base", apiv1.PackRequest{Path: "base.tar"})
	testutil.Check(t, err)
	if op.Kind != "pack" || op.ID == "" {
		t.Fatalf("pack: %+v", op)
	}
	op, err = d.tcp.WatchOperation(ctx, op.ID, 20*time.Millisecond, nil)
	testutil.Check(t, err)
	if op.Status != "succeeded" || op.Transfer == nil || op.Transfer.Digest == "" || op.Transfer.BlobBytes == 0 {
		t.Fatalf("pack ended %+v, transfer %+v", op, op.Transfer)
	}
	digest := op.Transfer.Digest
	if _, err := os.Stat(filepath.Join(exports, "base.tar")); err != nil {
		t.Fatalf("pack wrote no file in the export directory: %v", err)
	}

	// The file carried to another daemon's import directory unpacks there.
	d2 := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, nil)
	b, err := os.ReadFile(filepath.Join(exports, "base.tar"))
	testutil.Check(t, err)
	testutil.Check(t, os.MkdirAll(filepath.Join(d2.data, "imports"), 0o700))
	testutil.WriteFile(t, filepath.Join(d2.data, "imports", "base.tar"), b, 0o600)
	op, err = d2.tcp.UnpackSnapshot(ctx, apiv1.UnpackRequest{Path: "base.tar", Tag: "copy"})
	testutil.Check(t, err)
	op, err = d2.tcp.WatchOperation(ctx, op.ID, 20*time.Millisecond, nil)
	testutil.Check(t, err)
	if op.Status != "succeeded" || op.Snapshot != "copy" || op.Transfer == nil || op.Transfer.Digest != digest {
		t.Fatalf("unpack ended %+v %+v, error %+v", op, op.Transfer, op.Error)
	}
	if _, err := d2.e.Snapshots().Get("copy"); err != nil {
		t.Fatal(err)
	}

	// Outside the directories, through a symlink too: 400, nothing written.
	testutil.Check(t, os.Symlink("/etc", filepath.Join(exports, "etc")))
	testutil.Check(t, os.Symlink("/etc/passwd", filepath.Join(imports, "passwd.tar")))
	refused := []struct {
		method, path, body, words string
	}{
		{"POST", "/v1/snapshots/base/pack", `{"path":"../base.tar"}`, "outside the daemon's export directory"},
		{"POST", "/v1/snapshots/base/pack", `{"path":"/tmp/base.tar"}`, "outside the daemon's export directory"},
		{"POST", "/v1/snapshots/base/pack", `{"path":"etc/x.tar"}`, "outside the daemon's export directory"},
		{"POST", "/v1/snapshots/base/pack", `{"path":"base.tar"}`, "exists"},
		{"POST", "/v1/snapshots/unpack", `{"path":"../../etc/passwd"}`, "outside the daemon's import directory"},
		{"POST", "/v1/snapshots/unpack", `{"path":"passwd.tar"}`, "outside the daemon's import directory"},
		{"POST", "/v1/snapshots/pull", `{"ref":"registry.example.com/x:../y"}`, "reference"},
		{"POST", "/v1/snapshots/pull", `{"ref":"registry.example.com/x:v1","insecure":true}`, "loopback"},
		{"POST", "/v1/snapshots/base/push", `{"ref":"registry.example.com/x@sha256:` + strings.Repeat("a", 64) + `"}`, "tag"},
	}
	for _, c := range refused {
		code, b := d.call(t, c.method, c.path, testToken, strings.NewReader(c.body))
		if code != http.StatusBadRequest && code != http.StatusConflict || !strings.Contains(string(b), c.words) {
			t.Errorf("%s %s %s: %d %s; want a refusal saying %q", c.method, c.path, c.body, code, b, c.words)
		}
	}
	if code, b := d.call(t, "POST", "/v1/snapshots/nosuch/pack", testToken, strings.NewReader(`{"path":"n.tar"}`)); code != http.StatusNotFound {
		t.Errorf("pack of no snapshot: %d %s", code, b)
	}
	ents, _ := os.ReadDir(exports)
	if len(ents) != 2 {
		t.Errorf("the export directory holds %d entries, want base.tar and the link", len(ents))
	}
}
