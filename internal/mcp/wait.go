package mcp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
)

type waitArgs struct {
	ID          string  `json:"id" jsonschema:"the sandbox"`
	Path        string  `json:"path" jsonschema:"the file to watch, absolute (it may not exist yet)"`
	Text        string  `json:"text" jsonschema:"the text to wait for, matched literally"`
	TimeoutSecs float64 `json:"timeout_secs,omitempty" jsonschema:"give up after this many seconds (default 30)"`
	IntervalMS  int     `json:"interval_ms,omitempty" jsonschema:"read the file this often, in milliseconds (default 500)"`
}

type waitResult struct {
	Found     bool   `json:"found"`
	Path      string `json:"path"`
	Offset    int64  `json:"offset" jsonschema:"byte offset of the text's first occurrence in the file"`
	Line      string `json:"line" jsonschema:"the line holding it (at most 1 KiB)"`
	ElapsedMS int64  `json:"elapsed_ms"`
	Reads     int    `json:"reads" jsonschema:"how many times the file was read"`
}

// maxLine bounds waitResult.Line.
const maxLine = 1 << 10

func (t *tools) waitForText(ctx context.Context, c *call, in *waitArgs) (*waitResult, error) {
	if err := checkID(in.ID); err != nil {
		return nil, err
	}
	if err := checkPath("path", in.Path); err != nil {
		return nil, err
	}
	if in.Text == "" || len(in.Text) > maxMarkerBytes {
		return nil, errdefs.InvalidArgument("text is %d bytes: want 1 to %d", len(in.Text), maxMarkerBytes)
	}
	secs := in.TimeoutSecs
	if secs == 0 {
		secs = defaultWaitSecs
	}
	if err := checkSecs("timeout_secs", secs, 0, maxWaitSecs); err != nil {
		return nil, err
	}
	interval := in.IntervalMS
	if interval == 0 {
		interval = defaultInterval
	}
	if err := checkInt("interval_ms", interval, minIntervalMS, maxIntervalMS); err != nil {
		return nil, err
	}
	start := time.Now()
	deadline := start.Add(time.Duration(secs * float64(time.Second)))
	p := c.progress()
	out := &waitResult{Path: in.Path}
	var last *finder // the last read, for the message when the text never came
	var lastErr error
	sandboxSeen := false
	for {
		f := newFinder([]byte(in.Text))
		rctx, cancel := context.WithDeadline(ctx, deadline)
		_, err := t.c.ReadFile(rctx, in.ID, in.Path, f)
		cancel()
		out.Reads++
		switch {
		case f.found:
			out.Found, out.Offset, out.Line = true, f.at, f.line()
			out.ElapsedMS = time.Since(start).Milliseconds()
			return out, nil
		case err == nil:
			last, lastErr = f, nil
		case errdefs.IsNotFound(err):
			// The file is not there yet, or the sandbox is not: once, ask.
			if !sandboxSeen {
				if _, gerr := t.c.GetSandbox(ctx, in.ID); gerr != nil {
					return nil, notFoundSandbox(in.ID, gerr)
				}
				sandboxSeen = true
			}
			lastErr = err
		case errdefs.IsInvalidArgument(err), errdefs.IsFailedPrecondition(err), errdefs.IsNotImplemented(err):
			return nil, err // a directory, a path the agent refuses, …
		case ctx.Err() != nil:
			return nil, ctx.Err()
		case time.Now().After(deadline):
		default:
			lastErr = err
		}
		now := time.Now()
		if !now.Before(deadline) {
			return nil, waitFailed(in, out.Reads, now.Sub(start), last, lastErr)
		}
		p.report(ctx, float64(now.Sub(start).Milliseconds()), secs*1000, fmt.Sprintf("waiting for %q in %s", in.Text, in.Path))
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(min(time.Duration(interval)*time.Millisecond, time.Until(deadline))):
		}
	}
}

// waitFailed explains why the text was not found.
func waitFailed(in *waitArgs, reads int, took time.Duration, last *finder, lastErr error) error {
	var what string
	switch {
	case last != nil:
		what = fmt.Sprintf("the file has %d bytes", last.n)
		if tail := last.lastLine(); tail != "" {
			what += fmt.Sprintf("; its last line: %q", tail)
		}
	case lastErr != nil && errdefs.IsNotFound(lastErr):
		what = "the file does not exist"
	case lastErr != nil:
		what = "reading it failed: " + lastErr.Error()
	}
	return &hinted{
		err: errdefs.DeadlineExceeded("text %q did not appear in %s within %.1fs (%d reads; %s)",
			in.Text, in.Path, took.Seconds(), reads, what),
		hint: "Check that the program writing the file runs (exec_command), then wait again, perhaps with a longer timeout_secs.",
	}
}

// errFound stops a read once the text was found.
var errFound = errors.New("text found")

// finder is a writer that looks for a text in what is written to it and
// stops the copy (errFound) at the first match. It holds only a window of
// the last bytes written (maxLine plus the text's length), enough for a
// match cut across writes and for the line around it.
type finder struct {
	text   []byte
	recent []byte // the last bytes written, at most maxLine+len(text)
	n      int64  // bytes written
	found  bool
	at     int64  // offset of the match
	match  []byte // the line holding the match, as far as the data went
}

func newFinder(text []byte) *finder { return &finder{text: text} }

func (f *finder) Write(p []byte) (int, error) {
	buf := append(f.recent, p...)
	base := f.n - int64(len(f.recent)) // offset of buf[0]
	f.n += int64(len(p))
	if i := bytes.Index(buf, f.text); i >= 0 {
		f.found, f.at = true, base+int64(i)
		start := bytes.LastIndexByte(buf[:i], '\n') + 1
		end := len(buf)
		if j := bytes.IndexByte(buf[i+len(f.text):], '\n'); j >= 0 {
			end = i + len(f.text) + j
		}
		f.match = append([]byte(nil), buf[start:end]...)
		return len(p), errFound
	}
	if keep := maxLine + len(f.text); len(buf) > keep {
		buf = buf[len(buf)-keep:]
	}
	f.recent = append(make([]byte, 0, len(buf)), buf...)
	return len(p), nil
}

// line is the line that holds the match, cut to maxLine bytes.
func (f *finder) line() string {
	m := f.match
	if len(m) > maxLine {
		m = m[:maxLine]
	}
	return string(bytes.ToValidUTF8(m, []byte("\uFFFD")))
}

// lastLine is the last line read (the one before a final newline).
func (f *finder) lastLine() string {
	r := bytes.TrimRight(f.recent, "\n")
	r = r[bytes.LastIndexByte(r, '\n')+1:]
	if len(r) > maxLine {
		r = r[len(r)-maxLine:]
	}
	return string(bytes.ToValidUTF8(r, []byte("\uFFFD")))
}
