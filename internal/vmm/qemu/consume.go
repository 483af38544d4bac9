package qemu

import (
	"encoding/binary"
	"fmt"
	"io"
)

// A precopy migration of a restored child (RAM share=off, so x-ignore-shared
// does not skip it) streams every page of guest RAM at least once and
// again each time the guest dirties it, with the ROM pages, the device
// sections and the rest of a snapshot's state around them. consumeLive
// splits that stream: guest RAM pages go to a callback, everything else
// becomes a state stream that the ordinary restore path loads.

// liveSink keeps the state stream and hands guest RAM pages on.
type liveSink struct {
	out     []byte
	ramSize uint64 // of the guest RAM block
	memory  func(guestOffset uint64, data []byte) error
	// named is the block of the last page record kept in out: the
	// loader resolves CONTINUE against it, not against the block of the
	// last record read (the guest pages between are dropped).
	named *ramBlock
	pages int64
}

func (l *liveSink) copy(p []byte) error {
	if len(l.out)+len(p) > maxStateBytes {
		return fmt.Errorf("%w: state over %d bytes", errStream, maxStateBytes)
	}
	l.out = append(l.out, p...)
	return nil
}

// Write lets io.Copy feed the sink.
func (l *liveSink) Write(p []byte) (int, error) {
	if err := l.copy(p); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (l *liveSink) page(rec pageRecord) error {
	if rec.block.name == guestBlock {
		if rec.block.size != l.ramSize {
			return fmt.Errorf("%w: guest RAM of %d bytes, want %d", errStream, rec.block.size, l.ramSize)
		}
		l.pages++
		if err := l.memory(rec.addr, rec.data); err != nil {
			return fmt.Errorf("guest page at %#x: %w", rec.addr, err)
		}
		return nil
	}
	flags := uint64(ramPage)
	if rec.data == nil {
		flags = ramZero
	}
	var hdr []byte
	if rec.block == l.named {
		hdr = binary.BigEndian.AppendUint64(nil, rec.addr|flags|ramContinue)
	} else {
		hdr = binary.BigEndian.AppendUint64(nil, rec.addr|flags)
		hdr = append(append(hdr, byte(len(rec.block.name))), rec.block.name...)
		l.named = rec.block
	}
	if err := l.copy(hdr); err != nil {
		return err
	}
	if rec.data == nil {
		return l.copy([]byte{0})
	}
	return l.copy(rec.data)
}

// consumeLive reads a precopy migration stream from r to its end. Each
// ZERO or PAGE record of guest RAM, which must be ramSize bytes, goes to
// memory (data nil for a page of zeros), in stream order; it returns the
// rest as a state stream whose globalstate says "paused", and how many
// pages went to memory. An error from memory ends the walk and is
// returned wrapped.
func consumeLive(r io.Reader, ramSize uint64, memory func(guestOffset uint64, data []byte) error) ([]byte, int64, error) {
	sink := &liveSink{ramSize: ramSize, memory: memory}
	w := newWalker(r, sink)
	t, err := w.head()
	if err != nil {
		return nil, sink.pages, err
	}
	if t != secFull {
		return nil, sink.pages, w.s.errorf("section type %#x after the ram sections, want a device section", t)
	}
	if w.block([]byte(guestBlock)) == nil {
		return nil, sink.pages, fmt.Errorf("%w: no guest RAM block %q", errStream, guestBlock)
	}
	devices := len(sink.out)
	if err := sink.copy([]byte{t}); err != nil {
		return nil, sink.pages, err
	}
	// The device sections, EOF and VMDESCRIPTION run to the end.
	if _, err := io.Copy(sink, w.s.r); err != nil {
		return nil, sink.pages, err
	}
	tail := sink.out[devices:]
	end, err := devicesEnd(tail)
	if err != nil {
		return nil, sink.pages, err
	}
	if err := patchGlobalState(tail[:end], "paused"); err != nil {
		return nil, sink.pages, err
	}
	return sink.out, sink.pages, nil
}

// devicesEnd returns the offset of the EOF byte that ends the device
// sections in tail, which runs to the end of a stream: either
// that byte is last, or a VMDESCRIPTION (0x06, be32 length, JSON) follows
// it to the end.
func devicesEnd(tail []byte) (int, error) {
	for p := len(tail) - 5; p >= 1; p-- {
		if tail[p] == secVMDesc && tail[p-1] == secEOF &&
			uint64(binary.BigEndian.Uint32(tail[p+1:])) == uint64(len(tail)-p-5) {
			return p - 1, nil
		}
	}
	if n := len(tail); n > 0 && tail[n-1] == secEOF {
		return n - 1, nil
	}
	return 0, fmt.Errorf("%w: device sections do not end with EOF", errStream)
}
