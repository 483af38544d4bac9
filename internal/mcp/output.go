package mcp

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"
)

// MaxField is the most bytes of output one result field carries (a
// command's stdout, a file's content, …): a model's context is precious,
// and what is past this is rarely read. Past it, a field keeps its head
// and tail around a marker that says how many bytes there were.
const MaxField = 64 << 10

// capture is a writer that keeps the first and the last bytes written to
// it, at most limit in all, and counts every byte: it holds O(limit)
// whatever is written.
type capture struct {
	limit int
	head  []byte
	tail  []byte // ring buffer of the last limit-len(head) bytes, from pos
	pos   int
	total int64
}

func newCapture(limit int) *capture { return &capture{limit: limit} }

func (c *capture) Write(p []byte) (int, error) {
	n := len(p)
	c.total += int64(n)
	if room := c.limit/2 - len(c.head); room > 0 {
		k := min(room, len(p))
		c.head = append(c.head, p[:k]...)
		p = p[k:]
	}
	keep := c.limit - c.limit/2
	if len(p) >= keep {
		c.tail = append(c.tail[:0], p[len(p)-keep:]...)
		c.pos = 0
		return n, nil
	}
	for len(p) > 0 {
		if len(c.tail) < keep {
			k := min(keep-len(c.tail), len(p))
			c.tail = append(c.tail, p[:k]...)
			p = p[k:]
			continue
		}
		k := copy(c.tail[c.pos:], p)
		c.pos = (c.pos + k) % keep
		p = p[k:]
	}
	return n, nil
}

// bytes returns what was kept, in order, and whether bytes were dropped
// between head and tail.
func (c *capture) bytes() (head, tail []byte, dropped bool) {
	t := append(append([]byte(nil), c.tail[c.pos:]...), c.tail[:c.pos]...)
	return c.head, t, c.total > int64(len(c.head)+len(t))
}

// String is the output as text: all of it when it fits, else its head,
// a marker with the byte counts, and its tail, cut at character
// boundaries; bytes that are not UTF-8 become U+FFFD.
func (c *capture) String() string {
	head, tail, dropped := c.bytes()
	if !dropped {
		return strings.ToValidUTF8(string(head)+string(tail), "\uFFFD")
	}
	head = head[:runeStart(head, len(head))]
	tail = tail[runeEnd(tail):]
	shown := len(head) + len(tail)
	return strings.ToValidUTF8(string(head), "\uFFFD") +
		truncMarker(c.total, shown) +
		strings.ToValidUTF8(string(tail), "\uFFFD")
}

// truncMarker says, inside a field, that bytes were left out.
func truncMarker(total int64, shown int) string {
	return fmt.Sprintf("\n[... forkd: output truncated: %d bytes in all, %d omitted here, %d shown (the first and the last) ...]\n",
		total, total-int64(shown), shown)
}

// Truncated reports whether the output did not fit.
func (c *capture) Truncated() bool { return c.total > int64(c.limit) }

// runeStart is the largest i <= n at which b[:i] ends on a character
// boundary (it backs off an incomplete trailing UTF-8 sequence).
func runeStart(b []byte, n int) int {
	for i := n; i > 0 && i > n-utf8.UTFMax; i-- {
		if utf8.RuneStart(b[i-1]) {
			if utf8.FullRune(b[i-1 : n]) {
				return n
			}
			return i - 1
		}
	}
	return n
}

// runeEnd is the index of the first character boundary of b (it skips
// the continuation bytes of a character cut at its start).
func runeEnd(b []byte) int {
	for i := 0; i < len(b) && i < utf8.UTFMax; i++ {
		if utf8.RuneStart(b[i]) {
			return i
		}
	}
	return 0
}

// errFull stops a copy into a window that has what it wants.
var errFull = errors.New("window full")

// window is a writer that skips the first skip bytes, keeps the next
// limit, and then fails with errFull, so that a download stops there.
type window struct {
	skip  int64
	limit int
	buf   []byte
	full  bool
}

func (w *window) Write(p []byte) (int, error) {
	n := len(p)
	if w.skip > 0 {
		k := min(int64(len(p)), w.skip)
		w.skip -= k
		p = p[k:]
	}
	room := w.limit - len(w.buf)
	if len(p) > room {
		w.buf = append(w.buf, p[:room]...)
		w.full = true
		return n, errFull
	}
	w.buf = append(w.buf, p...)
	return n, nil
}
