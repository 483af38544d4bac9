package oci

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image/oci/ocitest"
	"github.com/forkd/forkd/internal/testutil"
)

func unpackRef(t *testing.T, ref string, o ApplyOptions) (string, error) {
	t.Helper()
	src, err := Open(context.Background(), ref, OpenOptions{})
	if err != nil {
		return "", err
	}
	tr, root, _ := newTree(t)
	return root, Unpack(context.Background(), src.Image, tr, o, nil)
}

func TestUnpackVerifiesDigests(t *testing.T) {
	good := layerTar(t, ent{name: "etc/motd", data: "good"})
	evil := layerTar(t, ent{name: "etc/motd", data: "evil"}, ent{name: "etc/extra", data: "planted"})
	img := ocitest.Image(t, ocitest.Layer(t, good))
	l, _ := img.Layers()
	digest, _ := l[0].Digest()

	dir := ocitest.Layout(t, img)
	if _, err := unpackRef(t, "oci:"+dir, ApplyOptions{}); err != nil {
		t.Fatalf("untampered layout: %v", err)
	}
	archive := filepath.Join(t.TempDir(), "image.tar")
	if err := tarball.WriteToFile(archive, name.MustParseReference("forkd.test/a:b"), img); err != nil {
		t.Fatal(err)
	}
	if root, err := unpackRef(t, "docker-archive:"+archive, ApplyOptions{}); err != nil {
		t.Fatalf("docker-archive: %v", err)
	} else if b, _ := os.ReadFile(filepath.Join(root, "etc/motd")); string(b) != "good" {
		t.Fatalf("docker-archive: etc/motd is %q", b)
	}

	// The same manifest, another (well-formed) layer blob under its digest.
	cz, err := ocitest.Layer(t, evil).Compressed()
	if err != nil {
		t.Fatal(err)
	}
	blob, _ := io.ReadAll(cz)
	if err := os.WriteFile(ocitest.Blob(dir, digest), blob, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = unpackRef(t, "oci:"+dir, ApplyOptions{})
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "layer "+digest.String()+" content does not match its digest") {
		t.Fatalf("tampered layer blob: got %v, want a digest mismatch", err)
	}

	// Trailing bytes after the tar's end-of-archive marker are content
	// too (an uncompressed blob, so that nothing else differs).
	plain := static.NewLayer(good, types.OCIUncompressedLayer)
	digest, _ = plain.Digest()
	dir = ocitest.Layout(t, ocitest.Image(t, plain))
	if _, err := unpackRef(t, "oci:"+dir, ApplyOptions{}); err != nil {
		t.Fatalf("uncompressed layer: %v", err)
	}
	padded := append(bytes.Clone(good), []byte("hidden after the end of the archive")...)
	if err := os.WriteFile(ocitest.Blob(dir, digest), padded, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err = unpackRef(t, "oci:"+dir, ApplyOptions{}); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "does not match") {
		t.Fatalf("trailing bytes: got %v, want a mismatch", err)
	}
}

// wrongDiffID is a layer whose config claims another diff_id.
type wrongDiffID struct{ v1.Layer }

func (wrongDiffID) DiffID() (v1.Hash, error) {
	return v1.Hash{Algorithm: "sha256", Hex: strings.Repeat("0", 64)}, nil
}

func TestUnpackVerifiesDiffIDs(t *testing.T) {
	l := wrongDiffID{ocitest.Layer(t, layerTar(t, ent{name: "a", data: "good"}))}
	tr, _, _ := newTree(t)
	err := Unpack(context.Background(), ocitest.Image(t, l), tr, ApplyOptions{}, nil)
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "does not match its diff_id") {
		t.Fatalf("got %v, want a diff_id mismatch", err)
	}
}

// sparseTar is a layer with one PAX GNU sparse 1.0 entry declaring a size
// of 1 PiB (archive/tar's writer cannot make one: the 'x' header is made
// by hand).
func sparseTar(t *testing.T) []byte {
	t.Helper()
	rec := func(k, v string) string {
		s := " " + k + "=" + v + "\n"
		n := len(s)
		for len(fmt.Sprint(n)+s) != n {
			n = len(fmt.Sprint(n) + s)
		}
		return fmt.Sprint(n) + s
	}
	recs := rec("GNU.sparse.major", "1") + rec("GNU.sparse.minor", "0") +
		rec("GNU.sparse.name", "huge") + rec("GNU.sparse.realsize", fmt.Sprint(int64(1)<<50))
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	if err := tw.WriteHeader(&tar.Header{Name: "PaxHeaders/huge", Typeflag: tar.TypeReg, Size: int64(len(recs)), Mode: 0o644, Format: tar.FormatUSTAR}); err != nil {
		t.Fatal(err)
	}
	testutil.Write(t, "PaxHeaders/huge", tw, []byte(recs))
	// The sparse map (0 holes... one data block of 0 bytes at the end),
	// in its own 512-byte block, then no data.
	sparseMap := "1\n" + fmt.Sprint(int64(1)<<50) + "\n0\n"
	data := make([]byte, 512)
	copy(data, sparseMap)
	if err := tw.WriteHeader(&tar.Header{Name: "GNUSparseFile.0/huge", Typeflag: tar.TypeReg, Size: 512, Mode: 0o644, Format: tar.FormatUSTAR}); err != nil {
		t.Fatal(err)
	}
	testutil.Write(t, "GNUSparseFile.0/huge", tw, data)
	testutil.Close(t, "tar writer", tw)
	out := b.Bytes()
	// Make the first header a PAX extended header.
	h := out[:512]
	h[156] = tar.TypeXHeader
	copy(h[148:156], "        ")
	sum := 0
	for _, c := range h {
		sum += int(c)
	}
	copy(h[148:156], fmt.Sprintf("%06o\x00 ", sum))
	return out
}

func TestUnpackLimits(t *testing.T) {
	// The sparse tar is what the limit is for: check it is read as one.
	hdr, err := tar.NewReader(bytes.NewReader(sparseTar(t))).Next()
	if err != nil || hdr.Size != 1<<50 || !sparse(hdr) {
		t.Fatalf("test sparse tar: %+v, %v", hdr, err)
	}

	big := layerTar(t, ent{name: "a", data: strings.Repeat("x", 4096)}, ent{name: "b", data: strings.Repeat("y", 4096)})
	many := make([]ent, 20)
	for i := range many {
		many[i] = ent{name: fmt.Sprintf("f%d", i), data: "z"}
	}
	tooMany := make([]v1.Layer, MaxLayers+1)
	small := ocitest.Layer(t, layerTar(t, ent{name: "a", data: "a"}))
	for i := range tooMany {
		tooMany[i] = small
	}
	for _, c := range []struct {
		name   string
		img    v1.Image
		o      ApplyOptions
		want   string
		passes bool
	}{
		{name: "sparse", img: ocitest.Image(t, ocitest.Layer(t, sparseTar(t))), want: "sparse files are not supported"},
		{name: "bytes in one file", img: ocitest.Image(t, ocitest.Layer(t, big)), o: ApplyOptions{MaxBytes: 2048}, want: "limit of 2048 uncompressed bytes"},
		{name: "bytes over layers", img: ocitest.Image(t, ocitest.Layer(t, big), ocitest.Layer(t, big)), o: ApplyOptions{MaxBytes: 12000}, want: "limit of 12000 uncompressed bytes"},
		{name: "bytes within", img: ocitest.Image(t, ocitest.Layer(t, big), ocitest.Layer(t, big)), o: ApplyOptions{MaxBytes: 40000}, passes: true},
		{name: "entries", img: ocitest.Image(t, ocitest.Layer(t, layerTar(t, many...))), o: ApplyOptions{MaxEntries: 10}, want: "limit of 10 tar entries"},
		{name: "layers", img: ocitest.Image(t, tooMany...), want: fmt.Sprintf("%d layers; the limit is %d", MaxLayers+1, MaxLayers)},
	} {
		t.Run(c.name, func(t *testing.T) {
			tr, root, _ := newTree(t)
			err := Unpack(context.Background(), c.img, tr, c.o, nil)
			if c.passes {
				if err != nil {
					t.Error(err)
				}
				return
			}
			if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), c.want) {
				t.Errorf("got %v, want %q", err, c.want)
			}
			if c.name == "layers" && len(listTree(t, root)) != 0 {
				t.Errorf("%v written before the layer count was checked", listTree(t, root))
			}
		})
	}
}

func TestOpenBoundsMetadata(t *testing.T) {
	img := ocitest.Image(t, ocitest.Layer(t, layerTar(t, ent{name: "a", data: "a"})))
	m, _ := img.Manifest()
	for _, c := range []struct {
		name   string
		tamper func(dir string) error
		want   string
	}{
		{"big index.json", func(dir string) error {
			idx, err := os.ReadFile(filepath.Join(dir, "index.json"))
			if err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(dir, "index.json"), append(idx, bytes.Repeat([]byte(" "), MaxMetadata)...), 0o644)
		}, "index.json is"},
		{"big config", func(dir string) error {
			return os.WriteFile(ocitest.Blob(dir, m.Config.Digest), bytes.Repeat([]byte(" "), MaxMetadata+1), 0o644)
		}, "the limit is 8388608"},
		{"tampered config", func(dir string) error {
			cf, err := img.RawConfigFile()
			if err != nil {
				return err
			}
			return os.WriteFile(ocitest.Blob(dir, m.Config.Digest), append(cf, ' '), 0o644)
		}, "config " + m.Config.Digest.String() + " content does not match its digest"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := ocitest.Layout(t, img)
			if err := c.tamper(dir); err != nil {
				t.Fatal(err)
			}
			_, err := Open(context.Background(), "oci:"+dir, OpenOptions{})
			if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), c.want) {
				t.Errorf("got %v, want %q", err, c.want)
			}
		})
	}

	many := make([]v1.Layer, MaxLayers+1)
	for i := range many {
		many[i] = ocitest.Layer(t, layerTar(t, ent{name: "a", data: "a"}))
	}
	if _, err := Open(context.Background(), "oci:"+ocitest.Layout(t, ocitest.Image(t, many...)), OpenOptions{}); !errdefs.IsInvalidArgument(err) ||
		!strings.Contains(err.Error(), "the limit is 256") {
		t.Errorf("too many layers: got %v", err)
	}

	// docker-archive: manifest.json is read whole.
	p := filepath.Join(t.TempDir(), "big.tar")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	tw := tar.NewWriter(f)
	if err := tw.WriteHeader(&tar.Header{Name: "manifest.json", Typeflag: tar.TypeReg, Mode: 0o644, Size: MaxMetadata + 1}); err != nil {
		t.Fatal(err)
	}
	testutil.Write(t, "manifest.json", tw, bytes.Repeat([]byte(" "), MaxMetadata+1))
	testutil.Close(t, "tar writer", tw)
	testutil.Close(t, p, f)
	if _, err := Open(context.Background(), "docker-archive:"+p, OpenOptions{}); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "manifest.json is") {
		t.Errorf("big manifest.json: got %v", err)
	}
}
