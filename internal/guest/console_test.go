package guest_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/guest"
	"github.com/forkd/forkd/internal/testutil"
	"golang.org/x/sys/unix"
)

// The agent serves over a real tty (a pty standing in for /dev/hvc0): raw
// mode must let every byte value through untouched and echo nothing.
func TestServeOnPTY(t *testing.T) {
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
	defer master.Close()

	console, err := guest.OpenConsole("/dev/pts/" + strconv.Itoa(n))
	if err != nil {
		t.Fatal(err)
	}
	defer console.Close()
	tio, err := unix.IoctlGetTermios(int(console.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	if tio.Lflag&(unix.ECHO|unix.ICANON|unix.ISIG) != 0 || tio.Oflag&unix.OPOST != 0 || tio.Iflag&unix.ICRNL != 0 {
		t.Fatalf("console not raw: lflag %#x oflag %#x iflag %#x", tio.Lflag, tio.Oflag, tio.Iflag)
	}

	a := guest.New(guest.Config{System: guest.System{
		SetTime:     func(time.Time) error { return nil },
		AddEntropy:  func([]byte) error { return nil },
		SetHostname: func(string) error { return nil },
	}})
	defer a.Close()
	go a.Serve(context.Background(), console)

	// A host died in the middle of a large frame: the agent must give it up
	// after its partial timeout, which needs read deadlines on the tty.
	torn, _ := proto.AppendFrame(nil, proto.Frame{Type: proto.TypeRequest, ID: 1, Payload: bytes.Repeat([]byte{'x'}, 60000)})
	if _, err := master.Write(torn[:100]); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := agent.Dial(ctx, fileConn{master}, agent.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	// Every byte value, both ways, several times the window.
	data := bytes.Repeat(func() []byte {
		b := make([]byte, 256)
		for i := range b {
			b[i] = byte(i)
		}
		return b
	}(), 4096)
	path := filepath.Join(t.TempDir(), "bytes")
	if _, err := c.WriteFile(ctx, path, bytes.NewReader(data), 0o600); err != nil {
		t.Fatal(err)
	}
	h := sha256.New()
	if _, err := c.ReadFile(ctx, path, h); err != nil {
		t.Fatal(err)
	}
	if want := sha256.Sum256(data); !bytes.Equal(h.Sum(nil), want[:]) {
		t.Fatal("bytes changed crossing the tty")
	}
}

// fileConn is a net.Conn over a pollable file (the pty master).
type fileConn struct{ *os.File }

func (fileConn) LocalAddr() net.Addr  { return ptyAddr{} }
func (fileConn) RemoteAddr() net.Addr { return ptyAddr{} }

type ptyAddr struct{}

func (ptyAddr) Network() string { return "pty" }
func (ptyAddr) String() string  { return "pty" }
