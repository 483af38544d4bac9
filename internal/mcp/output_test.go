package mcp

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestCapture(t *testing.T) {
	for _, tc := range []struct {
		name  string
		limit int
		in    string
		chunk int
		want  string
	}{
		{"fits", 10, "0123456789", 3, "0123456789"},
		{"empty", 10, "", 1, ""},
		{"head and tail", 10, "abcdefghijklmnopqrstuvwxyz", 1, "abcde" + truncMarker(26, 10) + "vwxyz"},
		{"one write", 10, "abcdefghijklmnopqrstuvwxyz", 26, "abcde" + truncMarker(26, 10) + "vwxyz"},
		{"odd chunks", 10, "abcdefghijklmnopqrstuvwxyz", 7, "abcde" + truncMarker(26, 10) + "vwxyz"},
		// A character cut by the head's end or the tail's start is left
		// out whole, never shown as a broken byte.
		{"utf-8 boundaries", 8, "aaaé" + strings.Repeat("x", 20) + "éyzb", 2, "aaa" + truncMarker(30, 6) + "yzb"},
		{"not utf-8", 10, "a\xffb", 1, "a\uFFFDb"},
	} {
		c := newCapture(tc.limit)
		in := []byte(tc.in)
		for len(in) > 0 {
			k := min(tc.chunk, len(in))
			if n, err := c.Write(in[:k]); n != k || err != nil {
				t.Fatalf("%s: Write = %d, %v", tc.name, n, err)
			}
			in = in[k:]
		}
		if got := c.String(); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
		if c.total != int64(len(tc.in)) || c.Truncated() != (len(tc.in) > tc.limit) {
			t.Errorf("%s: total %d truncated %v", tc.name, c.total, c.Truncated())
		}
	}
	// Memory stays bounded whatever is written.
	c := newCapture(MaxField)
	for range 1000 {
		_, _ = c.Write(bytes.Repeat([]byte("é"), 5000))
	}
	if cap(c.head)+cap(c.tail) > 2*MaxField || !utf8.ValidString(c.String()) {
		t.Errorf("capture holds %d bytes", cap(c.head)+cap(c.tail))
	}
}

func TestWindow(t *testing.T) {
	w := &window{skip: 3, limit: 4}
	_, err := io.Copy(w, strings.NewReader("abcdefghij"))
	if !errors.Is(err, errFull) || string(w.buf) != "defg" || !w.full {
		t.Errorf("window: %q full %v err %v", w.buf, w.full, err)
	}
	w = &window{limit: 4}
	if _, err := io.Copy(w, strings.NewReader("abcd")); err != nil || w.full || string(w.buf) != "abcd" {
		t.Errorf("exact fit: %q full %v err %v", w.buf, w.full, err)
	}
}

func TestFinder(t *testing.T) {
	text := "READY"
	for _, chunk := range []int{1, 2, 3, 5, 7, 1000} {
		f := newFinder([]byte(text))
		in := []byte("line one\nabc READY xyz\nline three\n")
		var err error
		for len(in) > 0 && err == nil {
			k := min(chunk, len(in))
			_, err = f.Write(in[:k])
			in = in[k:]
		}
		if !errors.Is(err, errFound) || !f.found || f.at != 13 {
			t.Errorf("chunk %d: found %v at %d err %v", chunk, f.found, f.at, err)
			continue
		}
		// The line is complete when the write that found the text
		// carried it to its end.
		if l := f.line(); !strings.HasPrefix("abc READY xyz", l) || !strings.HasPrefix(l, "abc READY") {
			t.Errorf("chunk %d: line %q", chunk, l)
		}
	}
	f := newFinder([]byte("nope"))
	_, _ = f.Write([]byte("a\nlast line\n"))
	if f.found || f.lastLine() != "last line" {
		t.Errorf("no match: found %v, last line %q", f.found, f.lastLine())
	}
	// Memory stays bounded over a long file.
	for range 1000 {
		_, _ = f.Write(bytes.Repeat([]byte("x"), 4096))
	}
	if len(f.recent) > maxLine+4 {
		t.Errorf("finder holds %d bytes", len(f.recent))
	}
}
