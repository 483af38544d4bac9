package image

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/image/deb"
	"github.com/forkd/forkd/internal/image/oci"
	"github.com/forkd/forkd/internal/image/rootfs"
)

// OCIOptions tune FromOCI.
type OCIOptions struct {
	// Tag names the resulting image (ValidateName); Build(Tag) returns it
	// later. Importing again under the same tag replaces the image.
	Tag string
	// Extra are Debian packages installed into the image with its own apt
	// (Debian and Ubuntu images only). They run the image's programs as
	// root on the host, in a chroot: only for trusted images.
	Extra []string
	// Insecure allows plain HTTP and unverified TLS for any registry (plain
	// HTTP is always allowed for localhost and loopback addresses).
	Insecure bool
	// Preload are Python modules the warm interpreter imports; they need a
	// python3 in the image.
	Preload []string
	// ImportDir, when set, confines local sources (tarballs, layouts) to
	// this directory, symlinks resolved (oci.Locate); any other reference
	// is a registry reference. Empty: any path the caller can read.
	ImportDir string
	// MaxBytes bounds the uncompressed bytes of the image's layers, all
	// together; zero means oci.DefaultMaxBytes (64 GiB).
	MaxBytes int64
}

// Bounds of OCI imports.
const (
	MaxRefLen        = 4096
	MaxExtraPackages = 64
)

// ValidateOCIOptions checks an import of ref with o before anything is
// done: the tag (a valid name, not a built-in image's), the extra
// packages and preloaded modules, and the reference (well formed; a local
// path inside o.ImportDir when set). It reads the file system (whether a
// path exists) and nothing else. Errors are errdefs.ErrInvalidArgument,
// errdefs.ErrAlreadyExists for a built-in name, errdefs.ErrNotFound for a
// missing path.
func ValidateOCIOptions(ref string, o OCIOptions) error {
	if err := ValidateName(o.Tag); err != nil {
		return err
	}
	registryMu.Lock()
	_, builtin := registry[o.Tag]
	registryMu.Unlock()
	if builtin {
		return errdefs.AlreadyExists("image name %s is taken by a built-in image", o.Tag)
	}
	if len(o.Extra) > MaxExtraPackages || len(o.Preload) > MaxExtraPackages {
		return errdefs.InvalidArgument("at most %d extra packages and %d preloaded modules", MaxExtraPackages, MaxExtraPackages)
	}
	for _, p := range o.Extra {
		if !deb.ValidName(p) {
			return errdefs.InvalidArgument("extra package name %s is not valid", errdefs.Quote(p))
		}
	}
	for _, m := range o.Preload {
		if !pyModuleRE.MatchString(m) {
			return errdefs.InvalidArgument("preload module %s is not valid", errdefs.Quote(m))
		}
	}
	if len(ref) > MaxRefLen {
		return errdefs.InvalidArgument("image reference is %d bytes long; the limit is %d", len(ref), MaxRefLen)
	}
	_, _, err := oci.Locate(ref, o.ImportDir)
	return err
}

const recordFormat = 1

// record is what images/<tag>.json keeps of an imported image.
type record struct {
	Format    int       `json:"format"`
	Name      string    `json:"name"`
	Ref       string    `json:"ref"`
	Digest    string    `json:"digest"`
	RootfsKey string    `json:"rootfs_key"`
	Extra     []string  `json:"extra,omitempty"`
	Python    string    `json:"python,omitempty"`
	Preload   []string  `json:"preload,omitempty"`
	Created   time.Time `json:"created"`
}

// FromOCI imports a container image as the root filesystem of a new image
// named o.Tag. ref is a registry reference ("localhost:5000/foo:tag"), a
// `docker save` tarball path ("docker-archive:PATH" or a file), or an OCI
// layout directory ("oci:PATH" or a directory with an oci-layout file).
//
// The layers are flattened (whiteouts honoured, entries escaping the root
// refused), o.Extra installed, a python3 looked for, and the tree written
// to an ext4 image, cached by image digest and extra packages. It needs
// root (file ownership). A missing image is errdefs.ErrNotFound; a
// malformed reference, archive or layer, a layer whose content does not
// match its digest, or an image past the bounds of oci.Unpack (layers,
// entries, o.MaxBytes) is errdefs.ErrInvalidArgument. On
// failure nothing of the import is left in the cache.
func (b *Builder) FromOCI(ctx context.Context, ref string, o OCIOptions) (*Image, error) {
	if err := ValidateOCIOptions(ref, o); err != nil {
		return nil, err
	}
	extra := slices.Clone(o.Extra)
	sort.Strings(extra)
	extra = slices.Compact(extra)
	if err := b.check(); err != nil {
		return nil, err
	}
	if os.Geteuid() != 0 {
		return nil, errdefs.FailedPrecondition("importing an image needs root (file ownership)")
	}
	start := time.Now()
	src, err := oci.Open(ctx, ref, oci.OpenOptions{Insecure: o.Insecure, Root: o.ImportDir,
		Platform: v1.Platform{OS: "linux", Architecture: runtime.GOARCH}})
	if err != nil {
		return nil, err
	}
	// Kernel and initramfs first, so that no failure after the (long)
	// import leaves an unused root filesystem in the cache.
	k, err := b.ensureKernel(ctx)
	if err != nil {
		return nil, err
	}
	initrd, initrdSHA, err := b.ensureInitramfs(ctx, k, false)
	if err != nil {
		return nil, err
	}
	b.progressf(ctx, "image %s: importing %s (%s)", o.Tag, ref, src.Digest)
	key := hashKey(builderVersion, "oci", src.Digest.String(), strings.Join(extra, ","))
	rf, err := b.ensureRootfs(ctx, key, func(ctx context.Context, tree string, m *rootfsInfo) error {
		t, err := rootfs.OpenTree(tree)
		if err != nil {
			return err
		}
		defer t.Close()
		if err := oci.Unpack(ctx, src.Image, t, oci.ApplyOptions{Ownership: true, Logger: b.log(), MaxBytes: o.MaxBytes}, b.progress(ctx)); err != nil {
			return err
		}
		if err := rootfs.EnsureMountpoints(t); err != nil {
			return err
		}
		if len(extra) > 0 {
			b.progressf(ctx, "image %s: installing %s", o.Tag, strings.Join(extra, " "))
			if err := b.rootfsTools().InstallPackages(ctx, t, extra, b.progress(ctx)); err != nil {
				return err
			}
		}
		m.Source, m.Ref, m.Digest, m.Extra = "oci", ref, src.Digest.String(), extra
		m.Python = rootfs.FindPython(t)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("import %s: %w", ref, err)
	}
	if len(o.Preload) > 0 && rf.info.Python == "" {
		return nil, errdefs.FailedPrecondition("preload %s: the image has no python3", strings.Join(o.Preload, ","))
	}
	rec := record{
		Format: recordFormat, Name: o.Tag, Ref: ref, Digest: src.Digest.String(), RootfsKey: key,
		Extra: extra, Python: rf.info.Python, Preload: slices.Clone(o.Preload), Created: time.Now().UTC(),
	}
	img := assemble(&rec, rf, k, initrd, initrdSHA)
	data, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(b.CacheDir, kindImages)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	if err := fsutil.WriteFile(filepath.Join(dir, o.Tag+".json"), append(data, '\n'), 0o644); err != nil {
		return nil, err
	}
	b.log().Info("image imported", "image", o.Tag, "ref", ref, "digest", src.Digest.String(),
		"elapsed", time.Since(start).Round(time.Millisecond))
	return img, nil
}

// loadImported returns an image imported earlier with FromOCI.
func (b *Builder) loadImported(ctx context.Context, name string) (*Image, error) {
	data, err := os.ReadFile(filepath.Join(b.CacheDir, kindImages, name+".json"))
	if os.IsNotExist(err) {
		return nil, errdefs.NotFound("no image %s (built-in: %s)", name, strings.Join(Names(), ", "))
	}
	if err != nil {
		return nil, err
	}
	var rec record
	if err := json.Unmarshal(data, &rec); err != nil || rec.Format != recordFormat || rec.Name != name {
		return nil, errdefs.NotFound("image %s: unreadable record; import it again", name)
	}
	if err := checkKey(rec.RootfsKey); err != nil {
		return nil, err
	}
	dir := filepath.Join(b.CacheDir, kindRootfs, rec.RootfsKey)
	info, err := readRootfsInfo(dir)
	if err != nil {
		return nil, errdefs.NotFound("image %s: root filesystem gone from the cache (%w); import it again", name, err)
	}
	k, err := b.ensureKernel(ctx)
	if err != nil {
		return nil, err
	}
	initrd, initrdSHA, err := b.ensureInitramfs(ctx, k, false)
	if err != nil {
		return nil, err
	}
	return assemble(&rec, &rootfsEntry{dir: dir, info: info}, k, initrd, initrdSHA), nil
}

// assemble makes the image of an imported root filesystem.
func assemble(rec *record, rf *rootfsEntry, k *kernelEntry, initrd, initrdSHA string) *Image {
	img := &Image{
		Name: rec.Name, Kernel: k.vmlinuz(), KernelSHA256: k.manifest.VmlinuzSHA256,
		Initrd: initrd, InitrdSHA256: initrdSHA,
		Rootfs: rf.image(), RootfsSHA256: rf.info.SHA256, Python: rec.Python, Preload: slices.Clone(rec.Preload),
	}
	img.Cmdline = rootCmdline(img.Python, img.Preload)
	return img
}
