package agent_test

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/guest"
	"github.com/forkd/forkd/internal/testutil"
)

// fakeChardev is a fake standing in for QEMU's socket chardev behind a
// virtconsole, so that these tests can run the guest agent in-process and
// inject loss and backpressure at will (dropNext, a host that reads
// slowly). It models the real one: the guest's stream never ends, hosts
// connect and disconnect over unix sockets, what the guest writes while no
// host is connected is lost, and so is what the host's socket cannot take
// at once (QEMU drops console output on EAGAIN). TestAgentInVM (vm_test.go)
// runs the agent behind QEMU's real chardev.
type fakeChardev struct {
	t       *testing.T
	toGuest *os.File // the test writes what the guest reads
	mu      sync.Mutex
	host    *os.File // guarded by mu; the relay's end of the connected host's socket
	agent   *guest.Agent
	sys     *fakeSystem
	// dropped counts guest bytes the host's socket could not take.
	dropped atomic.Int64
	// dropNext, when set, drops the next chunk of guest output whole.
	dropNext atomic.Bool
	// flipToGuest, when positive, is the offset in the next host's stream
	// of a byte the relay flips on its way to the guest: the frame holding
	// it fails its CRC there and is skipped, a frame lost host to guest.
	flipToGuest atomic.Int64
}

// guestStream is the guest's side: reads from one pipe, writes to another,
// with read deadlines like the real console.
type guestStream struct{ r, w *os.File }

func (g guestStream) Read(p []byte) (int, error)        { return g.r.Read(p) }
func (g guestStream) Write(p []byte) (int, error)       { return g.w.Write(p) }
func (g guestStream) SetReadDeadline(t time.Time) error { return g.r.SetReadDeadline(t) }

// fakeSystem records init's effects instead of changing the host.
type fakeSystem struct {
	mu       sync.Mutex
	time     time.Time
	entropy  []byte
	hostname string
	disks    []proto.Disk
	// attach, if set, is what attaching a disk does to the host.
	attach func(proto.Disk) error
}

func (f *fakeSystem) system() guest.System {
	return guest.System{
		SetTime: func(t time.Time) error {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.time = t
			return nil
		},
		AddEntropy: func(b []byte) error {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.entropy = append([]byte(nil), b...)
			return nil
		},
		SetHostname: func(s string) error {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.hostname = s
			return nil
		},
		AttachDisk: func(d proto.Disk) error {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.disks = append(f.disks, d)
			if f.attach != nil {
				return f.attach(d)
			}
			return nil
		},
	}
}

// startGuest runs an agent on a new fakeChardev. System effects are faked.
func startGuest(t *testing.T, cfg guest.Config) *fakeChardev {
	t.Helper()
	inR, inW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cd := &fakeChardev{t: t, toGuest: inW, sys: &fakeSystem{}}
	cfg.System = cd.sys.system()
	if cfg.PartialTimeout == 0 {
		cfg.PartialTimeout = 500 * time.Millisecond
	}
	cd.agent = guest.New(cfg)
	served := make(chan struct{})
	go func() {
		defer close(served)
		cd.agent.Serve(context.Background(), guestStream{inR, outW})
	}()
	go cd.relayOut(outR)
	t.Cleanup(func() {
		cd.disconnect()
		inW.Close()
		<-served
		cd.agent.Close()
		inR.Close()
		outW.Close()
		outR.Close()
	})
	return cd
}

// relayOut copies the guest's output to the connected host, if any, in
// chunks of at most a page like the virtio console, with non-blocking
// writes whose excess is dropped.
func (cd *fakeChardev) relayOut(r *os.File) {
	buf := make([]byte, 4096)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			cd.mu.Lock()
			h := cd.host
			cd.mu.Unlock()
			if h != nil && !cd.dropNext.CompareAndSwap(true, false) {
				cd.dropped.Add(int64(n - writeNonBlocking(h, buf[:n])))
			}
		}
		if err != nil {
			return
		}
	}
}

// writeNonBlocking writes what f takes without waiting and returns how
// much that was.
func writeNonBlocking(f *os.File, p []byte) int {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0
	}
	written := 0
	rc.Write(func(fd uintptr) bool {
		n, err := syscall.Write(int(fd), p)
		if err == nil && n > 0 {
			written = n
		}
		return true
	})
	return written
}

// connect attaches a new host and returns its connection.
func (cd *fakeChardev) connect() net.Conn {
	cd.t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC|syscall.SOCK_NONBLOCK, 0)
	if err != nil {
		cd.t.Fatal(err)
	}
	hostFile := os.NewFile(uintptr(fds[0]), "host")
	relay := os.NewFile(uintptr(fds[1]), "relay")
	conn, err := net.FileConn(hostFile)
	hostFile.Close()
	if err != nil {
		cd.t.Fatal(err)
	}
	cd.disconnect()
	cd.mu.Lock()
	cd.host = relay
	cd.mu.Unlock()
	flip := cd.flipToGuest.Swap(0) - 1 // -1: none
	go func() {
		buf := make([]byte, 32<<10)
		var off int64
		for {
			n, err := relay.Read(buf)
			if n > 0 {
				if flip >= off && flip < off+int64(n) {
					buf[flip-off] ^= 0xff
				}
				off += int64(n)
				if _, err := cd.toGuest.Write(buf[:n]); err != nil {
					break
				}
			}
			if err != nil {
				break
			}
		}
		cd.mu.Lock()
		if cd.host == relay {
			cd.host = nil
		}
		cd.mu.Unlock()
		relay.Close()
	}()
	return conn
}

// disconnect drops the connected host, as QEMU does when its peer closes.
func (cd *fakeChardev) disconnect() {
	cd.mu.Lock()
	h := cd.host
	cd.host = nil
	cd.mu.Unlock()
	if h != nil {
		h.Close()
	}
}

// dial connects a new host and performs the handshake.
func (cd *fakeChardev) dial() *agent.Client {
	cd.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	c, err := agent.Dial(ctx, cd.connect(), agent.Options{})
	if err != nil {
		cd.t.Fatalf("Dial: %v", err)
	}
	cd.t.Cleanup(func() { c.Close() })
	return c
}

// testCtx bounds one test's calls.
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// python returns an interpreter for eval tests, or skips.
func python(t *testing.T) string {
	t.Helper()
	for _, p := range []string{"/usr/bin/python3", "/usr/local/bin/python3"} {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if p, err := exec.LookPath("python3"); err == nil {
		return p
	}
	testutil.Unavailable(t, "eval tests need python3 on the host (scripts/deps.txt)")
	return ""
}

// gone reports whether pid no longer exists or is a zombie.
func gone(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return true
	}
	// The state follows the command in parentheses.
	for i := len(b) - 1; i >= 0; i-- {
		if b[i] == ')' {
			return i+2 < len(b) && (b[i+2] == 'Z' || b[i+2] == 'X')
		}
	}
	return false
}

// waitGone polls until pid is gone or the deadline passes.
func waitGone(t *testing.T, pid int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !gone(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("process %d still alive after %v", pid, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// fakeGuest runs a scripted guest on the far end of a new connection: it
// acknowledges hellos and hands each request to serve, in its own
// goroutine. It models a broken or hostile agent; the frames it writes are
// numbered like the agent's, and it ignores every window.
func fakeGuest(t *testing.T, serve func(w *proto.Writer, id uint32, req proto.Request)) net.Conn {
	t.Helper()
	hostConn, guestConn := socketPair(t)
	go func() {
		r := proto.NewReader(guestConn)
		w := proto.NewWriter(guestConn)
		for {
			f, err := r.Next()
			if err != nil {
				return
			}
			switch f.Type {
			case proto.TypeHello:
				var h proto.Hello
				json.Unmarshal(f.Payload, &h)
				w.WriteJSON(proto.TypeHelloAck, 0, proto.HelloAck{
					Version: proto.ProtocolVersion, MinVersion: proto.MinProtocolVersion, Nonce: h.Nonce,
				})
			case proto.TypeRequest:
				var req proto.Request
				json.Unmarshal(f.Payload, &req)
				go serve(w, f.ID, req)
			}
		}
	}()
	return hostConn
}

// blockingWriter takes nothing until release is closed, then everything.
type blockingWriter struct {
	release <-chan struct{}
	n       atomic.Int64
}

func (b *blockingWriter) Write(p []byte) (int, error) {
	<-b.release
	b.n.Add(int64(len(p)))
	return len(p), nil
}

// answerHello reads the next hello from r and answers it on w with ack,
// the hello's nonce filled in.
func answerHello(r *proto.Reader, w *proto.Writer, ack proto.HelloAck) error {
	for {
		f, err := r.Next()
		if err != nil {
			return err
		}
		if f.Type != proto.TypeHello {
			continue
		}
		var h proto.Hello
		json.Unmarshal(f.Payload, &h)
		ack.Nonce = h.Nonce
		return w.WriteJSON(proto.TypeHelloAck, 0, ack)
	}
}
