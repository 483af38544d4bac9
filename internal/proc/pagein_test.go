package proc

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

// TestResidentAnonSelf reads the test's own pagemap: of a fresh anonymous
// mapping, only the pages it touched are resident, in runs; PageIn reads
// them, and passes over a page it cannot read.
func TestResidentAnonSelf(t *testing.T) {
	page := os.Getpagesize()
	pg := uint64(page)
	m, err := unix.Mmap(-1, 0, 64*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	// Pages 0, 40 and 63 are not readable: VMAs of their own, so that
	// nothing else of the process's runs into the pages between, and
	// pages PageIn cannot read.
	for _, i := range []int{0, 40, 63} {
		if err := unix.Mprotect(m[i*page:(i+1)*page], unix.PROT_NONE); err != nil {
			t.Fatal(err)
		}
	}
	for i := 1; i <= 10; i++ {
		m[i*page] = 1
	}
	m[20*page] = 1
	m[41*page] = 1
	id, err := Self(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	base := addrOf(m)
	within := func(spans []Span) []Span {
		var in []Span
		for _, s := range spans {
			if s.Start < base+64*pg && s.Start+s.Len > base {
				in = append(in, s)
			}
		}
		return in
	}
	spans, err := ResidentAnon(id, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	want := []Span{{base + pg, 10 * pg}, {base + 20*pg, pg}, {base + 41*pg, pg}}
	if got := within(spans); !slices.Equal(got, want) {
		t.Fatalf("ResidentAnon within the mapping = %x, want %x", got, want)
	}
	// A span across unreadable pages, one starting on one, and the
	// readable pages after them.
	read, err := PageIn(id, []Span{{base + 20*pg, 0}, {base + 39*pg, 3 * pg}, {base + 63*pg, pg}, want[0]})
	if err != nil {
		t.Fatal(err)
	}
	if read != 12*int64(page) {
		t.Fatalf("PageIn read %d bytes, want %d (pages 39, 41 and 1-10)", read, 12*page)
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

// TestResidentAnonBounds reads a made-up process (a /proc of its own
// around the test's stat): private anonymous pages only, in runs, and
// nothing once a bound on bytes or runs is passed.
func TestResidentAnonBounds(t *testing.T) {
	pid := os.Getpid()
	stat, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		t.Fatal(err)
	}
	old := Root
	Root = t.TempDir()
	t.Cleanup(func() { Root = old })
	dir := filepath.Join(Root, strconv.Itoa(pid))
	testutil.Check(t, os.Mkdir(dir, 0o755))
	testutil.Check(t, os.WriteFile(filepath.Join(dir, "stat"), stat, 0o644))
	maps := `10000000-10010000 rw-p 00000000 00:00 0
10010000-10020000 rw-s 00000000 00:01 7 /memfd:ram (deleted)
10040000-10042000 rw-p 00000000 00:00 0
10050000-10050800 rw-p 00000000 00:00 0
`
	testutil.Check(t, os.WriteFile(filepath.Join(dir, "maps"), []byte(maps), 0o644))
	pg := uint64(os.Getpagesize())
	pagemap := make([]byte, 0x10051000/pg*8)
	set := func(addr, e uint64) { binary.NativeEndian.PutUint64(pagemap[addr/pg*8:], e) }
	for a := uint64(0x10000000); a < 0x10004000; a += pg {
		set(a, pmPresent|123)
	}
	set(0x10005000, pmPresent|pmFile) // a page cache page
	set(0x10008000, 1<<62)            // swapped
	set(0x10010000, pmPresent)        // shared: not ours
	set(0x10041000, pmPresent)
	testutil.Check(t, os.WriteFile(filepath.Join(dir, "pagemap"), pagemap, 0o644))
	id, err := Self(pid)
	if err != nil {
		t.Fatal(err)
	}
	want := []Span{{0x10000000, 4 * pg}, {0x10041000, pg}}
	for _, c := range []struct {
		bytes uint64
		runs  int
		whole bool
	}{{0, 0, true}, {5 * pg, 0, true}, {5*pg - 1, 0, false}, {0, 2, true}, {0, 1, false}} {
		got, err := ResidentAnon(id, c.bytes, c.runs)
		if err != nil {
			t.Fatal(err)
		}
		if c.whole && !slices.Equal(got, want) || !c.whole && got != nil {
			t.Errorf("ResidentAnon bounded at %d bytes, %d runs = %x, want %x (whole: %v)", c.bytes, c.runs, got, want, c.whole)
		}
	}
	// A pagemap cut short: the process is gone.
	testutil.Check(t, os.WriteFile(filepath.Join(dir, "pagemap"), pagemap[:0x10041000/pg*8], 0o644))
	if got, err := ResidentAnon(id, 0, 0); err == nil {
		t.Errorf("ResidentAnon over a short pagemap = %x, want an error", got)
	}
}

// addrOf returns the address of b's first byte.
func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }
