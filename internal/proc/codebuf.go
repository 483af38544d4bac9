package proc

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"golang.org/x/sys/unix"
)

// A JIT's code buffer (QEMU's under TCG) holds what it translated in the
// order it translated it, which differs from one process to the next: two
// VMMs restored from one snapshot translate the same guest code, but not
// in the same order, and the same code lies at other offsets. So Notes,
// which name pages by offset, name another VMM's code for much of a
// buffer (on a 2-core TCG host 1.3 of the 13.5 MiB a request used). A
// CodeLayout names the blocks of a buffer by what they translate instead.
//
// QEMU writes each translation block's header (TranslationBlock) into the
// buffer, cache-line aligned, right before the block's host code: its
// guest pc, cs_base, flags and cflags first, and, 32 bytes in, the
// address of the code, which follows the header. ReadCodeLayout finds the
// headers by that pointer: the distance from a header to its code is the
// same for every block of a build, and is taken as the one most
// candidates share. A build whose header says something else there finds
// no blocks, and its notes name its buffer by offset as before.

// codeLine is the alignment of block headers in the buffer (QEMU's icache
// line size on x86), codePtrAt where a header holds the address of its
// block's code, codeKeyLen how many bytes from a header's start key it.
const (
	codeLine   = 64
	codePtrAt  = 32
	codeKeyLen = 24
)

// codeHeaderMax bounds the header sizes ReadCodeLayout considers;
// codeBlocksMin is the fewest blocks a buffer's layout is believed with,
// codeAgreeMin the share (in 1/16ths) of candidates that must agree on
// the header size, and of blocks whose keys must differ.
const (
	codeHeaderMax = 1024
	codeBlocksMin = 64
	codeAgreeMin  = 15
)

// codeBlockPages bounds the pages one block is taken to span: a block
// is at most a few KiB of host code. codeBufferMax bounds the buffers
// read (forkd gives QEMU's 32 MiB): what one holds, and a layout of it,
// takes memory in proportion.
const (
	codeBlockPages = 64
	codeBufferMax  = 256 << 20
)

// CodeLayout is where the blocks in a process's code buffer lie: each
// block's key (a hash of what QEMU translated it from) with the pages of
// the buffer it spans, sorted by key. The zero CodeLayout names nothing.
type CodeLayout struct {
	base   uint64   // the buffer's address in the process
	keys   []uint32 // sorted
	blocks []uint32 // with keys: first page<<8 | (pages - 1)
}

// Blocks returns how many blocks l names.
func (l CodeLayout) Blocks() int { return len(l.keys) }

// ErrNoCodeBuffer is ReadCodeLayout's error for a process with no code
// buffer, or one whose blocks it cannot tell apart.
var ErrNoCodeBuffer = errors.New("no code buffer with known block headers")

// codeBuffer returns the index in layout (privateLayout's) of the code
// buffer: the only private anonymous mapping that is writable and
// executable, if it is no larger than codeBufferMax; -1 if there is
// none.
func codeBuffer(layout []mapDesc) int {
	found := -1
	for i, d := range layout {
		if d.isCode() {
			if found >= 0 {
				return -1
			}
			found = i
		}
	}
	if found >= 0 && layout[found].size > codeBufferMax {
		return -1
	}
	return found
}

// codeCandidate is a cache line of the buffer at off whose pointer lies
// header bytes after it.
type codeCandidate struct {
	off    uint64
	header uint64
	key    uint32
}

// ReadCodeLayout reads the block headers of the code buffer of the
// process named by id, in the pages of it that are resident (none is
// faulted in). It fails with ErrNoCodeBuffer when the process has no
// code buffer or no blocks were found in it, and with a NotFound-class
// error once the process has exited. Reading another process's memory
// and pagemap needs ptrace read access to it (root).
func ReadCodeLayout(id Identity) (CodeLayout, error) {
	p, err := Open(id)
	if err != nil {
		return CodeLayout{}, err
	}
	defer p.Close()
	dir := filepath.Join(Root, strconv.Itoa(id.PID))
	maps, err := os.ReadFile(filepath.Join(dir, "maps"))
	if err != nil {
		return CodeLayout{}, p.gone(err)
	}
	layout := privateLayout(maps)
	i := codeBuffer(layout)
	if i < 0 {
		return CodeLayout{}, ErrNoCodeBuffer
	}
	buf := layout[i]
	runs, err := exclusivePages(p, dir, buf)
	if err != nil {
		return CodeLayout{}, err
	}
	cands, err := readCodeCandidates(id.PID, buf.start, runs)
	switch {
	case errors.Is(err, unix.ESRCH):
		return CodeLayout{}, errExited(id.PID)
	case err != nil:
		return CodeLayout{}, p.gone(err)
	}
	if exited(p.fd) {
		return CodeLayout{}, errExited(id.PID)
	}
	return layoutOf(buf.start, runs, cands)
}

// pmExclusive marks a page mapped by this process alone: a private
// anonymous page it owns, not the shared zero page.
const pmExclusive = 1 << 56

// exclusivePages returns the runs of pages of mapping d that the process
// has resident and its own, as offsets into d.
func exclusivePages(p *Process, dir string, d mapDesc) ([]Span, error) {
	f, err := os.Open(filepath.Join(dir, "pagemap"))
	if err != nil {
		return nil, p.gone(err)
	}
	defer f.Close()
	page := uint64(os.Getpagesize())
	var runs []Span
	err = walkPagemap(f, p.id.PID, d.start, d.start+d.size, make([]byte, 8*pagemapChunk), func(at, e uint64) bool {
		if e&pmPresent == 0 || e&pmExclusive == 0 {
			return true
		}
		off := at - d.start
		if k := len(runs) - 1; k >= 0 && runs[k].Start+runs[k].Len == off {
			runs[k].Len += page
		} else {
			runs = append(runs, Span{off, page})
		}
		return true
	})
	if err != nil {
		return nil, p.gone(err)
	}
	return runs, nil
}

// readCodeCandidates reads the runs (offsets into the buffer at base) of
// process pid's memory and returns its cache lines that point a header's
// length ahead into the buffer, with the key their first bytes make.
func readCodeCandidates(pid int, base uint64, runs []Span) ([]codeCandidate, error) {
	chunk := make([]byte, pageInBuf)
	var out []codeCandidate
	for _, r := range runs {
		for at := r.Start; at < r.Start+r.Len; {
			n := min(r.Start+r.Len-at, uint64(len(chunk)))
			local := []unix.Iovec{{Base: &chunk[0]}}
			local[0].SetLen(int(n))
			remote := []unix.RemoteIovec{{Base: uintptr(base + at), Len: int(n)}}
			got, err := unix.ProcessVMReadv(pid, local, remote, 0)
			switch {
			case errors.Is(err, unix.EFAULT):
				// Unmapped since: what was read is all there is.
				got = 0
			case err != nil:
				return nil, fmt.Errorf("read the code buffer of %d: %w", pid, err)
			}
			out = appendCandidates(out, base, at, chunk[:got])
			if uint64(got) < n {
				break
			}
			at += n
		}
	}
	return out, nil
}

// appendCandidates appends the candidates among the cache lines of b,
// which was read from off into the buffer at base.
func appendCandidates(out []codeCandidate, base, off uint64, b []byte) []codeCandidate {
	for i := 0; i+codePtrAt+8 <= len(b); i += codeLine {
		at := off + uint64(i)
		ptr := binary.NativeEndian.Uint64(b[i+codePtrAt:])
		h := ptr - (base + at)
		if ptr <= base+at || h > codeHeaderMax || h%codeLine != 0 {
			continue
		}
		k := fnv.New32a()
		k.Write(b[i : i+codeKeyLen])
		out = append(out, codeCandidate{off: at, header: h, key: k.Sum32()})
	}
	return out
}

// layoutOf makes the layout of a buffer at base from its candidates
// (in offset order), read from its resident runs: those of the header
// length most share are its blocks, each spanning the buffer up to the
// next one's header or the end of its run.
func layoutOf(base uint64, runs []Span, cands []codeCandidate) (CodeLayout, error) {
	count := map[uint64]int{}
	for _, c := range cands {
		count[c.header]++
	}
	var header uint64
	for h, n := range count {
		if n > count[header] || n == count[header] && h < header {
			header = h
		}
	}
	if n := count[header]; n < codeBlocksMin || 16*n < codeAgreeMin*len(cands) {
		return CodeLayout{}, ErrNoCodeBuffer
	}
	page := uint64(os.Getpagesize())
	type block struct {
		key         uint32
		first, last uint64 // pages
	}
	var blocks []block
	r := 0
	for i, c := range cands {
		if c.header != header {
			continue
		}
		for r < len(runs) && runs[r].Start+runs[r].Len <= c.off {
			r++
		}
		end := c.off + header + codeBlockPages*page
		if r < len(runs) {
			end = min(end, runs[r].Start+runs[r].Len)
		}
		for _, next := range cands[i+1:] {
			if next.header == header {
				end = min(end, next.off)
				break
			}
		}
		// A block's code starts after its header: it spans the page of
		// its code's start even when the next header is on it.
		end = max(end, c.off+header+1)
		blocks = append(blocks, block{c.key, c.off / page, (end - 1) / page})
	}
	slices.SortFunc(blocks, func(a, b block) int { return cmp.Compare(a.key, b.key) })
	// Keys that do not tell blocks apart (a build whose headers hold no
	// pc there, as QEMU's for position-independent blocks may) would
	// place a block on every page of its key.
	distinct := 0
	for i, b := range blocks {
		if i == 0 || b.key != blocks[i-1].key {
			distinct++
		}
	}
	if 16*distinct < codeAgreeMin*len(blocks) {
		return CodeLayout{}, ErrNoCodeBuffer
	}
	l := CodeLayout{base: base, keys: make([]uint32, len(blocks)), blocks: make([]uint32, len(blocks))}
	for i, b := range blocks {
		n := min(b.last-b.first, codeBlockPages-1)
		l.keys[i], l.blocks[i] = b.key, uint32(b.first)<<8|uint32(n)
	}
	return l, nil
}

// pages returns the first page and how many pages block i spans.
func (l CodeLayout) pages(i int) (first, n uint64) {
	return uint64(l.blocks[i] >> 8), uint64(l.blocks[i]&0xff) + 1
}

// keysOn returns the keys of l's blocks that span a page of runs (offsets
// into the buffer), sorted, each once.
func (l CodeLayout) keysOn(runs []noteRun) []uint32 {
	page := uint64(os.Getpagesize())
	used := map[uint64]bool{}
	for _, r := range runs {
		for at := r.off / page; at*page < r.off+r.len; at++ {
			used[at] = true
		}
	}
	var keys []uint32
	for i := range l.keys {
		first, n := l.pages(i)
		for pg := first; pg < first+n; pg++ {
			if used[pg] {
				if k := len(keys) - 1; k < 0 || keys[k] != l.keys[i] {
					keys = append(keys, l.keys[i])
				}
				break
			}
		}
	}
	return keys
}

// spans returns the spans of the process l was read from that hold the
// blocks keys (sorted) name, in address order, adjacent ones joined.
func (l CodeLayout) spans(keys []uint32) []Span {
	page := uint64(os.Getpagesize())
	want := map[uint64]bool{}
	for i, j := 0, 0; i < len(l.keys) && j < len(keys); {
		switch {
		case l.keys[i] < keys[j]:
			i++
		case l.keys[i] > keys[j]:
			j++
		default:
			first, n := l.pages(i)
			for pg := first; pg < first+n; pg++ {
				want[pg] = true
			}
			i++
		}
	}
	out := make([]Span, 0, len(want))
	for pg := range want {
		out = append(out, Span{l.base + pg*page, page})
	}
	return joinSpans(out)
}

// isCode reports whether d may be a code buffer (codeBuffer's pick, when
// it is the only one).
func (d mapDesc) isCode() bool { return d.name == "" && d.perms == "rwxp" }
