package hub

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	ggcrregistry "github.com/google/go-containerregistry/pkg/registry"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/memimage"
	"github.com/forkd/forkd/internal/snapshot"
)

// world is a data dir with a snapshot store and a hub.
type world struct {
	dir   string
	store *snapshot.Store
	hub   *Hub
}

var testHost = Host{Backend: "qemu", Version: "7.2.22", Accelerator: "tcg", CPU: CPU{Vendor: "AuthenticAMD", Model: "test", Flags: []string{"sse2"}}}

func newWorld(t *testing.T) *world {
	t.Helper()
	dir := t.TempDir()
	st, err := snapshot.Open(filepath.Join(dir, "snapshots"))
	if err != nil {
		t.Fatal(err)
	}
	h, err := New(Config{Dir: filepath.Join(dir, "hub"), ContentDir: filepath.Join(dir, "content"), Store: st,
		Host: func(context.Context) (Host, error) { return testHost, nil }})
	if err != nil {
		t.Fatal(err)
	}
	return &world{dir: dir, store: st, hub: h}
}

// boot are fake boot files: a kernel, an initramfs, a sparse root
// filesystem.
type boot struct{ kernel, initrd, rootfs string }

func randBytes(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

func writeFile(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func sha(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func makeBoot(t *testing.T) boot {
	t.Helper()
	dir := t.TempDir()
	b := boot{filepath.Join(dir, "vmlinuz"), filepath.Join(dir, "initrd"), filepath.Join(dir, "rootfs.ext4")}
	writeFile(t, b.kernel, randBytes(1<<20))
	writeFile(t, b.initrd, randBytes(256<<10))
	f, err := os.Create(b.rootfs)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(24 << 20); err != nil {
		t.Fatal(err)
	}
	// Data in a few places; the rest holes.
	for _, off := range []int64{0, 3 << 20, 9<<20 + 4096*7, 20 << 20} {
		if _, err := f.WriteAt(randBytes(600<<10), off); err != nil {
			t.Fatal(err)
		}
	}
	return b
}

// makeSnapshot writes a boot snapshot of memMiB MiB whose memory holds
// random pages, pages of zeros, and pages equal to blocks of the boot
// files.
func (w *world) makeSnapshot(t *testing.T, tag string, b boot, memMiB int) *snapshot.Snapshot {
	t.Helper()
	wr, err := w.store.Create(tag)
	if err != nil {
		t.Fatal(err)
	}
	mem, err := os.OpenFile(wr.MemoryPath(), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := mem.Truncate(int64(memMiB) << 20); err != nil {
		t.Fatal(err)
	}
	rootfs, _ := os.ReadFile(b.rootfs)
	kernel, _ := os.ReadFile(b.kernel)
	writes := []struct {
		off  int64
		data []byte
	}{
		{0, randBytes(300 << 10)},
		{1 << 20, make([]byte, 64<<10)},                           // zeros, allocated
		{2 << 20, rootfs[3<<20 : 3<<20+128<<10]},                  // page cache of the rootfs
		{5<<20 + 4096, kernel[1536 : 1536+64<<10]},                // the kernel, at a 512-byte offset
		{int64(memMiB)<<20 - 40<<10, randBytes(40 << 10)},         // the last window
		{9 << 20, bytes.Repeat([]byte("forkd warm page "), 8192)}, // compressible
	}
	for _, wr := range writes {
		if _, err := mem.WriteAt(wr.data, wr.off); err != nil {
			t.Fatal(err)
		}
	}
	mem.Close()
	writeFile(t, wr.StatePath(), randBytes(70<<10))
	sum := sha256.Sum256([]byte(tag + time.Now().String()))
	md := snapshot.Metadata{
		Backend: testHost.Backend, BackendVersion: testHost.Version, Accelerator: testHost.Accelerator,
		Machine: json.RawMessage(`{"machine":"microvm"}`), Image: "python",
		Kernel:    snapshot.FileRef{Path: b.kernel, SHA256: sha(t, b.kernel)},
		Initrd:    snapshot.FileRef{Path: b.initrd, SHA256: sha(t, b.initrd)},
		Rootfs:    snapshot.FileRef{Path: b.rootfs, SHA256: sha(t, b.rootfs)},
		MemoryMiB: memMiB, VCPUs: 1, Python: "/usr/bin/python3", Kind: snapshot.KindBoot,
		ContentHash: hex.EncodeToString(sum[:]),
	}
	sn, err := wr.Commit(md)
	if err != nil {
		t.Fatal(err)
	}
	return sn
}

// makeBranch writes a diff branch of parent whose layer changes a few
// pages.
func (w *world) makeBranch(t *testing.T, tag string, parent *snapshot.Snapshot) *snapshot.Snapshot {
	t.Helper()
	md := parent.Metadata
	md.Tag, md.Kind, md.Parent, md.ParentHash = tag, snapshot.KindBranch, parent.Tag, parent.ContentHash
	depth := 1
	if parent.Branch != nil {
		depth = parent.Branch.Depth + 1
	}
	md.Branch = &snapshot.BranchInfo{Mode: "diff", Source: "sb-aaaaaaaaaa", Depth: depth}
	md.MemoryBytes, md.StateBytes, md.Created = 0, 0, time.Time{}
	wr, err := w.store.CreateBranch(tag, md)
	if err != nil {
		t.Fatal(err)
	}
	l, err := os.OpenFile(wr.LayerPath(), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Truncate(int64(md.MemoryMiB) << 20); err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{8192, 7 << 20, 12<<20 + 4096} {
		if _, err := l.WriteAt(randBytes(3*4096), off); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := l.WriteAt(make([]byte, 4096), 0); err != nil { // a page zeroed by the child
		t.Fatal(err)
	}
	l.Close()
	if err := memimage.Materialize(parent.MemoryPath(), wr.LayerPath(), wr.MemoryPath()); err != nil {
		t.Fatal(err)
	}
	writeFile(t, wr.StatePath(), randBytes(70<<10))
	sum := sha256.Sum256([]byte(tag + time.Now().String()))
	md.ContentHash = hex.EncodeToString(sum[:])
	md.Writer = nil
	sn, err := wr.Commit(md)
	if err != nil {
		t.Fatal(err)
	}
	return sn
}

// testRegistry is an in-memory registry on loopback that counts what it
// is sent and serves, and can be told to misbehave.
type testRegistry struct {
	srv               *httptest.Server
	host              string
	blobPuts          atomic.Int64
	bytesIn, bytesOut atomic.Int64
	// tamper, if set, rewrites a response body by request path.
	tamper atomic.Pointer[func(path string, body []byte) []byte]
	// While stalling, blob GETs after the first stallAfter wait for
	// release.
	stalling   atomic.Bool
	stallAfter atomic.Int64
	stall      chan struct{}
	release    sync.Once
	// gets is the digest of every blob GET, in the order they came (its
	// length counts them).
	getsMu sync.Mutex
	gets   []string
}

// getsSince returns the digests of the blob GETs after the first n.
func (r *testRegistry) getsSince(n int) []string {
	r.getsMu.Lock()
	defer r.getsMu.Unlock()
	return append([]string(nil), r.gets[n:]...)
}

// getCount returns how many blob GETs the registry has had.
func (r *testRegistry) getCount() int {
	r.getsMu.Lock()
	defer r.getsMu.Unlock()
	return len(r.gets)
}

func (r *testRegistry) setTamper(f func(path string, body []byte) []byte) {
	if f == nil {
		r.tamper.Store(nil)
		return
	}
	r.tamper.Store(&f)
}

func (r *testRegistry) unstall() { r.release.Do(func() { close(r.stall) }) }

func newRegistry(t *testing.T) *testRegistry {
	t.Helper()
	r := &testRegistry{stall: make(chan struct{})}
	h := ggcrregistry.New(ggcrregistry.Logger(log.New(io.Discard, "", 0)))
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Body != nil {
			b, _ := readAll(req)
			r.bytesIn.Add(int64(len(b)))
			req.Body = nopCloser{bytes.NewReader(b)}
		}
		isBlobGet := req.Method == http.MethodGet && strings.Contains(req.URL.Path, "/blobs/sha256:")
		if isBlobGet {
			r.getsMu.Lock()
			r.gets = append(r.gets, req.URL.Path[strings.LastIndex(req.URL.Path, "/")+1:])
			n := int64(len(r.gets))
			r.getsMu.Unlock()
			if r.stalling.Load() && n > r.stallAfter.Load() {
				<-r.stall
			}
		}
		if (req.Method == http.MethodPut || req.Method == http.MethodPatch) && strings.Contains(req.URL.Path, "/blobs/uploads/") && req.Method == http.MethodPut {
			r.blobPuts.Add(1)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		body := rec.Body.Bytes()
		if f := r.tamper.Load(); f != nil {
			body = (*f)(req.URL.Path, body)
		}
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		if req.Method != http.MethodHead {
			w.Header().Del("Content-Length")
		}
		w.WriteHeader(rec.Code)
		n, _ := w.Write(body)
		r.bytesOut.Add(int64(n))
	}))
	t.Cleanup(func() {
		r.unstall()
		r.srv.Close()
	})
	r.host = strings.TrimPrefix(r.srv.URL, "http://")
	return r
}

type nopCloser struct{ *bytes.Reader }

func (nopCloser) Close() error { return nil }

func readAll(req *http.Request) ([]byte, error) {
	defer req.Body.Close()
	var b bytes.Buffer
	_, err := b.ReadFrom(req.Body)
	return b.Bytes(), err
}

var plain = Remote{Insecure: true}

func equalFiles(t *testing.T, a, b string) {
	t.Helper()
	x, err := os.ReadFile(a)
	if err != nil {
		t.Fatal(err)
	}
	y, err := os.ReadFile(b)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(x, y) {
		t.Fatalf("%s and %s differ", a, b)
	}
}

func TestPushPullRoundTrip(t *testing.T) {
	ctx := context.Background()
	reg := newRegistry(t)
	src, dst := newWorld(t), newWorld(t)
	b := makeBoot(t)
	sn := src.makeSnapshot(t, "py", b, 64)
	ref := reg.host + "/forkd/py:v1"
	res, err := src.hub.Push(ctx, PushSpec{Tag: "py", Ref: ref, Remote: plain})
	if err != nil {
		t.Fatal(err)
	}
	if res.Moved == 0 || res.Skipped != 0 || res.Digest == "" {
		t.Fatalf("first push: %+v", res)
	}
	t.Logf("push: %d blobs, %d bytes sent of RAM %d (data %d)", res.Blobs, res.Moved, res.MemoryBytes, res.MemoryData)

	pres, err := dst.hub.Pull(ctx, PullSpec{Ref: ref, Remote: plain})
	if err != nil {
		t.Fatal(err)
	}
	if pres.Tag != "py" || pres.Digest != res.Digest {
		t.Fatalf("pull: %+v", pres)
	}
	got, err := dst.store.Get("py")
	if err != nil {
		t.Fatal(err)
	}
	equalFiles(t, sn.MemoryPath(), got.MemoryPath())
	equalFiles(t, sn.StatePath(), got.StatePath())
	equalFiles(t, sn.Rootfs.Path, got.Rootfs.Path)
	equalFiles(t, sn.Kernel.Path, got.Kernel.Path)
	if got.Origin == nil || got.Origin.Digest != res.Digest || got.Origin.Ref != ref || got.ContentHash != sn.ContentHash {
		t.Fatalf("pulled metadata: %+v", got.Metadata)
	}
	if err := got.Verify(); err != nil {
		t.Fatal(err)
	}
	// The pulled memory keeps its holes (and loses its pages of zeros).
	if a, _ := memimage.Allocated(got.MemoryPath()); a > 2<<20 {
		t.Errorf("pulled memory allocates %d bytes", a)
	}
	// Nothing of the pull stays in the blob cache.
	if ents, _ := os.ReadDir(dst.hub.cache.dir); len(ents) != 0 {
		t.Errorf("blob cache keeps %d entries after a pull", len(ents))
	}

	// Pushed again: nothing sent.
	res2, err := src.hub.Push(ctx, PushSpec{Tag: "py", Ref: ref, Remote: plain})
	if err != nil {
		t.Fatal(err)
	}
	if res2.Moved != 0 || res2.Digest != res.Digest {
		t.Fatalf("second push sent %d bytes, digest %s (was %s)", res2.Moved, res2.Digest, res.Digest)
	}
	// Pulled again: here already.
	pres2, err := dst.hub.Pull(ctx, PullSpec{Ref: ref, Remote: plain})
	if err != nil || pres2.Tag != "py" || pres2.Moved != 0 {
		t.Fatalf("second pull: %+v, %v", pres2, err)
	}

	// Another snapshot of the same image: its root filesystem and boot
	// files are not sent again, and a pull reuses the ones it has.
	src.makeSnapshot(t, "py2", b, 64)
	res3, err := src.hub.Push(ctx, PushSpec{Tag: "py2", Ref: reg.host + "/forkd/py:v2", Remote: plain})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range res3.Files {
		if (f.Name == "rootfs" || f.Name == "kernel" || f.Name == "initrd") && f.Done != 0 {
			t.Errorf("second snapshot of the image sent its %s again (%d bytes)", f.Name, f.Done)
		}
	}
	pres3, err := dst.hub.Pull(ctx, PullSpec{Ref: reg.host + "/forkd/py:v2", Remote: plain})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range pres3.Files {
		if f.Name == "rootfs" || f.Name == "kernel" {
			t.Errorf("pull fetched %s again: %+v", f.Name, f)
		}
	}
	py2, _ := dst.store.Get("py2")
	py1, _ := dst.store.Get("py")
	if py2.Rootfs.Path != py1.Rootfs.Path {
		t.Errorf("two pulled snapshots of one image have two root filesystems: %s, %s", py1.Rootfs.Path, py2.Rootfs.Path)
	}
	// rmi of one keeps what the other uses; of both, removes it.
	if err := dst.store.Remove("py"); err != nil {
		t.Fatal(err)
	}
	if _, err := dst.hub.Sweep(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(py2.Rootfs.Path); err != nil {
		t.Fatalf("rmi of py removed py2's root filesystem: %v", err)
	}
	if err := dst.store.Remove("py2"); err != nil {
		t.Fatal(err)
	}
	removed, err := dst.hub.Sweep()
	if err != nil || len(removed) != 3 {
		t.Fatalf("sweep after the last rmi removed %v, %v; want kernel, initrd, rootfs", removed, err)
	}
}

func TestPullChainFetchesOnlyLinks(t *testing.T) {
	ctx := context.Background()
	reg := newRegistry(t)
	src, dst := newWorld(t), newWorld(t)
	base := src.makeSnapshot(t, "base", makeBoot(t), 32)
	l1 := src.makeBranch(t, "l1", base)
	l2 := src.makeBranch(t, "l2", l1)
	bres, err := src.hub.Push(ctx, PushSpec{Tag: "base", Ref: reg.host + "/s:base", Remote: plain})
	if err != nil {
		t.Fatal(err)
	}
	res, err := src.hub.Push(ctx, PushSpec{Tag: "l2", Ref: reg.host + "/s:l2", Remote: plain})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Links) != 3 {
		t.Fatalf("push of a depth-2 chain: links %+v", res.Links)
	}
	if _, err := dst.hub.Pull(ctx, PullSpec{Ref: reg.host + "/s:base", Remote: plain}); err != nil {
		t.Fatal(err)
	}
	pres, err := dst.hub.Pull(ctx, PullSpec{Ref: reg.host + "/s:l2", Remote: plain})
	if err != nil {
		t.Fatal(err)
	}
	var links int64
	for _, f := range pres.Files {
		if strings.Contains(f.Name, "rootfs") || strings.Contains(f.Name, "kernel") {
			t.Errorf("chain pull fetched %s", f.Name)
		}
		links += f.Done
	}
	if len(pres.Links) != 3 || pres.Links[0].New || !pres.Links[1].New || !pres.Links[2].New {
		t.Fatalf("links: %+v", pres.Links)
	}
	if pres.Moved != links || pres.Moved >= bres.Moved/4 {
		t.Errorf("chain pull moved %d bytes (files %d), the base alone %d", pres.Moved, links, bres.Moved)
	}
	t.Logf("chain pull moved %d bytes for two links; the base is %d", links, bres.Moved)
	got, err := dst.store.Get("l2")
	if err != nil {
		t.Fatal(err)
	}
	equalFiles(t, l2.MemoryPath(), got.MemoryPath())
	p, err := dst.store.Get(got.Parent)
	if err != nil || p.ContentHash != l1.ContentHash {
		t.Fatalf("parent of pulled l2: %v %v", p, err)
	}
	if anc, err := dst.store.Ancestors(got); err != nil || len(anc) != 2 {
		t.Fatalf("ancestors: %v %v", anc, err)
	}
}

func TestPackUnpack(t *testing.T) {
	ctx := context.Background()
	src, dst := newWorld(t), newWorld(t)
	base := src.makeSnapshot(t, "base", makeBoot(t), 32)
	l1 := src.makeBranch(t, "l1", base)
	file := filepath.Join(t.TempDir(), "l1.tar")
	if _, err := src.hub.Pack(ctx, PackSpec{Tag: "l1", Path: file}); err != nil {
		t.Fatal(err)
	}
	if _, err := src.hub.Pack(ctx, PackSpec{Tag: "l1", Path: file}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("pack over a file: %v", err)
	}
	res, err := dst.hub.Unpack(ctx, UnpackSpec{Path: file, Tag: "mine"})
	if err != nil {
		t.Fatal(err)
	}
	got, err := dst.store.Get("mine")
	if err != nil || res.Tag != "mine" {
		t.Fatal(err, res)
	}
	equalFiles(t, l1.MemoryPath(), got.MemoryPath())
}

func TestPullRefusesWhatCannotRestore(t *testing.T) {
	ctx := context.Background()
	reg := newRegistry(t)
	src, dst := newWorld(t), newWorld(t)
	src.makeSnapshot(t, "py", makeBoot(t), 32)
	ref := reg.host + "/forkd/py:v1"
	if _, err := src.hub.Push(ctx, PushSpec{Tag: "py", Ref: ref, Remote: plain}); err != nil {
		t.Fatal(err)
	}
	for name, host := range map[string]Host{
		"version":     {Backend: "qemu", Version: "8.0.0", Accelerator: "tcg"},
		"accelerator": {Backend: "qemu", Version: "7.2.1", Accelerator: "kvm"},
		"backend":     {Backend: "firecracker", Version: "7.2.1", Accelerator: "tcg"},
	} {
		dst.hub.cfg.Host = func(context.Context) (Host, error) { return host, nil }
		gets := reg.getCount()
		_, err := dst.hub.Pull(ctx, PullSpec{Ref: ref, Remote: plain})
		if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "cannot be restored here") {
			t.Errorf("%s: %v", name, err)
		}
		if n := reg.getCount() - gets; n != 1 {
			t.Errorf("%s: %d blobs fetched before the refusal; want 1 (the config)", name, n)
		}
	}
}
