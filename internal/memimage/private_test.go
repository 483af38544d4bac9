package memimage

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/vmm"
)

var ps = os.Getpagesize()

// helperEnv makes the test binary run helperMain instead of the tests.
const helperEnv = "FORKD_MEMIMAGE_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) == "1" {
		helperMain()
		return
	}
	os.Exit(m.Run())
}

// patternPage fills b, page i of a test image, with content unique to i.
func patternPage(b []byte, i int) {
	for j := range b {
		b[j] = byte(i*7 + j/512 + 1)
	}
	binary.LittleEndian.PutUint64(b, uint64(i)+0xf00d0000)
}

// writeImage writes a file of pages pages: the pattern, except pages in
// holes, left as holes.
func writeImage(t testing.TB, path string, pages int, holes map[int]bool) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(int64(pages * ps)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, ps)
	for i := 0; i < pages; i++ {
		if holes[i] {
			continue
		}
		patternPage(buf, i)
		if _, err := f.WriteAt(buf, int64(i*ps)); err != nil {
			t.Fatal(err)
		}
	}
}

// mapPrivate maps the file at path MAP_PRIVATE, read-write, as a child VMM
// maps its snapshot's memory, and unmaps it at the end of the test.
func mapPrivate(t testing.TB, path string) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	return mem
}

// addr returns the address of b[0].
func addr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }

// selfMap describes the given slices of this process's memory as a
// memory map, one region each, in the order given.
func selfMap(parts ...[]byte) vmm.MemoryMap {
	mm := vmm.MemoryMap{PID: os.Getpid()}
	var guest uint64
	for _, p := range parts {
		mm.Regions = append(mm.Regions, vmm.Region{HostAddr: addr(p), GuestAddr: guest, Size: uint64(len(p))})
		guest += uint64(len(p))
	}
	return mm
}

// touch writes one byte of each page listed (keeping its value for the
// pages in same, which must be made private all the same) and reads the
// pages in read.
func touch(mem []byte, write, same, read []int) {
	for _, i := range write {
		mem[i*ps+100] ^= 0x5a
	}
	for _, i := range same {
		store(&mem[i*ps], mem[i*ps])
	}
	for _, i := range read {
		load(&mem[i*ps+1])
	}
}

// load reads the byte at p, a read the compiler cannot drop.
//
//go:noinline
func load(p *byte) byte { return *p }

// store writes v at p, even when *p holds v already.
//
//go:noinline
func store(p *byte, v byte) { *p = v }

func TestPrivate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "memory")
	writeImage(t, path, 64, map[int]bool{40: true, 41: true})
	mem := mapPrivate(t, path)
	touch(mem, []int{3, 4, 5, 40, 63}, []int{10}, []int{0, 20, 21, 41})

	got, err := Private(selfMap(mem))
	if err != nil {
		t.Fatal(err)
	}
	want := Pages{PageSize: ps, Runs: []Run{{3, 3}, {10, 1}, {40, 1}, {63, 1}}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Private = %v, want %v", got, want)
	}
}

func TestPrivateNone(t *testing.T) {
	path := filepath.Join(t.TempDir(), "memory")
	writeImage(t, path, 16, nil)
	mem := mapPrivate(t, path)
	touch(mem, nil, nil, []int{0, 1, 15})
	got, err := Private(selfMap(mem))
	if err != nil || len(got.Runs) != 0 || got.PageSize != ps {
		t.Fatalf("Private = %v, %v; want no pages", got, err)
	}
}

// TestPrivateRegions: regions lie end to end in the image in the order of
// the map, not of their addresses, and runs join across a boundary.
func TestPrivateRegions(t *testing.T) {
	path := filepath.Join(t.TempDir(), "memory")
	writeImage(t, path, 64, nil)
	mem := mapPrivate(t, path)
	hi, lo := mem[32*ps:], mem[:32*ps] // image: pages 32..63, then 0..31
	touch(mem, []int{33, 63, 0, 1, 20}, nil, nil)

	got, err := Private(selfMap(hi, lo))
	if err != nil {
		t.Fatal(err)
	}
	want := Pages{PageSize: ps, Runs: []Run{{1, 1}, {31, 3}, {52, 1}}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Private = %v, want %v", got, want)
	}
}

// TestPrivateEntries checks the classification of pagemap entries against
// a fake proc root, for the kinds a test cannot make for real (swapped,
// migrating).
func TestPrivateEntries(t *testing.T) {
	root := t.TempDir()
	const pid = 4242
	dir := filepath.Join(root, strconv.Itoa(pid))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	base := uint64(0x7f0000000000)
	size := uint64(8 * ps)
	far := base + 1<<30 // mapped, but past the end of the fake pagemap
	maps := fmt.Sprintf("00400000-00452000 r-xp 00000000 fd:00 1 /bin/x\n%x-%x rw-p 00000000 fd:00 2 /memory\n%x-%x rw-p 00000000 00:00 0\n%x-%x rw-p 00000000 00:00 0\n",
		base, base+4*uint64(ps), base+4*uint64(ps), base+size, far, far+size)
	if err := os.WriteFile(filepath.Join(dir, "maps"), []byte(maps), 0o644); err != nil {
		t.Fatal(err)
	}
	entries := []uint64{
		pmPresent | 0x1234,             // 0: written: anonymous
		pmPresent | pmFile | 0x1234,    // 1: read: page cache
		0,                              // 2: never touched
		pmSwapped | 0x99,               // 3: written, swapped out
		pmSwapped | pmFile,             // 4: a file page under migration
		pmPresent | 1<<55,              // 5: written, soft-dirty
		pmPresent | pmFile | pmSwapped, // 6: nonsense, but a file page
		pmPresent,                      // 7: written
	}
	pm := make([]byte, 8*len(entries))
	for i, e := range entries {
		binary.LittleEndian.PutUint64(pm[8*i:], e)
	}
	f, err := os.Create(filepath.Join(dir, "pagemap"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(pm, int64(base/uint64(ps)*8)); err != nil {
		t.Fatal(err)
	}
	f.Close()
	old := proc.Root
	proc.Root = root
	t.Cleanup(func() { proc.Root = old })

	got, err := Private(vmm.MemoryMap{PID: pid, Regions: []vmm.Region{{HostAddr: base, Size: size}}})
	if err != nil {
		t.Fatal(err)
	}
	want := Pages{PageSize: ps, Runs: []Run{{0, 1}, {3, 1}, {5, 1}, {7, 1}}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Private = %v, want %v", got, want)
	}

	// A region past the mappings is refused; so is one with a gap.
	for _, r := range []vmm.Region{{HostAddr: base, Size: size + uint64(ps)}, {HostAddr: 0x00450000, Size: 0x4000}} {
		_, err := Private(vmm.MemoryMap{PID: pid, Regions: []vmm.Region{r}})
		if !errdefs.IsNotFound(err) {
			t.Errorf("region %#x+%#x: Private = %v, want NotFound", r.HostAddr, r.Size, err)
		}
	}
	// pagemap reads nothing once the process's memory is gone.
	_, err = Private(vmm.MemoryMap{PID: pid, Regions: []vmm.Region{{HostAddr: far, Size: size}}})
	if !errdefs.IsNotFound(err) {
		t.Errorf("pagemap at its end: Private = %v, want NotFound", err)
	}
}

func TestPrivateErrors(t *testing.T) {
	path := filepath.Join(t.TempDir(), "memory")
	writeImage(t, path, 8, nil)
	mem := mapPrivate(t, path)

	// A process that has exited.
	cmd := exec.Command("/bin/true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	gone := selfMap(mem)
	gone.PID = cmd.Process.Pid
	if _, err := Private(gone); !errdefs.IsNotFound(err) {
		t.Errorf("exited process: Private = %v, want NotFound", err)
	}
	if _, err := Copy(gone, Pages{PageSize: ps, Runs: []Run{{0, 1}}}, nil); !errdefs.IsNotFound(err) {
		t.Errorf("exited process: Copy = %v, want NotFound", err)
	}

	// A region that is not mapped: the bottom of the address space, where
	// nothing is placed unless asked for. (A region unmapped here could be
	// mapped again by the runtime before the calls below.)
	unmapped := vmm.MemoryMap{PID: os.Getpid(), Regions: []vmm.Region{{HostAddr: 16 * uint64(ps), Size: 4 * uint64(ps)}}}
	if _, err := Private(unmapped); !errdefs.IsNotFound(err) {
		t.Errorf("unmapped region: Private = %v, want NotFound", err)
	}
	dst, err := os.Create(filepath.Join(t.TempDir(), "dst"))
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	if _, err := Copy(unmapped, Pages{PageSize: ps, Runs: []Run{{1, 2}}}, dst); !errdefs.IsNotFound(err) {
		t.Errorf("unmapped region: Copy = %v, want NotFound", err)
	}

	// Malformed maps.
	for name, mm := range map[string]vmm.MemoryMap{
		"no pid":     {Regions: selfMap(mem).Regions},
		"no regions": {PID: os.Getpid()},
		"unaligned":  {PID: os.Getpid(), Regions: []vmm.Region{{HostAddr: addr(mem) + 1, Size: uint64(ps)}}},
		"empty":      {PID: os.Getpid(), Regions: []vmm.Region{{HostAddr: addr(mem)}}},
		"part page":  {PID: os.Getpid(), Regions: []vmm.Region{{HostAddr: addr(mem), Size: uint64(ps) + 1}}},
	} {
		if _, err := Private(mm); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%s: Private = %v, want InvalidArgument", name, err)
		}
	}
}

func TestParseMaps(t *testing.T) {
	got, err := parseMaps([]byte("1000-3000 rw-p 0 0:0 0\n3000-4000 r--p 0 0:0 0 /a b\n\n8000-9000 ---p 0 0:0 0"))
	if err != nil {
		t.Fatal(err)
	}
	want := []vma{{0x1000, 0x3000}, {0x3000, 0x4000}, {0x8000, 0x9000}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("parseMaps = %v", got)
	}
	for _, c := range []struct {
		start, end uint64
		ok         bool
	}{
		{0x1000, 0x4000, true}, {0x2000, 0x3800, true}, {0x8000, 0x9000, true},
		{0x1000, 0x5000, false}, {0x0, 0x2000, false}, {0x3000, 0x8800, false}, {0x9000, 0xa000, false},
	} {
		if covered(got, c.start, c.end) != c.ok {
			t.Errorf("covered(%#x, %#x) = %v", c.start, c.end, !c.ok)
		}
	}
	if _, err := parseMaps([]byte("zz-10 rw-p\n")); err == nil {
		t.Error("malformed line accepted")
	}
}

// helperMain is the other process of TestOtherProcess: it maps a patterned
// file MAP_PRIVATE, writes 0xab over pages 2, 3 and 9, prints the mapping's
// address and size, and waits for stdin to close.
func helperMain() {
	path := os.Getenv("FORKD_MEMIMAGE_FILE")
	f, err := os.Open(path)
	if err != nil {
		panic(err)
	}
	st, _ := f.Stat()
	mem, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		panic(err)
	}
	for _, i := range []int{2, 3, 9} {
		copy(mem[i*ps:(i+1)*ps], bytes.Repeat([]byte{0xab}, ps))
	}
	fmt.Printf("%d %d\n", addr(mem), len(mem))
	io.Copy(io.Discard, os.Stdin)
}

// TestOtherProcess reads the private pages of another process, as forkd
// reads a VMM's.
func TestOtherProcess(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "memory")
	writeImage(t, path, 16, nil)
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"=1", "FORKD_MEMIMAGE_FILE="+path)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		stdin.Close()
		cmd.Wait()
	}()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	var a, size uint64
	if _, err := fmt.Sscan(strings.TrimSpace(line), &a, &size); err != nil {
		t.Fatalf("helper said %q: %v", line, err)
	}
	mm := vmm.MemoryMap{PID: cmd.Process.Pid, Regions: []vmm.Region{{HostAddr: a, Size: size}}}

	pages, err := Private(mm)
	if errdefs.IsFailedPrecondition(err) && os.Geteuid() != 0 {
		t.Skipf("cannot read another process here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	want := Pages{PageSize: ps, Runs: []Run{{2, 2}, {9, 1}}}
	if !reflect.DeepEqual(pages, want) {
		t.Fatalf("Private = %v, want %v", pages, want)
	}
	out := filepath.Join(dir, "layer")
	if n, err := Copy(mm, pages, newImageFile(t, out, int64(size))); err != nil || n != 3*int64(ps) {
		t.Fatalf("Copy = %d, %v", n, err)
	}
	got, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 16; i++ {
		b := byte(0)
		if i == 2 || i == 3 || i == 9 {
			b = 0xab
		}
		if !bytes.Equal(got[i*ps:(i+1)*ps], bytes.Repeat([]byte{b}, ps)) {
			t.Fatalf("page %d of the layer is wrong", i)
		}
	}
}
