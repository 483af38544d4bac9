// Package image makes the boot assets of forkd guests: a kernel from the
// distribution's cloud kernel package (downloaded and unpacked, never
// installed on the host), an initramfs carrying the forkd agent as /init
// and the kernel modules it loads, and for images with a root filesystem an
// ext4 image built with debootstrap or flattened from an OCI image.
//
// Images come from a registry of Specs ("minimal" and "python" are built
// in; Register adds more) or from FromOCI. Everything is cached under
// Builder.CacheDir by content (see the layout in cache.go), built in staging
// and renamed into place, with an flock per entry so concurrent builders
// neither corrupt nor duplicate each other's work.
package image

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image/deb"
	"github.com/forkd/forkd/internal/image/rootfs"
	"github.com/forkd/forkd/internal/progress"
)

// builderVersion is part of every cache key: bump it when the content a
// recipe produces changes.
const builderVersion = "1"

// KernelDebEnv names local kernel .deb files (a path list: the image
// package, then its modules package if separate) used instead of apt.
const KernelDebEnv = "FORKD_KERNEL_DEB"

// Image is a bootable guest: the files a VM is started from. Paths point
// into the builder's cache and stay valid while the cache entry exists.
type Image struct {
	Name         string   `json:"name"`
	Kernel       string   `json:"kernel"`           // path of the bzImage
	Initrd       string   `json:"initrd"`           // path of the initramfs (gzip newc cpio)
	Rootfs       string   `json:"rootfs,omitempty"` // path of the ext4 image; "" for initramfs-only images
	Cmdline      []string `json:"cmdline,omitempty"`
	KernelSHA256 string   `json:"kernel_sha256"`
	InitrdSHA256 string   `json:"initrd_sha256"`
	RootfsSHA256 string   `json:"rootfs_sha256,omitempty"`
	Python       string   `json:"python,omitempty"`  // python3 in the guest; "" if none
	Preload      []string `json:"preload,omitempty"` // modules the warm interpreter imports
}

// Spec is a recipe for an image in the registry.
type Spec struct {
	Name string
	// Busybox puts a static busybox and its applet links into the
	// initramfs (for images without a root filesystem).
	Busybox bool
	// Rootfs, if set, builds an ext4 root filesystem with debootstrap; the
	// guest mounts it read-only as its root (forkd.root=/dev/vda).
	Rootfs *RootfsSpec
}

// RootfsSpec is a debootstrap recipe.
type RootfsSpec struct {
	Suite    string   // "" means the host's Debian suite, else bookworm
	Mirror   string   // "" means the host's apt mirror, else deb.debian.org
	Variant  string   // debootstrap --variant, e.g. "minbase"
	Packages []string // --include
	Python   string   // guest path of python3, "" if none
	Preload  []string // Python modules imported in the warm interpreter
}

var (
	registryMu sync.Mutex
	registry   = map[string]Spec{} // guarded by registryMu
	builtins   []string            // names registered by this package
)

func init() {
	for _, s := range []Spec{
		{Name: "minimal", Busybox: true},
		{Name: "python", Rootfs: &RootfsSpec{
			Variant:  "minbase",
			Packages: []string{"python3", "python3-numpy", "ca-certificates", "iproute2", "procps"},
			Python:   "/usr/bin/python3",
			Preload:  []string{"numpy"},
		}},
		// The E2B code interpreter's runtime (docs/e2b.md): python with
		// pandas and matplotlib warm; figures come back as PNG.
		{Name: "code-interpreter", Rootfs: &RootfsSpec{
			Variant: "minbase",
			Packages: []string{"python3", "python3-numpy", "python3-pandas", "python3-matplotlib",
				"ca-certificates", "iproute2", "procps"},
			Python:  "/usr/bin/python3",
			Preload: []string{"numpy", "pandas", "matplotlib.pyplot"},
		}},
	} {
		if err := Register(s); err != nil {
			panic(err)
		}
		builtins = append(builtins, s.Name)
	}
}

// Register adds a recipe to the registry. Names are unique and follow
// ValidateName; package names must be valid Debian names.
func Register(s Spec) error {
	if err := ValidateName(s.Name); err != nil {
		return err
	}
	if s.Rootfs != nil {
		for _, p := range s.Rootfs.Packages {
			if !deb.ValidName(p) {
				return errdefs.InvalidArgument("image %s: package name %q is not valid", s.Name, p)
			}
		}
		for _, m := range s.Rootfs.Preload {
			if !pyModuleRE.MatchString(m) {
				return errdefs.InvalidArgument("image %s: preload module %q is not valid", s.Name, m)
			}
		}
	}
	registryMu.Lock()
	defer registryMu.Unlock()
	if _, dup := registry[s.Name]; dup {
		return errdefs.AlreadyExists("image %s is already registered", s.Name)
	}
	registry[s.Name] = s
	return nil
}

// BuiltinNames returns the names of the built-in images, sorted.
func BuiltinNames() []string {
	out := slices.Clone(builtins)
	sort.Strings(out)
	return out
}

// Names returns every registered image name, sorted.
func Names() []string {
	registryMu.Lock()
	defer registryMu.Unlock()
	var out []string
	for n := range registry {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

var (
	nameRE     = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)
	pyModuleRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$`)
)

// ValidateName checks an image name (the same rules as snapshot tags): 1 to
// 63 characters of [A-Za-z0-9._-], starting with a letter or digit, with no
// "..". A valid name is always a single, safe path component. Anything else
// is errdefs.ErrInvalidArgument.
func ValidateName(name string) error {
	if !nameRE.MatchString(name) || strings.Contains(name, "..") {
		return errdefs.InvalidArgument("image name %s: want 1-63 of [A-Za-z0-9._-], starting with a letter or digit, no \"..\"", errdefs.Quote(name))
	}
	return nil
}

// Tools names the host commands the builder runs. A zero field means the
// command of that name, found in PATH, /usr/sbin or /sbin.
type Tools struct {
	AptGet, AptCache, DpkgDeb string
	Debootstrap, MkfsExt4     string
	Unshare                   string
}

// Builder builds images into a cache. Its fields are set before first use
// and not changed after; a Builder is then safe for concurrent use, and
// several Builders (in several processes) may share one CacheDir.
type Builder struct {
	CacheDir  string    // absolute, e.g. <data dir>/cache
	AgentPath string    // the static forkd-agent binary that becomes /init
	Progress  io.Writer // human progress lines; nil for none
	Logger    *slog.Logger
	Tools     Tools

	// KernelDebs are local kernel packages used instead of apt; nil means
	// the path list in $FORKD_KERNEL_DEB, and apt if that is empty.
	KernelDebs []string
	// BusyboxPath is a static busybox to use; "" means the one from
	// Debian's busybox-static package, downloaded with apt.
	BusyboxPath string
	// EtcDir is the host's /etc, read for the Debian suite and mirror
	// ("" means /etc).
	EtcDir string
	// AptListsDir is apt's lists directory ("" means /var/lib/apt/lists).
	AptListsDir string
}

func (b *Builder) log() *slog.Logger {
	if b.Logger != nil {
		return b.Logger
	}
	return slog.New(slog.DiscardHandler)
}

// progress is where the build reports: the writer of ctx (package
// progress), else b.Progress.
func (b *Builder) progress(ctx context.Context) io.Writer { return progress.Writer(ctx, b.Progress) }

func (b *Builder) progressf(ctx context.Context, format string, args ...any) {
	fmt.Fprintf(b.progress(ctx), format+"\n", args...)
}

func (b *Builder) debTools() deb.Tools {
	return deb.Tools{AptGet: b.Tools.AptGet, AptCache: b.Tools.AptCache, DpkgDeb: b.Tools.DpkgDeb, ListsDir: b.AptListsDir,
		Memo: filepath.Join(b.CacheDir, "apt-candidates.json")}
}

func (b *Builder) rootfsTools() rootfs.Tools {
	return rootfs.Tools{Debootstrap: b.Tools.Debootstrap, MkfsExt4: b.Tools.MkfsExt4, Unshare: b.Tools.Unshare,
		ResolvConf: filepath.Join(b.etcDir(), "resolv.conf")}
}

func (b *Builder) etcDir() string {
	if b.EtcDir != "" {
		return b.EtcDir
	}
	return "/etc"
}

func (b *Builder) check() error {
	if b.CacheDir == "" || !filepath.IsAbs(b.CacheDir) {
		return errdefs.InvalidArgument("image builder: cache directory %q is not an absolute path", b.CacheDir)
	}
	return checkAgent(b.AgentPath)
}

// checkAgent refuses an agent that is missing or dynamically linked (the
// initramfs has no libc).
func checkAgent(path string) error {
	if path == "" {
		return errdefs.InvalidArgument("image builder: no agent binary")
	}
	fi, err := os.Stat(path)
	if err != nil {
		return errdefs.NotFound("agent binary: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return errdefs.InvalidArgument("agent binary %s is not a regular file", path)
	}
	if err := checkStatic(path); err != nil {
		return errdefs.InvalidArgument("agent binary: %w (build it with CGO_ENABLED=0)", err)
	}
	return nil
}

// Build returns the image name, building whatever is not cached yet: a
// registered recipe ("minimal", "python", ...) or an image imported
// earlier with FromOCI. An unknown name is errdefs.ErrNotFound.
func (b *Builder) Build(ctx context.Context, name string) (*Image, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	if err := b.check(); err != nil {
		return nil, err
	}
	registryMu.Lock()
	spec, ok := registry[name]
	registryMu.Unlock()
	start := time.Now()
	var (
		img *Image
		err error
	)
	if ok {
		img, err = b.buildSpec(ctx, spec)
	} else {
		img, err = b.loadImported(ctx, name)
	}
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", name, err)
	}
	b.log().Debug("image ready", "image", name, "elapsed", time.Since(start).Round(time.Millisecond))
	return img, nil
}

func (b *Builder) buildSpec(ctx context.Context, s Spec) (*Image, error) {
	// Kernel and initramfs first: they are quick, and a failure there
	// should not come after minutes of debootstrap.
	k, err := b.ensureKernel(ctx)
	if err != nil {
		return nil, err
	}
	img := &Image{Name: s.Name, Kernel: k.vmlinuz(), KernelSHA256: k.manifest.VmlinuzSHA256}
	if img.Initrd, img.InitrdSHA256, err = b.ensureInitramfs(ctx, k, s.Busybox); err != nil {
		return nil, err
	}
	if s.Rootfs == nil {
		return img, nil
	}
	rf, err := b.ensureDebootstrapRootfs(ctx, *s.Rootfs)
	if err != nil {
		return nil, err
	}
	img.Rootfs, img.RootfsSHA256 = rf.image(), rf.info.SHA256
	img.Python, img.Preload = s.Rootfs.Python, slices.Clone(s.Rootfs.Preload)
	img.Cmdline = rootCmdline(img.Python, img.Preload)
	return img, nil
}

// rootCmdline is the kernel command line an image with a root filesystem
// needs: where the root is, and the warm interpreter's settings.
func rootCmdline(python string, preload []string) []string {
	c := []string{"forkd.root=/dev/vda", "forkd.rootfstype=ext4"}
	if python != "" {
		c = append(c, "forkd.python="+python)
		if len(preload) > 0 {
			c = append(c, "forkd.preload="+strings.Join(preload, ","))
		}
	}
	return c
}
