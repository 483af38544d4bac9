package qemu

import (
	"context"
	"regexp"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/vmm"
)

var _ vmm.RestoreChecker = (*Backend)(nil)

// tcgCPU is the CPU model of machines under TCG (see newConfig).
const tcgCPU = "qemu64,+arat"

var (
	configVersionRE = regexp.MustCompile(`^[0-9]{1,4}\.[0-9]{1,4}(\.[0-9]{1,6})?$`)
	macRE           = regexp.MustCompile(`^[0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2}){5}$`)
)

// Bounds of a machine config from elsewhere (see validate).
const (
	maxConfigMemoryMiB = 1 << 20
	maxConfigVCPUs     = 255
	maxConfigDisks     = 8
	maxConfigNICs      = 8
	maxConfigTBSizeMiB = 4096
	maxConfigTSCkHz    = 100_000_000
)

// CheckRestore implements vmm.RestoreChecker: the config must decode, be
// one this code builds the same argv for, hold only values this backend
// makes (every field reaches QEMU's command line, so one from a registry
// must not smuggle options in), and be compatible with this host's QEMU
// and accelerator.
func (b *Backend) CheckRestore(ctx context.Context, config []byte) error {
	cfg, err := decodeConfig(config)
	if err != nil {
		return err
	}
	if err := cfg.validate(); err != nil {
		return err
	}
	return b.compatible(ctx, cfg)
}

// validate checks every field of c against what newConfig makes. It
// fails with an InvalidArgument-class error naming the field.
func (c machineConfig) validate() error {
	bad := func(field string, v any) error {
		return errdefs.InvalidArgument("qemu machine config: %s %v is not one this forkd makes", field, v)
	}
	switch {
	case !configVersionRE.MatchString(c.Version):
		return bad("qemu_version", errdefs.Quote(c.Version))
	case c.Accel != "tcg" && c.Accel != "kvm":
		return bad("accel", errdefs.Quote(c.Accel))
	case c.Accel == "tcg" && c.CPU != tcgCPU, c.Accel == "kvm" && c.CPU != "host":
		return bad("cpu", errdefs.Quote(c.CPU))
	case c.TBSizeMiB < 0 || c.TBSizeMiB > maxConfigTBSizeMiB:
		return bad("tb_size_mib", c.TBSizeMiB)
	case c.MemoryMiB < 64 || c.MemoryMiB > maxConfigMemoryMiB:
		return bad("memory_mib", c.MemoryMiB)
	case c.VCPUs < 1 || c.VCPUs > maxConfigVCPUs:
		return bad("vcpus", c.VCPUs)
	case c.Disks < 0 || c.Disks > maxConfigDisks:
		return bad("disks", c.Disks)
	case len(c.NICs) > maxConfigNICs:
		return bad("nic count", len(c.NICs))
	case c.TSCkHz < 0 || c.TSCkHz > maxConfigTSCkHz:
		return bad("tsc_khz", c.TSCkHz)
	}
	for _, mac := range c.NICs {
		if !macRE.MatchString(mac) {
			return bad("nic mac", errdefs.Quote(mac))
		}
	}
	return nil
}
