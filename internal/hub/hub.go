package hub

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/vmm"
)

// Host is what this host restores: a snapshot from elsewhere must match it.
type Host struct {
	Backend     string // the VMM backend's name
	Version     string // its version (major.minor must match)
	Accelerator string
	// Network: children can have their own network namespace (root).
	Network bool
	CPU     CPU
	// Checker, if set, is the backend's own check of a machine identity.
	Checker vmm.RestoreChecker
}

// Config configures a Hub.
type Config struct {
	// Dir holds the hub's own files: the cache of verified blobs of pulls
	// (blobs/), the index of artifacts pulled and pushed (index.json) and
	// what pushes encoded (pushed/).
	Dir string
	// ContentDir holds boot files pulled (kernels, initramfs, root
	// filesystems), one file per sha256, shared by every snapshot that
	// uses one and swept once none does.
	ContentDir string
	Store      *snapshot.Store
	// Host describes this host; it is asked once per pull.
	Host   func(ctx context.Context) (Host, error)
	Limits Limits
	// Workers encode or decode chunks at once (default: CPUs).
	Workers int
	Logger  *slog.Logger
}

// Hub pushes snapshots of a store to registries and OCI layout files, and
// pulls them back. Safe for concurrent use.
type Hub struct {
	cfg     Config
	log     *slog.Logger
	cache   *blobCache
	content *contentStore
	index   *index
}

// New returns a Hub over cfg.
func New(cfg Config) (*Hub, error) {
	if cfg.Store == nil || cfg.Dir == "" || cfg.ContentDir == "" || cfg.Host == nil {
		return nil, errdefs.InvalidArgument("hub: store, dirs and host are required")
	}
	cfg.Limits = cfg.Limits.withDefaults()
	if cfg.Workers <= 0 {
		cfg.Workers = max(2, runtime.NumCPU())
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	for _, d := range []string{cfg.Dir, cfg.ContentDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("hub: %w", err)
		}
	}
	return &Hub{
		cfg:     cfg,
		log:     cfg.Logger,
		cache:   &blobCache{dir: filepath.Join(cfg.Dir, "blobs", "sha256")},
		content: &contentStore{dir: cfg.ContentDir},
		index:   &index{path: filepath.Join(cfg.Dir, "index.json")},
	}, nil
}

// Sweep removes the pulled boot files no snapshot uses any more (see
// Config.ContentDir). It does nothing while a pull or unpack runs (they
// hold the content store); the next sweep does it. It returns what it
// removed.
func (h *Hub) Sweep() ([]string, error) {
	snaps, err := h.cfg.Store.List()
	if err != nil {
		return nil, err
	}
	used := map[string]bool{}
	for _, sn := range snaps {
		for _, p := range []string{sn.Kernel.Path, sn.Initrd.Path, sn.Rootfs.Path} {
			if p != "" {
				used[filepath.Clean(p)] = true
			}
		}
	}
	// A staging snapshot (a pull or a build under way) is listed too when
	// its writer lives; a pull holds the content store besides.
	return h.content.sweep(used)
}

// compatible says why this host cannot restore the snapshot c describes
// (FailedPrecondition), before anything but its config was fetched.
func (h *Hub) compatible(ctx context.Context, host Host, c *ArtifactConfig) error {
	why := func(format string, args ...any) error {
		return errdefs.FailedPrecondition("snapshot %s cannot be restored here: "+format, append([]any{c.Tag}, args...)...)
	}
	switch {
	case c.Backend != host.Backend:
		return why("it was made by backend %s; this forkd runs %s", c.Backend, host.Backend)
	case majorMinor(c.BackendVersion) != majorMinor(host.Version):
		return why("it was made by %s %s; this host has %s (the major.minor versions must match)", c.Backend, c.BackendVersion, host.Version)
	case c.Accelerator != host.Accelerator:
		return why("it was made under %s; this host runs %s", c.Accelerator, host.Accelerator)
	case c.Network && !host.Network:
		return why("it has a NIC: its children need their own network namespaces, which need forkd running as root")
	}
	if c.Accelerator == "kvm" {
		var missing []string
		for _, f := range c.CPU.Flags {
			if !slices.Contains(host.CPU.Flags, f) {
				missing = append(missing, f)
			}
		}
		if len(missing) > 0 {
			return why("it was made on a %s whose CPU flags this host lacks: %s", c.CPU.Model, strings.Join(missing, " "))
		}
	}
	if host.Checker != nil {
		if err := host.Checker.CheckRestore(ctx, c.Machine); err != nil {
			if errdefs.IsFailedPrecondition(err) {
				return why("%v", err)
			}
			return fmt.Errorf("snapshot %s: %w", c.Tag, err)
		}
	}
	return nil
}

func majorMinor(v string) string {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return v
	}
	return parts[0] + "." + parts[1]
}

// HostCPU reads this host's CPU from cpuinfo (the content of
// /proc/cpuinfo): vendor, model name and flags of its first CPU.
func HostCPU(cpuinfo []byte) CPU {
	var c CPU
	sc := bufio.NewScanner(bytes.NewReader(cpuinfo))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		key, val, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			if c.Flags != nil {
				break // end of the first CPU
			}
			continue
		}
		key, val = strings.TrimSpace(key), strings.TrimSpace(val)
		switch key {
		case "vendor_id":
			c.Vendor = val
		case "model name":
			c.Model = val
		case "flags":
			c.Flags = strings.Fields(val)
			slices.Sort(c.Flags)
		}
	}
	return c
}
