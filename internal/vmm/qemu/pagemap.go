package qemu

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/maphash"
	"os"
	"path/filepath"
	"strconv"

	"github.com/forkd/forkd/internal/proc"
)

// zeroPage is a page of zeros.
var zeroPage [pageSize]byte

// pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const (
	pmPresent = 1 << 63
	pmSwapped = 1 << 62
	pmFile    = 1 << 61 // file page or shared anonymous
)

// privatePage reports whether a pagemap entry of a MAP_PRIVATE file
// mapping is a page the process wrote (a private copy, in RAM or swap):
// every other page still reads from the file.
func privatePage(e uint64) bool {
	return e&pmPresent != 0 && e&pmFile == 0 || e&pmSwapped != 0
}

const (
	pagemapChunk = 1 << 16 // pagemap entries read at once (512 KiB)
	memRun       = 256     // pages read from /proc/PID/mem at once (1 MiB)
)

// checkPages runs with the machine stopped after a completed migration.
// It reads every private page of guest RAM (pagemap) from the process and
// delivers again each whose hash differs from that of what was delivered
// last; it returns how many. Pages the guest never wrote still hold the
// file's content, which the migration read and sent as is.
func (ls *liveSave) checkPages() (int64, error) {
	dir := filepath.Join(proc.Root, strconv.Itoa(ls.m.handle.Process.PID))
	pm, err := os.Open(filepath.Join(dir, "pagemap"))
	if err != nil {
		return 0, err
	}
	defer pm.Close()
	mem, err := os.Open(filepath.Join(dir, "mem"))
	if err != nil {
		return 0, err
	}
	defer mem.Close()
	n := len(ls.sums)
	entries := make([]byte, min(n, pagemapChunk)*8)
	buf := make([]byte, memRun*pageSize)
	first := int64(ls.ram.HostAddr / pageSize)
	var resent int64
	for base := 0; base < n; base += pagemapChunk {
		k := min(pagemapChunk, n-base)
		e := entries[:k*8]
		if _, err := pm.ReadAt(e, (first+int64(base))*8); err != nil {
			return resent, fmt.Errorf("pagemap: %w", err)
		}
		private := func(i int) bool { return privatePage(binary.LittleEndian.Uint64(e[i*8:])) }
		for i := 0; i < k; {
			if !private(i) {
				i++
				continue
			}
			j := i + 1
			for j < k && j-i < memRun && private(j) {
				j++
			}
			run := buf[:(j-i)*pageSize]
			addr := int64(ls.ram.HostAddr) + int64(base+i)*pageSize
			if _, err := mem.ReadAt(run, addr); err != nil {
				return resent, fmt.Errorf("guest memory at %#x: %w", addr, err)
			}
			for p := range j - i {
				page := run[p*pageSize : (p+1)*pageSize]
				idx := base + i + p
				h := maphash.Bytes(ls.seed, page)
				if h == ls.sums[idx] {
					continue
				}
				ls.sums[idx] = h
				data := page
				if h == ls.zero && bytes.Equal(page, zeroPage[:]) {
					data = nil
				}
				if err := ls.page(uint64(idx)*pageSize, data); err != nil {
					return resent, fmt.Errorf("guest page at %#x: %w", uint64(idx)*pageSize, err)
				}
				resent++
			}
			i = j
		}
	}
	return resent, nil
}
