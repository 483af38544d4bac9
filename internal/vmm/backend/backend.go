// Package backend is the one place where a VMM backend is chosen and
// made. Callers name the kind they want (or take the default) and get a
// vmm.Backend; no backend registers itself by init side effects.
package backend

import (
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/vmm"
	"github.com/forkd/forkd/internal/vmm/qemu"
)

// Kinds of backend.
const (
	QEMU = "qemu"
)

// Options choose and configure a backend.
type Options struct {
	// Kind is the backend ("" or "qemu"; Firecracker is not written yet).
	Kind string
	// QEMU configures the QEMU backend.
	QEMU qemu.Options
}

// New returns the backend opts name.
func New(opts Options) (vmm.Backend, error) {
	switch opts.Kind {
	case "", QEMU:
		return qemu.New(opts.QEMU)
	}
	return nil, errdefs.InvalidArgument("VMM backend %q: want %s", opts.Kind, QEMU)
}
