package hub

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/authn"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

// TestRealRegistry pushes to and pulls from a real registry, Debian's
// docker-registry (the CNCF distribution registry 2.8) that the test
// starts on loopback with a self-signed certificate and htpasswd auth,
// not the in-memory registry of the other tests.
func TestRealRegistry(t *testing.T) {
	ctx := context.Background()
	reg := testutil.StartRegistryWith(t, testutil.RegistryOptions{TLS: true, Auth: true})
	ca, err := os.ReadFile(reg.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	good := Remote{Username: reg.User, Password: reg.Password, CAPEM: ca}
	src, dst := newWorld(t), newWorld(t)
	b := makeBoot(t)
	sn := src.makeSnapshot(t, "py", b, 64)
	ref := reg.Addr + "/forkd/py:v1"

	// Refused with the reason, and nothing sent: wrong password, no
	// credentials, a CA not trusted, plain HTTP to a TLS registry.
	refusals := []struct {
		name  string
		rm    Remote
		is    func(error) bool
		words string
	}{
		{"wrong password", Remote{Username: reg.User, Password: "not-it", CAPEM: ca}, errdefs.IsUnauthenticated, `refused user "forkd"`},
		{"no credentials", Remote{CAPEM: ca, Keychain: noKeychain{}}, errdefs.IsUnauthenticated, "wants credentials"},
		{"untrusted CA", Remote{Username: reg.User, Password: reg.Password}, errdefs.IsFailedPrecondition, "--ca-file"},
	}
	for _, c := range refusals {
		_, err := src.hub.Push(ctx, PushSpec{Tag: "py", Ref: ref, Remote: c.rm})
		t.Logf("push, %s: %v", c.name, err)
		if err == nil || !c.is(err) || !strings.Contains(err.Error(), c.words) {
			t.Errorf("push, %s: %v; want a refusal that names %s", c.name, err, c.words)
		}
		_, err = dst.hub.Pull(ctx, PullSpec{Ref: ref, Remote: c.rm})
		if err == nil || !c.is(err) {
			t.Errorf("pull, %s: %v", c.name, err)
		}
	}
	if n, _ := reg.Blobs(t); n != 0 {
		t.Fatalf("refused pushes left %d blobs in the registry", n)
	}

	res, err := src.hub.Push(ctx, PushSpec{Tag: "py", Ref: ref, Remote: good})
	if err != nil {
		t.Fatal(err)
	}
	n1, size1 := reg.Blobs(t)
	t.Logf("push: %d blobs, %d bytes sent (wire %d), registry %d blobs of %d bytes", res.Blobs, res.Moved, res.NetSent, n1, size1)

	pres, err := dst.hub.Pull(ctx, PullSpec{Ref: reg.Addr + "/forkd/py@" + res.Digest, Tag: "pulled", Remote: good})
	if err != nil {
		t.Fatal(err)
	}
	got, err := dst.store.Get("pulled")
	if err != nil {
		t.Fatal(err)
	}
	if pres.Digest != res.Digest || got.Origin == nil || got.Origin.Digest != res.Digest {
		t.Fatalf("pulled %+v, origin %+v; pushed %s", pres, got.Origin, res.Digest)
	}
	equalFiles(t, sn.MemoryPath(), got.MemoryPath())
	equalFiles(t, sn.Rootfs.Path, got.Rootfs.Path)
	if err := got.Verify(); err != nil {
		t.Fatal(err)
	}

	// A second snapshot of the same image: the registry gains its memory
	// and state, not the root filesystem, kernel or initramfs again.
	src.makeSnapshot(t, "py2", b, 64)
	res2, err := src.hub.Push(ctx, PushSpec{Tag: "py2", Ref: reg.Addr + "/forkd/py:v2", Remote: good})
	if err != nil {
		t.Fatal(err)
	}
	n2, size2 := reg.Blobs(t)
	var boot int64
	for _, f := range res2.Files {
		switch f.Name {
		case "rootfs", "kernel", "initrd":
			if f.Done != 0 {
				t.Errorf("second snapshot of the image sent its %s again (%d bytes)", f.Name, f.Done)
			}
			boot += f.Total
		}
	}
	// The registry stores manifests as blobs too: allow for them.
	if most := res2.BlobBytes - boot + 64<<10; size2-size1 > most || res2.NetSent > most {
		t.Errorf("second push: registry grew %d bytes, %d on the wire, of %d of blobs (%d boot files)", size2-size1, res2.NetSent, res2.BlobBytes, boot)
	}
	t.Logf("second push: %d bytes sent (wire %d) of %d; registry +%d blobs, +%d bytes", res2.Moved, res2.NetSent, res2.BlobBytes, n2-n1, size2-size1)
}

// noKeychain has no credentials for any registry.
type noKeychain struct{}

func (noKeychain) Resolve(authn.Resource) (authn.Authenticator, error) { return authn.Anonymous, nil }
