package proc

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// SysBlock is where block devices show in sysfs; tests point it elsewhere.
var SysBlock = "/sys/block"

// Zram is the use of one zram device: what it stores, and the RAM that
// takes, compressed.
type Zram struct {
	Device string // zram0
	// Stored is what it holds, uncompressed (mm_stat's orig_data_size);
	// Used the RAM its pool takes for that (mem_used_total), which
	// grows apart from Stored as stored pages are freed, until the pool
	// is compacted.
	Stored, Used int64
}

// ZramDevices returns the use of each of the host's zram devices that
// stores something. A host without zram has none.
func ZramDevices() ([]Zram, error) {
	devs, err := filepath.Glob(filepath.Join(SysBlock, "zram*"))
	if err != nil {
		return nil, err
	}
	var out []Zram
	var errs []error
	for _, d := range devs {
		z, err := zramUse(d)
		switch {
		case errors.Is(err, os.ErrNotExist):
			// Being removed, or not set up: it stores nothing.
		case err != nil:
			errs = append(errs, err)
		case z.Stored > 0:
			out = append(out, z)
		}
	}
	return out, errors.Join(errs...)
}

// zramUse reads the mm_stat of the zram device at dir.
func zramUse(dir string) (Zram, error) {
	z := Zram{Device: filepath.Base(dir)}
	b, err := os.ReadFile(filepath.Join(dir, "mm_stat"))
	if err != nil {
		return z, err
	}
	f := bytes.Fields(b)
	if len(f) < 3 {
		return z, fmt.Errorf("%s/mm_stat: %d fields, want at least 3", dir, len(f))
	}
	if z.Stored, err = strconv.ParseInt(string(f[0]), 10, 64); err == nil {
		z.Used, err = strconv.ParseInt(string(f[2]), 10, 64)
	}
	if err != nil {
		return z, fmt.Errorf("%s/mm_stat: %w", dir, err)
	}
	return z, nil
}

// CompactZramSwap asks each zram device the host swaps to to compact its
// pool: pages swapped back in leave holes there that still take RAM. It
// returns how many it compacted and the RAM that freed.
func CompactZramSwap() (devices int, freed int64, err error) {
	b, err := os.ReadFile(filepath.Join(Root, "swaps"))
	if err != nil {
		return 0, 0, err
	}
	var errs []error
	for _, d := range ParseSwaps(b) {
		if !d.Zram() {
			continue
		}
		dir := filepath.Join(SysBlock, filepath.Base(d.Path))
		before, err := zramUse(dir)
		if err == nil {
			err = os.WriteFile(filepath.Join(dir, "compact"), []byte("1"), 0)
		}
		var after Zram
		if err == nil {
			after, err = zramUse(dir)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("compact %s: %w", before.Device, err))
			continue
		}
		devices++
		freed += max(0, before.Used-after.Used)
	}
	return devices, freed, errors.Join(errs...)
}

// SwapDevice is a swap device or file of /proc/swaps: its path and the
// priority the kernel fills it in (higher first).
type SwapDevice struct {
	Path     string
	Priority int64
}

// Zram reports whether d is a zram device: what is paged out to it stays
// in RAM, compressed, and comes back without a disk read.
func (d SwapDevice) Zram() bool { return strings.HasPrefix(filepath.Base(d.Path), "zram") }

// ParseSwaps returns the swap devices a /proc/swaps text lists, past its
// heading; a line it cannot read is left out.
func ParseSwaps(b []byte) []SwapDevice {
	var out []SwapDevice
	for i, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(line)
		if i == 0 || len(f) < 5 {
			continue
		}
		prio, err := strconv.ParseInt(f[4], 10, 64)
		if err != nil {
			continue
		}
		out = append(out, SwapDevice{Path: f[0], Priority: prio})
	}
	return out
}

// SwapsToZram reports whether the swap the kernel fills first (the
// highest priority in /proc/swaps) is a zram device. A host without swap
// has none.
func SwapsToZram() (bool, error) {
	b, err := os.ReadFile(filepath.Join(Root, "swaps"))
	if err != nil {
		return false, err
	}
	best, zram := int64(math.MinInt64), false
	for _, d := range ParseSwaps(b) {
		if d.Priority > best {
			best, zram = d.Priority, d.Zram()
		}
	}
	return zram, nil
}
