package proc

import (
	"cmp"
	"os"
	"slices"
	"testing"
)

// Two processes of one program: the same mappings at other addresses, the
// libraries and the anonymous ones in another order, some anonymous
// mappings of other sizes (one of 2 MiB in both, and one that grew to
// 1.3 MiB in A but 1 MiB in B, in the other order), and mappings only the
// first has.
const (
	mapsA = `55d000000000-55d000100000 r--p 00000000 fd:01 100 /usr/bin/qemu
55d000100000-55d000104000 rw-p 00100000 fd:01 100 /usr/bin/qemu
55d001000000-55d001200000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
7f0000100000-7f0000200000 rw-p 00000000 00:00 0
7f0000200000-7f0000300000 rw-p 00000000 00:00 0
7f0000400000-7f0000402000 rw-p 00000000 00:00 0
7f0000500000-7f0000700000 rw-p 00000000 00:00 0
7f0000800000-7f0000950000 rw-p 00000000 00:00 0
7f1000000000-7f1000004000 rw-p 00008000 fd:01 200 /usr/lib/libz.so
7f2000000000-7f2000004000 rw-p 00008000 fd:01 300 /usr/lib/libc.so
7f3000000000-7f3000001000 rw-s 00000000 00:01 9 /dev/zero (deleted)
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0 [vsyscall]
`
	mapsB = `56e000000000-56e000100000 r--p 00000000 fd:01 100 /usr/bin/qemu
56e000100000-56e000104000 rw-p 00100000 fd:01 100 /usr/bin/qemu
56e002000000-56e002300000 rw-p 00000000 00:00 0 [heap]
7e5000000000-7e5000004000 rw-p 00008000 fd:01 300 /usr/lib/libc.so
7e6000000000-7e6000004000 rw-p 00008000 fd:01 200 /usr/lib/libz.so
7e7000000000-7e70000ff000 rw-p 00000000 00:00 0
7e7000100000-7e70001f0000 rw-p 00000000 00:00 0
7e7000300000-7e7000401000 rw-p 00000000 00:00 0
7e7000500000-7e7000700000 rw-p 00000000 00:00 0
`
)

// TestNotesPlace notes spans of one process's mappings and places them in
// the other's: each run lands at the same offset into the mapping alike,
// runs across mappings are split, and runs of mappings the other lacks
// are dropped.
func TestNotesPlace(t *testing.T) {
	spans := []Span{
		{0x55d000100000, 0x2000},         // qemu's data
		{0x55d001000000, 0x1000},         // heap
		{0x7f00000fe000, 0x4000},         // end of anon #1, start of anon #2
		{0x7f0000280000, 0x1000},         // anon #3: not in B
		{0x7f0000400000, 0x2000},         // a small anonymous one: not in B
		{0x7f0000500000, 0x1000},         // the 2 MiB one
		{0x7f00008ff000, 0x4000},         // in the one that grew: cut short in B
		{0x7f1000002000, 0x2000},         // libz's data
		{0x7f2000000000, 0x1000},         // libc's data
		{0x7f3000000000, 0x1000},         // shared: not noted
		{0x7f00000f0000 + 1<<40, 0x1000}, // outside every mapping
	}
	slices.SortFunc(spans, func(a, b Span) int { return cmp.Compare(a.Start, b.Start) })
	n := noteSpans([]byte(mapsA), spans)
	if got, want := n.Bytes(), uint64(0x12000); got != want {
		t.Fatalf("notes name %#x bytes, want %#x", got, want)
	}
	got := placeNotes([]byte(mapsB), n, CodeLayout{})
	want := []Span{
		{0x56e000100000, 0x2000},
		{0x56e002000000, 0x1000},
		{0x7e5000000000, 0x1000},
		{0x7e6000002000, 0x2000},
		{0x7e70000fe000, 0x1000}, // anon #1 is smaller in B: cut
		{0x7e7000100000, 0x2000},
		{0x7e70003ff000, 0x2000},
		{0x7e7000500000, 0x1000},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("placed %#x, want %#x", got, want)
	}
	// In the process they were noted in, they are where they were.
	back := placeNotes([]byte(mapsA), n, CodeLayout{})
	wantA := []Span{
		{0x55d000100000, 0x2000},
		{0x55d001000000, 0x1000},
		{0x7f00000fe000, 0x4000},
		{0x7f0000280000, 0x1000},
		{0x7f0000400000, 0x2000},
		{0x7f0000500000, 0x1000},
		{0x7f00008ff000, 0x4000},
		{0x7f1000002000, 0x2000},
		{0x7f2000000000, 0x1000},
	}
	if !slices.Equal(back, wantA) {
		t.Fatalf("placed back %#x, want %#x", back, wantA)
	}
	if got := placeNotes([]byte(mapsB), Notes{}, CodeLayout{}); got != nil {
		t.Fatalf("zero notes placed %#x", got)
	}
}

// TestNotePlaceSelf notes the test's own resident pages and places them
// in itself again; NoteResident reads and notes them in one go.
func TestNotePlaceSelf(t *testing.T) {
	id, err := Self(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	spans, err := ResidentAnon(id, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	n, err := Note(id, spans)
	if err != nil {
		t.Fatal(err)
	}
	placed, err := Place(id, n, CodeLayout{})
	if err != nil {
		t.Fatal(err)
	}
	var total, in uint64
	for _, s := range spans {
		total += s.Len
	}
	for _, s := range placed {
		in += s.Len
	}
	// The Go runtime maps and unmaps as the test runs: allow a little.
	if n.Bytes() < total*9/10 || in < total*9/10 {
		t.Fatalf("%d resident bytes, %d noted, %d placed", total, n.Bytes(), in)
	}
	// NoteResident does both at once, and notes nothing past its bounds.
	if nr, err := NoteResident(id, 0, 0); err != nil || nr.Bytes() < total*9/10 {
		t.Fatalf("NoteResident: %d bytes of %d resident, %v", nr.Bytes(), total, err)
	}
	if nr, err := NoteResident(id, 0, 1); err != nil || nr.Bytes() != 0 {
		t.Fatalf("NoteResident with one run at most: %d bytes, %v", nr.Bytes(), err)
	}
}
