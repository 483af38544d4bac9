package qemu

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// The QEMU 7.2 migration stream, as far as forkd takes it apart
// (migration/savevm.c, migration/ram.c of 7.2):
//
//	header:        be32 magic "QEVM", be32 version 3
//	configuration: 0x07, be32 len, machine name, subsections (0x05, u8 len,
//	               name, be32 version, fields)
//	ram sections:  0x01 START (be32 id, u8 len "ram", be32 instance,
//	               be32 version) or 0x02 PART / 0x03 END (be32 id), then
//	               records up to EOS, then the footer 0x7e, be32 id
//	devices:       0x04 FULL sections, one per device; their fields are
//	               described nowhere in the stream, so they are only copied
//	end:           0x00 EOF, then 0x06 VMDESCRIPTION (be32 len, JSON)
//
// QEMU 10 also sends a command (0x08, be16 command, be16 len, len bytes)
// before the last ram section: SWITCHOVER_START (11, no data), which says
// the source has stopped its guest and begins to write the final state
// (only VFIO devices act on it). The walker passes it through, between
// the ram START and END sections, and takes no other command.
//
// A ram record starts with a be64 holding a page-aligned offset and flags
// in its low 12 bits. MEM_SIZE lists the RAM blocks (u8 len, name, be64
// used length, and be64 guest address when x-ignore-shared is on); ZERO and
// PAGE carry a page of a block, named unless CONTINUE says "the block of
// the previous page record". QEMU's loader keeps that previous block across
// sections, and so does the walker.
//
// Device state holds bytes the guest chose (CMOS, device registers), and a
// stream file may be damaged: the walker checks every length against the
// data it has and against fixed limits, allocates nothing sized by the
// stream, and reports the byte offset of what it could not take.
const (
	streamMagic   = 0x5145564d // "QEVM"
	streamVersion = 3

	secEOF    = 0x00
	secStart  = 0x01
	secPart   = 0x02
	secEnd    = 0x03
	secFull   = 0x04
	secSub    = 0x05
	secVMDesc = 0x06
	secConfig = 0x07
	secCmd    = 0x08
	secFooter = 0x7e

	cmdSwitchoverStart = 11

	ramZero     = 0x02
	ramMemSize  = 0x04
	ramPage     = 0x08
	ramEOS      = 0x10
	ramContinue = 0x20
	ramFlagMask = 0xfff

	pageSize = 4096

	// guestBlock is the RAM block of guest memory: the memory backend
	// object is called "mem" (instanceArgs). Every other block is
	// firmware (ROMs), which the stream carries.
	guestBlock = "mem"

	// maxStateBytes bounds a device-state stream read into memory (a
	// microvm's is about 60 KB).
	maxStateBytes = 64 << 20
	// maxBlocks bounds the RAM blocks a MEM_SIZE record may list.
	maxBlocks = 256
	// maxConfigName bounds the machine name of the configuration section.
	maxConfigName = 256
	// maxCapabilities bounds the capabilities listed in the configuration.
	maxCapabilities = 64
)

// errStream marks a malformed or truncated migration stream.
var errStream = errors.New("malformed migration stream")

// streamError is a malformed stream: what, and where.
type streamError struct {
	off int64
	msg string
}

func (e *streamError) Error() string {
	return fmt.Sprintf("%s at byte %d", e.msg, e.off)
}

func (e *streamError) Unwrap() error { return errStream }

// streamReader reads a stream, counting the bytes it consumed.
type streamReader struct {
	r   *bufio.Reader
	off int64
	tmp [8]byte
	str [255]byte
}

func newStreamReader(r io.Reader) *streamReader {
	switch r := r.(type) {
	case *bufio.Reader:
		return &streamReader{r: r}
	case *bytes.Reader:
		// In memory already: a buffer only for the reader's sake.
		return &streamReader{r: bufio.NewReaderSize(r, 4096)}
	}
	return &streamReader{r: bufio.NewReaderSize(r, 256<<10)}
}

// errorf returns a streamError at the current offset.
func (s *streamReader) errorf(format string, args ...any) error {
	return &streamError{off: s.off, msg: fmt.Sprintf(format, args...)}
}

// full fills p. The end of the input inside p is a truncated stream; other
// read errors are returned as they are.
func (s *streamReader) full(p []byte) error {
	n, err := io.ReadFull(s.r, p)
	s.off += int64(n)
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return s.errorf("stream truncated")
	}
	return err
}

func (s *streamReader) u8() (byte, error) {
	if err := s.full(s.tmp[:1]); err != nil {
		return 0, err
	}
	return s.tmp[0], nil
}

func (s *streamReader) be32() (uint32, error) {
	if err := s.full(s.tmp[:4]); err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint32(s.tmp[:4]), nil
}

func (s *streamReader) be64() (uint64, error) {
	if err := s.full(s.tmp[:8]); err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint64(s.tmp[:8]), nil
}

// name reads a u8-length-prefixed string. The result is valid until the
// next name.
func (s *streamReader) name() ([]byte, error) {
	n, err := s.u8()
	if err != nil {
		return nil, err
	}
	if err := s.full(s.str[:n]); err != nil {
		return nil, err
	}
	return s.str[:n], nil
}

// peek returns the next byte without consuming it.
func (s *streamReader) peek() (byte, error) {
	b, err := s.r.Peek(1)
	if len(b) == 1 {
		return b[0], nil
	}
	if err == nil || errors.Is(err, io.EOF) {
		return 0, s.errorf("stream truncated")
	}
	return 0, err
}

// ramBlock is a RAM block listed by the stream's MEM_SIZE record.
type ramBlock struct {
	name string
	size uint64 // used length in bytes
}

// pageRecord is one ZERO or PAGE record of a ram section.
type pageRecord struct {
	block *ramBlock
	// addr is the page's byte offset in its block: page aligned and
	// below the block's size.
	addr uint64
	// data is the page, or nil for a ZERO record (a page of zeros). It
	// is valid until the walker reads on.
	data []byte
}

// streamSink receives a stream as the walker takes it apart.
type streamSink interface {
	// copy receives, in stream order, every byte the walker consumed
	// that is not part of a page record.
	copy(p []byte) error
	// page receives each page record, in stream order.
	page(rec pageRecord) error
}

// walker takes apart the head of a stream: header, configuration and ram
// sections, up to the first section of another kind.
type walker struct {
	s    *streamReader
	sink streamSink

	sections     int  // sections walked
	ignoreShared bool // x-ignore-shared: MEM_SIZE entries carry addresses
	blocks       []*ramBlock
	last         *ramBlock // block of the last page record, across sections
	ramID        uint32
	ramStarted   bool
	ramEnded     bool
	buf          [pageSize]byte
}

func newWalker(r io.Reader, sink streamSink) *walker {
	return &walker{s: newStreamReader(r), sink: sink}
}

// emit hands p (consumed bytes) to the sink.
func (w *walker) emit(p []byte) error { return w.sink.copy(p) }

// head walks the header, the configuration section and the ram sections,
// and returns the type byte of the section that follows them, consumed
// but not emitted. It fails unless the configuration section came first
// and a complete ram START ... END sequence followed.
func (w *walker) head() (byte, error) {
	var h [8]byte
	if err := w.s.full(h[:]); err != nil {
		return 0, err
	}
	if m := binary.BigEndian.Uint32(h[:4]); m != streamMagic {
		return 0, w.s.errorf("not a migration stream (magic %#08x)", m)
	}
	if v := binary.BigEndian.Uint32(h[4:]); v != streamVersion {
		return 0, w.s.errorf("migration stream version %d, want %d", v, streamVersion)
	}
	if err := w.emit(h[:]); err != nil {
		return 0, err
	}
	for {
		t, err := w.s.u8()
		if err != nil {
			return 0, err
		}
		switch {
		case t == secConfig && w.sections == 0:
			err = w.configuration()
		case t == secConfig:
			return 0, w.s.errorf("configuration section after other sections")
		case w.sections == 0:
			return 0, w.s.errorf("section type %#x where the configuration section belongs", t)
		case t == secStart || t == secPart || t == secEnd:
			err = w.ramSection(t)
		case t == secCmd && w.ramStarted && !w.ramEnded:
			err = w.command()
		default:
			if !w.ramEnded {
				return 0, w.s.errorf("section type %#x before the ram section ended", t)
			}
			return t, nil
		}
		if err != nil {
			return 0, err
		}
		w.sections++
	}
}

// configuration walks a configuration section after its type byte.
func (w *walker) configuration() error {
	if err := w.emit([]byte{secConfig}); err != nil {
		return err
	}
	n, err := w.s.be32()
	if err != nil {
		return err
	}
	if n > maxConfigName {
		return w.s.errorf("machine name of %d bytes", n)
	}
	var name [4 + maxConfigName]byte
	binary.BigEndian.PutUint32(name[:4], n)
	if err := w.s.full(name[4 : 4+n]); err != nil {
		return err
	}
	if err := w.emit(name[:4+n]); err != nil {
		return err
	}
	for {
		t, err := w.s.peek()
		if err != nil {
			return err
		}
		if t != secSub {
			return nil
		}
		if err := w.subsection(); err != nil {
			return err
		}
	}
}

// subsection walks one subsection of the configuration section.
func (w *walker) subsection() error {
	if _, err := w.s.u8(); err != nil {
		return err
	}
	name, err := w.s.name()
	if err != nil {
		return err
	}
	sub := string(name)
	version, err := w.s.be32()
	if err != nil {
		return err
	}
	out := append([]byte{secSub, byte(len(sub))}, sub...)
	out = binary.BigEndian.AppendUint32(out, version)
	switch sub {
	case "configuration/target-page-bits":
		bits, err := w.s.be32()
		if err != nil {
			return err
		}
		if bits != 12 {
			return w.s.errorf("target page of 2^%d bytes, want 4096", bits)
		}
		out = binary.BigEndian.AppendUint32(out, bits)
	case "configuration/capabilities":
		count, err := w.s.be32()
		if err != nil {
			return err
		}
		if count > maxCapabilities {
			return w.s.errorf("%d capabilities", count)
		}
		out = binary.BigEndian.AppendUint32(out, count)
		for range count {
			c, err := w.s.name()
			if err != nil {
				return err
			}
			if string(c) == "x-ignore-shared" {
				w.ignoreShared = true
			}
			out = append(append(out, byte(len(c))), c...)
		}
	case "configuration/uuid":
		var uuid [16]byte
		if err := w.s.full(uuid[:]); err != nil {
			return err
		}
		out = append(out, uuid[:]...)
	default:
		return w.s.errorf("unknown configuration subsection %q", sub)
	}
	return w.emit(out)
}

// ramSection walks a ram START, PART or END section after its type byte.
func (w *walker) ramSection(t byte) error {
	id, err := w.s.be32()
	if err != nil {
		return err
	}
	hdr := binary.BigEndian.AppendUint32([]byte{t}, id)
	switch {
	case t == secStart:
		name, err := w.s.name()
		if err != nil {
			return err
		}
		if string(name) != "ram" {
			return w.s.errorf("iterative section %q (only ram is supported)", name)
		}
		if w.ramStarted {
			return w.s.errorf("second ram START section")
		}
		var iv [8]byte // instance and version
		if err := w.s.full(iv[:]); err != nil {
			return err
		}
		hdr = append(append(append(hdr, byte(len(name))), name...), iv[:]...)
		w.ramStarted, w.ramID = true, id
	case !w.ramStarted || id != w.ramID:
		return w.s.errorf("section %d continues no ram START", id)
	case w.ramEnded:
		return w.s.errorf("ram section after its END")
	case t == secEnd:
		w.ramEnded = true
	}
	if err := w.emit(hdr); err != nil {
		return err
	}
	if err := w.ramRecords(t == secStart); err != nil {
		return err
	}
	return w.footer(id)
}

// command walks a command section after its type byte: only a
// SWITCHOVER_START, without data.
func (w *walker) command() error {
	var c [5]byte
	c[0] = secCmd
	if err := w.s.full(c[1:]); err != nil {
		return err
	}
	cmd, n := binary.BigEndian.Uint16(c[1:]), binary.BigEndian.Uint16(c[3:])
	if cmd != cmdSwitchoverStart || n != 0 {
		return w.s.errorf("migration command %d with %d bytes (only SWITCHOVER_START, %d, without data, is taken)", cmd, n, cmdSwitchoverStart)
	}
	return w.emit(c[:])
}

// footer walks a section footer, which must name section id.
func (w *walker) footer(id uint32) error {
	var f [5]byte
	if err := w.s.full(f[:]); err != nil {
		return err
	}
	if f[0] != secFooter || binary.BigEndian.Uint32(f[1:]) != id {
		return w.s.errorf("bad footer of section %d", id)
	}
	return w.emit(f[:])
}

// ramRecords walks the records of one ram section up to its EOS. Only the
// START section may carry the MEM_SIZE record, and it must come before any
// page.
func (w *walker) ramRecords(start bool) error {
	for {
		v, err := w.s.be64()
		if err != nil {
			return err
		}
		flags, addr := v&ramFlagMask, v&^uint64(ramFlagMask)
		switch flags &^ ramContinue {
		case ramEOS:
			return w.emit(binary.BigEndian.AppendUint64(nil, v))
		case ramMemSize:
			if !start || w.blocks != nil {
				return w.s.errorf("unexpected MEM_SIZE record")
			}
			if err := w.emit(binary.BigEndian.AppendUint64(nil, v)); err != nil {
				return err
			}
			if err := w.memSize(addr); err != nil {
				return err
			}
		case ramZero, ramPage:
			if err := w.pageRecord(flags, addr); err != nil {
				return err
			}
		default:
			return w.s.errorf("unsupported ram record flags %#x", flags)
		}
	}
}

// memSize walks the block list of a MEM_SIZE record whose sizes add up to
// total.
func (w *walker) memSize(total uint64) error {
	w.blocks = []*ramBlock{}
	for left := total; left > 0; {
		if len(w.blocks) == maxBlocks {
			return w.s.errorf("more than %d RAM blocks", maxBlocks)
		}
		name, err := w.s.name()
		if err != nil {
			return err
		}
		if len(name) == 0 {
			return w.s.errorf("RAM block without a name")
		}
		b := &ramBlock{name: string(name)}
		if w.block(name) != nil {
			return w.s.errorf("RAM block %q listed twice", name)
		}
		if b.size, err = w.s.be64(); err != nil {
			return err
		}
		if b.size > left {
			return w.s.errorf("RAM block %q of %d bytes exceeds the total", b.name, b.size)
		}
		if b.name == guestBlock && b.size%pageSize != 0 {
			return w.s.errorf("guest RAM of %d bytes is not a whole number of pages", b.size)
		}
		left -= b.size
		out := append(append([]byte{byte(len(b.name))}, b.name...), binary.BigEndian.AppendUint64(nil, b.size)...)
		if w.ignoreShared {
			gpa, err := w.s.be64()
			if err != nil {
				return err
			}
			out = binary.BigEndian.AppendUint64(out, gpa)
		}
		if err := w.emit(out); err != nil {
			return err
		}
		w.blocks = append(w.blocks, b)
	}
	return nil
}

// block returns the listed block called name, or nil.
func (w *walker) block(name []byte) *ramBlock {
	for _, b := range w.blocks {
		if b.name == string(name) {
			return b
		}
	}
	return nil
}

// pageRecord reads the rest of a ZERO or PAGE record and hands it to the
// sink.
func (w *walker) pageRecord(flags, addr uint64) error {
	b := w.last
	if flags&ramContinue == 0 {
		name, err := w.s.name()
		if err != nil {
			return err
		}
		if b = w.block(name); b == nil {
			return w.s.errorf("page of unlisted RAM block %q", name)
		}
	} else if b == nil {
		return w.s.errorf("CONTINUE record without a previous block")
	}
	if addr >= b.size {
		return w.s.errorf("page at %#x beyond RAM block %q of %d bytes", addr, b.name, b.size)
	}
	w.last = b
	rec := pageRecord{block: b, addr: addr}
	if flags&ramZero != 0 {
		fill, err := w.s.u8()
		if err != nil {
			return err
		}
		if fill != 0 {
			// QEMU 7.2 sends zero pages only; a fill byte would mean
			// a page of that byte.
			return w.s.errorf("ZERO record with fill byte %#x", fill)
		}
	} else {
		if err := w.s.full(w.buf[:]); err != nil {
			return err
		}
		rec.data = w.buf[:]
	}
	return w.sink.page(rec)
}
