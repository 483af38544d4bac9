package image

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/image/rootfs"
)

const (
	rootfsImage    = "rootfs.ext4"
	rootfsManifest = "rootfs.json"
	rootfsFormat   = 1
)

// GuestUser is the unprivileged account of the built-in images with a
// root filesystem (the minimal image's initramfs has it too, with
// /bin/sh): E2B's default user.
var GuestUser = rootfs.User{Name: "user", UID: 1000, GID: 1000, Home: "/home/user", Shell: "/bin/bash"}

// rootfsInfo is the manifest of a root filesystem in the cache.
type rootfsInfo struct {
	Format int    `json:"format"`
	Key    string `json:"key"`
	Source string `json:"source"` // "debootstrap" or "oci"
	// debootstrap
	Suite    string   `json:"suite,omitempty"`
	Mirror   string   `json:"mirror,omitempty"`
	Variant  string   `json:"variant,omitempty"`
	Packages []string `json:"packages,omitempty"`
	// oci
	Ref    string   `json:"ref,omitempty"`
	Digest string   `json:"digest,omitempty"`
	Extra  []string `json:"extra,omitempty"`

	Python  string    `json:"python,omitempty"` // python3 found in the tree
	SHA256  string    `json:"sha256"`
	Size    int64     `json:"size"`
	Created time.Time `json:"created"`
}

type rootfsEntry struct {
	dir  string
	info *rootfsInfo
}

func (r *rootfsEntry) image() string { return filepath.Join(r.dir, rootfsImage) }

func readRootfsInfo(dir string) (*rootfsInfo, error) {
	b, err := os.ReadFile(filepath.Join(dir, rootfsManifest))
	if err != nil {
		return nil, errdefs.NotFound("rootfs manifest: %w", err)
	}
	var m rootfsInfo
	if err := json.Unmarshal(b, &m); err != nil || m.Format != rootfsFormat {
		return nil, errdefs.NotFound("rootfs manifest %s: unreadable or another format", dir)
	}
	fi, err := os.Stat(filepath.Join(dir, rootfsImage))
	if err != nil || fi.Size() != m.Size {
		return nil, errdefs.NotFound("rootfs %s: image missing or of the wrong size", dir)
	}
	return &m, nil
}

// ensureRootfs returns <cache>/rootfs/<key>, building it first if needed:
// fill populates tree (an empty directory) and completes the manifest; the
// tree is then written to an ext4 image and removed.
func (b *Builder) ensureRootfs(ctx context.Context, key string,
	fill func(ctx context.Context, tree string, info *rootfsInfo) error) (*rootfsEntry, error) {
	var info *rootfsInfo
	valid := func(dir string) error {
		m, err := readRootfsInfo(dir)
		info = m
		return err
	}
	dir, err := b.ensureDir(ctx, kindRootfs, key, valid, func(ctx context.Context, staging string) error {
		tree := filepath.Join(staging, "tree")
		if err := os.Mkdir(tree, 0o755); err != nil {
			return err
		}
		m := &rootfsInfo{Format: rootfsFormat, Key: key}
		if err := fill(ctx, tree, m); err != nil {
			return err
		}
		start := time.Now()
		b.progressf(ctx, "rootfs: writing the ext4 image")
		size, err := b.rootfsTools().MakeExt4(ctx, tree, filepath.Join(staging, rootfsImage), rootfs.Ext4Options{UUIDSeed: key})
		if err != nil {
			return err
		}
		if err := removeTree(tree); err != nil {
			return err
		}
		if m.SHA256, err = sha256File(filepath.Join(staging, rootfsImage)); err != nil {
			return err
		}
		m.Size, m.Created = size, time.Now().UTC()
		data, err := json.MarshalIndent(m, "", "  ")
		if err != nil {
			return err
		}
		if err := fsutil.CreateFile(filepath.Join(staging, rootfsManifest), append(data, '\n'), 0o644); err != nil {
			return err
		}
		b.progressf(ctx, "rootfs: %d MiB ext4 image (%s)", size>>20, time.Since(start).Round(time.Millisecond))
		info = m
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &rootfsEntry{dir: dir, info: info}, nil
}

// debootstrapKey returns the cache key of s's root filesystem, with the
// distribution and the sorted packages it is built from.
func (b *Builder) debootstrapKey(s RootfsSpec) (key string, d distro, pkgs []string) {
	d = b.hostDistro()
	if s.Suite != "" {
		d.suite = s.Suite
	}
	if s.Mirror != "" {
		d.mirror = s.Mirror
	}
	pkgs = slices.Clone(s.Packages)
	sort.Strings(pkgs)
	key = hashKey(builderVersion, "debootstrap", d.suite, d.mirror, s.Variant,
		strings.Join(d.components, ","), strings.Join(pkgs, ","), "user="+GuestUser.Name)
	return key, d, pkgs
}

// ensureDebootstrapRootfs builds (or finds) the root filesystem of a
// debootstrap recipe. Its key is the hash of suite, mirror, variant,
// components, packages and builderVersion.
func (b *Builder) ensureDebootstrapRootfs(ctx context.Context, s RootfsSpec) (*rootfsEntry, error) {
	key, d, pkgs := b.debootstrapKey(s)
	return b.ensureRootfs(ctx, key, func(ctx context.Context, tree string, m *rootfsInfo) error {
		start := time.Now()
		b.progressf(ctx, "rootfs: debootstrap %s %s from %s with %s (takes minutes)", s.Variant, d.suite, d.mirror, strings.Join(pkgs, ","))
		err := b.rootfsTools().Bootstrap(ctx, rootfs.Bootstrap{
			Suite: d.suite, Mirror: d.mirror, Variant: s.Variant, Components: d.components, Include: pkgs,
		}, tree, b.progress(ctx))
		if err != nil {
			return err
		}
		b.log().Info("debootstrap done", "step", "rootfs", "suite", d.suite, "elapsed", time.Since(start).Round(time.Second))
		t, err := rootfs.OpenTree(tree)
		if err != nil {
			return err
		}
		defer t.Close()
		if err := trimApt(t); err != nil {
			return err
		}
		if err := rootfs.EnsureMountpoints(t); err != nil {
			return err
		}
		if err := rootfs.AddUser(t, GuestUser); err != nil {
			return err
		}
		m.Python = rootfs.FindPython(t)
		if s.Python != "" {
			if _, err := t.Stat(strings.TrimPrefix(s.Python, "/")); err != nil {
				return errdefs.FailedPrecondition("debootstrap left no %s: %w", s.Python, err)
			}
			m.Python = s.Python
		}
		m.Source, m.Suite, m.Mirror, m.Variant, m.Packages = "debootstrap", d.suite, d.mirror, s.Variant, pkgs
		return nil
	})
}

// trimApt removes downloaded packages and package lists from a tree: the
// guest never runs apt-get from its read-only root.
func trimApt(t *rootfs.Tree) error {
	var errs []error
	for _, dir := range []string{"var/cache/apt/archives", "var/lib/apt/lists"} {
		names, err := t.ReadDirNames(dir)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		for _, n := range names {
			if n == "partial" || n == "lock" {
				continue
			}
			errs = append(errs, t.RemoveAll(dir+"/"+n))
		}
	}
	for _, f := range []string{"var/cache/apt/pkgcache.bin", "var/cache/apt/srcpkgcache.bin"} {
		errs = append(errs, t.RemoveAll(f))
	}
	return errors.Join(errs...)
}
