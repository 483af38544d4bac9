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

	"github.com/forkd/forkd/internal/errdefs"
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
// and shared memory) are left out. Once the runs come to more than limit
// bytes it stops and returns nil (limit 0: no bound). It fails with a
// NotFound-class error once the process has exited. Reading another
// process's pagemap needs ptrace read access to it (root).
func ResidentAnon(id Identity, limit uint64) ([]Span, error) {
	p, err := Open(id)
	if err != nil {
		return nil, err
	}
	defer p.Close()
	gone := func(err error) error {
		if exited(p.fd) {
			return errdefs.NotFound("process %d has exited", id.PID)
		}
		return err
	}
	dir := filepath.Join(Root, strconv.Itoa(id.PID))
	maps, err := os.ReadFile(filepath.Join(dir, "maps"))
	if err != nil {
		return nil, gone(err)
	}
	f, err := os.Open(filepath.Join(dir, "pagemap"))
	if err != nil {
		return nil, gone(err)
	}
	defer f.Close()
	page := uint64(os.Getpagesize())
	buf := make([]byte, 8*pagemapChunk)
	var spans []Span
	var total uint64
	for _, m := range privateMappings(maps) {
		for addr := m.start; addr < m.end; {
			n := min((m.end-addr)/page, pagemapChunk)
			got, err := f.ReadAt(buf[:8*n], int64(addr/page*8))
			if err != nil && !errors.Is(err, io.EOF) {
				return nil, gone(fmt.Errorf("read pagemap of %d at %#x: %w", id.PID, addr, err))
			}
			for i := range uint64(got / 8) {
				e := binary.NativeEndian.Uint64(buf[8*i:])
				if e&pmPresent == 0 || e&pmFile != 0 {
					continue
				}
				at := addr + i*page
				if k := len(spans) - 1; k >= 0 && spans[k].Start+spans[k].Len == at {
					spans[k].Len += page
				} else {
					spans = append(spans, Span{at, page})
				}
				if total += page; limit > 0 && total > limit {
					return nil, nil
				}
			}
			if uint64(got) < 8*n {
				// The mapping went away under us: on to the next.
				break
			}
			addr += n * page
		}
	}
	return spans, nil
}

// pageInBuf is how many bytes PageIn copies out with one call.
const pageInBuf = 256 << 10

// PageIn brings the pages of spans back into the memory of the process
// named by id, from swap where they went, by reading them
// (process_vm_readv): the kernel faults them in for it, without the
// process taking a fault on each, and what it read is thrown away. Spans
// no longer mapped are passed over. It returns how many bytes it read. The
// process need not run (a frozen one is fine); the caller needs ptrace
// access to it (root). It fails with a NotFound-class error once the
// process has exited.
func PageIn(id Identity, spans []Span) (int64, error) {
	p, err := Open(id)
	if err != nil {
		return 0, err
	}
	defer p.Close()
	buf := make([]byte, pageInBuf)
	local := []unix.Iovec{{Base: &buf[0]}}
	remote := make([]unix.RemoteIovec, 0, 64)
	var read int64
	// The next byte to read is off into spans[i].
	i, off := 0, uint64(0)
	for i < len(spans) {
		// As many spans as fill buf, the last one cut where it is full.
		remote = remote[:0]
		size := 0
		for j, o := i, off; j < len(spans) && size < len(buf); j, o = j+1, 0 {
			n := min(spans[j].Len-o, uint64(len(buf)-size))
			remote = append(remote, unix.RemoteIovec{Base: uintptr(spans[j].Start + o), Len: int(n)})
			size += int(n)
		}
		local[0].SetLen(size)
		n, err := unix.ProcessVMReadv(id.PID, local, remote, 0)
		switch {
		case errors.Is(err, unix.ESRCH):
			return read, errdefs.NotFound("process %d has exited", id.PID)
		case errors.Is(err, unix.EFAULT) || err == nil && n == 0:
			// The first span is not mapped (any more): skip it.
			n = remote[0].Len
		case err != nil:
			return read, fmt.Errorf("page in %d: process_vm_readv: %w", id.PID, err)
		default:
			read += int64(n)
			if n < size {
				// It stopped before a span no longer mapped (it never
				// splits one): skip that one too.
				n = skipTo(remote, n)
			}
		}
		for left := uint64(n); left > 0 && i < len(spans); {
			if rest := spans[i].Len - off; left < rest {
				off += left
				left = 0
			} else {
				left -= rest
				i, off = i+1, 0
			}
		}
	}
	if exited(p.fd) {
		return read, errdefs.NotFound("process %d has exited", id.PID)
	}
	return read, nil
}

// skipTo returns the offset, in the bytes of remote, of the end of the
// iovec holding offset n: where a read that stopped at n goes on.
func skipTo(remote []unix.RemoteIovec, n int) int {
	end := 0
	for _, r := range remote {
		end += r.Len
		if n < end {
			return end
		}
	}
	return end
}
