package guest_test

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/guest"
	"github.com/forkd/forkd/internal/testutil"
	"golang.org/x/sys/unix"
)

// noSystem changes nothing on the host.
var noSystem = guest.System{
	SetTime:     func(time.Time) error { return nil },
	AddEntropy:  func([]byte) error { return nil },
	SetHostname: func(string) error { return nil },
}

// serveSocket runs an in-process agent on one end of a socket pair and
// returns a client on the other.
func serveSocket(t *testing.T) *agent.Client {
	t.Helper()
	return serveConfig(t, guest.Config{System: noSystem})
}

// serveConfig is serveSocket for an agent of configuration cfg.
func serveConfig(t *testing.T, cfg guest.Config) *agent.Client {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	hostFile, agentFile := os.NewFile(uintptr(fds[0]), "host"), os.NewFile(uintptr(fds[1]), "agent")
	conn, err := net.FileConn(hostFile)
	hostFile.Close()
	if err != nil {
		t.Fatal(err)
	}
	a := guest.New(cfg)
	go a.Serve(context.Background(), agentFile)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := agent.Dial(ctx, conn, agent.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Close()
		agentFile.Close()
		a.Close()
	})
	return c
}

// servePTY runs an in-process agent on a pty's slave, as the real one
// serves /dev/hvc0, and returns a client on the master and the slave's
// path.
func servePTY(t *testing.T) (*agent.Client, string) {
	t.Helper()
	mfd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		testutil.Unavailable(t, "no pty: "+err.Error())
	}
	if err := unix.IoctlSetPointerInt(mfd, unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(mfd, unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	master := os.NewFile(uintptr(mfd), "ptmx")
	path := "/dev/pts/" + strconv.Itoa(n)
	console, err := guest.OpenConsole(path)
	if err != nil {
		t.Fatal(err)
	}
	a := guest.New(guest.Config{System: noSystem})
	go a.Serve(context.Background(), console)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := agent.Dial(ctx, fileConn{master}, agent.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Close()
		master.Close()
		console.Close()
		a.Close()
	})
	return c, path
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// nullDevice returns a character device that discards what is written to
// it: a fresh node of /dev/null's numbers in a temporary directory as root
// (so that a broken write could never replace the host's own /dev/null),
// /dev/null itself otherwise (nobody else may replace it).
func nullDevice(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		return "/dev/null"
	}
	p := filepath.Join(t.TempDir(), "null")
	if err := unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
		t.Fatal(err)
	}
	return p
}

// A files write to a character device writes into it: the node stays.
func TestWriteCharDeviceInPlace(t *testing.T) {
	c := serveSocket(t)
	ctx := testCtx(t)
	p := nullDevice(t)
	n, err := c.WriteFile(ctx, p, strings.NewReader("into the void"), 0)
	if err != nil {
		t.Fatalf("write %s: %v", p, err)
	}
	st, err := os.Stat(p)
	if err != nil || st.Mode()&os.ModeCharDevice == 0 {
		t.Fatalf("%s after the write: %v, %v: the device node was replaced", p, st.Mode(), err)
	}
	if n != 13 {
		t.Errorf("wrote %d bytes, want 13", n)
	}
	if m, _ := filepath.Glob(filepath.Join(filepath.Dir(p), ".null.forkd-*")); len(m) != 0 {
		t.Errorf("temporary files left: %v", m)
	}
}

// A files write to a FIFO writes into it for its reader; with no reader it
// fails at once, saying so, instead of hanging.
func TestWriteFIFOInPlace(t *testing.T) {
	c := serveSocket(t)
	ctx := testCtx(t)
	p := filepath.Join(t.TempDir(), "fifo")
	if err := unix.Mkfifo(p, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WriteFile(ctx, p, strings.NewReader("x"), 0); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "no reader") {
		t.Errorf("write to a FIFO nobody reads: %v, want a failed precondition naming no reader", err)
	}
	got := make(chan string, 1)
	go func() {
		f, err := os.Open(p) // blocks until the writer opens
		if err != nil {
			got <- err.Error()
			return
		}
		defer f.Close()
		b, _ := io.ReadAll(f)
		got <- string(b)
	}()
	// The reader must be waiting in open before the write starts.
	deadline := time.Now().Add(10 * time.Second)
	var err error
	for {
		_, err = c.WriteFile(ctx, p, strings.NewReader("through the pipe"), 0)
		if err == nil || !errdefs.IsFailedPrecondition(err) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("write to a FIFO with a reader: %v", err)
	}
	select {
	case s := <-got:
		if s != "through the pipe" {
			t.Errorf("reader got %q", s)
		}
	case <-ctx.Done():
		t.Fatal("reader never saw EOF")
	}
	if st, err := os.Lstat(p); err != nil || st.Mode()&os.ModeNamedPipe == 0 {
		t.Fatalf("%s after the write: %v, %v: the FIFO was replaced", p, st.Mode(), err)
	}
}

// The agent refuses to write (or read) the device it serves the host on,
// and its channel keeps working.
func TestWriteRefusesAgentChannel(t *testing.T) {
	c, channel := servePTY(t)
	ctx := testCtx(t)
	paths := []string{channel}
	if os.Geteuid() == 0 {
		// Another node for the same device, and the kernel console.
		dir := t.TempDir()
		var st unix.Stat_t
		if err := unix.Stat(channel, &st); err != nil {
			t.Fatal(err)
		}
		alias, console := filepath.Join(dir, "hvc0"), filepath.Join(dir, "console")
		if err := unix.Mknod(alias, unix.S_IFCHR|0o600, int(st.Rdev)); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mknod(console, unix.S_IFCHR|0o600, int(unix.Mkdev(5, 1))); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, alias, console)
	}
	for _, p := range paths {
		_, err := c.WriteFile(ctx, p, strings.NewReader("garbage on the channel"), 0)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "channel") {
			t.Errorf("write %s: %v, want an invalid argument naming the channel", p, err)
		}
		if st, err := os.Stat(p); err != nil || st.Mode()&os.ModeCharDevice == 0 {
			t.Fatalf("%s after the write: %v, %v: the device node was replaced", p, st.Mode(), err)
		}
		if _, err := c.ReadFile(ctx, p, io.Discard); !errdefs.IsInvalidArgument(err) {
			t.Errorf("read %s: %v, want an invalid argument", p, err)
		}
		if _, err := c.Ping(ctx); err != nil {
			t.Fatalf("ping after writing %s: %v", p, err)
		}
	}
}

// Kernel pseudo file systems hold no files to replace: a write there is
// refused as an invalid argument, never reported as a missing file.
func TestWritePseudoFileSystemsRefused(t *testing.T) {
	c := serveSocket(t)
	ctx := testCtx(t)
	for _, p := range []string{"/proc/version", "/proc/self/forkd-test", "/proc/sys/vm/forkd-test", "/sys/kernel/forkd-test"} {
		_, err := c.WriteFile(ctx, p, strings.NewReader("1"), 0)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "pseudo file system") {
			t.Errorf("write %s: %v, want an invalid argument naming a pseudo file system", p, err)
		}
	}
}

// A socket is not written; a rename never replaces a device node.
func TestWriteSocketAndRenameOntoDevice(t *testing.T) {
	c := serveSocket(t)
	ctx := testCtx(t)
	dir := t.TempDir()
	sock := filepath.Join(dir, "sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := c.WriteFile(ctx, sock, strings.NewReader("x"), 0); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "socket") {
		t.Errorf("write to a socket: %v", err)
	}
	dev := nullDevice(t)
	src := filepath.Join(dir, "src")
	testutil.WriteFile(t, src, []byte("x"), 0o644)
	err = c.Rename(ctx, src, dev)
	if !errdefs.IsInvalidArgument(err) {
		t.Errorf("rename onto %s: %v, want an invalid argument", dev, err)
	}
	if st, serr := os.Stat(dev); serr != nil || st.Mode()&os.ModeCharDevice == 0 {
		t.Fatalf("%s after the rename: %v, %v: the device node was replaced", dev, st.Mode(), errors.Join(err, serr))
	}
}
