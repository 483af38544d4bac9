// Package proto is the wire format between forkd's host and its guest agent.
//
// Both ends speak it over one byte stream that may carry stale or torn bytes
// (a virtio console whose host side comes and goes). Everything travels in
// frames:
//
//	offset size field
//	0      4    magic 0xFD 'f' 'k' 'd'
//	4      1    frame format version (FrameVersion)
//	5      1    type (Type)
//	6      2    flags (stream in the low nibble, FlagEOF, FlagMore)
//	8      4    id: the request the frame belongs to (0: the connection)
//	12     4    sequence number of the frame in its direction
//	16     4    payload length, at most MaxPayload
//	20     4    CRC32C (Castagnoli) over bytes 0..19 and the payload
//	24     n    payload
//
// All integers are big-endian. A receiver scans for the magic, checks the
// version, type and length bound, waits for the payload and checks the CRC;
// on any failure it skips one byte past the magic and scans again (Reader).
//
// Control payloads (hello, request, result, event) are JSON and may span
// several frames of the same type and id, all but the last flagged FlagMore,
// written back to back (Writer.WriteMessage, Assembler). Data frames carry raw
// bytes of one stream (stdin, stdout, stderr, file contents). Data is flow
// controlled per request: each side may have at most InitialWindow bytes of
// data unacknowledged per request and direction; the receiver returns credit
// with Window frames as it consumes data (Credit).
//
// The guest-to-host direction may lose bytes: QEMU's virtconsole drops what
// the host's socket cannot take at once instead of applying backpressure,
// and the guest's console driver drops what it cannot allocate for under
// memory pressure. So that the first never happens, the agent keeps at
// most ConnWindow bytes (as counted by FrameCost) of a session's frames,
// hello_ack excepted, in flight; the host returns that credit with Window
// frames of id 0 as soon as it has read frames in order, whoever consumes
// them. Every frame carries a sequence number, counted per direction (the
// agent's from 0 at each session's first hello_ack), so a receiver detects
// a lost frame instead of misreading the stream; and the agent keeps a copy
// of each frame in flight (Writer.Retain) until its credit comes back, so
// that since protocol 2 the host asks for what was lost (TypeResend) and
// the stream recovers: a starved or squeezed guest makes calls slower,
// never corrupt.
//
// The protocol version (ProtocolVersion) is negotiated in hello; the frame
// format itself never changes for hello and hello_ack, so two ends of
// different versions can always tell each other which versions they speak.
package proto

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
)

// Magic starts every frame.
var Magic = [4]byte{0xFD, 'f', 'k', 'd'}

const (
	// FrameVersion is the frame format version in byte 4 of every header.
	FrameVersion = 1
	// HeaderSize is the size of a frame header in bytes.
	HeaderSize = 24
	// MaxPayload bounds a frame's payload; larger data is chunked.
	MaxPayload = 64 << 10
	// GuestMaxPayload bounds the payload of the agent's frames, so that
	// each fits ConnWindow with room to spare.
	GuestMaxPayload = 16 << 10
	// ConnWindow bounds the agent's bytes in flight per session (FrameCost),
	// well under a host socket's default send buffer (208 KiB on Linux),
	// which also pays for each write's bookkeeping.
	ConnWindow = 64 << 10
	// FrameOverhead is what FrameCost adds per frame for that bookkeeping.
	FrameOverhead = 512
	// MaxMessage bounds a reassembled JSON message.
	MaxMessage = 16 << 20
	// InitialWindow is the data credit each side starts with per request and
	// direction.
	InitialWindow = 256 << 10
)

// Type is a frame type.
type Type uint8

// Frame types. Direction: H = host to guest, G = guest to host.
const (
	// TypeHello (H, id 0): JSON Hello. Starts or resumes a session.
	TypeHello Type = 1
	// TypeHelloAck (G, id 0): JSON HelloAck.
	TypeHelloAck Type = 2
	// TypeRequest (H): JSON Request opening request id.
	TypeRequest Type = 3
	// TypeResult (G): JSON Result, the last frame of request id.
	TypeResult Type = 4
	// TypeEvent (G): JSON Event, progress of request id.
	TypeEvent Type = 5
	// TypeData (H, G): raw bytes of the stream in the flags' low nibble.
	TypeData Type = 6
	// TypeWindow (H, G): 4-byte credit increment for request id's data in
	// the opposite direction; with id 0 (H only), for the connection
	// (ConnWindow).
	TypeWindow Type = 7
	// TypeCancel (H): cancel request id; the guest still ends it with a
	// result, which the host may ignore.
	TypeCancel Type = 8
	// TypeResend (H, id 0, protocol 2): 4-byte sequence number; the guest
	// writes again, in order, every frame of its session from that number
	// on that the host has not yet returned credit for. The host asks when
	// a sequence gap or a torn frame shows that bytes were lost.
	TypeResend Type = 9
)

func (t Type) String() string {
	switch t {
	case TypeHello:
		return "hello"
	case TypeHelloAck:
		return "hello_ack"
	case TypeRequest:
		return "request"
	case TypeResult:
		return "result"
	case TypeEvent:
		return "event"
	case TypeData:
		return "data"
	case TypeWindow:
		return "window"
	case TypeCancel:
		return "cancel"
	case TypeResend:
		return "resend"
	}
	return fmt.Sprintf("type(%d)", uint8(t))
}

func (t Type) valid() bool { return t >= TypeHello && t <= TypeResend }

// Stream names the byte stream of a data frame (low nibble of the flags).
type Stream uint8

// Streams.
const (
	StreamStdin  Stream = 1
	StreamStdout Stream = 2
	StreamStderr Stream = 3
	StreamFile   Stream = 4
	StreamWatch  Stream = 5 // WatchEvent lines of OpFileWatch
)

// Flags.
const (
	// FlagStreamMask selects the Stream of a data frame.
	FlagStreamMask uint16 = 0x000F
	// FlagEOF on a data frame: the sender's stream ends after this payload.
	FlagEOF uint16 = 0x0010
	// FlagMore on a JSON frame: the message continues in the next frame.
	FlagMore uint16 = 0x0020
)

// Frame is one decoded frame. A Payload returned by Reader.Next aliases the
// reader's buffer and is valid until the next call. Writer assigns Seq.
type Frame struct {
	Type    Type
	Flags   uint16
	ID      uint32
	Seq     uint32
	Payload []byte
}

// FrameCost is what a frame counts against ConnWindow.
func FrameCost(payloadLen int) int { return HeaderSize + payloadLen + FrameOverhead }

// Stream returns the stream of a data frame.
func (f Frame) Stream() Stream { return Stream(f.Flags & FlagStreamMask) }

// EOF reports whether a data frame ends its stream.
func (f Frame) EOF() bool { return f.Flags&FlagEOF != 0 }

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// putHeader writes f's header into b[:HeaderSize], CRC included.
func putHeader(b []byte, f Frame) {
	copy(b[0:4], Magic[:])
	b[4] = FrameVersion
	b[5] = byte(f.Type)
	binary.BigEndian.PutUint16(b[6:8], f.Flags)
	binary.BigEndian.PutUint32(b[8:12], f.ID)
	binary.BigEndian.PutUint32(b[12:16], f.Seq)
	binary.BigEndian.PutUint32(b[16:20], uint32(len(f.Payload)))
	crc := crc32.Update(0, castagnoli, b[0:20])
	crc = crc32.Update(crc, castagnoli, f.Payload)
	binary.BigEndian.PutUint32(b[20:24], crc)
}

// AppendFrame appends f's encoding to b. It fails if the payload exceeds
// MaxPayload or the type is unknown.
func AppendFrame(b []byte, f Frame) ([]byte, error) {
	if len(f.Payload) > MaxPayload {
		return b, fmt.Errorf("frame payload of %d bytes exceeds %d", len(f.Payload), MaxPayload)
	}
	if !f.Type.valid() {
		return b, fmt.Errorf("unknown frame type %d", f.Type)
	}
	n := len(b)
	b = append(b, make([]byte, HeaderSize)...)
	b = append(b, f.Payload...)
	putHeader(b[n:n+HeaderSize], Frame{Type: f.Type, Flags: f.Flags, ID: f.ID, Seq: f.Seq, Payload: b[n+HeaderSize:]})
	return b, nil
}

// header is a parsed, not yet CRC-checked, frame header.
type header struct {
	typ    Type
	flags  uint16
	id     uint32
	seq    uint32
	length int
	crc    uint32
}

// parseHeader checks the fixed fields of b[:HeaderSize]; the magic is
// assumed present.
func parseHeader(b []byte) (header, bool) {
	h := header{
		typ:    Type(b[5]),
		flags:  binary.BigEndian.Uint16(b[6:8]),
		id:     binary.BigEndian.Uint32(b[8:12]),
		seq:    binary.BigEndian.Uint32(b[12:16]),
		length: int(binary.BigEndian.Uint32(b[16:20])),
		crc:    binary.BigEndian.Uint32(b[20:24]),
	}
	if b[4] != FrameVersion || !h.typ.valid() || h.length > MaxPayload {
		return h, false
	}
	return h, true
}

// checkCRC verifies the CRC of a complete frame b (header and payload).
func checkCRC(b []byte, h header) bool {
	crc := crc32.Update(0, castagnoli, b[0:20])
	crc = crc32.Update(crc, castagnoli, b[HeaderSize:HeaderSize+h.length])
	return crc == h.crc
}

// WindowPayload encodes a credit increment for a TypeWindow frame.
func WindowPayload(n uint32) []byte {
	return binary.BigEndian.AppendUint32(nil, n)
}

// ParseWindow decodes a TypeWindow payload.
func ParseWindow(p []byte) (uint32, error) {
	if len(p) != 4 {
		return 0, fmt.Errorf("window payload of %d bytes, want 4", len(p))
	}
	return binary.BigEndian.Uint32(p), nil
}
