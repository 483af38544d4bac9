package qemu

import (
	"bytes"
	"encoding/binary"
	"os"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestSoftDirty checks what softDirtyWorks decided against a page of this
// process: where it says the kernel tracks soft-dirty pages, a page reads
// clean after a clear and dirty after a write; where it says not, the bit
// stays clear after a write, so that checkPages must read every private
// page.
func TestSoftDirty(t *testing.T) {
	b, err := unix.Mmap(-1, 0, pageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(b)
	b[0] = 1
	works := softDirtyWorks()
	if err := clearSoftDirty("/proc/self"); err != nil {
		t.Fatalf("clear_refs: %v", err)
	}
	pm, err := os.Open("/proc/self/pagemap")
	if err != nil {
		t.Fatal(err)
	}
	defer pm.Close()
	entry := func() uint64 {
		var e [8]byte
		if _, err := pm.ReadAt(e[:], int64(uintptr(unsafe.Pointer(&b[0]))/pageSize)*8); err != nil {
			t.Fatal(err)
		}
		return binary.LittleEndian.Uint64(e[:])
	}
	if e := entry(); e&pmSoftDirty != 0 {
		t.Fatalf("page soft-dirty right after a clear: %#x", e)
	}
	b[0] = 2
	if dirty := entry()&pmSoftDirty != 0; dirty != works {
		t.Fatalf("written page soft-dirty = %v, softDirtyWorks = %v", dirty, works)
	}
	t.Logf("soft-dirty tracking here: %v", works)
}

// TestReadPages reads scattered and adjacent pages of this process, more
// of them than one process_vm_readv takes iovecs for, and gets each page's
// own content in order.
func TestReadPages(t *testing.T) {
	const pages = 3 * iovMax
	mem, err := unix.Mmap(-1, 0, pages*pageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	for i := range pages {
		binary.LittleEndian.PutUint64(mem[i*pageSize:], uint64(i)+1)
	}
	// Every other page, then a run of adjacent ones: more separate runs
	// than iovMax.
	var idx []int
	for i := 0; i < 2*iovMax+2; i += 2 {
		idx = append(idx, i)
	}
	for i := 2*iovMax + 3; i < pages; i++ {
		idx = append(idx, i)
	}
	buf := make([]byte, len(idx)*pageSize)
	base := uint64(uintptr(unsafe.Pointer(&mem[0])))
	if err := readPages(os.Getpid(), base, idx, buf); err != nil {
		t.Fatal(err)
	}
	for p, i := range idx {
		if got := buf[p*pageSize : (p+1)*pageSize]; !bytes.Equal(got, mem[i*pageSize:(i+1)*pageSize]) {
			t.Fatalf("page %d (guest page %d) = %x…, want %x…", p, i, got[:8], mem[i*pageSize:i*pageSize+8])
		}
	}
	// Past the mapping's end: an error, not a short read taken as data.
	if err := readPages(os.Getpid(), base, []int{pages + 1<<20}, buf[:pageSize]); err == nil {
		t.Fatal("read past the mapping succeeded")
	}
}
