package qemu

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
)

// The testdata streams come from QEMU 7.2 running forkd's minimal guest
// (microvm, TCG, 256 MiB): root.state is a parent snapshot's state (migrate
// with x-ignore-shared), devices.xen what xen-save-devices-state wrote for
// a child of it, live.state what SaveLive made of a child.

func readTestdata(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile("testdata/" + name)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

const testRAM = 256 << 20

// testPage is a page record as a test sees it.
type testPage struct {
	block string
	addr  uint64
	data  []byte // nil for a ZERO record
}

func (p testPage) String() string {
	return fmt.Sprintf("%s@%#x zero=%v", p.block, p.addr, p.data == nil)
}

// recorder is a sink that keeps everything: copied bytes with their offsets
// in the output, and page records.
type recorder struct {
	out    []byte
	chunks []int // offset in out of each copy
	pages  []testPage
}

func (r *recorder) copy(p []byte) error {
	r.chunks = append(r.chunks, len(r.out))
	r.out = append(r.out, p...)
	return nil
}

func (r *recorder) page(rec pageRecord) error {
	p := testPage{block: rec.block.name, addr: rec.addr}
	if rec.data != nil {
		p.data = bytes.Clone(rec.data)
	}
	r.pages = append(r.pages, p)
	return nil
}

// walkHead walks the head of b with a recorder.
func walkHead(t testing.TB, b []byte) (*walker, *recorder, byte) {
	t.Helper()
	r := &recorder{}
	w := newWalker(bytes.NewReader(b), r)
	next, err := w.head()
	if err != nil {
		t.Fatalf("walk: %v", err)
	}
	return w, r, next
}

// runState returns the run state recorded in the globalstate section of
// device sections b.
func runState(t testing.TB, b []byte) string {
	t.Helper()
	var found []string
	for i := 0; ; {
		j := bytes.Index(b[i:], globalStateName)
		if j < 0 {
			break
		}
		j += i
		i = j + 1
		if at, ok := globalStateAt(b, j); ok {
			n := binary.BigEndian.Uint32(b[at:])
			rs := b[at+4 : at+4+runStateLen]
			found = append(found, fmt.Sprintf("%s/%d", bytes.TrimRight(rs, "\x00"), n))
		}
	}
	if len(found) != 1 {
		t.Fatalf("globalstate sections: %q", found)
	}
	return found[0]
}

func TestStateHeadOfSnapshots(t *testing.T) {
	for _, name := range []string{"root.state", "live.state"} {
		t.Run(name, func(t *testing.T) {
			b := readTestdata(t, name)
			head, err := stateHead(b)
			if err != nil {
				t.Fatal(err)
			}
			w, r, next := walkHead(t, b)
			if next != secFull {
				t.Fatalf("head: %d bytes, next %#x", len(head), next)
			}
			if !w.ignoreShared || !w.ramEnded {
				t.Fatalf("ignoreShared %v, ram ended %v", w.ignoreShared, w.ramEnded)
			}
			var names []string
			for _, b := range w.blocks {
				names = append(names, fmt.Sprintf("%s:%d", b.name, b.size))
			}
			want := "[mem:268435456 /rom@etc/acpi/tables:4096 pc.bios:65536 /rom@etc/table-loader:4096 /rom@etc/acpi/rsdp:4096]"
			if fmt.Sprint(names) != want {
				t.Fatalf("blocks %v, want %s", names, want)
			}
			// The firmware is there, guest RAM is not: 19 records of
			// the ROM blocks, 8 of them with data.
			data := 0
			for _, p := range r.pages {
				if p.block == guestBlock {
					t.Fatalf("guest RAM page %v in a state file", p)
				}
				if p.data != nil {
					data++
				}
			}
			if len(r.pages) != 19 || data != 8 {
				t.Fatalf("%d ROM page records, %d with data: %v", len(r.pages), data, r.pages)
			}
		})
	}
	if n := len(must(stateHead(readTestdata(t, "root.state")))); n != 33301 {
		t.Fatalf("root.state head is %d bytes, QEMU wrote 33301", n)
	}
	// QEMU 10 sends SWITCHOVER_START before the last ram section; the
	// head keeps it, in its place.
	root := readTestdata(t, "root.state")
	head := must(stateHead(root))
	end := len(head) - 18 // the END section: type, id, EOS, footer
	if head[end] != secEnd {
		t.Fatalf("root.state's head does not end with a bare ram END section")
	}
	b := append(append(bytes.Clone(root[:end]), switchoverStart...), root[end:]...)
	if got, err := stateHead(b); err != nil || !bytes.Equal(got, append(append(bytes.Clone(head[:end]), switchoverStart...), head[end:]...)) {
		t.Fatalf("a head with SWITCHOVER_START: %d bytes, %v", len(got), err)
	}
	if got := runState(t, readTestdata(t, "live.state")); got != "paused/7" {
		t.Fatalf("live.state run state %s, want paused/7", got)
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func TestSpliceState(t *testing.T) {
	root := readTestdata(t, "root.state")
	xen := readTestdata(t, "devices.xen")
	head := must(stateHead(root))
	if got := runState(t, xen); got != "running/8" {
		t.Fatalf("xen-save run state %s, want running/8", got)
	}
	out, err := spliceState(head, xen)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(xen[8:], readTestdata(t, "devices.xen")[8:]) {
		t.Fatal("spliceState changed its input")
	}
	// head ++ devices (run state patched) ++ VMDESCRIPTION.
	if !bytes.HasPrefix(out, head) {
		t.Fatal("spliced state does not start with the head")
	}
	devices := out[len(head) : len(out)-5-len(vmDescription)]
	if len(devices) != len(xen)-8 {
		t.Fatalf("device sections of %d bytes, xen-save wrote %d", len(devices), len(xen)-8)
	}
	if got := runState(t, devices); got != "paused/7" {
		t.Fatalf("spliced run state %s, want paused/7", got)
	}
	diff := 0
	for i := range devices {
		if devices[i] != xen[8+i] {
			diff++
		}
	}
	if diff == 0 || diff > 8 {
		t.Fatalf("%d bytes of the device sections differ from xen-save's", diff)
	}
	trailer := out[len(out)-5-len(vmDescription):]
	if trailer[0] != secVMDesc || binary.BigEndian.Uint32(trailer[1:]) != uint32(len(vmDescription)) || !bytes.Equal(trailer[5:], vmDescription) {
		t.Fatalf("trailer %q", trailer)
	}
	if end, err := devicesEnd(out[len(head):]); err != nil || end != len(devices)-1 {
		t.Fatalf("devicesEnd = %d, %v; want %d", end, err, len(devices)-1)
	}
	// A branch of the branch reuses the same head.
	if again := must(stateHead(out)); !bytes.Equal(again, head) {
		t.Fatal("the head of a spliced state differs from its base's")
	}
	out2, err := spliceState(must(stateHead(out)), xen)
	if err != nil || !bytes.Equal(out2, out) {
		t.Fatalf("splicing onto a spliced state: %v", err)
	}
}

func TestSpliceStateRejects(t *testing.T) {
	head := must(stateHead(readTestdata(t, "root.state")))
	xen := readTestdata(t, "devices.xen")
	gs := bytes.Index(xen, globalStateName) - 5
	cases := map[string][]byte{
		"empty":                 nil,
		"header only":           xen[:8],
		"header and EOF":        append(bytes.Clone(xen[:8]), secEOF),
		"wrong magic":           append([]byte("QEVN"), xen[4:]...),
		"version 2":             append(append(bytes.Clone(xen[:7]), 2), xen[8:]...),
		"configuration first":   append(append(bytes.Clone(xen[:8]), secConfig), xen[9:]...),
		"truncated":             xen[:len(xen)-1],
		"no globalstate":        append(bytes.Clone(xen[:gs]), secEOF),
		"globalstate twice":     append(bytes.Clone(xen[:len(xen)-1]), xen[gs:]...),
		"globalstate size >100": setBE32(bytes.Clone(xen), gs+5+len(globalStateName)+8, 101),
		"globalstate footer":    setBE32(bytes.Clone(xen), gs+5+len(globalStateName)+8+4+runStateLen+1, 99),
	}
	for name, x := range cases {
		if _, err := spliceState(head, x); !errors.Is(err, errStream) {
			t.Errorf("%s: spliceState = %v, want a stream error", name, err)
		}
	}
}

func setBE32(b []byte, at int, v uint32) []byte {
	binary.BigEndian.PutUint32(b[at:], v)
	return b
}

// streamBuilder writes migration streams the way QEMU 7.2 does.
type streamBuilder struct {
	b    []byte
	last string // block of the last page record, across sections
}

func (s *streamBuilder) be32(v uint32) { s.b = binary.BigEndian.AppendUint32(s.b, v) }
func (s *streamBuilder) be64(v uint64) { s.b = binary.BigEndian.AppendUint64(s.b, v) }

func (s *streamBuilder) page(p testPage) {
	flags := uint64(ramPage)
	if p.data == nil {
		flags = ramZero
	}
	if p.block == s.last {
		s.be64(p.addr | flags | ramContinue)
	} else {
		s.be64(p.addr | flags)
		s.b = append(append(s.b, byte(len(p.block))), p.block...)
		s.last = p.block
	}
	if p.data == nil {
		s.b = append(s.b, 0)
	} else {
		s.b = append(s.b, p.data...)
	}
}

// section writes a ram PART or END section holding pages.
func (s *streamBuilder) section(t byte, id uint32, pages ...testPage) {
	s.b = append(s.b, t)
	s.be32(id)
	for _, p := range pages {
		s.page(p)
	}
	s.be64(ramEOS)
	s.b = append(s.b, secFooter)
	s.be32(id)
}

// switchoverStart is the SWITCHOVER_START command section QEMU 10 writes
// before the last ram section.
var switchoverStart = []byte{secCmd, 0, cmdSwitchoverStart, 0, 0}

func guestPage(n int, fill byte) testPage {
	return testPage{block: guestBlock, addr: uint64(n) * pageSize, data: bytes.Repeat([]byte{fill}, pageSize)}
}

// liveStream builds a stream like a live migration's from the real
// pieces: root.state's header, configuration and ram START; PART and END
// sections that mix its ROM pages with guest pages, CONTINUE carried
// across sections; devices.xen's device sections and a VMDESCRIPTION.
// With switchover, a SWITCHOVER_START command precedes the END section,
// as QEMU 10 writes it. It returns the stream, the guest pages in order,
// and the ROM pages.
func liveStream(t testing.TB, switchover bool) ([]byte, []testPage, []testPage) {
	t.Helper()
	root := readTestdata(t, "root.state")
	_, r, _ := walkHead(t, root)
	// The START section is the copy that starts with 0x01 and names
	// "ram"; the first PART follows its footer.
	start, part := -1, -1
	for i, off := range r.chunks {
		c := r.out[off:]
		if start < 0 && c[0] == secStart && bytes.HasPrefix(c[5:], []byte("\x03ram")) {
			start = off
		}
		if start >= 0 && c[0] == secPart && i+1 < len(r.chunks) && r.chunks[i+1]-off == 5 {
			part = off
			break
		}
	}
	if start < 0 || part < 0 {
		t.Fatal("no ram START/PART in root.state")
	}
	id := binary.BigEndian.Uint32(root[start+1:])
	rom := r.pages
	s := &streamBuilder{b: bytes.Clone(root[:part])}
	var guest []testPage
	add := func(ps ...testPage) []testPage {
		for _, p := range ps {
			if p.block == guestBlock {
				guest = append(guest, p)
			}
		}
		return ps
	}
	zero := testPage{block: guestBlock, addr: 7 * pageSize}
	// QEMU's order: ROMs and guest RAM interleaved; a section may end
	// on one block and the next go on with it as CONTINUE.
	s.section(secPart, id, add(rom[0], guestPage(0, 1), guestPage(1, 2), rom[1], rom[2])...)
	s.section(secPart, id, add(rom[3], guestPage(2, 3), zero, guestPage(3, 4))...)
	s.section(secPart, id, add(guestPage(4, 5), rom[4])...)
	s.section(secPart, id, add(rom[5:16]...)...)
	s.section(secPart, id) // a round with nothing dirty
	s.section(secPart, id, add(guestPage(1, 9), guestPage(65535, 6), rom[16], rom[17])...)
	if switchover {
		s.b = append(s.b, switchoverStart...)
	}
	s.section(secEnd, id, add(rom[18], guestPage(0, 10), guestPage(7, 11), guestPage(1, 0xee))...)
	xen := readTestdata(t, "devices.xen")
	s.b = append(s.b, xen[8:]...)
	s.b = append(s.b, secVMDesc)
	desc := []byte(`{"page_size":4096,"devices":[{"name":"timer"}]}`)
	s.be32(uint32(len(desc)))
	s.b = append(s.b, desc...)
	return s.b, guest, rom
}

func TestConsumeLive(t *testing.T) {
	t.Run("QEMU 7.2", func(t *testing.T) { testConsumeLive(t, false) })
	t.Run("QEMU 10", func(t *testing.T) { testConsumeLive(t, true) })
}

func testConsumeLive(t *testing.T, switchover bool) {
	stream, wantGuest, wantROM := liveStream(t, switchover)
	var got []testPage
	state, pages, err := consumeLive(bytes.NewReader(stream), testRAM, func(off uint64, data []byte) error {
		p := testPage{block: guestBlock, addr: off}
		if data != nil {
			if len(data) != pageSize {
				t.Fatalf("page of %d bytes", len(data))
			}
			p.data = bytes.Clone(data)
		}
		got = append(got, p)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if pages != int64(len(wantGuest)) || fmt.Sprint(got) != fmt.Sprint(wantGuest) {
		t.Fatalf("guest pages (%d):\n got %v\nwant %v", pages, got, wantGuest)
	}
	for i := range got {
		if !bytes.Equal(got[i].data, wantGuest[i].data) {
			t.Fatalf("guest page %d: content differs", i)
		}
	}
	// The state is a snapshot's: it walks, names each ROM page's block
	// right (CONTINUE fixed up across the dropped guest pages and the
	// section boundaries), and carries no guest RAM.
	head, err := stateHead(state)
	if err != nil {
		t.Fatalf("state: %v", err)
	}
	// QEMU 10's command stays in the state, in its place.
	if kept := bytes.Contains(head, switchoverStart); kept != switchover {
		t.Fatalf("SWITCHOVER_START in the state's head: %v, want %v", kept, switchover)
	}
	_, r, _ := walkHead(t, state)
	if fmt.Sprint(r.pages) != fmt.Sprint(wantROM) {
		t.Fatalf("ROM pages in the state:\n got %v\nwant %v", r.pages, wantROM)
	}
	for i := range r.pages {
		if !bytes.Equal(r.pages[i].data, wantROM[i].data) {
			t.Fatalf("ROM page %v: content differs", r.pages[i])
		}
	}
	tail := state[len(head):]
	if got := runState(t, tail); got != "paused/7" {
		t.Fatalf("run state %s, want paused/7", got)
	}
	// The device sections, EOF and VMDESCRIPTION are the stream's, but
	// for the run state.
	diff := 0
	for i, c := range stream[len(stream)-len(tail):] {
		if c != tail[i] {
			diff++
		}
	}
	if diff == 0 || diff > 8 {
		t.Fatalf("%d bytes of the device sections differ from the stream's", diff)
	}
}

func TestConsumeLiveErrors(t *testing.T) {
	stream, _, _ := liveStream(t, false)
	boom := errors.New("boom")
	n := 0
	_, _, err := consumeLive(bytes.NewReader(stream), testRAM, func(uint64, []byte) error {
		if n++; n == 3 {
			return boom
		}
		return nil
	})
	if !errors.Is(err, boom) || n != 3 {
		t.Fatalf("failing sink: %v after %d pages, want boom after 3", err, n)
	}
	nop := func(uint64, []byte) error { return nil }
	if _, _, err := consumeLive(bytes.NewReader(stream), testRAM/2, nop); !errors.Is(err, errStream) {
		t.Fatalf("guest RAM of another size: %v", err)
	}
	// Cut anywhere, the stream is an error, never a panic or a state.
	for cut := 0; cut < len(stream); cut += 1 + cut/64 {
		if st, _, err := consumeLive(bytes.NewReader(stream[:cut]), testRAM, nop); err == nil {
			t.Fatalf("stream cut at %d of %d: a state of %d bytes", cut, len(stream), len(st))
		}
	}
	// A stream whose ram sections never end.
	if _, _, err := consumeLive(bytes.NewReader(readTestdata(t, "devices.xen")), testRAM, nop); !errors.Is(err, errStream) {
		t.Fatalf("device sections only: %v", err)
	}
}

// TestStateHeadRejects feeds damaged streams to the walker: each is an
// error of the stream, never a panic.
func TestStateHeadRejects(t *testing.T) {
	root := readTestdata(t, "root.state")
	head := must(stateHead(root))
	_, r, _ := walkHead(t, root)
	// Offsets of the copies the walker made: the configuration section
	// at 8, the ram START after it, and so on.
	at := func(prefix string) int {
		for _, off := range r.chunks {
			if bytes.HasPrefix(r.out[off:], []byte(prefix)) {
				return off
			}
		}
		t.Fatalf("no copy starts with %q", prefix)
		return 0
	}
	start := at("\x01\x00\x00\x00")
	memSize := start + 1 + 4 + 4 + 8
	end := bytes.LastIndex(head, append([]byte{secEnd}, root[start+1:start+5]...))
	name := []byte("\x14/rom@etc/acpi/tables")
	inList := bytes.Index(root, name)
	firstPage := inList + 1 + bytes.Index(root[inList+1:], name) - 8 // after the MEM_SIZE list
	edit := func(off int, b ...byte) []byte {
		c := bytes.Clone(root)
		copy(c[off:], b)
		return c
	}
	be := func(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }
	insert := func(off int, b ...byte) []byte {
		return append(append(bytes.Clone(root[:off]), b...), root[off:]...)
	}
	cases := map[string]struct {
		b    []byte
		want string
	}{
		"empty":                  {nil, "stream truncated"},
		"magic":                  {edit(0, 'X'), "not a migration stream"},
		"version":                {edit(7, 4), "version 4"},
		"no configuration":       {append(bytes.Clone(root[:8]), root[start:]...), "where the configuration section belongs"},
		"configuration twice":    {append(bytes.Clone(root[:start]), root[8:]...), "configuration section after"},
		"machine name too long":  {edit(9, 0xff, 0xff, 0xff, 0xff), "machine name of"},
		"unknown subsection":     {edit(bytes.Index(root, []byte("configuration/capabilities")), 'X'), "unknown configuration subsection"},
		"capability count":       {edit(bytes.Index(root, []byte("configuration/capabilities"))+26+4, 0x7f, 0xff, 0xff, 0xff), "capabilities"},
		"not ram":                {edit(start+6, 'x'), "only ram is supported"},
		"block larger than all":  {edit(memSize+8+1+3, be(1<<40)...), "exceeds the total"},
		"guest RAM odd size":     {edit(memSize+8+1+3+7, 1), "whole number of pages"},
		"unsupported flags":      {edit(memSize+7, 0x44), "unsupported ram record flags"},
		"page of unknown block":  {edit(firstPage+9, 'X'), "unlisted RAM block"},
		"page beyond its block":  {edit(firstPage, be(0x10000|ramPage)...), "beyond RAM block"},
		"CONTINUE first":         {edit(firstPage+7, ramPage|ramContinue), "CONTINUE record without"},
		"zero with a fill byte":  {zeroFill(t, root), "fill byte"},
		"bad footer":             {edit(at("\x7e")+4, 9), "bad footer"},
		"device before ram end":  {append(bytes.Clone(root[:at("\x02")]), root[len(head):]...), "before the ram section ended"},
		"no device section":      {append(bytes.Clone(head), secEOF), "want a device section"},
		"second START":           {append(bytes.Clone(head[:at("\x02")]), head[start:]...), "second ram START"},
		"END twice":              {append(bytes.Clone(head), head[end:]...), "after its END"},
		"section of another id":  {edit(at("\x02"), secPart, 0, 0, 0, 9), "continues no ram START"},
		"ram section name empty": {edit(memSize+8, 0), "without a name"},
		"command not taken":      {insert(end, secCmd, 0, 1, 0, 0), "migration command 1 with 0 bytes"},
		"command with data":      {insert(end, secCmd, 0, cmdSwitchoverStart, 0, 1, 0), "migration command 11 with 1 bytes"},
		"command before ram":     {insert(start, switchoverStart...), "before the ram section ended"},
		"command after ram":      {insert(len(head), switchoverStart...), "want a device section"},
	}
	for name, c := range cases {
		h, err := stateHead(c.b)
		if !errors.Is(err, errStream) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: stateHead = %d bytes, %v; want a stream error saying %q", name, len(h), err, c.want)
		}
	}
	// Guest RAM in a base state would be loaded over the memory file.
	stream, _, _ := liveStream(t, false)
	if _, err := stateHead(stream); !errors.Is(err, errStream) {
		t.Errorf("a state with guest RAM: %v", err)
	}
	for cut := 0; cut < len(head); cut++ {
		if _, err := stateHead(root[:cut]); !errors.Is(err, errStream) {
			t.Fatalf("cut at %d: %v", cut, err)
		}
	}
}

// zeroFill returns root.state with its first ZERO record's fill byte set.
func zeroFill(t testing.TB, root []byte) []byte {
	t.Helper()
	i := bytes.Index(root, binary.BigEndian.AppendUint64(nil, 0x4000|ramZero|ramContinue))
	if i < 0 {
		t.Fatal("no ZERO record")
	}
	c := bytes.Clone(root)
	c[i+8] = 1
	return c
}

func FuzzStateHead(f *testing.F) {
	f.Add(readTestdata(f, "root.state"))
	f.Add(readTestdata(f, "live.state"))
	f.Add(readTestdata(f, "devices.xen"))
	f.Fuzz(func(t *testing.T, b []byte) {
		head, err := stateHead(b)
		if err != nil {
			if !errors.Is(err, errStream) {
				t.Fatalf("error of no stream class: %v", err)
			}
			return
		}
		if !bytes.HasPrefix(b, head) || len(head) == len(b) || b[len(head)] != secFull {
			t.Fatalf("head of %d bytes in %d", len(head), len(b))
		}
		again, err := stateHead(append(bytes.Clone(head), secFull))
		if err != nil || !bytes.Equal(again, head) {
			t.Fatalf("head does not walk again: %v", err)
		}
	})
}

func FuzzConsumeLive(f *testing.F) {
	for _, switchover := range []bool{false, true} {
		stream, _, _ := liveStream(f, switchover)
		f.Add(stream)
	}
	f.Add(readTestdata(f, "live.state"))
	f.Fuzz(func(t *testing.T, b []byte) {
		state, _, err := consumeLive(bytes.NewReader(b), testRAM, func(off uint64, data []byte) error {
			if off%pageSize != 0 || off >= testRAM || (data != nil && len(data) != pageSize) {
				t.Fatalf("page at %#x of %d bytes", off, len(data))
			}
			return nil
		})
		if err != nil {
			if !errors.Is(err, errStream) {
				t.Fatalf("error of no stream class: %v", err)
			}
			return
		}
		// What it keeps is a state file whose head a branch can reuse.
		if _, err := stateHead(state); err != nil {
			t.Fatalf("kept state does not walk: %v", err)
		}
	})
}

func FuzzSpliceState(f *testing.F) {
	f.Add(readTestdata(f, "devices.xen"))
	head := must(stateHead(readTestdata(f, "root.state")))
	f.Fuzz(func(t *testing.T, xen []byte) {
		out, err := spliceState(head, xen)
		if err != nil {
			if !errors.Is(err, errStream) {
				t.Fatalf("error of no stream class: %v", err)
			}
			return
		}
		if again, err := stateHead(out); err != nil || !bytes.Equal(again, head) {
			t.Fatalf("spliced state does not walk to its head: %v", err)
		}
	})
}
