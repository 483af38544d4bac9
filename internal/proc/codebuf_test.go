package proc

import (
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"os"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// codeHeader is QEMU 7.2's distance from a block's header to its code.
const codeHeader = 192

// writeBlocks writes blocks into buf (at base) as QEMU lays them out: the
// header of block i (key bytes i, then the pointer to its code) at each
// of offs, in order. It returns where each block's code starts.
func writeBlocks(buf []byte, base uint64, order []int, offs []uint64) {
	clear(buf)
	for j, i := range order {
		x := offs[j]
		binary.NativeEndian.PutUint64(buf[x:], 0xffffffff81000000+uint64(i)*16) // pc
		binary.NativeEndian.PutUint32(buf[x+16:], 0x40c2b0)                     // flags
		binary.NativeEndian.PutUint64(buf[x+codePtrAt:], base+x+codeHeader)
		// The block's code: bytes that look like nothing.
		for k := x + codeHeader; k < x+codeHeader+100; k++ {
			buf[k] = byte(k * 7)
		}
	}
}

// TestCodeLayout lays blocks out in a code buffer of this process, notes
// the pages some of them are on, lays the same blocks out in another
// order (as another VMM of the snapshot would have them) and places the
// notes: they find the blocks where they are now, not at their old
// offsets. Pages never touched are not read (nor faulted in).
func TestCodeLayout(t *testing.T) {
	self, err := Self(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ReadCodeLayout(self); !errors.Is(err, ErrNoCodeBuffer) {
		t.Fatalf("a process with no code buffer: %v, want ErrNoCodeBuffer", err)
	}
	page := uint64(os.Getpagesize())
	const pages = 64
	buf, err := unix.Mmap(-1, 0, int(pages*page), unix.PROT_READ|unix.PROT_WRITE|unix.PROT_EXEC, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatalf("no writable, executable mapping here: %v", err)
	}
	defer unix.Munmap(buf)
	base := uint64(uintptr(unsafe.Pointer(&buf[0])))

	// 200 blocks, 384 to 1024 bytes apart, in the first 48 pages: the
	// last 16 are never touched.
	const n = 200
	rng := rand.New(rand.NewPCG(1, 2))
	offs := make([]uint64, n)
	for i, at := 0, uint64(0); i < n; i++ {
		offs[i] = at
		at += 384 + uint64(rng.IntN(11))*codeLine
	}
	if end := offs[n-1] + 1024; end > 48*page {
		t.Fatalf("blocks end at %d", end)
	}
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	writeBlocks(buf[:48*page], base, order, offs)

	a, err := ReadCodeLayout(self)
	if err != nil {
		t.Fatal(err)
	}
	if a.Blocks() != n || a.base != base {
		t.Fatalf("found %d blocks at %#x, want %d at %#x", a.Blocks(), a.base, n, base)
	}
	resident, err := ResidentAnon(self, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range resident {
		if s.Start+s.Len > base+48*page && s.Start < base+pages*page {
			t.Fatalf("untouched pages of the buffer were faulted in: %#x+%#x", s.Start, s.Len)
		}
	}

	// The notes: pages 10 and 11, and so the blocks on them.
	used := []Span{{base + 10*page, 2 * page}}
	notes, err := Note(self, used)
	if err != nil {
		t.Fatal(err)
	}
	notes = notes.WithCode(a)
	// The pages the block at position j spans: up to the next one's
	// header, the last up to the end of what is resident.
	extent := func(j int) (first, last uint64) {
		first, last = offs[j]/page, 47
		if j+1 < n {
			last = max((offs[j]+codeHeader)/page, (offs[j+1]-1)/page)
		}
		return first, last
	}
	var want []int
	for i := range offs {
		if first, last := extent(i); first <= 11 && last >= 10 {
			want = append(want, i)
		}
	}
	if notes.CodeBlocks() != len(want) {
		t.Fatalf("notes know %d blocks, want %d", notes.CodeBlocks(), len(want))
	}

	// The other VMM: the same blocks, in reverse.
	for i := range order {
		order[i] = n - 1 - i
	}
	writeBlocks(buf[:48*page], base, order, offs)
	b, err := ReadCodeLayout(self)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Place(self, notes, b)
	if err != nil {
		t.Fatal(err)
	}
	wantPages := map[uint64]bool{}
	for _, i := range want {
		first, last := extent(n - 1 - i) // where block i lies now
		for pg := first; pg <= last; pg++ {
			wantPages[pg] = true
		}
	}
	gotPages := map[uint64]bool{}
	for _, s := range got {
		for at := s.Start; at < s.Start+s.Len; at += page {
			gotPages[(at-base)/page] = true
		}
	}
	if len(gotPages) != len(wantPages) {
		t.Fatalf("placed on pages %v, want %v", gotPages, wantPages)
	}
	for pg := range wantPages {
		if !gotPages[pg] {
			t.Fatalf("placed on pages %v, want %v", gotPages, wantPages)
		}
	}
	if gotPages[10] && !wantPages[10] {
		t.Fatal("placed by offset")
	}

	// Without a layout for the other VMM, the notes place by offset.
	got, err = Place(self, notes, CodeLayout{})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0] != used[0] {
		t.Fatalf("placed %v without a layout, want %v", got, used)
	}
}

// TestCodeLayoutNoBlocks: a writable, executable mapping whose lines do
// not point at their code a fixed distance ahead has no layout, nor one
// whose blocks' keys are all alike.
func TestCodeLayoutNoBlocks(t *testing.T) {
	const line = 64
	base := uint64(0x7f0000000000)
	b := make([]byte, 1<<16)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	// A few that do, at two distances: not enough, and not agreeing.
	for i := 0; i < 40; i++ {
		x := uint64(i * 8 * line)
		binary.NativeEndian.PutUint64(b[x+codePtrAt:], base+x+uint64(192+64*(i%2)))
	}
	cands := appendCandidates(nil, base, 0, b)
	if _, err := layoutOf(base, []Span{{0, uint64(len(b))}}, cands); !errors.Is(err, ErrNoCodeBuffer) {
		t.Fatalf("random bytes: %v, want ErrNoCodeBuffer", err)
	}

	// Headers that agree, but whose first bytes are all alike: keys that
	// tell no block apart.
	clear(b)
	for x := uint64(0); x+codeHeader+64 <= uint64(len(b)); x += 4 * line {
		binary.NativeEndian.PutUint64(b[x+codePtrAt:], base+x+codeHeader)
	}
	cands = appendCandidates(nil, base, 0, b)
	if len(cands) < codeBlocksMin {
		t.Fatalf("%d candidates", len(cands))
	}
	if _, err := layoutOf(base, []Span{{0, uint64(len(b))}}, cands); !errors.Is(err, ErrNoCodeBuffer) {
		t.Fatalf("keys all alike: %v, want ErrNoCodeBuffer", err)
	}
}

// TestCodeBufferPick: the code buffer is the one private anonymous
// writable, executable mapping, and not one past codeBufferMax.
func TestCodeBufferPick(t *testing.T) {
	const rest = `55d000000000-55d000100000 r-xp 00000000 fd:01 100 /usr/bin/qemu
7f1000000000-7f1000004000 rwxp 00008000 fd:01 200 /usr/lib/libjit.so
7f3000000000-7f3002000000 rwxs 00000000 00:01 9 /memfd:code (deleted)
`
	for _, c := range []struct {
		maps string
		ok   bool
	}{
		{rest, false},
		{rest + "7f2000000000-7f2002000000 rwxp 00000000 00:00 0\n", true},
		{rest + "7f2000000000-7f2002000000 rwxp 00000000 00:00 0\n7f4000000000-7f4000001000 rwxp 00000000 00:00 0\n", false},
		{rest + "7f2000000000-7f2020000000 rwxp 00000000 00:00 0\n", false}, // 512 MiB
	} {
		layout := privateLayout([]byte(c.maps))
		i := codeBuffer(layout)
		if ok := i >= 0; ok != c.ok || ok && layout[i].start != 0x7f2000000000 {
			t.Errorf("%q: %d, want %v", c.maps, i, c.ok)
		}
	}
}
