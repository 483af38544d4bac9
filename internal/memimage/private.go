package memimage

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"sync"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/vmm"
)

// The bits of a /proc/PID/pagemap entry that Private reads
// (Documentation/admin-guide/mm/pagemap.rst). None needs CAP_SYS_ADMIN;
// only the page frame numbers do, and they are not read.
const (
	pmPresent = 1 << 63 // a page is mapped
	pmSwapped = 1 << 62 // a swap (or migration) entry
	pmFile    = 1 << 61 // the page is a file page or shared anonymous
)

// maxPagemapRead bounds one pread of pagemap (8 bytes per page): 16 MiB of
// entries cover 8 GiB of guest RAM, so a region up to that size is read in
// one syscall.
const maxPagemapRead = 16 << 20

// pagemapBufs holds pagemap read buffers (*[]byte) between calls, so that
// a scan during a guest's pause reuses memory a scan before it faulted in.
var pagemapBufs sync.Pool

// Private returns the pages of mm's image that the process has made
// private: the ones its guest wrote since the mapping was made
// (copy-on-write), which differ from the file mm's RAM is mapped from.
//
// A page is private when its pagemap entry is present or swapped and not a
// file page. A page never touched, or only read (a page-cache page, the file
// bit set), reads from the file; a swapped page is anonymous and was
// written; a file page under migration shows swapped and file and is not
// private. Pages are returned canonical (see Pages), PageSize the host's.
//
// It reads proc.Root/PID/maps once, to check that every region is mapped
// (pagemap reports an unmapped page as one never touched), then pagemap in
// one pread per region (per 8 GiB of region). It must be able to ptrace the
// process (root, or the same user). Each region's HostAddr and Size must be
// page-aligned.
//
// Errors: NotFound when the process does not exist or exits during the scan,
// or when a region is not mapped; FailedPrecondition when the process
// cannot be read (permission); InvalidArgument for a malformed mm.
//
// In an anonymous mapping (RAM not mapped from a file), a page only read
// maps the shared zero page, which pagemap does not tell from a written
// page: it counts as private, and copying it is correct but wasted.
//
// The result is exact only while the guest is paused; on a running guest it
// is already stale. Measured costs are in the package doc.
func Private(mm vmm.MemoryMap) (Pages, error) {
	ps := os.Getpagesize()
	if err := checkMap(mm, ps); err != nil {
		return Pages{}, err
	}
	pm, err := os.Open(filepath.Join(proc.Root, strconv.Itoa(mm.PID), "pagemap"))
	if err != nil {
		return Pages{}, procError(mm.PID, "pagemap", err)
	}
	defer pm.Close()
	if err := checkMapped(mm); err != nil {
		return Pages{}, err
	}

	bp, _ := pagemapBufs.Get().(*[]byte)
	if bp == nil {
		bp = new([]byte)
	}
	defer pagemapBufs.Put(bp)

	out := Pages{PageSize: ps}
	var base uint64 // image page index of the region's first page
	for _, r := range mm.Regions {
		first, n := r.HostAddr/uint64(ps), r.Size/uint64(ps)
		for done := uint64(0); done < n; {
			c := min(n-done, maxPagemapRead/8)
			if uint64(cap(*bp)) < c*8 {
				*bp = make([]byte, c*8)
			}
			buf := (*bp)[:c*8]
			if _, err := pm.ReadAt(buf, int64(first+done)*8); err != nil {
				if errors.Is(err, io.EOF) {
					// pagemap reads nothing once the process's memory is gone.
					return Pages{}, errdefs.NotFound("process %d exited while its pagemap was read", mm.PID)
				}
				return Pages{}, procError(mm.PID, "pagemap", err)
			}
			out.Runs = scanPagemap(out.Runs, buf, base+done)
			done += c
		}
		base += n
	}
	return out, nil
}

// scanPagemap appends to runs the private pages among the pagemap entries
// in buf, the first of which is image page first.
func scanPagemap(runs []Run, buf []byte, first uint64) []Run {
	for i := 0; i+8 <= len(buf); i += 8 {
		e := binary.LittleEndian.Uint64(buf[i:])
		if e&(pmPresent|pmSwapped) == 0 || e&pmFile != 0 {
			continue
		}
		idx := first + uint64(i/8)
		if n := len(runs); n > 0 && runs[n-1].end() == idx {
			runs[n-1].Count++
			continue
		}
		runs = append(runs, Run{Start: idx, Count: 1})
	}
	return runs
}

// checkMap checks that mm names a process and page-aligned, non-empty
// regions. It fails with an InvalidArgument-class error.
func checkMap(mm vmm.MemoryMap, ps int) error {
	if mm.PID <= 0 {
		return errdefs.InvalidArgument("memory map: pid %d", mm.PID)
	}
	if len(mm.Regions) == 0 {
		return errdefs.InvalidArgument("memory map of process %d: no regions", mm.PID)
	}
	for _, r := range mm.Regions {
		if r.Size == 0 || r.HostAddr%uint64(ps) != 0 || r.Size%uint64(ps) != 0 || r.HostAddr+r.Size < r.HostAddr {
			return errdefs.InvalidArgument("memory map of process %d: region %#x+%#x is not whole pages", mm.PID, r.HostAddr, r.Size)
		}
	}
	return nil
}

// ImageSize returns the size in bytes of mm's memory image: its regions'
// sizes summed.
func ImageSize(mm vmm.MemoryMap) int64 {
	var n uint64
	for _, r := range mm.Regions {
		n += r.Size
	}
	return int64(n)
}

// checkMapped checks that every region of mm is covered by mappings of the
// process, as proc.Root/PID/maps lists them (a region may span several
// adjacent mappings). It fails with a NotFound-class error when one is not.
func checkMapped(mm vmm.MemoryMap) error {
	data, err := os.ReadFile(filepath.Join(proc.Root, strconv.Itoa(mm.PID), "maps"))
	if err != nil {
		return procError(mm.PID, "maps", err)
	}
	vmas, err := parseMaps(data)
	if err != nil {
		return fmt.Errorf("process %d maps: %w", mm.PID, err)
	}
	for _, r := range mm.Regions {
		if !covered(vmas, r.HostAddr, r.HostAddr+r.Size) {
			return errdefs.NotFound("region %#x+%#x is not mapped in process %d", r.HostAddr, r.Size, mm.PID)
		}
	}
	return nil
}

// vma is one line of a maps file: the addresses [start, end).
type vma struct{ start, end uint64 }

// parseMaps returns the address ranges of a maps file, in its order
// (ascending).
func parseMaps(data []byte) ([]vma, error) {
	var out []vma
	for len(data) > 0 {
		line := data
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			line, data = data[:i], data[i+1:]
		} else {
			data = nil
		}
		if len(line) == 0 {
			continue
		}
		sp := bytes.IndexByte(line, ' ')
		if sp < 0 {
			sp = len(line)
		}
		dash := bytes.IndexByte(line[:sp], '-')
		if dash < 0 {
			return nil, fmt.Errorf("malformed line %q", line)
		}
		lo, err1 := strconv.ParseUint(string(line[:dash]), 16, 64)
		hi, err2 := strconv.ParseUint(string(line[dash+1:sp]), 16, 64)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("malformed line %q", line)
		}
		out = append(out, vma{lo, hi})
	}
	return out, nil
}

// covered reports whether vmas (ascending, non-overlapping) cover
// [start, end) without a gap.
func covered(vmas []vma, start, end uint64) bool {
	cur := start
	for _, v := range vmas {
		if v.end <= cur {
			continue
		}
		if v.start > cur {
			return false
		}
		cur = v.end
		if cur >= end {
			return true
		}
	}
	return false
}
