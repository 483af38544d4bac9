package memimage

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/vmm"
)

// Copy's batching: one read syscall moves at most maxCopyChunk bytes, from
// at most maxCopyIov runs (process_vm_readv takes up to IOV_MAX = 1024
// remote ranges).
const (
	maxCopyChunk = 2 << 20
	maxCopyIov   = 512
)

// copyBufs holds Copy's buffers (*[maxCopyChunk]byte) between calls, so
// that a copy during a guest's pause reuses memory one before it faulted in.
var copyBufs = sync.Pool{New: func() any { return new([maxCopyChunk]byte) }}

// processVMReadv is unix.ProcessVMReadv; tests replace it to take the
// /proc/PID/mem path.
var processVMReadv = unix.ProcessVMReadv

// Copy copies pages of mm's image out of the process into dst, each at its
// image offset (page index * PageSize), and returns the bytes copied. dst
// is written with pwrite and never truncated; the caller sizes it (see
// CreateLayer). pages must be valid
// and fit in the image, and mm's regions whole pages of pages.PageSize
// (InvalidArgument otherwise).
//
// It reads with process_vm_readv, up to 2 MiB from up to 512 runs per
// syscall, and falls back to preads of proc.Root/PID/mem when that syscall
// is not allowed (seccomp) or absent; then it writes each run with one
// pwrite (a run split across two regions is written whole).
// The process must be ptrace-able by the caller, as for Private.
//
// Errors: NotFound when the process does not exist or exits, or a page's
// address is not mapped; FailedPrecondition without permission;
// ResourceExhausted when dst's filesystem is full. On error the bytes
// returned were written and the rest of dst is as it was.
//
// The copy is consistent only while the guest is paused; a copy of a
// running guest (a pre-copy) may tear pages the guest writes meanwhile, and
// must be followed by one in the pause. Measured costs are in the package
// doc.
func Copy(mm vmm.MemoryMap, pages Pages, dst *os.File) (int64, error) {
	ps := pages.PageSize
	if len(pages.Runs) == 0 {
		ps = os.Getpagesize()
	}
	if err := checkMap(mm, ps); err != nil {
		return 0, err
	}
	if err := pages.Validate(uint64(ImageSize(mm)) / uint64(ps)); err != nil {
		return 0, err
	}
	if len(pages.Runs) == 0 {
		return 0, nil
	}
	buf := copyBufs.Get().(*[maxCopyChunk]byte)
	defer copyBufs.Put(buf)
	c := &copier{pid: mm.PID, dst: dst, buf: buf[:]}
	defer func() {
		if c.mem != nil {
			c.mem.Close()
		}
	}()

	// Walk the runs and the regions together, both in image order.
	ri, regionStart := 0, int64(0) // the region holding off, and its image offset
	for _, r := range pages.Runs {
		off, n := int64(r.Start)*int64(ps), int64(r.Count)*int64(ps)
		for n > 0 {
			for off >= regionStart+int64(mm.Regions[ri].Size) {
				regionStart += int64(mm.Regions[ri].Size)
				ri++
			}
			reg := mm.Regions[ri]
			k := min(n, regionStart+int64(reg.Size)-off)
			if err := c.add(reg.HostAddr+uint64(off-regionStart), off, k); err != nil {
				return c.copied, err
			}
			off, n = off+k, n-k
		}
	}
	err := c.flush()
	return c.copied, err
}

// copier batches ranges of a process's memory into buf, reads them with one
// syscall and writes them to dst.
type copier struct {
	pid    int
	dst    *os.File
	buf    []byte
	segs   []segment // pending ranges, filling buf[:fill] in order
	fill   int
	local  [1]unix.Iovec
	remote []unix.RemoteIovec
	mem    *os.File // proc.Root/PID/mem, once process_vm_readv failed
	copied int64
}

// segment is n bytes at addr in the process, for image offset off.
type segment struct {
	addr uint64
	off  int64
	n    int
}

// add queues n bytes at addr for image offset off, flushing as the buffer
// or the range list fills.
func (c *copier) add(addr uint64, off, n int64) error {
	for n > 0 {
		if c.fill == len(c.buf) || len(c.segs) == maxCopyIov {
			if err := c.flush(); err != nil {
				return err
			}
		}
		k := int(min(n, int64(len(c.buf)-c.fill)))
		if i := len(c.segs) - 1; i >= 0 && c.segs[i].addr+uint64(c.segs[i].n) == addr && c.segs[i].off+int64(c.segs[i].n) == off {
			c.segs[i].n += k
		} else {
			c.segs = append(c.segs, segment{addr: addr, off: off, n: k})
		}
		c.fill += k
		addr, off, n = addr+uint64(k), off+int64(k), n-int64(k)
	}
	return nil
}

// flush reads the pending ranges and writes them to dst, one pwrite per
// range of consecutive image offsets.
func (c *copier) flush() error {
	if c.fill == 0 {
		return nil
	}
	if err := c.read(); err != nil {
		return err
	}
	pos := 0
	for i := 0; i < len(c.segs); {
		off, n := c.segs[i].off, 0
		for ; i < len(c.segs) && c.segs[i].off == off+int64(n); i++ {
			n += c.segs[i].n
		}
		if _, err := c.dst.WriteAt(c.buf[pos:pos+n], off); err != nil {
			return writeError(fmt.Errorf("write image: %w", err))
		}
		pos += n
		c.copied += int64(n)
	}
	c.segs, c.fill = c.segs[:0], 0
	return nil
}

// read fills buf[:fill] from the pending ranges.
func (c *copier) read() error {
	if c.mem == nil {
		err := c.readv()
		if !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EPERM) {
			return err
		}
		f, oerr := os.Open(filepath.Join(proc.Root, strconv.Itoa(c.pid), "mem"))
		if oerr != nil {
			return procError(c.pid, "mem", oerr)
		}
		c.mem = f
	}
	return c.preadMem()
}

// readv reads the pending ranges with process_vm_readv. It returns ENOSYS
// and EPERM bare, for read to fall back on; other errors are classed.
func (c *copier) readv() error {
	done, si, skip := 0, 0, 0 // bytes read; the segment and offset in it to read next
	for done < c.fill {
		c.remote = c.remote[:0]
		for k := si; k < len(c.segs); k++ {
			s, b := c.segs[k], 0
			if k == si {
				b = skip
			}
			c.remote = append(c.remote, unix.RemoteIovec{Base: uintptr(s.addr) + uintptr(b), Len: s.n - b})
		}
		c.local[0].Base = &c.buf[done]
		c.local[0].SetLen(c.fill - done)
		n, err := processVMReadv(c.pid, c.local[:], c.remote, 0)
		switch {
		case errors.Is(err, unix.ENOSYS) || (errors.Is(err, unix.EPERM) && done == 0):
			return err
		case errors.Is(err, unix.EFAULT) || (err == nil && n == 0):
			return errdefs.NotFound("address %#x is not mapped in process %d", c.remote[0].Base, c.pid)
		case err != nil:
			return procError(c.pid, "process_vm_readv", err)
		}
		done += n
		for n > 0 { // a partial read stops at a range that faulted: retry from there
			if r := c.segs[si].n - skip; n < r {
				skip, n = skip+n, 0
			} else {
				si, skip, n = si+1, 0, n-r
			}
		}
	}
	return nil
}

// preadMem reads the pending ranges from proc.Root/PID/mem, one pread per
// range of consecutive addresses.
func (c *copier) preadMem() error {
	pos := 0
	for i := 0; i < len(c.segs); {
		addr, n := c.segs[i].addr, 0
		for ; i < len(c.segs) && c.segs[i].addr == addr+uint64(n); i++ {
			n += c.segs[i].n
		}
		if _, err := c.mem.ReadAt(c.buf[pos:pos+n], int64(addr)); err != nil {
			switch {
			case errors.Is(err, io.EOF):
				return errdefs.NotFound("process %d exited while its memory was read", c.pid)
			case errors.Is(err, unix.EIO), errors.Is(err, unix.EFAULT):
				return errdefs.NotFound("address %#x is not mapped in process %d: %w", addr, c.pid, err)
			}
			return procError(c.pid, "mem", err)
		}
		pos += n
	}
	return nil
}
