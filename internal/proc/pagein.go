package proc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// Span is a run of whole pages in a process's address space: Len bytes
// from Start.
type Span struct{ Start, Len uint64 }

// pagemap bits (Documentation/admin-guide/mm/pagemap.rst).
const (
	pmPresent = 1 << 63
	pmFile    = 1 << 61 // a page cache page, or shared anonymous memory
)

// pagemapChunk is how many pagemap entries ResidentAnon reads at once.
const pagemapChunk = 8192

// ResidentAnon returns the runs of resident anonymous pages in the private
// mappings of the process named by id: the pages PageOut would send to
// swap, in address order. Pages of the page cache (the process's files
// and shared memory) are left out. Once the runs come to more than
// maxBytes bytes, or are more than maxRuns, it stops and returns nil (0:
// no bound). It fails with a
// NotFound-class error once the process has exited. Reading another
// process's pagemap needs ptrace read access to it (root).
func ResidentAnon(id Identity, maxBytes uint64, maxRuns int) ([]Span, error) {
	spans, _, err := residentAnon(id, maxBytes, maxRuns)
	return spans, err
}

// residentAnon is ResidentAnon, and returns the maps text it read too.
func residentAnon(id Identity, maxBytes uint64, maxRuns int) (spans []Span, maps []byte, err error) {
	p, err := Open(id)
	if err != nil {
		return nil, nil, err
	}
	defer p.Close()
	dir := filepath.Join(Root, strconv.Itoa(id.PID))
	maps, err = os.ReadFile(filepath.Join(dir, "maps"))
	if err != nil {
		return nil, nil, p.gone(err)
	}
	f, err := os.Open(filepath.Join(dir, "pagemap"))
	if err != nil {
		return nil, nil, p.gone(err)
	}
	defer f.Close()
	page := uint64(os.Getpagesize())
	buf := make([]byte, 8*pagemapChunk)
	var total uint64
	over := false // past maxBytes or maxRuns
	for _, m := range privateMappings(maps) {
		err := walkPagemap(f, id.PID, m.start, m.end, buf, func(at, e uint64) bool {
			if e&pmPresent == 0 || e&pmFile != 0 {
				return true
			}
			if k := len(spans) - 1; k >= 0 && spans[k].Start+spans[k].Len == at {
				spans[k].Len += page
			} else {
				if maxRuns > 0 && len(spans) == maxRuns {
					over = true
					return false
				}
				spans = append(spans, Span{at, page})
			}
			total += page
			over = maxBytes > 0 && total > maxBytes
			return !over
		})
		switch {
		case err != nil:
			return nil, nil, p.gone(err)
		case over:
			return nil, maps, nil
		}
	}
	if exited(p.fd) {
		return nil, nil, errExited(id.PID)
	}
	return spans, maps, nil
}

// walkPagemap calls each with the address and pagemap entry of every
// whole page from start to end of the process pid whose pagemap f is, in
// address order, reading len(buf)/8 entries at a time, until each
// returns false. It fails on a short read: pagemap has an entry for
// every address below the top of the address space, so the process has
// exited.
func walkPagemap(f *os.File, pid int, start, end uint64, buf []byte, each func(addr, entry uint64) bool) error {
	page := uint64(os.Getpagesize())
	for addr := start; addr+page <= end; {
		n := min((end-addr)/page, uint64(len(buf)/8))
		got, err := f.ReadAt(buf[:8*n], int64(addr/page*8))
		if err != nil && !errors.Is(err, io.EOF) {
			return fmt.Errorf("read pagemap of %d at %#x: %w", pid, addr, err)
		}
		for i := range uint64(got / 8) {
			if !each(addr+i*page, binary.NativeEndian.Uint64(buf[8*i:])) {
				return nil
			}
		}
		if uint64(got) < 8*n {
			return fmt.Errorf("read pagemap of %d at %#x: short read", pid, addr)
		}
		addr += n * page
	}
	return nil
}

// pageInBuf is how many bytes PageIn copies out with one call.
const pageInBuf = 256 << 10

// PageIn brings the pages of spans back into the memory of the process
// named by id, from swap where they went, by reading them
// (process_vm_readv): the kernel faults them in for it, without the
// process taking a fault on each, and what it read is thrown away. A page
// it cannot read (no longer mapped, or not readable) is passed over. It
// returns how many bytes it read. The process need not run (a frozen one
// is fine: nothing it does then can make a read wait on it); the caller
// needs ptrace access to it (root). It fails with a NotFound-class error
// once the process has exited.
func PageIn(id Identity, spans []Span) (int64, error) {
	p, err := Open(id)
	if err != nil {
		return 0, err
	}
	defer p.Close()
	page := uint64(os.Getpagesize())
	buf := make([]byte, pageInBuf)
	local := []unix.Iovec{{Base: &buf[0]}}
	remote := make([]unix.RemoteIovec, 0, 64)
	var read int64
	c := spanCursor{spans: spans}
	for !c.done() {
		// process_vm_readv takes the pid: check between calls that it
		// is still this process's.
		if exited(p.fd) {
			return read, errExited(id.PID)
		}
		var size int
		remote, size = c.next(remote[:0], len(buf))
		local[0].SetLen(size)
		n, err := unix.ProcessVMReadv(id.PID, local, remote, 0)
		switch {
		case errors.Is(err, unix.ESRCH):
			return read, errExited(id.PID)
		case errors.Is(err, unix.EFAULT):
			n = 0
		case err != nil:
			return read, fmt.Errorf("page in %d: process_vm_readv: %w", id.PID, err)
		}
		read += int64(n)
		c.advance(uint64(n))
		if n < size {
			// It stopped at a page it could not read: skip that page.
			c.skipPage(page)
		}
	}
	return read, nil
}

// spanCursor walks the bytes of spans: the next one is off into spans[i].
type spanCursor struct {
	spans []Span
	i     int
	off   uint64
}

func (c *spanCursor) done() bool {
	for c.i < len(c.spans) && c.off >= c.spans[c.i].Len {
		c.i, c.off = c.i+1, 0
	}
	return c.i >= len(c.spans)
}

// next appends to remote the iovecs of up to limit bytes from the
// cursor, without moving it, and returns them and their size.
func (c *spanCursor) next(remote []unix.RemoteIovec, limit int) ([]unix.RemoteIovec, int) {
	size := 0
	for j, o := c.i, c.off; j < len(c.spans) && size < limit; j, o = j+1, 0 {
		if o >= c.spans[j].Len {
			continue
		}
		n := int(min(c.spans[j].Len-o, uint64(limit-size)))
		remote = append(remote, unix.RemoteIovec{Base: uintptr(c.spans[j].Start + o), Len: n})
		size += n
	}
	return remote, size
}

// advance moves the cursor n bytes on.
func (c *spanCursor) advance(n uint64) {
	for n > 0 && !c.done() {
		d := min(n, c.spans[c.i].Len-c.off)
		c.off += d
		n -= d
	}
}

// skipPage moves the cursor to the start of the next page of the address
// space.
func (c *spanCursor) skipPage(page uint64) {
	if c.done() {
		return
	}
	addr := c.spans[c.i].Start + c.off
	c.advance(page - addr%page)
}
