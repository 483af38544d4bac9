package hub

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"sync"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/forkd/forkd/internal/errdefs"
)

// source is where a pull reads artifacts: a registry, or an OCI image
// layout in a tar file.
type source interface {
	// manifest returns the manifest ref names (a tag, a digest, or "" for
	// a layout's only one) and its digest, reading at most limit bytes; a
	// manifest named by digest hashes to it.
	manifest(ctx context.Context, ref string, limit int64) ([]byte, string, error)
	// blob writes blob digest, of size bytes, to w (unverified).
	blob(ctx context.Context, digest string, size int64, w io.Writer) error
	name() string
}

// sink is where a push writes artifacts.
type sink interface {
	has(ctx context.Context, digest string) (bool, error)
	put(ctx context.Context, b blob) error
	putManifest(ctx context.Context, raw []byte, digest, tag string) error
}

var (
	_ source = (*registry)(nil)
	_ sink   = (*registry)(nil)
	_ source = (*tarSource)(nil)
	_ sink   = (*tarSink)(nil)
)

func (g *registry) name() string { return g.repo.String() }

// OCI image layout names.
const (
	layoutFile    = "oci-layout"
	layoutIndex   = "index.json"
	layoutVersion = `{"imageLayoutVersion":"1.0.0"}`
	refNameKey    = "org.opencontainers.image.ref.name"
)

var blobEntryRE = regexp.MustCompile(`^blobs/sha256/[0-9a-f]{64}$`)

// tarSink writes an OCI image layout into a tar stream: oci-layout, the
// blobs as they come (each once), index.json last naming the tagged
// manifests. Safe for concurrent use.
type tarSink struct {
	mu    sync.Mutex // guards the rest
	tw    *tar.Writer
	have  map[string]bool
	index []v1.Descriptor
	mtime time.Time
}

func newTarSink(w io.Writer, mtime time.Time) (*tarSink, error) {
	s := &tarSink{tw: tar.NewWriter(w), have: map[string]bool{}, mtime: mtime.UTC().Truncate(time.Second)}
	if err := s.entry(layoutFile, int64(len(layoutVersion)), strings.NewReader(layoutVersion)); err != nil {
		return nil, err
	}
	return s, nil
}

// entry writes one file; called with mu held or before use.
func (s *tarSink) entry(name string, size int64, r io.Reader) error {
	hdr := &tar.Header{Typeflag: tar.TypeReg, Name: name, Size: size, Mode: 0o644, ModTime: s.mtime, Format: tar.FormatPAX}
	if err := s.tw.WriteHeader(hdr); err != nil {
		return writeErr(err)
	}
	n, err := io.Copy(s.tw, r)
	if err != nil {
		return writeErr(err)
	}
	if n != size {
		return fmt.Errorf("layout entry %s: %d bytes, want %d", name, n, size)
	}
	return nil
}

func (s *tarSink) has(_ context.Context, digest string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.have[digest], nil
}

func (s *tarSink) put(_ context.Context, b blob) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.have[b.digest] {
		return nil
	}
	r, err := b.reader()
	if err != nil {
		return err
	}
	defer r.Close()
	if err := s.entry("blobs/sha256/"+strings.TrimPrefix(b.digest, "sha256:"), b.size, r); err != nil {
		return err
	}
	s.have[b.digest] = true
	return nil
}

func (s *tarSink) putManifest(ctx context.Context, raw []byte, digest, tag string) error {
	if err := s.put(ctx, blob{digest: digest, size: int64(len(raw)), data: raw}); err != nil {
		return err
	}
	if tag != "" {
		s.mu.Lock()
		defer s.mu.Unlock()
		h, err := v1.NewHash(digest)
		if err != nil {
			return err
		}
		s.index = append(s.index, v1.Descriptor{MediaType: types.OCIManifestSchema1, Digest: h, Size: int64(len(raw)),
			ArtifactType: ArtifactType, Annotations: map[string]string{refNameKey: tag}})
	}
	return nil
}

// close writes index.json and ends the tar stream.
func (s *tarSink) close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	idx := v1.IndexManifest{SchemaVersion: 2, MediaType: types.OCIImageIndex, Manifests: s.index}
	b, err := json.Marshal(idx)
	if err != nil {
		return err
	}
	if err := s.entry(layoutIndex, int64(len(b)), strings.NewReader(string(b))); err != nil {
		return err
	}
	return writeErr(s.tw.Close())
}

// tarSource reads an OCI image layout from a tar file. Only plain files
// named oci-layout, index.json or blobs/sha256/<hex> may be in it: any
// other entry (a path outside the layout, a link, a device, a directory
// entry aside) is refused before anything is read.
type tarSource struct {
	path    string
	f       *os.File
	entries map[string]section
}

type section struct{ off, size int64 }

// maxLayoutEntries bounds the entries of a layout tar.
const maxLayoutEntries = 1 << 16

// openTar indexes the layout tar at path.
func openTar(path string, l Limits) (*tarSource, error) {
	f, err := os.Open(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, errdefs.NotFound("layout %s: %w", path, err)
		}
		return nil, err
	}
	s := &tarSource{path: path, f: f, entries: map[string]section{}}
	pr := &posReader{f: f}
	tr := tar.NewReader(pr)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			f.Close()
			return nil, errdefs.InvalidArgument("layout %s: not a tar file: %v", path, err)
		}
		name := hdr.Name
		switch {
		case hdr.Typeflag == tar.TypeDir && (name == "blobs/" || name == "blobs/sha256/" || name == "blobs" || name == "blobs/sha256"):
			continue
		case hdr.Typeflag != tar.TypeReg:
			f.Close()
			return nil, errdefs.InvalidArgument("layout %s: entry %s is not a plain file (type %q): refused", path, errdefs.Quote(name), hdr.Typeflag)
		case name != layoutFile && name != layoutIndex && !blobEntryRE.MatchString(name):
			f.Close()
			return nil, errdefs.InvalidArgument("layout %s: entry %s is not part of an OCI layout (path tricks are refused)", path, errdefs.Quote(name))
		case hdr.Size < 0:
			f.Close()
			return nil, errdefs.InvalidArgument("layout %s: entry %s has size %d", path, errdefs.Quote(name), hdr.Size)
		}
		if _, dup := s.entries[name]; dup {
			f.Close()
			return nil, errdefs.InvalidArgument("layout %s: entry %s twice", path, errdefs.Quote(name))
		}
		if len(s.entries) >= maxLayoutEntries {
			f.Close()
			return nil, errdefs.InvalidArgument("layout %s: more than %d entries", path, maxLayoutEntries)
		}
		s.entries[name] = section{off: pr.pos, size: hdr.Size}
	}
	if _, ok := s.entries[layoutFile]; !ok {
		f.Close()
		return nil, errdefs.InvalidArgument("layout %s: no %s file: not an OCI image layout", path, layoutFile)
	}
	if e, ok := s.entries[layoutIndex]; !ok || e.size > l.ManifestBytes {
		f.Close()
		return nil, errdefs.InvalidArgument("layout %s: no %s, or one over %d bytes", path, layoutIndex, l.ManifestBytes)
	}
	return s, nil
}

func (s *tarSource) close() error { return s.f.Close() }

func (s *tarSource) name() string { return s.path }

// read returns entry name, at most limit bytes of it.
func (s *tarSource) read(name string, limit int64) ([]byte, error) {
	e, ok := s.entries[name]
	if !ok {
		return nil, errdefs.NotFound("layout %s: no %s", s.path, name)
	}
	if e.size > limit {
		return nil, errdefs.InvalidArgument("layout %s: %s is %d bytes; the limit is %d", s.path, name, e.size, limit)
	}
	b := make([]byte, e.size)
	if _, err := s.f.ReadAt(b, e.off); err != nil {
		return nil, errdefs.InvalidArgument("layout %s: %s: %v", s.path, name, err)
	}
	return b, nil
}

func (s *tarSource) manifest(_ context.Context, ref string, limit int64) ([]byte, string, error) {
	if !strings.HasPrefix(ref, "sha256:") {
		b, err := s.read(layoutIndex, limit)
		if err != nil {
			return nil, "", err
		}
		var idx v1.IndexManifest
		if err := json.Unmarshal(b, &idx); err != nil {
			return nil, "", errdefs.InvalidArgument("layout %s: %s: %v", s.path, layoutIndex, err)
		}
		var pick []v1.Descriptor
		for _, d := range idx.Manifests {
			if ref == "" || d.Annotations[refNameKey] == ref {
				pick = append(pick, d)
			}
		}
		if len(pick) != 1 {
			return nil, "", errdefs.InvalidArgument("layout %s: %d manifests named %s in its index; want one", s.path, len(pick), errdefs.Quote(ref))
		}
		ref = pick[0].Digest.String()
	}
	if err := checkDigest("manifest", ref); err != nil {
		return nil, "", err
	}
	b, err := s.read("blobs/sha256/"+strings.TrimPrefix(ref, "sha256:"), limit)
	if err != nil {
		return nil, "", err
	}
	if got := fmt.Sprintf("sha256:%x", sha256.Sum256(b)); got != ref {
		return nil, "", errdefs.InvalidArgument("layout %s: manifest %s hashes to %s: refused", s.path, ref, got)
	}
	return b, ref, nil
}

func (s *tarSource) blob(_ context.Context, digest string, size int64, w io.Writer) error {
	name := "blobs/sha256/" + strings.TrimPrefix(digest, "sha256:")
	e, ok := s.entries[name]
	if !ok {
		return errdefs.NotFound("layout %s: no blob %s", s.path, digest)
	}
	if e.size != size {
		return errdefs.InvalidArgument("layout %s: blob %s is %d bytes; its manifest says %d", s.path, digest, e.size, size)
	}
	_, err := io.Copy(w, io.NewSectionReader(s.f, e.off, e.size))
	return err
}

// posReader is a file read in order whose position is known: after
// tar.Reader.Next, the start of the entry's data.
type posReader struct {
	f   *os.File
	pos int64
}

func (r *posReader) Read(p []byte) (int, error) {
	n, err := r.f.ReadAt(p, r.pos)
	r.pos += int64(n)
	if err == io.EOF && n > 0 {
		err = nil
	}
	return n, err
}

// Seek lets tar.Reader skip entries' data without reading it.
func (r *posReader) Seek(off int64, whence int) (int64, error) {
	switch whence {
	case io.SeekStart:
		r.pos = off
	case io.SeekCurrent:
		r.pos += off
	case io.SeekEnd:
		st, err := r.f.Stat()
		if err != nil {
			return 0, err
		}
		r.pos = st.Size() + off
	}
	return r.pos, nil
}
