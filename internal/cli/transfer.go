package cli

import (
	"fmt"
	"io"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
)

// transferView shows a hub operation's progress. On a terminal it redraws
// a block of lines in place, one per file: bytes moved of its total, rate,
// ETA. Elsewhere it prints the operation's progress lines as they come,
// and one line per file once it is done.
type transferView struct {
	w        io.Writer
	terminal bool
	seen     int // progress lines printed
	drawn    int // lines of the block drawn last (terminal)
	files    map[string]*fileRate
}

// fileRate measures one file's rate since it was first seen moving.
type fileRate struct {
	since time.Time
	base  int64 // work done then
}

func newTransferView(w io.Writer) *transferView {
	return &transferView{w: w, terminal: isTerminal(w), files: map[string]*fileRate{}}
}

// ETA and rate are of the work (bytes read and encoded by a push, fetched
// by a pull); the block shows blob bytes done of those known.

// interval is how often the operation is polled.
func (v *transferView) interval() time.Duration {
	if v.terminal {
		return 250 * time.Millisecond
	}
	return time.Second
}

// update shows op's state.
func (v *transferView) update(op *apiv1.Operation) {
	var fresh []string
	if op.ProgressLines > v.seen {
		n := min(op.ProgressLines-v.seen, len(op.Progress))
		fresh = op.Progress[len(op.Progress)-n:]
		v.seen = op.ProgressLines
	}
	if !v.terminal {
		for _, l := range fresh {
			fmt.Fprintln(v.w, l)
		}
		return
	}
	v.clear()
	for _, l := range fresh {
		fmt.Fprintln(v.w, l)
	}
	if t := op.Transfer; t != nil && op.Status == apiv1.OperationRunning {
		v.draw(t)
	}
}

// clear erases the block drawn last.
func (v *transferView) clear() {
	if v.drawn > 0 {
		fmt.Fprintf(v.w, "\033[%dA", v.drawn)
		for range v.drawn {
			fmt.Fprint(v.w, "\r\033[K\n")
		}
		fmt.Fprintf(v.w, "\033[%dA", v.drawn)
		v.drawn = 0
	}
}

// draw writes the block: a line per file, then the phase.
func (v *transferView) draw(t *apiv1.Transfer) {
	now := time.Now()
	for _, f := range t.Files {
		r := v.files[f.Name]
		if r == nil {
			r = &fileRate{since: now, base: f.WorkDoneBytes}
			v.files[f.Name] = r
		}
		line := fmt.Sprintf("%-16s %9s / %-9s", shorten(f.Name, 16), mibs(f.DoneBytes+f.SkippedBytes), mibs(f.TotalBytes))
		if f.SkippedBytes > 0 {
			line += fmt.Sprintf(" (%s there already)", mibs(f.SkippedBytes))
		}
		el := now.Sub(r.since).Seconds()
		switch {
		case f.WorkBytes > 0 && f.WorkDoneBytes >= f.WorkBytes && f.BlobsDone == f.Blobs:
			line += "  done"
		case el > 0.5 && f.WorkDoneBytes > r.base:
			rate := float64(f.WorkDoneBytes-r.base) / el
			line += fmt.Sprintf("  %s/s", mibs(int64(rate)))
			if left := f.WorkBytes - f.WorkDoneBytes; left > 0 {
				line += fmt.Sprintf("  ETA %s", (time.Duration(float64(left)/rate) * time.Second).Round(time.Second))
			}
		}
		fmt.Fprintf(v.w, "\r\033[K%s\n", line)
		v.drawn++
	}
	if t.Phase != "" {
		fmt.Fprintf(v.w, "\r\033[K%s\n", t.Phase)
		v.drawn++
	}
}

// finish ends the display once the operation is over.
func (v *transferView) finish(op *apiv1.Operation) {
	if op == nil {
		return
	}
	if v.terminal {
		v.clear()
	}
	t := op.Transfer
	if t == nil || op.Status != apiv1.OperationSucceeded {
		return
	}
	verb := map[string]string{"push": "sent", "pack": "written", "pull": "fetched", "unpack": "read"}[t.Op]
	fmt.Fprintf(v.w, "%s %s in %.1fs: %s of %s %s", t.Op, t.Tag, t.Seconds, mibs(t.MovedBytes), mibs(t.BlobBytes), verb)
	if t.SkippedBytes > 0 {
		fmt.Fprintf(v.w, ", %s there already", mibs(t.SkippedBytes))
	}
	if t.MemoryBytes > 0 && t.MemoryBlobBytes > 0 {
		fmt.Fprintf(v.w, "; memory %s of RAM in %s (%.1fx)", mibs(t.MemoryBytes), mibs(t.MemoryBlobBytes),
			float64(t.MemoryBytes)/float64(t.MemoryBlobBytes))
	}
	fmt.Fprintln(v.w)
}

func mibs(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

func shorten(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "…" + s[len(s)-n+1:]
}
