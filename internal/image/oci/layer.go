package oci

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"path"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image/rootfs"
)

// Whiteout markers of the OCI image spec (and Docker before it).
const (
	whiteoutPrefix = ".wh."
	whiteoutOpaque = ".wh..wh..opq"
)

// ApplyOptions tune ApplyLayer.
type ApplyOptions struct {
	// Ownership applies the uid/gid of entries (needs root). Without it
	// files belong to the caller and device nodes are skipped.
	Ownership bool
	Logger    *slog.Logger // nil means discard
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
// the layer; the caller discards it.
func ApplyLayer(ctx context.Context, t *rootfs.Tree, r io.Reader, o ApplyOptions) error {
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
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return malformed(err)
		}
		name, err := rootfs.Clean(hdr.Name)
		if err != nil {
			return errdefs.InvalidArgument("layer entry %q refused: %v", hdr.Name, err)
		}
		if name == "." {
			continue // the root itself
		}
		if err := applyEntry(t, tr, hdr, name, created, o, log); err != nil {
			if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
				return errdefs.ResourceExhausted("layer entry %s: %v", hdr.Name, err)
			}
			if errdefs.Code(err) != "internal" {
				return err
			}
			return errdefs.InvalidArgument("layer entry %s: %v", hdr.Name, err)
		}
	}
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
	case tar.TypeReg, tar.TypeRegA: //nolint:staticcheck // TypeRegA appears in old layers
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
	if errdefs.Code(err) != "internal" {
		return err
	}
	return errdefs.InvalidArgument("malformed layer: %v", err)
}

// Unpack applies the layers of img in order to t. Progress lines (one per
// layer) go to progress, which may be nil.
func Unpack(ctx context.Context, img v1.Image, t *rootfs.Tree, o ApplyOptions, progress io.Writer) error {
	layers, err := img.Layers()
	if err != nil {
		return errdefs.InvalidArgument("image layers: %v", err)
	}
	for i, l := range layers {
		d, _ := l.Digest()
		size, _ := l.Size()
		if progress != nil {
			fmt.Fprintf(progress, "  layer %d/%d %s (%.1f MB)\n", i+1, len(layers), short(d), float64(size)/1e6)
		}
		rc, err := l.Uncompressed()
		if err != nil {
			return classify(d.String(), err, "")
		}
		err = ApplyLayer(ctx, t, rc, o)
		cerr := rc.Close()
		if err != nil {
			return fmt.Errorf("layer %d (%s): %w", i+1, short(d), err)
		}
		if cerr != nil {
			// Closing verifies the digest for some sources.
			return errdefs.InvalidArgument("layer %d (%s): %v", i+1, short(d), cerr)
		}
	}
	return nil
}

func short(h v1.Hash) string {
	if len(h.Hex) > 12 {
		return h.Algorithm + ":" + h.Hex[:12]
	}
	return h.String()
}
