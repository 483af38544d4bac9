package hub

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"math/bits"
	"os"

	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
)

// PageSize is the unit of the chunk format.
const PageSize = 4096

// DefaultChunkBytes is the window of guest RAM (or of a root filesystem)
// one chunk covers.
const DefaultChunkBytes = 8 << 20

// chunkMagic opens every chunk, before compression.
const chunkMagic = "FKDCHNK1"

// chunkHeader is the magic, then page size, window pages and reference
// count, each a little-endian uint32.
const chunkHeader = len(chunkMagic) + 12

// Sources a page reference names: boot files the artifact carries anyway,
// so a page of guest RAM equal to a block of one (the page cache of the
// root filesystem, the kernel image the guest booted from) is stored as
// where to read it.
const (
	srcKernel = 1
	srcInitrd = 2
	srcRootfs = 3
	nSources  = 4
)

// refBytes is one reference: a source byte, a little-endian uint64 offset.
const refBytes = 9

// A chunk, uncompressed (the package doc has the why):
//
//	"FKDCHNK1" | page size | pages P in the window | references R
//	present bitmap (P bits): the pages the chunk restores
//	reference bitmap (P bits): those of them read from a source
//	R references, in page order: source, offset
//	the other present pages' bytes, in page order
//
// compressed as one zstd frame. A chunk says nothing of where its window
// is: two windows with the same pages share one blob.

// chunkOut is an encoded window.
type chunkOut struct {
	index int64
	read  int64  // bytes of the window's data extents
	blob  []byte // nil: nothing to store
	// digest and size of blob, once it is stored
	digest string
	size   int64
	pages  int
	hash   [32]byte // pagesHash of what it restores
}

// encoder turns windows of an image file into chunks. One per goroutine.
type encoder struct {
	window   int64
	dropZero bool       // a page of zeros is a hole (HolesZero)
	refs     *pageIndex // nil: no references
	zw       *zstd.Encoder
	data     []byte // the window's bytes
	present  []bool
	raw      []byte
	page     []byte
}

// newEncoder returns an encoder of windows of w bytes.
func newEncoder(w int64, dropZero bool, refs *pageIndex) (*encoder, error) {
	zw, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedDefault), zstd.WithEncoderConcurrency(1),
		zstd.WithWindowSize(int(min(w, zstd.MaxWindowSize))))
	if err != nil {
		return nil, err
	}
	return &encoder{window: w, dropZero: dropZero, refs: refs, zw: zw, data: make([]byte, w),
		present: make([]bool, w/PageSize), page: make([]byte, PageSize)}, nil
}

// encode reads window idx of f (size bytes; only its data extents) and
// encodes it.
func (e *encoder) encode(f *os.File, size, idx int64) (chunkOut, error) {
	out := chunkOut{index: idx}
	start := idx * e.window
	end := min(start+e.window, size)
	clear(e.present)
	found := false
	err := extents(f, start, end, func(off, n int64) error {
		first, last := (off-start)/PageSize, (off+n-start+PageSize-1)/PageSize
		lo, hi := first*PageSize, min(last*PageSize, end-start)
		if _, err := f.ReadAt(e.data[lo:hi], start+lo); err != nil && !errors.Is(err, io.EOF) {
			return err
		}
		for p := first; p < last; p++ {
			e.present[p] = true
		}
		out.read += hi - lo
		found = true
		return nil
	})
	if err != nil || !found {
		return out, err
	}
	pages := int(e.window / PageSize)
	bm := (pages + 7) / 8
	e.raw = append(e.raw[:0], chunkMagic...)
	e.raw = binary.LittleEndian.AppendUint32(e.raw, PageSize)
	e.raw = binary.LittleEndian.AppendUint32(e.raw, uint32(pages))
	e.raw = binary.LittleEndian.AppendUint32(e.raw, 0) // references, set below
	e.raw = append(e.raw, make([]byte, 2*bm)...)
	present, isRef := e.raw[chunkHeader:chunkHeader+bm], e.raw[chunkHeader+bm:chunkHeader+2*bm]
	h := sha256.New()
	var refs []pageRef
	var data [][]byte
	var hdr [8]byte
	for p := 0; p < pages; p++ {
		if !e.present[p] {
			continue
		}
		pg := e.data[p*PageSize : (p+1)*PageSize]
		if e.dropZero && isZero(pg) {
			continue
		}
		present[p/8] |= 1 << (p % 8)
		if r, ok := e.refs.find(pg, e.page); ok {
			isRef[p/8] |= 1 << (p % 8)
			refs = append(refs, r)
		} else {
			data = append(data, pg)
		}
		binary.LittleEndian.PutUint64(hdr[:], uint64(start/PageSize)+uint64(p))
		h.Write(hdr[:])
		h.Write(pg)
		out.pages++
	}
	if out.pages == 0 {
		return out, nil
	}
	binary.LittleEndian.PutUint32(e.raw[len(chunkMagic)+8:], uint32(len(refs)))
	for _, r := range refs {
		e.raw = append(e.raw, r.src)
		e.raw = binary.LittleEndian.AppendUint64(e.raw, uint64(r.off))
	}
	for _, d := range data {
		e.raw = append(e.raw, d...)
	}
	out.blob = e.zw.EncodeAll(e.raw, make([]byte, 0, len(e.raw)/2))
	copy(out.hash[:], h.Sum(nil))
	return out, nil
}

// decoder writes chunks into an image file. One per goroutine.
type decoder struct {
	window int64
	srcs   *sources
	zr     *zstd.Decoder
	raw    []byte
	buf    []byte
}

// sources are the files page references read from, verified.
type sources struct {
	f    [nSources]*os.File
	size [nSources]int64
}

func (s *sources) close() {
	for _, f := range s.f {
		if f != nil {
			f.Close()
		}
	}
}

// maxRaw bounds a chunk of a window of w bytes, uncompressed.
func maxRaw(w int64) int {
	p := int(w / PageSize)
	return chunkHeader + 2*((p+7)/8) + p*refBytes + p*PageSize
}

func newDecoder(w int64, srcs *sources) (*decoder, error) {
	zr, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxMemory(uint64(maxRaw(w))),
		zstd.WithDecodeAllCapLimit(true), zstd.WithDecoderMaxWindow(uint64(max(w, zstd.MinWindowSize))))
	if err != nil {
		return nil, err
	}
	return &decoder{window: w, srcs: srcs, zr: zr, raw: make([]byte, 0, maxRaw(w)), buf: make([]byte, 0, w)}, nil
}

func (d *decoder) close() { d.zr.Close() }

// decode writes the pages of chunk blob (already verified against its
// digest) into out at window idx of an image of size bytes. It checks
// everything the chunk claims: its shape, its references (inside a source
// the artifact has), its page count (want) and the length of its data;
// a malformed chunk is InvalidArgument. It returns the pages hash.
func (d *decoder) decode(blob []byte, idx, size int64, want int, out *os.File) ([32]byte, error) {
	var sum [32]byte
	bad := func(format string, args ...any) error {
		return errdefs.InvalidArgument("chunk of window %d: "+format, append([]any{idx}, args...)...)
	}
	raw, err := d.zr.DecodeAll(blob, d.raw[:0])
	if err != nil {
		return sum, bad("%v", err)
	}
	pages := int(d.window / PageSize)
	bm := (pages + 7) / 8
	if len(raw) < chunkHeader+2*bm || string(raw[:len(chunkMagic)]) != chunkMagic {
		return sum, bad("not a forkd chunk")
	}
	ps := binary.LittleEndian.Uint32(raw[len(chunkMagic):])
	np := binary.LittleEndian.Uint32(raw[len(chunkMagic)+4:])
	nrefs := int(binary.LittleEndian.Uint32(raw[len(chunkMagic)+8:]))
	if ps != PageSize || int(np) != pages {
		return sum, bad("pages of %d bytes, %d a window; want %d and %d", ps, np, PageSize, pages)
	}
	present, isRef := raw[chunkHeader:chunkHeader+bm], raw[chunkHeader+bm:chunkHeader+2*bm]
	count, nref := 0, 0
	for i := range bm {
		if isRef[i]&^present[i] != 0 {
			return sum, bad("a reference to a page it does not restore")
		}
		count += bits.OnesCount8(present[i])
		nref += bits.OnesCount8(isRef[i])
	}
	start := idx * d.window
	windowPages := int((min(start+d.window, size) - start) / PageSize)
	for p := windowPages; p < pages; p++ {
		if present[p/8]&(1<<(p%8)) != 0 {
			return sum, bad("page %d is past the end of the image", p)
		}
	}
	refsAt := chunkHeader + 2*bm
	dataAt := refsAt + nref*refBytes
	switch {
	case count != want:
		return sum, bad("restores %d pages; its config says %d", count, want)
	case nref != nrefs:
		return sum, bad("%d references counted, %d declared", nref, nrefs)
	case len(raw) != dataAt+(count-nref)*PageSize:
		return sum, bad("%d bytes, want %d", len(raw), dataAt+(count-nref)*PageSize)
	}
	h := sha256.New()
	var hdr [8]byte
	d.buf = d.buf[:0]
	runStart := -1
	flush := func() error {
		if runStart < 0 || len(d.buf) == 0 {
			return nil
		}
		_, err := out.WriteAt(d.buf, start+int64(runStart)*PageSize)
		d.buf, runStart = d.buf[:0], -1
		return err
	}
	ri, di := 0, 0
	for p := 0; p < pages; p++ {
		if present[p/8]&(1<<(p%8)) == 0 {
			if err := flush(); err != nil {
				return sum, writeErr(err)
			}
			continue
		}
		if runStart < 0 {
			runStart = p
		}
		n := len(d.buf)
		d.buf = d.buf[:n+PageSize]
		pg := d.buf[n:]
		if isRef[p/8]&(1<<(p%8)) != 0 {
			r := raw[refsAt+ri*refBytes:]
			ri++
			src, off := int(r[0]), int64(binary.LittleEndian.Uint64(r[1:9]))
			if src <= 0 || src >= nSources || d.srcs == nil || d.srcs.f[src] == nil {
				return sum, bad("a reference to source %d, which the snapshot lacks", src)
			}
			if off < 0 || off%512 != 0 || off > d.srcs.size[src]-PageSize {
				return sum, bad("a reference to offset %d of source %d (%d bytes)", off, src, d.srcs.size[src])
			}
			if _, err := d.srcs.f[src].ReadAt(pg, off); err != nil {
				return sum, fmt.Errorf("chunk of window %d: read source %d: %w", idx, src, err)
			}
		} else {
			copy(pg, raw[dataAt+di*PageSize:])
			di++
		}
		binary.LittleEndian.PutUint64(hdr[:], uint64(start/PageSize)+uint64(p))
		h.Write(hdr[:])
		h.Write(pg)
	}
	if err := flush(); err != nil {
		return sum, writeErr(err)
	}
	copy(sum[:], h.Sum(nil))
	return sum, nil
}

// imageHash combines the pages hashes of an image's chunks, in window
// order, into its PagesSHA256.
func imageHash(chunks []chunkOut) string {
	h := sha256.New()
	h.Write([]byte("forkd-pages-v1\n"))
	var b [8]byte
	for _, c := range chunks {
		if c.pages == 0 {
			continue
		}
		binary.LittleEndian.PutUint64(b[:], uint64(c.index))
		h.Write(b[:])
		h.Write(c.hash[:])
	}
	return fmt.Sprintf("%x", h.Sum(nil))
}

// isZero reports whether b is all zeros.
func isZero(b []byte) bool {
	for len(b) >= 8 {
		if binary.LittleEndian.Uint64(b) != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// extents calls fn for each data extent of f within [start, end), in
// order, as SEEK_DATA and SEEK_HOLE report them.
func extents(f *os.File, start, end int64, fn func(off, n int64) error) error {
	fd := int(f.Fd())
	for off := start; off < end; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("seek data in %s: %w", f.Name(), err)
		}
		if data >= end {
			return nil
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("seek hole in %s: %w", f.Name(), err)
		}
		hole = min(hole, end)
		if err := fn(data, hole-data); err != nil {
			return err
		}
		off = hole
	}
	return nil
}

// pageRef is where a page can be read from: a source and an offset.
type pageRef struct {
	src uint8
	off int64
}

// pageIndex finds pages of guest RAM in the sources an artifact carries.
// It is read-only once built, safe for concurrent find.
type pageIndex struct {
	seed maphash.Seed
	m    map[uint64]pageRef
	f    [nSources]*os.File
}

// newPageIndex indexes the data pages of each source file (nil: none):
// every 512-byte offset of the kernel (its payload is loaded at an
// offset that is not page-aligned in the file), every page of the others.
// A page of zeros is never indexed.
func newPageIndex(files [nSources]*os.File) (*pageIndex, error) {
	x := &pageIndex{seed: maphash.MakeSeed(), m: map[uint64]pageRef{}, f: files}
	for src, f := range files {
		if f == nil {
			continue
		}
		st, err := f.Stat()
		if err != nil {
			return nil, err
		}
		step := int64(PageSize)
		if src == srcKernel {
			step = 512
		}
		buf := make([]byte, 4<<20)
		size := st.Size()
		err = extents(f, 0, size, func(off, n int64) error {
			end := off + n
			for pos := off / step * step; pos+PageSize <= size && pos < end; {
				k, err := f.ReadAt(buf, pos)
				if err != nil && !errors.Is(err, io.EOF) {
					return err
				}
				o := 0
				for ; o+PageSize <= k && pos+int64(o) < end; o += int(step) {
					pg := buf[o : o+PageSize]
					if isZero(pg) {
						continue
					}
					h := maphash.Bytes(x.seed, pg)
					if _, dup := x.m[h]; !dup {
						x.m[h] = pageRef{src: uint8(src), off: pos + int64(o)}
					}
				}
				if o == 0 {
					break
				}
				pos += int64(o)
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("index %s: %w", f.Name(), err)
		}
	}
	return x, nil
}

// find returns where page can be read from, checked byte for byte (a
// hash collision is no reference); scratch holds one page.
func (x *pageIndex) find(page, scratch []byte) (pageRef, bool) {
	if x == nil || len(x.m) == 0 {
		return pageRef{}, false
	}
	r, ok := x.m[maphash.Bytes(x.seed, page)]
	if !ok {
		return pageRef{}, false
	}
	if _, err := x.f[r.src].ReadAt(scratch[:PageSize], r.off); err != nil || !bytes.Equal(scratch[:PageSize], page) {
		return pageRef{}, false
	}
	return r, true
}

// writeErr classes an error of writing a file: a full filesystem is
// ResourceExhausted.
func writeErr(err error) error {
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
		return errdefs.ResourceExhausted("%w", err)
	}
	return err
}
