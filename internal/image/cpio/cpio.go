// Package cpio reads and writes the "newc" (SVR4, no CRC) cpio format, the
// format the Linux kernel unpacks as an initramfs.
//
// The writer is deterministic: it assigns inode numbers in write order and
// writes exactly what the headers say, so the same sequence of headers and
// data always yields the same bytes.
package cpio

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// File type bits of Header.Mode (the st_mode values the kernel expects).
const (
	TypeMask    = 0o170000
	TypeSocket  = 0o140000
	TypeSymlink = 0o120000
	TypeReg     = 0o100000
	TypeBlock   = 0o060000
	TypeDir     = 0o040000
	TypeChar    = 0o020000
	TypeFifo    = 0o010000
)

const (
	magic      = "070701"
	headerLen  = 110
	trailer    = "TRAILER!!!"
	maxField   = 1<<32 - 1
	maxNameLen = 4096
)

// ErrFormat is wrapped by every error the Reader returns for malformed input.
var ErrFormat = errors.New("cpio: malformed archive")

// Header describes one archive member.
type Header struct {
	Name     string // path inside the archive, without a leading "/" (e.g. "bin/sh")
	Mode     uint32 // file type bits | permission bits, e.g. TypeReg|0o755
	UID, GID uint32
	NLink    uint32 // 0 means 2 for directories and 1 otherwise
	ModTime  int64  // seconds since the epoch
	Size     int64  // length of the data; for symlinks, set by the writer from Linkname
	Linkname string // symlink target (TypeSymlink only)

	DevMajor, DevMinor   uint32 // device holding the file (informational)
	RDevMajor, RDevMinor uint32 // device numbers of a TypeChar/TypeBlock node

	ino uint32
}

// IsDir reports whether h describes a directory.
func (h *Header) IsDir() bool { return h.Mode&TypeMask == TypeDir }

// Writer writes a newc archive. Close writes the trailer; it does not close
// the underlying writer. A Writer is not safe for concurrent use.
type Writer struct {
	w       io.Writer
	n       int64 // bytes written so far, for padding
	remain  int64 // data bytes the current member still expects
	pad     int   // padding owed after the current member's data
	nextIno uint32
	closed  bool
}

// NewWriter returns a Writer that writes to w.
func NewWriter(w io.Writer) *Writer { return &Writer{w: w, nextIno: 1} }

// WriteHeader starts a new member. The previous member's data must have been
// written in full. For TypeSymlink the data (the target) is written here.
func (w *Writer) WriteHeader(h *Header) error {
	if w.closed {
		return errors.New("cpio: write after close")
	}
	if w.remain != 0 {
		return fmt.Errorf("cpio: %d bytes of the previous member missing", w.remain)
	}
	if err := w.flushPad(); err != nil {
		return err
	}
	if err := checkName(h.Name); err != nil {
		return err
	}
	hdr := *h
	if hdr.Mode&TypeMask == 0 {
		return fmt.Errorf("cpio: %q: mode %o has no file type", h.Name, h.Mode)
	}
	if hdr.Mode&TypeMask == TypeSymlink {
		hdr.Size = int64(len(hdr.Linkname))
	} else if hdr.Linkname != "" {
		return fmt.Errorf("cpio: %q: link name on a non-symlink", h.Name)
	}
	if hdr.Mode&TypeMask != TypeReg && hdr.Mode&TypeMask != TypeSymlink && hdr.Size != 0 {
		return fmt.Errorf("cpio: %q: data on a member that cannot have any", h.Name)
	}
	if hdr.NLink == 0 {
		hdr.NLink = 1
		if hdr.IsDir() {
			hdr.NLink = 2
		}
	}
	hdr.ino = w.nextIno
	w.nextIno++
	if err := w.writeHeader(&hdr); err != nil {
		return err
	}
	w.remain = hdr.Size
	w.pad = padLen(w.n + hdr.Size)
	if hdr.Mode&TypeMask == TypeSymlink {
		if _, err := w.Write([]byte(hdr.Linkname)); err != nil {
			return err
		}
	}
	return nil
}

func (w *Writer) writeHeader(h *Header) error {
	if h.Size < 0 || h.Size > maxField || h.ModTime < 0 || h.ModTime > maxField {
		return fmt.Errorf("cpio: %q: size or time out of range", h.Name)
	}
	var b strings.Builder
	b.Grow(headerLen + len(h.Name) + 4)
	b.WriteString(magic)
	for _, v := range []uint64{
		uint64(h.ino), uint64(h.Mode), uint64(h.UID), uint64(h.GID), uint64(h.NLink),
		uint64(h.ModTime), uint64(h.Size), uint64(h.DevMajor), uint64(h.DevMinor),
		uint64(h.RDevMajor), uint64(h.RDevMinor), uint64(len(h.Name) + 1), 0,
	} {
		fmt.Fprintf(&b, "%08x", v)
	}
	b.WriteString(h.Name)
	b.WriteByte(0)
	for i := padLen(int64(headerLen + len(h.Name) + 1)); i > 0; i-- {
		b.WriteByte(0)
	}
	return w.raw([]byte(b.String()))
}

// Write writes data of the current member; it refuses more than Size bytes.
func (w *Writer) Write(p []byte) (int, error) {
	if int64(len(p)) > w.remain {
		return 0, fmt.Errorf("cpio: write of %d bytes exceeds the member's remaining %d", len(p), w.remain)
	}
	if err := w.raw(p); err != nil {
		return 0, err
	}
	w.remain -= int64(len(p))
	return len(p), nil
}

// Close writes the trailer and pads the archive to a 512-byte boundary, as
// GNU cpio does. It does not close the underlying writer.
func (w *Writer) Close() error {
	if w.closed {
		return nil
	}
	if err := w.WriteHeader(&Header{Name: trailer, Mode: TypeReg, NLink: 1}); err != nil {
		return err
	}
	w.closed = true
	if err := w.flushPad(); err != nil {
		return err
	}
	if r := w.n % 512; r != 0 {
		return w.raw(make([]byte, 512-r))
	}
	return nil
}

func (w *Writer) flushPad() error {
	if w.pad == 0 {
		return nil
	}
	n := w.pad
	w.pad = 0
	return w.raw(make([]byte, n))
}

func (w *Writer) raw(p []byte) error {
	n, err := w.w.Write(p)
	w.n += int64(n)
	return err
}

func padLen(n int64) int { return int((4 - n%4) % 4) }

func checkName(name string) error {
	switch {
	case name == "":
		return errors.New("cpio: empty name")
	case len(name) > maxNameLen:
		return fmt.Errorf("cpio: name of %d bytes is too long", len(name))
	case strings.IndexByte(name, 0) >= 0:
		return fmt.Errorf("cpio: name %q contains NUL", name)
	}
	return nil
}

// Reader reads a newc archive member by member.
type Reader struct {
	r      *bufio.Reader
	n      int64
	remain int64
	pad    int
	done   bool
}

// NewReader returns a Reader that reads from r.
func NewReader(r io.Reader) *Reader { return &Reader{r: bufio.NewReader(r)} }

// Next skips what is left of the current member and returns the next
// header. It returns io.EOF after the trailer. A symlink's target is read
// into Linkname and is not returned by Read.
func (r *Reader) Next() (*Header, error) {
	if r.done {
		return nil, io.EOF
	}
	if _, err := io.CopyN(io.Discard, r, r.remain); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrFormat, err)
	}
	if err := r.skip(r.pad); err != nil {
		return nil, err
	}
	r.pad = 0
	var buf [headerLen]byte
	if err := r.full(buf[:]); err != nil {
		return nil, err
	}
	if string(buf[:6]) != magic {
		return nil, fmt.Errorf("%w: bad magic %q", ErrFormat, buf[:6])
	}
	var f [13]uint64
	for i := range f {
		v, err := strconv.ParseUint(string(buf[6+8*i:14+8*i]), 16, 32)
		if err != nil {
			return nil, fmt.Errorf("%w: bad header field %d", ErrFormat, i)
		}
		f[i] = v
	}
	namesize := int(f[11])
	if namesize < 1 || namesize > maxNameLen+1 {
		return nil, fmt.Errorf("%w: name size %d", ErrFormat, namesize)
	}
	name := make([]byte, namesize)
	if err := r.full(name); err != nil {
		return nil, err
	}
	if name[namesize-1] != 0 {
		return nil, fmt.Errorf("%w: name not NUL-terminated", ErrFormat)
	}
	if err := r.skip(padLen(int64(headerLen + namesize))); err != nil {
		return nil, err
	}
	h := &Header{
		Name: string(name[:namesize-1]), Mode: uint32(f[1]), UID: uint32(f[2]), GID: uint32(f[3]),
		NLink: uint32(f[4]), ModTime: int64(f[5]), Size: int64(f[6]),
		DevMajor: uint32(f[7]), DevMinor: uint32(f[8]), RDevMajor: uint32(f[9]), RDevMinor: uint32(f[10]),
		ino: uint32(f[0]),
	}
	r.remain = h.Size
	r.pad = padLen(r.n + h.Size)
	if h.Name == trailer {
		r.done = true
		return nil, io.EOF
	}
	if h.Mode&TypeMask == TypeSymlink {
		if h.Size > maxNameLen {
			return nil, fmt.Errorf("%w: symlink %q target of %d bytes", ErrFormat, h.Name, h.Size)
		}
		target := make([]byte, h.Size)
		if _, err := io.ReadFull(r, target); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrFormat, err)
		}
		h.Linkname = string(target)
	}
	return h, nil
}

// Read reads data of the current member; it returns io.EOF at its end.
func (r *Reader) Read(p []byte) (int, error) {
	if r.remain == 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > r.remain {
		p = p[:r.remain]
	}
	n, err := r.r.Read(p)
	r.n += int64(n)
	r.remain -= int64(n)
	if errors.Is(err, io.EOF) && r.remain > 0 {
		err = fmt.Errorf("%w: unexpected end of data", ErrFormat)
	}
	return n, err
}

func (r *Reader) full(p []byte) error {
	n, err := io.ReadFull(r.r, p)
	r.n += int64(n)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrFormat, err)
	}
	return nil
}

func (r *Reader) skip(n int) error {
	if n == 0 {
		return nil
	}
	return r.full(make([]byte, n))
}
