package proc

import (
	"os"
	"slices"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
)

// TestResidentAnonSelf reads the test's own pagemap: of a fresh anonymous
// mapping, only the pages it touched are resident, in two runs; PageIn
// reads them, and passes over a span no longer mapped.
func TestResidentAnonSelf(t *testing.T) {
	page := os.Getpagesize()
	m, err := unix.Mmap(-1, 0, 64*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	// Its own VMA, so that nothing else of the process's runs into it.
	if err := unix.Mprotect(m[63*page:], unix.PROT_READ); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		m[i*page] = 1
	}
	m[20*page] = 1
	id, err := Self(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	spans, err := ResidentAnon(id, 0)
	if err != nil {
		t.Fatal(err)
	}
	base := addrOf(m)
	var in []Span
	for _, s := range spans {
		if s.Start < base+64*uint64(page) && s.Start+s.Len > base {
			in = append(in, s)
		}
	}
	want := []Span{{base, 10 * uint64(page)}, {base + 20*uint64(page), uint64(page)}}
	if !slices.Equal(in, want) {
		t.Fatalf("ResidentAnon within the mapping = %x, want %x", in, want)
	}
	if got, err := ResidentAnon(id, uint64(page)); err != nil || got != nil {
		t.Fatalf("ResidentAnon with a bound of one page = %d spans, %v; want nil", len(got), err)
	}
	// A span past the end of a mapping, between two that are mapped.
	unmapped, err := unix.Mmap(-1, 0, page, unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	gone := addrOf(unmapped)
	unix.Munmap(unmapped)
	read, err := PageIn(id, []Span{want[0], {gone, uint64(page)}, want[1]})
	if err != nil {
		t.Fatal(err)
	}
	if read != 11*int64(page) {
		t.Fatalf("PageIn read %d bytes, want %d", read, 11*page)
	}
	// More than one buffer's worth, cut across calls.
	big := make([]byte, 3*pageInBuf+page)
	if read, err := PageIn(id, []Span{{addrOf(big), uint64(len(big))}}); err != nil || read != int64(len(big)) {
		t.Fatalf("PageIn of %d bytes: %d, %v", len(big), read, err)
	}
	if _, err := PageIn(Identity{PID: id.PID, StartTime: id.StartTime + 1}, want); !errdefs.IsNotFound(err) {
		t.Fatalf("PageIn of a process that is not ours: %v, want NotFound", err)
	}
}

// addrOf returns the address of b's first byte.
func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

func TestSkipTo(t *testing.T) {
	r := []unix.RemoteIovec{{Len: 10}, {Len: 5}, {Len: 7}}
	for _, c := range []struct{ n, want int }{{0, 10}, {10, 15}, {15, 22}, {22, 22}} {
		if got := skipTo(r, c.n); got != c.want {
			t.Errorf("skipTo(%d) = %d, want %d", c.n, got, c.want)
		}
	}
}
