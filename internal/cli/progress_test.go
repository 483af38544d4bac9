package cli

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/testutil"
)

func TestCounterSilentWithoutTerminal(t *testing.T) {
	var b bytes.Buffer
	c := newCounter(&b, "forking x", 2)
	c.add(true)
	c.add(false)
	c.finish()
	if b.Len() != 0 {
		t.Fatalf("counter wrote %q to a non-terminal", b.String())
	}
}

func TestCounterOnTerminal(t *testing.T) {
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		testutil.Unavailable(t, "no pty: "+err.Error())
	}
	defer m.Close()
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	slave, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer slave.Close()
	c := newCounter(slave, "forking x", 2)
	c.add(true)
	c.add(false)
	c.finish()
	// The counter's writes may reach the master in several reads.
	m.SetReadDeadline(time.Now().Add(5 * time.Second))
	var out []byte
	buf := make([]byte, 4096)
	for !strings.Contains(string(out), "forking x: 1/2 ready, 1 failed") {
		k, err := m.Read(buf)
		out = append(out, buf[:k]...)
		if err != nil {
			t.Fatalf("terminal got %q (%v)", out, err)
		}
	}
}
