package qemu

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/proc"
)

// zeroPage is a page of zeros.
var zeroPage [pageSize]byte

// pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const (
	pmPresent = 1 << 63
	pmSwapped = 1 << 62
	pmFile    = 1 << 61 // file page or shared anonymous
	// pmSoftDirty: written since the last clear of the process's
	// soft-dirty bits (Documentation/admin-guide/mm/soft-dirty.rst).
	pmSoftDirty = 1 << 55
)

// softDirtyWorks reports whether this kernel tracks soft-dirty pages
// (CONFIG_MEM_SOFT_DIRTY): one without it takes the clear and never sets
// the bit, which would hide every write. It tries on a page of its own,
// once per process: clear, the page reads clean; write, it reads dirty.
var softDirtyWorks = sync.OnceValue(func() bool {
	b, err := unix.Mmap(-1, 0, pageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return false
	}
	defer func() { _ = unix.Munmap(b) }()
	b[0] = 1
	self := filepath.Join(proc.Root, "self")
	if clearSoftDirty(self) != nil {
		return false
	}
	pm, err := os.Open(filepath.Join(self, "pagemap"))
	if err != nil {
		return false
	}
	defer pm.Close()
	entry := func() uint64 {
		var e [8]byte
		if _, err := pm.ReadAt(e[:], int64(uintptr(unsafe.Pointer(&b[0]))/pageSize)*8); err != nil {
			return 0
		}
		return binary.LittleEndian.Uint64(e[:])
	}
	clean := entry()
	b[0] = 2
	dirty := entry()
	return clean&pmPresent != 0 && clean&pmSoftDirty == 0 && dirty&pmSoftDirty != 0
})

// clearSoftDirty clears the soft-dirty bits of the process whose /proc
// directory is dir: from then on, a page it writes reads soft-dirty in its
// pagemap.
func clearSoftDirty(dir string) error {
	f, err := os.OpenFile(filepath.Join(dir, "clear_refs"), os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString("4")
	return errors.Join(err, f.Close())
}

// privatePage reports whether a pagemap entry of a MAP_PRIVATE file
// mapping is a page the process wrote (a private copy, in RAM or swap):
// every other page still reads from the file.
func privatePage(e uint64) bool {
	return e&pmPresent != 0 && e&pmFile == 0 || e&pmSwapped != 0
}

const (
	pagemapChunk = 1 << 16 // pagemap entries read at once (512 KiB)
	memBatch     = 1024    // pages checked at once (4 MiB)
	iovMax       = 1024    // IOV_MAX: iovecs per process_vm_readv
)

// checkPages runs with the machine stopped after a completed migration.
// It reads every private page of guest RAM (pagemap) from the process and
// delivers again each whose hash differs from that of what was delivered
// last; it returns how many. Pages the guest never wrote still hold the
// file's content, which the migration read and sent as is. With
// ls.softDirty, the process's soft-dirty bits were cleared before the
// migration sent its first page, so a private page that is not soft-dirty
// has not changed since it was sent and is not read again: the pause then
// grows with what the guest wrote during the save, not since its restore.
//
// The guest is stopped and the check is the pause, so the pages are read
// and hashed by one worker per host CPU (up to checkWorkers), each over
// its own run of them; what changed is delivered after, in order.
func (ls *liveSave) checkPages() (int64, error) {
	pid := ls.m.handle.Process.PID
	idx, err := ls.candidates(pid)
	if err != nil {
		return 0, err
	}
	workers := min(len(ls.checkBufs), len(idx)/memBatch+1)
	per := (len(idx) + workers - 1) / workers
	changed := make([][]changedPage, workers)
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		part := idx[min(w*per, len(idx)):min((w+1)*per, len(idx))]
		wg.Go(func() { changed[w], errs[w] = ls.changedPages(pid, part, ls.checkBufs[w]) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	var resent int64
	for _, part := range changed {
		for _, c := range part {
			if err := ls.page(uint64(c.idx)*pageSize, c.data); err != nil {
				return resent, fmt.Errorf("guest page at %#x: %w", uint64(c.idx)*pageSize, err)
			}
			resent++
		}
	}
	return resent, nil
}

// checkWorkers bounds checkPages' workers.
const checkWorkers = 4

// changedPage is a guest page checkPages found changed; data nil for a
// page of zeros.
type changedPage struct {
	idx  int
	data []byte
}

// prepareCheck allocates what checkPages uses and runs its reads once,
// before the pause: a buffer's first read by pread or process_vm_readv
// costs 10–20 ms here (whether this process wrote to it or not), its next
// ones about 1 ms per 4 MiB, and the check is the pause.
func (ls *liveSave) prepareCheck() error {
	ls.seed = maphash.MakeSeed()
	ls.sums = make([]uint64, ls.ram.Size/pageSize)
	ls.zero = maphash.Bytes(ls.seed, zeroPage[:])
	ls.entries = make([]byte, min(len(ls.sums), pagemapChunk)*8)
	ls.idx = make([]int, 0, len(ls.sums))
	pid := ls.m.handle.Process.PID
	if _, err := ls.candidates(pid); err != nil {
		return err
	}
	first := make([]int, min(len(ls.sums), memBatch))
	for i := range first {
		first[i] = i
	}
	ls.checkBufs = make([][]byte, max(1, min(runtime.NumCPU(), checkWorkers)))
	for w := range ls.checkBufs {
		ls.checkBufs[w] = make([]byte, memBatch*pageSize)
		if err := readPages(pid, ls.ram.HostAddr, first, ls.checkBufs[w][:len(first)*pageSize]); err != nil {
			return err
		}
	}
	return nil
}

// candidates returns the guest page numbers, ascending, that checkPages
// reads: the private ones (and soft-dirty ones, with ls.softDirty).
func (ls *liveSave) candidates(pid int) ([]int, error) {
	pm, err := os.Open(filepath.Join(proc.Root, strconv.Itoa(pid), "pagemap"))
	if err != nil {
		return nil, err
	}
	defer pm.Close()
	n := len(ls.sums)
	entries := ls.entries
	first := int64(ls.ram.HostAddr / pageSize)
	idx := ls.idx[:0]
	for base := 0; base < n; base += pagemapChunk {
		k := min(pagemapChunk, n-base)
		e := entries[:k*8]
		if _, err := pm.ReadAt(e, (first+int64(base))*8); err != nil {
			return nil, fmt.Errorf("pagemap: %w", err)
		}
		for i := range k {
			pe := binary.LittleEndian.Uint64(e[i*8:])
			if privatePage(pe) && (!ls.softDirty || pe&pmSoftDirty != 0) {
				idx = append(idx, base+i)
			}
		}
	}
	return idx, nil
}

// changedPages reads guest pages idx (ascending) in batches into buf
// (memBatch pages), records the
// hash of each that changed in ls.sums (each worker owns its pages'
// entries) and returns copies of those pages.
func (ls *liveSave) changedPages(pid int, idx []int, buf []byte) ([]changedPage, error) {
	var changed []changedPage
	for len(idx) > 0 {
		batch := idx[:min(len(idx), memBatch)]
		idx = idx[len(batch):]
		data := buf[:len(batch)*pageSize]
		if err := readPages(pid, ls.ram.HostAddr, batch, data); err != nil {
			return nil, err
		}
		for p, i := range batch {
			page := data[p*pageSize : (p+1)*pageSize]
			h := maphash.Bytes(ls.seed, page)
			if h == ls.sums[i] {
				continue
			}
			ls.sums[i] = h
			c := changedPage{idx: i}
			if h != ls.zero || !bytes.Equal(page, zeroPage[:]) {
				c.data = bytes.Clone(page)
			}
			changed = append(changed, c)
		}
	}
	return changed, nil
}

// readPages reads guest pages idx (ascending page numbers of the RAM
// mapped at hostAddr in process pid) into buf, one after the other, with
// as few process_vm_readv calls as IOV_MAX allows: the private pages of a
// guest lie scattered, and one read each cost more than the rest of the
// check.
func readPages(pid int, hostAddr uint64, idx []int, buf []byte) error {
	remote := make([]unix.RemoteIovec, 0, len(idx))
	for _, i := range idx {
		addr := uintptr(hostAddr) + uintptr(i)*pageSize
		if r := len(remote) - 1; r >= 0 && remote[r].Base+uintptr(remote[r].Len) == addr {
			remote[r].Len += pageSize
			continue
		}
		remote = append(remote, unix.RemoteIovec{Base: addr, Len: pageSize})
	}
	for len(remote) > 0 {
		iov := remote[:min(len(remote), iovMax)]
		remote = remote[len(iov):]
		size := 0
		for _, r := range iov {
			size += r.Len
		}
		local := []unix.Iovec{{Base: &buf[0]}}
		local[0].SetLen(size)
		got, err := unix.ProcessVMReadv(pid, local, iov, 0)
		if err != nil {
			return fmt.Errorf("guest memory at %#x: %w", iov[0].Base, err)
		}
		if got != size {
			return fmt.Errorf("guest memory at %#x: read %d of %d bytes", iov[0].Base, got, size)
		}
		buf = buf[size:]
	}
	return nil
}
