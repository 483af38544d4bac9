package hub

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/forkd/forkd/internal/errdefs"
)

// pushed is a snapshot pushed to a test registry, with its manifest and
// config as the registry has them.
type pushed struct {
	reg *testRegistry
	ref string
	m   v1.Manifest
	cfg ArtifactConfig
}

func pushOne(t *testing.T) (*pushed, *world) {
	t.Helper()
	reg := newRegistry(t)
	src := newWorld(t)
	src.makeSnapshot(t, "py", makeBoot(t), 32)
	p := &pushed{reg: reg, ref: reg.host + "/forkd/py:v1"}
	if _, err := src.hub.Push(context.Background(), PushSpec{Tag: "py", Ref: p.ref, Remote: plain}); err != nil {
		t.Fatal(err)
	}
	g := p.dial(t)
	raw, _, err := g.manifest(context.Background(), "v1", 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &p.m); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := g.blob(context.Background(), p.m.Config.Digest.String(), p.m.Config.Size, &buf); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(buf.Bytes(), &p.cfg); err != nil {
		t.Fatal(err)
	}
	return p, src
}

func (p *pushed) dial(t *testing.T) *registry {
	t.Helper()
	g, err := dial(context.Background(), p.ref, plain, true)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// craft pushes an edited copy of the artifact under tag and returns its
// reference. edit may change the manifest and the config.
func (p *pushed) craft(t *testing.T, tag string, edit func(m *v1.Manifest, c *ArtifactConfig)) string {
	t.Helper()
	m, c := p.m, p.cfg
	m.Annotations = map[string]string{}
	for k, v := range p.m.Annotations {
		m.Annotations[k] = v
	}
	m.Layers = append([]v1.Descriptor(nil), p.m.Layers...)
	for i := range m.Layers {
		a := map[string]string{}
		for k, v := range m.Layers[i].Annotations {
			a[k] = v
		}
		m.Layers[i].Annotations = a
	}
	c.Memory.Chunks = append([]Chunk(nil), p.cfg.Memory.Chunks...)
	edit(&m, &c)
	g := p.dial(t)
	ctx := context.Background()
	cb, _ := json.Marshal(c)
	d := digestOf(cb)
	if err := g.put(ctx, blob{digest: d, size: int64(len(cb)), mediaType: ConfigType, data: cb}); err != nil {
		t.Fatal(err)
	}
	m.Config.Digest, _ = v1.NewHash(d)
	m.Config.Size = int64(len(cb))
	raw, _ := json.Marshal(m)
	if err := g.putManifest(ctx, raw, digestOf(raw), tag); err != nil {
		t.Fatal(err)
	}
	return p.reg.host + "/forkd/py:" + tag
}

// assertNothingLeft checks that a refused pull left no snapshot, staging
// directory, cached blob or boot file behind.
func assertNothingLeft(t *testing.T, w *world) {
	t.Helper()
	if l, _ := w.store.List(); len(l) != 0 {
		t.Errorf("snapshots left: %v", l[0].Tag)
	}
	for _, d := range []string{w.store.Root(), w.hub.cache.dir, filepath.Join(w.hub.content.dir, "sha256")} {
		ents, _ := os.ReadDir(d)
		if len(ents) != 0 {
			t.Errorf("%s keeps %s", d, ents[0].Name())
		}
	}
}

func TestPullRefusesHostileArtifacts(t *testing.T) {
	p, _ := pushOne(t)
	memChunk := p.cfg.Memory.Chunks[0]
	cases := []struct {
		name string
		ref  func(t *testing.T) string
		want string
	}{
		{"tampered blob", func(t *testing.T) string {
			p.reg.setTamper(func(path string, body []byte) []byte {
				if strings.HasSuffix(path, "/blobs/"+memChunk.Digest) && len(body) > 10 {
					body = append([]byte(nil), body...)
					body[len(body)/2] ^= 0xff
				}
				return body
			})
			return p.ref
		}, "does not match its digest"},
		{"manifest of the wrong digest", func(t *testing.T) string {
			// Asked for by digest, the registry answers with another.
			orig := p.reg.host + "/forkd/py@" + digestOf(mustJSON(t, p.m))
			p.reg.setTamper(func(path string, body []byte) []byte {
				if strings.Contains(path, "/manifests/sha256:") {
					var m v1.Manifest
					_ = json.Unmarshal(body, &m)
					m.Annotations["x"] = "y"
					return mustJSON(t, m)
				}
				return body
			})
			return orig
		}, "does not match its digest"},
		{"config of the wrong digest", func(t *testing.T) string {
			p.reg.setTamper(func(path string, body []byte) []byte {
				if strings.HasSuffix(path, "/blobs/"+p.m.Config.Digest.String()) {
					return bytes.Replace(body, []byte(`"memory_mib":32`), []byte(`"memory_mib":64`), 1)
				}
				return body
			})
			return p.ref
		}, "does not match its digest"},
		{"oversize manifest", func(t *testing.T) string {
			return p.craft(t, "huge", func(m *v1.Manifest, _ *ArtifactConfig) {
				m.Annotations["padding"] = strings.Repeat("x", 5<<20)
			})
		}, "limit"},
		{"layer titled with a path", func(t *testing.T) string {
			return p.craft(t, "path", func(m *v1.Manifest, _ *ArtifactConfig) {
				m.Layers[1].Annotations[AnnotationTitle] = "../../../../etc/cron.d/x"
			})
		}, "path tricks"},
		{"chunk outside the memory", func(t *testing.T) string {
			return p.craft(t, "outside", func(_ *v1.Manifest, c *ArtifactConfig) {
				c.Memory.Chunks[len(c.Memory.Chunks)-1].Index = 1 << 40
			})
		}, "window"},
		{"memory larger than allowed", func(t *testing.T) string {
			return p.craft(t, "ram", func(_ *v1.Manifest, c *ArtifactConfig) {
				c.MemoryMiB, c.Memory.Bytes = 1<<30, 1<<50
			})
		}, "memory_mib"},
		{"tag with a path", func(t *testing.T) string {
			return p.craft(t, "tagpath", func(_ *v1.Manifest, c *ArtifactConfig) { c.Tag = "../../x" })
		}, "tag"},
		{"chunk claiming more than it holds", func(t *testing.T) string {
			return p.craft(t, "pages", func(_ *v1.Manifest, c *ArtifactConfig) { c.Memory.Chunks[0].Pages++ })
		}, "restores"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			defer p.reg.setTamper(nil)
			dst := newWorld(t)
			ref := c.ref(t)
			_, err := dst.hub.Pull(context.Background(), PullSpec{Ref: ref, Remote: plain})
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("pull of %s: %v; want an error saying %q", ref, err, c.want)
			}
			if !errdefs.IsInvalidArgument(err) {
				t.Errorf("error class %v, want invalid argument: %v", errdefs.Code(err), err)
			}
			t.Logf("refused: %v", err)
			assertNothingLeft(t, dst)
		})
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestUnpackRefusesPathTricks(t *testing.T) {
	for name, entry := range map[string]*tar.Header{
		"parent dir":     {Name: "../../etc/passwd", Typeflag: tar.TypeReg, Size: 1, Mode: 0o644},
		"absolute":       {Name: "/etc/passwd", Typeflag: tar.TypeReg, Size: 1, Mode: 0o644},
		"symlink":        {Name: "blobs/sha256/" + strings.Repeat("a", 64), Typeflag: tar.TypeSymlink, Linkname: "/etc/shadow", Mode: 0o777},
		"hard link":      {Name: "index.json", Typeflag: tar.TypeLink, Linkname: "/etc/shadow"},
		"dotted blob":    {Name: "blobs/sha256/../../x", Typeflag: tar.TypeReg, Size: 1, Mode: 0o644},
		"device":         {Name: "oci-layout", Typeflag: tar.TypeChar, Devmajor: 1, Devminor: 3},
		"other file":     {Name: "run.sh", Typeflag: tar.TypeReg, Size: 1, Mode: 0o755},
		"blob uppercase": {Name: "blobs/sha256/" + strings.Repeat("A", 64), Typeflag: tar.TypeReg, Size: 1, Mode: 0o644},
	} {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "x.tar")
			f, err := os.Create(path)
			if err != nil {
				t.Fatal(err)
			}
			tw := tar.NewWriter(f)
			_ = tw.WriteHeader(&tar.Header{Name: layoutFile, Typeflag: tar.TypeReg, Size: int64(len(layoutVersion)), Mode: 0o644, ModTime: time.Unix(0, 0)})
			_, _ = tw.Write([]byte(layoutVersion))
			if err := tw.WriteHeader(entry); err != nil {
				t.Fatal(err)
			}
			if entry.Size > 0 {
				_, _ = tw.Write([]byte("x"))
			}
			tw.Close()
			f.Close()
			w := newWorld(t)
			_, err = w.hub.Unpack(context.Background(), UnpackSpec{Path: path})
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("unpack: %v, want invalid argument", err)
			}
			t.Logf("refused: %v", err)
			assertNothingLeft(t, w)
		})
	}
}

func TestPullResumesFromVerifiedBlobs(t *testing.T) {
	p, _ := pushOne(t)
	dst := newWorld(t)
	total := int64(len(p.m.Layers))
	p.reg.stalling.Store(true)
	p.reg.stallAfter.Store(int64(p.reg.getCount()) + 1 + 3) // the config and three blobs, then it hangs
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := dst.hub.Pull(ctx, PullSpec{Ref: p.ref, Remote: plain})
		errc <- err
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ents, _ := os.ReadDir(dst.hub.cache.dir)
		n := 0
		for _, e := range ents {
			if !strings.HasPrefix(e.Name(), ".") {
				n++
			}
		}
		if n >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the pull never cached three blobs")
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel() // killed half-way
	if err := <-errc; err == nil {
		t.Fatal("the cut pull succeeded")
	}
	if _, err := dst.store.Get("py"); !errdefs.IsNotFound(err) {
		t.Fatalf("a cut pull left its tag: %v", err)
	}
	// What the cut pull left verified in the cache. (Its requests still
	// on their way to the registry may be served after this; they are for
	// blobs it does not hold, so the check below counts digests, not GETs.)
	cachedBefore := map[string]int64{}
	ents, _ := os.ReadDir(dst.hub.cache.dir)
	for _, e := range ents {
		if info, err := e.Info(); err == nil && !strings.HasPrefix(e.Name(), ".") {
			cachedBefore["sha256:"+e.Name()] = info.Size()
		}
	}
	if len(cachedBefore) < 3 {
		t.Fatalf("the cut pull left %d verified blobs in the cache, want 3 or more", len(cachedBefore))
	}
	p.reg.unstall()
	before := p.reg.getCount()
	res, err := dst.hub.Pull(context.Background(), PullSpec{Ref: p.ref, Remote: plain})
	if err != nil {
		t.Fatal(err)
	}
	var wantCached int64
	for _, size := range cachedBefore {
		wantCached += size
	}
	layers := map[string]bool{}
	for _, d := range p.reg.getsSince(before) {
		if d == p.m.Config.Digest.String() {
			continue
		}
		if _, ok := cachedBefore[d]; ok {
			t.Errorf("resumed pull fetched %s again; it was in the cache", d)
		}
		layers[d] = true
	}
	fetched := int64(len(layers))
	if res.Cached != wantCached || fetched > total-int64(len(cachedBefore)) {
		t.Fatalf("resumed pull fetched %d of %d blobs, %d bytes counted cached; the cache held %d blobs, %d bytes", fetched, total, res.Cached, len(cachedBefore), wantCached)
	}
	t.Logf("resumed: %d of %d blobs fetched, %d bytes verified in the cache", fetched, total, res.Cached)
}
