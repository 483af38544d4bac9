package sandbox

import (
	"context"
	"os"
	"path/filepath"
	"sync"

	"github.com/forkd/forkd/internal/hub"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/vmm"
)

// Hub is the engine's hub: snapshots pushed to and pulled from OCI
// registries, packed into and unpacked from layout files. Its files live
// in <data>/hub (cache, index) and <data>/content (pulled boot files).
func (e *Engine) Hub() *hub.Hub { return e.hub }

// newHub makes the engine's hub.
func (e *Engine) newHub() (*hub.Hub, error) {
	return hub.New(hub.Config{
		Dir:        filepath.Join(e.cfg.DataDir, "hub"),
		ContentDir: filepath.Join(e.cfg.DataDir, "content"),
		Store:      e.snaps,
		Host:       e.hubHost,
		Limits:     hub.Limits{MemoryMiB: MaxMemoryMiB},
		Logger:     e.log,
	})
}

var (
	hostCPUOnce sync.Once
	hostCPU     hub.CPU
)

// hubHost describes what this engine restores, for the hub to judge
// snapshots from elsewhere by.
func (e *Engine) hubHost(ctx context.Context) (hub.Host, error) {
	ver, err := e.cfg.Backend.Version(ctx)
	if err != nil {
		return hub.Host{}, err
	}
	hostCPUOnce.Do(func() {
		b, _ := os.ReadFile(filepath.Join(proc.Root, "cpuinfo"))
		hostCPU = hub.HostCPU(b)
	})
	h := hub.Host{
		Backend: e.cfg.Backend.Name(), Version: ver, Accelerator: e.cfg.Backend.Capabilities().Accelerator,
		Network: e.cfg.Net != nil, CPU: hostCPU,
	}
	if c, ok := e.cfg.Backend.(vmm.RestoreChecker); ok {
		h.Checker = c
	}
	return h, nil
}

// Push sends a snapshot (and its chain) to a registry (hub.Hub.Push).
func (e *Engine) Push(ctx context.Context, spec hub.PushSpec) (*hub.Result, error) {
	return e.hub.Push(ctx, spec)
}

// Pull fetches a snapshot (and the links of its chain this host lacks)
// from a registry (hub.Hub.Pull).
func (e *Engine) Pull(ctx context.Context, spec hub.PullSpec) (*hub.Result, error) {
	return e.hub.Pull(ctx, spec)
}

// Pack writes a snapshot (and its chain) into an OCI layout tar file
// (hub.Hub.Pack).
func (e *Engine) Pack(ctx context.Context, spec hub.PackSpec) (*hub.Result, error) {
	return e.hub.Pack(ctx, spec)
}

// Unpack reads a snapshot from a layout tar file Pack wrote
// (hub.Hub.Unpack).
func (e *Engine) Unpack(ctx context.Context, spec hub.UnpackSpec) (*hub.Result, error) {
	return e.hub.Unpack(ctx, spec)
}

// sweepContent removes the pulled boot files no snapshot uses any more.
func (e *Engine) sweepContent() {
	if removed, err := e.hub.Sweep(); err != nil {
		e.log.Warn("sweep pulled boot files", "err", err)
	} else if len(removed) > 0 {
		e.log.Info("pulled boot files removed", "files", len(removed))
	}
}
