// Package kernel fetches a guest kernel from the distribution's kernel
// package (downloaded and unpacked, never installed on the host) and picks
// the modules a forkd guest must load, in load order.
//
// Fetch writes one self-contained directory:
//
//	vmlinuz        the bzImage
//	config         the kernel's build configuration, when the package has it
//	modules/<file> the selected module files, as packaged (.ko, .ko.zst, .ko.xz)
//	kernel.json    the Manifest: package, version, release, sha256, load order
package kernel

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/image/deb"
)

// ManifestFormat is the version of the directory layout Fetch writes.
const ManifestFormat = 1

// ManifestFile is the name of the manifest inside a kernel directory.
const ManifestFile = "kernel.json"

// Manifest describes a directory written by Fetch.
type Manifest struct {
	Format        int      `json:"format"`
	Package       string   `json:"package"`
	Version       string   `json:"version"`
	Release       string   `json:"release"` // uname -r of the kernel
	VmlinuzSHA256 string   `json:"vmlinuz_sha256"`
	Want          []string `json:"want"`    // the module names asked for
	Modules       []string `json:"modules"` // files under modules/, in load order
}

// Source says where kernels come from.
type Source struct {
	Tools deb.Tools
	// Debs, when set, are local .deb files used instead of apt (offline):
	// the kernel image package first, then, if its modules live in a
	// separate package (Ubuntu's linux-modules-*), that package.
	Debs []string
	// Metas are the meta packages tried in order; nil means DefaultMetas.
	Metas []string
}

// DefaultMetas are the meta packages naming the current kernel for a
// virtual machine: Debian's cloud kernel first, then Ubuntu's.
func DefaultMetas(arch string) []string {
	return []string{"linux-image-cloud-" + arch, "linux-image-kvm", "linux-image-virtual"}
}

// Resolve returns the kernel image package Fetch would use: the one the
// first known meta package depends on, or the first of Debs.
func (s Source) Resolve(ctx context.Context) (deb.Package, error) {
	if len(s.Debs) > 0 {
		return s.Tools.Fields(ctx, s.Debs[0])
	}
	metas := s.Metas
	if metas == nil {
		metas = DefaultMetas("amd64")
	}
	var errs []error
	for _, meta := range metas {
		p, err := s.Tools.Candidate(ctx, meta)
		if errdefs.IsNotFound(err) {
			errs = append(errs, err)
			continue
		}
		if err != nil {
			return deb.Package{}, err
		}
		for _, d := range p.Depends {
			if strings.HasPrefix(d, "linux-image-") {
				return s.Tools.Candidate(ctx, d)
			}
		}
		return p, nil
	}
	return deb.Package{}, errdefs.NotFound("no kernel package: none of %s is known to apt: %w",
		strings.Join(metas, ", "), errors.Join(errs...))
}

// Fetch downloads (or takes from Debs) the kernel package pkg, unpacks it
// under dir, and leaves in dir only the files described in the package
// comment: vmlinuz, config, the modules want resolves to, and kernel.json.
// dir must exist and be empty; on error it may hold partial files, and the
// caller removes it.
func Fetch(ctx context.Context, s Source, pkg deb.Package, dir string, want []string) (*Manifest, error) {
	work := filepath.Join(dir, ".work")
	x := filepath.Join(work, "x")
	if err := os.MkdirAll(x, 0o755); err != nil {
		return nil, err
	}
	debs := s.Debs
	if len(debs) == 0 {
		p, err := s.Tools.Download(ctx, pkg, work)
		if err != nil {
			return nil, err
		}
		debs = []string{p}
	}
	if err := s.Tools.Extract(ctx, debs[0], x); err != nil {
		return nil, err
	}
	vmlinuz, release, err := findVmlinuz(x)
	if err != nil {
		return nil, fmt.Errorf("package %s: %w", pkg.Name, err)
	}
	modDir := findModuleDir(x, release)
	if modDir == "" {
		// Ubuntu ships the modules in linux-modules-<release>.
		extra := debs[1:]
		if len(s.Debs) == 0 {
			for _, d := range pkg.Depends {
				if !strings.HasPrefix(d, "linux-modules-") || strings.HasPrefix(d, "linux-modules-extra-") {
					continue
				}
				mp, err := s.Tools.Candidate(ctx, d)
				if err != nil {
					return nil, err
				}
				f, err := s.Tools.Download(ctx, mp, work)
				if err != nil {
					return nil, err
				}
				extra = append(extra, f)
			}
		}
		for _, f := range extra {
			if err := s.Tools.Extract(ctx, f, x); err != nil {
				return nil, err
			}
		}
		if modDir = findModuleDir(x, release); modDir == "" {
			return nil, errdefs.NotFound("package %s: no modules for %s (lib/modules/%s)", pkg.Name, release, release)
		}
	}
	tree, err := ScanTree(modDir)
	if err != nil {
		return nil, err
	}
	order, err := tree.LoadOrder(want)
	if err != nil {
		return nil, fmt.Errorf("kernel %s: %w", release, err)
	}

	m := &Manifest{
		Format: ManifestFormat, Package: pkg.Name, Version: pkg.Version, Release: release,
		Want: slices.Clone(want), Modules: []string{},
	}
	if m.VmlinuzSHA256, err = copyFile(vmlinuz, filepath.Join(dir, "vmlinuz")); err != nil {
		return nil, err
	}
	if config := filepath.Join(x, "boot", "config-"+release); exists(config) {
		if _, err := copyFile(config, filepath.Join(dir, "config")); err != nil {
			return nil, err
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "modules"), 0o755); err != nil {
		return nil, err
	}
	for _, mod := range order {
		if _, err := copyFile(mod.Path, filepath.Join(dir, "modules", mod.File())); err != nil {
			return nil, err
		}
		m.Modules = append(m.Modules, mod.File())
	}
	if err := os.RemoveAll(work); err != nil {
		return nil, err
	}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := fsutil.CreateFile(filepath.Join(dir, ManifestFile), append(b, '\n'), 0o644); err != nil {
		return nil, err
	}
	return m, nil
}

// ReadManifest reads and checks the manifest of a kernel directory. A
// directory whose manifest is missing, of another format, or names files
// that are absent is errdefs.ErrNotFound (it must be fetched again).
func ReadManifest(dir string) (*Manifest, error) {
	b, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		return nil, errdefs.NotFound("kernel manifest: %w", err)
	}
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, errdefs.NotFound("kernel manifest %s: %w", dir, err)
	}
	if m.Format != ManifestFormat {
		return nil, errdefs.NotFound("kernel manifest %s: format %d, want %d", dir, m.Format, ManifestFormat)
	}
	if !exists(filepath.Join(dir, "vmlinuz")) {
		return nil, errdefs.NotFound("kernel %s: vmlinuz missing", dir)
	}
	for _, f := range m.Modules {
		if filepath.Base(f) != f || !exists(filepath.Join(dir, "modules", f)) {
			return nil, errdefs.NotFound("kernel %s: module %s missing", dir, f)
		}
	}
	return &m, nil
}

func findVmlinuz(root string) (path, release string, err error) {
	var found []string
	for _, pat := range []string{"boot/vmlinuz-*", "usr/lib/linux/vmlinuz-*"} {
		m, _ := filepath.Glob(filepath.Join(root, pat))
		found = append(found, m...)
	}
	switch len(found) {
	case 0:
		return "", "", errdefs.InvalidArgument("no boot/vmlinuz-* in the package")
	case 1:
		return found[0], strings.TrimPrefix(filepath.Base(found[0]), "vmlinuz-"), nil
	default:
		return "", "", errdefs.InvalidArgument("several kernels in the package: %v", found)
	}
}

// findModuleDir returns lib/modules/<release> (or its /usr twin) under root
// if it holds at least one module file, else "".
func findModuleDir(root, release string) string {
	for _, d := range []string{"lib/modules", "usr/lib/modules"} {
		dir := filepath.Join(root, d, release)
		t, err := ScanTree(dir)
		if err == nil && len(t.Files) > 0 {
			return dir
		}
	}
	return ""
}

// copyFile copies src to a new file dst (mode 0644, fsynced) and returns
// the sha256 of the content.
func copyFile(src, dst string) (string, error) {
	in, err := os.Open(src)
	if err != nil {
		return "", err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	if _, err := io.Copy(io.MultiWriter(out, h), in); err != nil {
		out.Close()
		return "", err
	}
	if err := out.Sync(); err != nil {
		out.Close()
		return "", err
	}
	if err := out.Close(); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
