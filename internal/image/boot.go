package image

import (
	"context"
	"debug/elf"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/image/initramfs"
	"github.com/forkd/forkd/internal/image/kernel"
)

// kernelEntry is a kernel directory in the cache.
type kernelEntry struct {
	dir      string
	manifest *kernel.Manifest
}

func (k *kernelEntry) vmlinuz() string { return filepath.Join(k.dir, "vmlinuz") }

func (b *Builder) kernelSource() kernel.Source {
	debs := b.KernelDebs
	if debs == nil {
		if v := os.Getenv(KernelDebEnv); v != "" {
			debs = filepath.SplitList(v)
		}
	}
	return kernel.Source{Tools: b.debTools(), Debs: debs, Metas: kernel.DefaultMetas(runtime.GOARCH)}
}

// ensureKernel returns the cached kernel of the current kernel package,
// fetching it first if needed.
func (b *Builder) ensureKernel(ctx context.Context) (*kernelEntry, error) {
	src := b.kernelSource()
	pkg, err := src.Resolve(ctx)
	if err != nil {
		return nil, err
	}
	want := kernel.DefaultModules
	var m *kernel.Manifest
	valid := func(dir string) error {
		mm, err := kernel.ReadManifest(dir)
		if err != nil {
			return err
		}
		if !slices.Equal(mm.Want, want) {
			return errdefs.NotFound("kernel %s was fetched for other modules", dir)
		}
		m = mm
		return nil
	}
	dir, err := b.ensureDir(ctx, kindKernel, pkg.Key(), valid, func(ctx context.Context, staging string) error {
		start := time.Now()
		b.progressf(ctx, "kernel: fetching %s %s", pkg.Name, pkg.Version)
		mm, err := kernel.Fetch(ctx, src, pkg, staging, want)
		if err != nil {
			return err
		}
		m = mm
		b.progressf(ctx, "kernel: %s, %d modules (%s)", mm.Release, len(mm.Modules), time.Since(start).Round(time.Millisecond))
		b.log().Info("kernel fetched", "step", "kernel", "package", pkg.Name, "version", pkg.Version,
			"elapsed", time.Since(start).Round(time.Millisecond))
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &kernelEntry{dir: dir, manifest: m}, nil
}

// busyboxEntry is a static busybox and its applets.
type busyboxEntry struct {
	path    string
	applets []string
}

// ensureBusybox returns Builder.BusyboxPath, or Debian's busybox-static
// (downloaded, not installed) from the cache.
func (b *Builder) ensureBusybox(ctx context.Context) (*busyboxEntry, error) {
	if b.BusyboxPath != "" {
		if err := checkStatic(b.BusyboxPath); err != nil {
			return nil, err
		}
		applets, err := initramfs.Applets(ctx, b.BusyboxPath)
		if err != nil {
			return nil, err
		}
		return &busyboxEntry{path: b.BusyboxPath, applets: applets}, nil
	}
	t := b.debTools()
	pkg, err := t.Candidate(ctx, "busybox-static")
	if err != nil {
		return nil, err
	}
	valid := func(dir string) error {
		for _, f := range []string{"busybox", "applets"} {
			if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
				return err
			}
		}
		return nil
	}
	dir, err := b.ensureDir(ctx, kindBusybox, pkg.Key(), valid, func(ctx context.Context, staging string) error {
		b.progressf(ctx, "busybox: fetching %s %s", pkg.Name, pkg.Version)
		work := filepath.Join(staging, ".work")
		x := filepath.Join(work, "x")
		if err := os.MkdirAll(x, 0o755); err != nil {
			return err
		}
		f, err := t.Download(ctx, pkg, work)
		if err != nil {
			return err
		}
		if err := t.Extract(ctx, f, x); err != nil {
			return err
		}
		src := ""
		for _, p := range []string{"bin/busybox", "usr/bin/busybox"} {
			if fi, err := os.Lstat(filepath.Join(x, p)); err == nil && fi.Mode().IsRegular() {
				src = filepath.Join(x, p)
				break
			}
		}
		if src == "" {
			return errdefs.NotFound("package %s has no busybox binary", pkg.Name)
		}
		if err := checkStatic(src); err != nil {
			return err
		}
		dst := filepath.Join(staging, "busybox")
		if err := copyFile(src, dst, 0o755); err != nil {
			return err
		}
		applets, err := initramfs.Applets(ctx, dst)
		if err != nil {
			return err
		}
		if err := fsutil.CreateFile(filepath.Join(staging, "applets"), []byte(strings.Join(applets, "\n")+"\n"), 0o644); err != nil {
			return err
		}
		return os.RemoveAll(work)
	})
	if err != nil {
		return nil, err
	}
	list, err := os.ReadFile(filepath.Join(dir, "applets"))
	if err != nil {
		return nil, err
	}
	return &busyboxEntry{path: filepath.Join(dir, "busybox"), applets: strings.Fields(string(list))}, nil
}

// ensureInitramfs returns the path and sha256 of the initramfs for kernel
// k, the builder's agent and, with withBusybox, a busybox. Its cache name
// is the hash of all its inputs.
func (b *Builder) ensureInitramfs(ctx context.Context, k *kernelEntry, withBusybox bool) (string, string, error) {
	agentSHA, err := sha256File(b.AgentPath)
	if err != nil {
		return "", "", errdefs.NotFound("agent binary: %w", err)
	}
	spec := initramfs.Spec{Agent: b.AgentPath}
	for _, f := range k.manifest.Modules {
		spec.Modules = append(spec.Modules, initramfs.Module{File: f, Path: filepath.Join(k.dir, "modules", f)})
	}
	parts := []string{builderVersion, "initramfs", k.manifest.Package, k.manifest.Version,
		strings.Join(k.manifest.Modules, ","), agentSHA}
	if withBusybox {
		bb, err := b.ensureBusybox(ctx)
		if err != nil {
			return "", "", err
		}
		bbSHA, err := sha256File(bb.path)
		if err != nil {
			return "", "", err
		}
		spec.Busybox, spec.Applets = bb.path, bb.applets
		parts = append(parts, "busybox", bbSHA, strings.Join(bb.applets, ","))
	}
	name := hashKey(parts...) + ".cpio.gz"
	path, err := b.ensureFile(ctx, kindInitramfs, name, func(w io.Writer) error {
		b.progressf(ctx, "initramfs: writing (%d modules%s)", len(spec.Modules), map[bool]string{true: ", busybox"}[withBusybox])
		return initramfs.Write(w, spec)
	})
	if err != nil {
		return "", "", err
	}
	sum, err := sha256File(path)
	return path, sum, err
}

// checkStatic refuses a binary that is not a statically linked ELF file.
func checkStatic(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return errdefs.InvalidArgument("%s is not an ELF executable: %w", path, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return errdefs.InvalidArgument("%s is dynamically linked", path)
		}
	}
	return nil
}

// copyFile copies src to the new file dst with mode perm and syncs it.
func copyFile(src, dst string, perm os.FileMode) (err error) {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, out.Close()) }()
	if _, err := io.Copy(out, in); err != nil {
		return err
	}
	if err := out.Chmod(perm); err != nil {
		return err
	}
	return out.Sync()
}
