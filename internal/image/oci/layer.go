package oci

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"path"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image/rootfs"
)

// Whiteout markers of the OCI image spec (and Docker before it).
const (
	whiteoutPrefix = ".wh."
	whiteoutOpaque = ".wh..wh..opq"
)

// Default bounds of what an image may make Unpack do.
const (
	DefaultMaxBytes   = 64 << 30 // uncompressed layer bytes, all layers together
	DefaultMaxEntries = 2_000_000
	MaxLayers         = 256
	MaxMetadata       = 8 << 20 // bytes of an index, manifest or config
)

// ApplyOptions tune ApplyLayer and Unpack.
type ApplyOptions struct {
	// Ownership applies the uid/gid of entries (needs root). Without it
	// files belong to the caller and device nodes are skipped.
	Ownership bool
	Logger    *slog.Logger // nil means discard
	// MaxBytes bounds the uncompressed tar bytes read (which bounds the
	// bytes written), and MaxEntries the tar entries, over one ApplyLayer
	// call or over all the layers of one Unpack; zero means
	// DefaultMaxBytes and DefaultMaxEntries.
	MaxBytes   int64
	MaxEntries int64
}

// budget is what is left of ApplyOptions' bounds; Unpack shares one over
// all layers.
type budget struct {
	bytes, entries       int64
	maxBytes, maxEntries int64
}

func newBudget(o ApplyOptions) *budget {
	b := &budget{maxBytes: o.MaxBytes, maxEntries: o.MaxEntries}
	if b.maxBytes <= 0 {
		b.maxBytes = DefaultMaxBytes
	}
	if b.maxEntries <= 0 {
		b.maxEntries = DefaultMaxEntries
	}
	b.bytes, b.entries = b.maxBytes, b.maxEntries
	return b
}

func (b *budget) tooLarge() error {
	return errdefs.InvalidArgument("image is larger than the limit of %d uncompressed bytes", b.maxBytes)
}

// meteredReader reads from r and fails once b's bytes are spent.
type meteredReader struct {
	r io.Reader
	b *budget
}

func (m *meteredReader) Read(p []byte) (int, error) {
	if m.b.bytes <= 0 {
		// Only an error if something is left to read.
		var one [1]byte
		if n, _ := io.ReadFull(m.r, one[:]); n > 0 {
			return 0, m.b.tooLarge()
		}
		return 0, io.EOF
	}
	if int64(len(p)) > m.b.bytes {
		p = p[:m.b.bytes]
	}
	n, err := m.r.Read(p)
	m.b.bytes -= int64(n)
	return n, err
}

// ApplyLayer applies one uncompressed layer (a tar stream) to t, as the OCI
// image spec's "Applying Changesets" says: entries replace what is there,
// ".wh.NAME" removes NAME from lower layers, ".wh..wh..opq" empties its
// directory of everything lower layers put there.
//
// An entry whose name or hard-link target is absolute or has a ".."
// component is refused with errdefs.ErrInvalidArgument before anything of
// it is written; every write is confined to t (see rootfs.Tree), so a
// symlink planted by a layer can never redirect a later write outside. A
// malformed tar is errdefs.ErrInvalidArgument. On error t holds part of
// the layer; the caller discards it. Sparse entries, and a layer past
// o.MaxBytes or o.MaxEntries, are errdefs.ErrInvalidArgument.
func ApplyLayer(ctx context.Context, t *rootfs.Tree, r io.Reader, o ApplyOptions) error {
	b := newBudget(o)
	return applyLayer(ctx, t, &meteredReader{r: r, b: b}, o, b)
}

// applyLayer is ApplyLayer with r already metered against b.
func applyLayer(ctx context.Context, t *rootfs.Tree, r io.Reader, o ApplyOptions, b *budget) error {
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	tr := tar.NewReader(r)
	created := map[string]bool{} // paths this layer put in place
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return malformed(err)
		}
		if b.entries--; b.entries < 0 {
			return errdefs.InvalidArgument("image has more than the limit of %d tar entries", b.maxEntries)
		}
		if sparse(hdr) {
			return errdefs.InvalidArgument("layer entry %q refused: sparse files are not supported", hdr.Name)
		}
		if hdr.Size > b.bytes {
			return b.tooLarge()
		}
		name, err := rootfs.Clean(hdr.Name)
		if err != nil {
			return errdefs.InvalidArgument("layer entry %q refused: %w", hdr.Name, err)
		}
		if name == "." {
			continue // the root itself
		}
		if err := applyEntry(t, tr, hdr, name, created, o, log); err != nil {
			if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
				return errdefs.ResourceExhausted("layer entry %s: %w", hdr.Name, err)
			}
			if errdefs.Classed(err) {
				return err
			}
			return errdefs.InvalidArgument("layer entry %s: %w", hdr.Name, err)
		}
	}
}

// sparse reports whether hdr is a GNU sparse file (old GNU or PAX form),
// whose few stored bytes archive/tar expands to its declared size.
func sparse(hdr *tar.Header) bool {
	if hdr.Typeflag == tar.TypeGNUSparse {
		return true
	}
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return true
		}
	}
	return false
}

func applyEntry(t *rootfs.Tree, tr *tar.Reader, hdr *tar.Header, name string, created map[string]bool, o ApplyOptions, log *slog.Logger) error {
	dir, base := path.Split(name)
	dir = strings.TrimSuffix(dir, "/")
	if dir == "" {
		dir = "."
	}

	// Whiteouts.
	if base == whiteoutOpaque {
		if err := t.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		return pruneLower(t, dir, created)
	}
	if strings.HasPrefix(base, whiteoutPrefix) {
		victim := strings.TrimPrefix(base, whiteoutPrefix)
		if victim == "" || victim == "." || victim == ".." {
			return errdefs.InvalidArgument("layer entry %q refused: whiteout of %q", hdr.Name, victim)
		}
		return t.RemoveAll(path.Join(dir, victim))
	}

	if err := t.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	mode := uint32(hdr.Mode) & 0o7777
	existing, lerr := t.Lstat(name)
	exists := lerr == nil
	if lerr != nil && !errors.Is(lerr, fs.ErrNotExist) {
		return lerr
	}
	// Replace whatever is there, except a directory by a directory.
	if exists && !(hdr.Typeflag == tar.TypeDir && existing.Mode&unix.S_IFMT == unix.S_IFDIR) {
		if hdr.Typeflag == tar.TypeLink {
			if target, err := rootfs.Clean(hdr.Linkname); err == nil && target == name {
				return nil // a link to itself: already there
			}
		}
		if err := t.RemoveAll(name); err != nil {
			return err
		}
	}

	switch hdr.Typeflag {
	case tar.TypeDir:
		if !exists || existing.Mode&unix.S_IFMT != unix.S_IFDIR {
			if err := t.Mkdir(name, 0o755); err != nil {
				return err
			}
		}
	case tar.TypeReg: // archive/tar reads the old TypeRegA as TypeReg (or TypeDir)
		f, err := t.Create(name, 0o600)
		if err != nil {
			return err
		}
		n, err := io.Copy(f, tr)
		if err == nil && n != hdr.Size {
			err = io.ErrUnexpectedEOF
		}
		if err != nil {
			f.Close()
			return malformed(err)
		}
		if err := f.Close(); err != nil {
			return err
		}
	case tar.TypeSymlink:
		if err := t.Symlink(hdr.Linkname, name); err != nil {
			return err
		}
	case tar.TypeLink:
		target, err := rootfs.Clean(hdr.Linkname)
		if err != nil || target == "." {
			return errdefs.InvalidArgument("layer entry %q refused: hard link to %q", hdr.Name, hdr.Linkname)
		}
		if err := t.Link(target, name); err != nil {
			return err
		}
		markCreated(created, name)
		return nil // a hard link shares its target's metadata
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		kind := map[byte]uint32{tar.TypeChar: unix.S_IFCHR, tar.TypeBlock: unix.S_IFBLK, tar.TypeFifo: unix.S_IFIFO}[hdr.Typeflag]
		if kind != unix.S_IFIFO && !o.Ownership {
			log.Debug("device node skipped without root", "path", name)
			return nil
		}
		if err := t.Mknod(name, kind|mode, unix.Mkdev(uint32(hdr.Devmajor), uint32(hdr.Devminor))); err != nil {
			return err
		}
	case tar.TypeXGlobalHeader:
		return nil
	default:
		return errdefs.InvalidArgument("layer entry %q: unsupported tar type %q", hdr.Name, hdr.Typeflag)
	}
	markCreated(created, name)

	// Metadata: owner first (chown clears setuid), then mode, xattrs, times.
	if o.Ownership {
		if err := t.Lchown(name, hdr.Uid, hdr.Gid); err != nil {
			return err
		}
	}
	if hdr.Typeflag != tar.TypeSymlink {
		if err := t.Chmod(name, mode); err != nil {
			return err
		}
	}
	for k, v := range hdr.PAXRecords {
		attr, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok {
			continue
		}
		if err := t.SetXattr(name, attr, []byte(v)); err != nil {
			if errors.Is(err, unix.ENOTSUP) || (!o.Ownership && errors.Is(err, unix.EPERM)) {
				log.Debug("xattr not set", "path", name, "attr", attr, "err", err)
				continue
			}
			return err
		}
	}
	mtime := hdr.ModTime
	if mtime.IsZero() {
		mtime = time.Unix(0, 0)
	}
	atime := hdr.AccessTime
	if atime.IsZero() {
		atime = mtime
	}
	return t.Lchtimes(name, atime, mtime)
}

// pruneLower removes from dir everything lower layers put there: entries
// this layer did not create go, directories it did are pruned in turn.
func pruneLower(t *rootfs.Tree, dir string, created map[string]bool) error {
	names, err := t.ReadDirNames(dir)
	if err != nil {
		return err
	}
	for _, n := range names {
		p := path.Join(dir, n)
		if !created[p] {
			if err := t.RemoveAll(p); err != nil {
				return err
			}
			continue
		}
		st, err := t.Lstat(p)
		if err != nil {
			return err
		}
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			if err := pruneLower(t, p, created); err != nil {
				return err
			}
		}
	}
	return nil
}

// markCreated records that this layer put name in place, and with it its
// parents, so an opaque whiteout later in the layer keeps them.
func markCreated(created map[string]bool, name string) {
	for p := name; p != "." && p != "/" && p != ""; p = path.Dir(p) {
		created[p] = true
	}
}

func malformed(err error) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	if errdefs.Classed(err) {
		return err
	}
	return errdefs.InvalidArgument("malformed layer: %w", err)
}

// Unpack applies the layers of img in order to t. Progress lines (one per
// layer) go to progress, which may be nil.
//
// Each layer is read to its end, its compressed bytes checked against its
// digest and its uncompressed bytes against the config's diff_id: a
// mismatch is errdefs.ErrInvalidArgument (t then holds part of the layer;
// the caller discards it). More than MaxLayers layers, or layers past
// o.MaxBytes or o.MaxEntries together, are errdefs.ErrInvalidArgument.
func Unpack(ctx context.Context, img v1.Image, t *rootfs.Tree, o ApplyOptions, progress io.Writer) error {
	layers, err := img.Layers()
	if err != nil {
		return errdefs.InvalidArgument("image layers: %w", err)
	}
	if len(layers) > MaxLayers {
		return errdefs.InvalidArgument("image has %d layers; the limit is %d", len(layers), MaxLayers)
	}
	b := newBudget(o)
	for i, l := range layers {
		if err := unpackLayer(ctx, l, t, o, b, func(d v1.Hash, size int64) {
			if progress != nil {
				fmt.Fprintf(progress, "  layer %d/%d %s (%.1f MB)\n", i+1, len(layers), short(d), float64(size)/1e6)
			}
		}); err != nil {
			return fmt.Errorf("layer %d: %w", i+1, err)
		}
	}
	return nil
}

// unpackLayer applies l to t and verifies it (see Unpack).
func unpackLayer(ctx context.Context, l v1.Layer, t *rootfs.Tree, o ApplyOptions, b *budget, started func(v1.Hash, int64)) error {
	digest, err := l.Digest()
	if err != nil {
		return errdefs.InvalidArgument("digest: %w", err)
	}
	diffID, err := l.DiffID()
	if err != nil {
		return errdefs.InvalidArgument("layer %s: diff_id: %w", digest, err)
	}
	size, _ := l.Size()
	started(digest, size)
	rc, err := l.Compressed()
	if err != nil {
		return classify(digest.String(), err, "")
	}
	defer rc.Close()
	zsum := sha256.New()
	compressed := io.TeeReader(rc, zsum)
	zr, err := decompress(compressed)
	if err != nil {
		return errdefs.InvalidArgument("layer %s: %w", digest, err)
	}
	defer zr.Close()
	sum := sha256.New()
	r := &meteredReader{r: io.TeeReader(zr, sum), b: b}
	if err := applyLayer(ctx, t, r, o, b); err != nil {
		return fmt.Errorf("%s: %w", short(digest), err)
	}
	// The tar reader stops at the end-of-archive marker: read the rest,
	// so that the digests cover every byte.
	if _, err := io.Copy(io.Discard, r); err != nil {
		return fmt.Errorf("%s: %w", short(digest), malformed(err))
	}
	if _, err := io.Copy(io.Discard, compressed); err != nil {
		return classify(digest.String(), err, "")
	}
	if got := hex.EncodeToString(zsum.Sum(nil)); digest.Algorithm != "sha256" || got != digest.Hex {
		return errdefs.InvalidArgument("layer %s content does not match its digest (sha256:%s)", digest, got)
	}
	if got := hex.EncodeToString(sum.Sum(nil)); diffID.Algorithm != "sha256" || got != diffID.Hex {
		return errdefs.InvalidArgument("layer %s uncompressed content does not match its diff_id %s (sha256:%s)", digest, diffID, got)
	}
	return nil
}

// decompress returns the uncompressed stream of r: gzip, zstd or plain
// tar, told by its first bytes.
func decompress(r io.Reader) (io.ReadCloser, error) {
	br := bufio.NewReader(r)
	magic, err := br.Peek(4)
	if err != nil && err != io.EOF {
		return nil, err
	}
	switch {
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
		return gzip.NewReader(br)
	case bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		zr, err := zstd.NewReader(br, zstd.WithDecoderConcurrency(1))
		if err != nil {
			return nil, err
		}
		return zr.IOReadCloser(), nil
	}
	return io.NopCloser(br), nil
}

func short(h v1.Hash) string {
	if len(h.Hex) > 12 {
		return h.Algorithm + ":" + h.Hex[:12]
	}
	return h.String()
}
