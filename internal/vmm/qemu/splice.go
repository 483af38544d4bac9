package qemu

import (
	"bytes"
	"encoding/binary"
	"fmt"
)

// A state file that `migrate` with x-ignore-shared wrote (a snapshot's)
// holds the header, the configuration section, the ram sections (the block
// list and the firmware ROMs' pages; guest RAM is skipped) and then the
// device sections. xen-save-devices-state writes the header and the device
// sections only, which a -incoming QEMU cannot load: it wants the
// configuration section first, and without the ram sections it leaves the
// firmware ROMs zeroed. Neither of those changes while a machine runs, so
// a loadable state is the head of a snapshot's state of the same lineage
// followed by the fresh device sections.

// vmDescription is the VMDESCRIPTION trailer appended to built streams: the
// loader reads and discards it, and logs a warning when it is missing.
var vmDescription = []byte(`{"page_size":4096,"devices":[]}`)

// headSink checks the head of a state stream that is reused as is: it must
// carry no guest RAM, which a restore would load over the memory file.
type headSink struct{}

func (headSink) copy([]byte) error { return nil }

func (headSink) page(rec pageRecord) error {
	if rec.block.name == guestBlock {
		return fmt.Errorf("%w: state carries guest RAM (page at %#x)", errStream, rec.addr)
	}
	return nil
}

// stateHead returns the head of state stream b (header, configuration and
// ram sections): everything before its first device section.
func stateHead(b []byte) ([]byte, error) {
	w := newWalker(bytes.NewReader(b), headSink{})
	t, err := w.head()
	if err != nil {
		return nil, err
	}
	if t != secFull {
		return nil, w.s.errorf("section type %#x after the ram sections, want a device section", t)
	}
	return b[:w.s.off-1], nil
}

// spliceState builds a loadable state stream from the head of a state
// stream of the machine's lineage (stateHead) and the output of
// xen-save-devices-state, whose globalstate is set to "paused" so that the
// restored machine waits for its cont like every restored child.
func spliceState(head, xen []byte) ([]byte, error) {
	if len(xen) < 10 || binary.BigEndian.Uint32(xen) != streamMagic || binary.BigEndian.Uint32(xen[4:]) != streamVersion {
		return nil, fmt.Errorf("%w: device state is not a version 3 migration stream", errStream)
	}
	if xen[8] != secFull {
		return nil, fmt.Errorf("%w: device state starts with section type %#x", errStream, xen[8])
	}
	if xen[len(xen)-1] != secEOF {
		return nil, fmt.Errorf("%w: device state does not end with EOF", errStream)
	}
	out := make([]byte, 0, len(head)+len(xen)-8+5+len(vmDescription))
	out = append(out, head...)
	devices := len(out)
	out = append(out, xen[8:]...)
	if err := patchGlobalState(out[devices:len(out)-1], "paused"); err != nil {
		return nil, err
	}
	return appendVMDescription(out), nil
}

func appendVMDescription(b []byte) []byte {
	b = append(b, secVMDesc)
	b = binary.BigEndian.AppendUint32(b, uint32(len(vmDescription)))
	return append(b, vmDescription...)
}

// globalstate is the section that records the run state the loader
// returns to: 0x04, be32 id, "globalstate", be32 instance 0, be32 version
// 1, then be32 size and char[100] runstate, then the footer naming id.
var globalStateName = append([]byte{11}, "globalstate"...)

const runStateLen = 100

// patchGlobalState sets the run state in the device sections b to state.
// Device sections cannot be walked, so the section is found by its exact
// shape, footer included, and must be found once.
func patchGlobalState(b []byte, state string) error {
	if len(state) >= runStateLen {
		return fmt.Errorf("run state %q too long", state)
	}
	found := -1
	for i := 0; ; {
		j := bytes.Index(b[i:], globalStateName)
		if j < 0 {
			break
		}
		j += i
		i = j + 1
		if at, ok := globalStateAt(b, j); ok {
			if found >= 0 {
				return fmt.Errorf("%w: globalstate section found twice", errStream)
			}
			found = at
		}
	}
	if found < 0 {
		return fmt.Errorf("%w: no globalstate section", errStream)
	}
	binary.BigEndian.PutUint32(b[found:], uint32(len(state)+1))
	rs := b[found+4 : found+4+runStateLen]
	clear(rs)
	copy(rs, state)
	return nil
}

// globalStateAt reports whether the name at b[j:] belongs to a globalstate
// section, and where its size field is.
func globalStateAt(b []byte, j int) (int, bool) {
	h := j - 5
	if h < 0 || b[h] != secFull {
		return 0, false
	}
	id := binary.BigEndian.Uint32(b[h+1:])
	p := j + len(globalStateName)
	if len(b)-p < 8+4+runStateLen+5 {
		return 0, false
	}
	if binary.BigEndian.Uint32(b[p:]) != 0 || binary.BigEndian.Uint32(b[p+4:]) != 1 {
		return 0, false
	}
	p += 8
	if binary.BigEndian.Uint32(b[p:]) > runStateLen {
		return 0, false
	}
	f := p + 4 + runStateLen
	if b[f] != secFooter || binary.BigEndian.Uint32(b[f+1:]) != id {
		return 0, false
	}
	return p, true
}
