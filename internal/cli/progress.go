package cli

import (
	"fmt"
	"io"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// isTerminal reports whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// counter draws "label: k/n" on one terminal line as work completes, and
// nothing when w is not a terminal. Safe for concurrent use.
type counter struct {
	mu       sync.Mutex // guards done, failed
	w        io.Writer
	label    string
	n        int
	done     int
	failed   int
	terminal bool
}

func newCounter(w io.Writer, label string, n int) *counter {
	c := &counter{w: w, label: label, n: n, terminal: isTerminal(w)}
	c.draw()
	return c
}

// add counts one finished item.
func (c *counter) add(ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.done++
	if !ok {
		c.failed++
	}
	c.drawLocked()
}

func (c *counter) draw() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.drawLocked()
}

func (c *counter) drawLocked() {
	if !c.terminal {
		return
	}
	fmt.Fprintf(c.w, "\r\033[K%s: %d/%d ready", c.label, c.done-c.failed, c.n)
	if c.failed > 0 {
		fmt.Fprintf(c.w, ", %d failed", c.failed)
	}
}

// finish ends the line.
func (c *counter) finish() {
	if c.terminal {
		fmt.Fprint(c.w, "\r\033[K")
	}
}
