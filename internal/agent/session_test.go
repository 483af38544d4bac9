package agent_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/guest"
	"github.com/forkd/forkd/internal/testutil"
)

func TestHandshakeAndPing(t *testing.T) {
	cd := startGuest(t, guest.Config{Version: "1.2.3", SandboxID: "sb-0"})
	c := cd.dial()
	if c.AgentVersion() != "1.2.3" || c.ProtocolVersion() != proto.ProtocolVersion {
		t.Fatalf("agent version %q protocol %d", c.AgentVersion(), c.ProtocolVersion())
	}
	p, err := c.Ping(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if p.AgentVersion != "1.2.3" || p.SandboxID != "sb-0" || p.Hostname == "" || p.UptimeMS < 0 {
		t.Fatalf("ping = %+v", p)
	}
	for _, f := range []string{proto.FeatureExec, proto.FeatureFiles, proto.FeatureProcesses} {
		if !contains(p.Features, f) {
			t.Errorf("feature %q missing from %v", f, p.Features)
		}
	}
	if contains(p.Features, proto.FeatureEval) {
		t.Errorf("eval announced without python: %v", p.Features)
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// The host discards whatever the channel holds before its hello_ack:
// console noise and frames of an older session.
func TestDialSkipsNoise(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	conn := cd.connect()
	// Noise from the guest side reaches the host before the ack.
	cd.mu.Lock()
	cd.host.Write([]byte("[    0.000000] Linux version 6.1\r\n\xfdfk"))
	stale, _ := proto.AppendFrame(nil, proto.Frame{Type: proto.TypeResult, ID: 1, Payload: []byte(`{}`)})
	cd.host.Write(stale)
	cd.mu.Unlock()
	c, err := agent.Dial(testCtx(t), conn, agent.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Ping(testCtx(t)); err != nil {
		t.Fatal(err)
	}
}

// An agent refuses a host whose protocol it does not speak, naming both.
func TestAgentRefusesNewerHost(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	conn := cd.connect()
	defer conn.Close()
	hello, _ := json.Marshal(proto.Hello{Version: 99, MinVersion: 99, Nonce: "n1"})
	if err := proto.NewWriter(conn).WriteMessage(proto.TypeHello, 0, hello); err != nil {
		t.Fatal(err)
	}
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	r := proto.NewReader(conn)
	for {
		f, err := r.Next()
		if err != nil {
			t.Fatal(err)
		}
		if f.Type != proto.TypeHelloAck {
			continue
		}
		var ack proto.HelloAck
		if err := json.Unmarshal(f.Payload, &ack); err != nil {
			t.Fatal(err)
		}
		if ack.Error == nil || ack.Nonce != "n1" {
			t.Fatalf("ack = %+v, want a refusal", ack)
		}
		err = ack.Error.Err()
		if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "host speaks v99") ||
			!strings.Contains(err.Error(), fmt.Sprintf("agent speaks v%d", proto.ProtocolVersion)) {
			t.Fatalf("refusal = %v", err)
		}
		return
	}
}

// A host refuses an agent whose protocol it does not speak, naming both.
func TestHostRefusesNewerAgent(t *testing.T) {
	hostConn, agentConn := socketPair(t)
	go answerHello(proto.NewReader(agentConn), proto.NewWriter(agentConn),
		proto.HelloAck{Version: 7, MinVersion: 5, AgentVersion: "future"})
	_, err := agent.Dial(testCtx(t), hostConn, agent.Options{})
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), fmt.Sprintf("host speaks v%d", proto.ProtocolVersion)) ||
		!strings.Contains(err.Error(), "agent speaks v7 (accepts v5") {
		t.Fatalf("Dial = %v", err)
	}
}

func socketPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC|syscall.SOCK_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	var conns [2]net.Conn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "sock")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c
		t.Cleanup(func() { c.Close() })
	}
	return conns[0], conns[1]
}

// Dial keeps saying hello until ctx ends when nobody answers.
func TestDialTimesOut(t *testing.T) {
	hostConn, _ := socketPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := agent.Dial(ctx, hostConn, agent.Options{})
	if !errors.Is(err, errdefs.ErrDeadlineExceeded) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Dial = %v", err)
	}
}

// A host that died in the middle of a frame does not wedge the next host:
// the agent gives the torn frame up and finds the new hello.
func TestResyncAfterTornFrame(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	c1 := cd.dial()
	if _, err := c1.Ping(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	// The first host writes half of a large request, then dies.
	args, _ := json.Marshal(proto.EvalRequest{Code: strings.Repeat("x", 40000)})
	req, _ := json.Marshal(proto.Request{Op: proto.OpEval, Args: args})
	torn, _ := proto.AppendFrame(nil, proto.Frame{Type: proto.TypeRequest, ID: 99, Payload: req})
	if _, err := cd.toGuest.Write(torn[:len(torn)/2]); err != nil {
		t.Fatal(err)
	}
	c1.Close()
	cd.disconnect()

	start := time.Now()
	c2 := cd.dial()
	p, err := c2.Ping(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("new host served after %v (partial timeout 500ms)", time.Since(start))
	if p.ProtocolVersion != proto.ProtocolVersion {
		t.Fatalf("ping = %+v", p)
	}
}

// A new host (as after a snapshot restore) starts a new session: the old
// session's foreground processes are killed, background ones survive.
func TestNewSessionCancelsForeground(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	c1 := cd.dial()
	ctx := testCtx(t)
	bg, err := c1.Exec(ctx, agent.ExecRequest{Args: []string{"sleep", "60"}, Background: true, Tag: "keeper"})
	if err != nil {
		t.Fatal(err)
	}
	fgErr := make(chan error, 1)
	go func() {
		_, err := c1.Exec(ctx, agent.ExecRequest{Args: []string{"sleep", "60"}, Tag: "fg"})
		fgErr <- err
	}()
	fgPID := 0
	for deadline := time.Now().Add(10 * time.Second); fgPID == 0; {
		ps, err := c1.Processes(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range ps {
			if p.PID != bg.PID && p.Running {
				fgPID = p.PID
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("foreground process never listed")
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The first host vanishes without a word; the guest cannot tell.
	cd.disconnect()
	select {
	case err := <-fgErr:
		if !errdefs.IsUnavailable(err) {
			t.Fatalf("pending Exec on a lost connection = %v, want unavailable", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("pending Exec did not fail when its connection was lost")
	}
	if gone(fgPID) {
		t.Fatal("foreground process died before a new session started")
	}
	c2 := cd.dial()
	waitGone(t, fgPID, 10*time.Second)
	ps, err := c2.Processes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, p := range ps {
		if p.PID == bg.PID && p.Running && p.Tag == "keeper" {
			found = true
		}
	}
	if !found {
		t.Fatalf("background process %d missing after the new session: %+v", bg.PID, ps)
	}
	if err := c2.KillProcess(ctx, bg.PID); err != nil {
		t.Fatal(err)
	}
}

// Closing a client fails its pending calls at once, and later calls too.
func TestClosedClientFailsAtOnce(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	c := cd.dial()
	ctx := testCtx(t)
	errc := make(chan error, 1)
	go func() {
		_, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"sleep", "30"}})
		errc <- err
	}()
	pid := 0
	for deadline := time.Now().Add(10 * time.Second); pid == 0; time.Sleep(10 * time.Millisecond) {
		if ps, _ := c.Processes(ctx); len(ps) == 1 {
			pid = ps[0].PID
		}
		if time.Now().After(deadline) {
			t.Fatal("the process never showed up")
		}
	}
	start := time.Now()
	c.Close()
	select {
	case err := <-errc:
		if !errdefs.IsUnavailable(err) {
			t.Fatalf("Exec after Close = %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Exec still pending after Close")
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("pending call failed only after %v", d)
	}
	if _, err := c.Ping(ctx); !errdefs.IsUnavailable(err) {
		t.Fatalf("Ping after Close = %v", err)
	}
	// Close cancelled the call in the guest: its process is gone although
	// no new session started.
	waitGone(t, pid, 10*time.Second)
	select {
	case <-c.Done():
	default:
		t.Fatal("Done not closed")
	}
}

func TestInit(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	c := cd.dial()
	ctx := testCtx(t)
	now := time.Date(2030, 1, 2, 3, 4, 5, 6, time.UTC)
	entropy := bytes.Repeat([]byte{0xAB}, 64)
	if err := c.Init(ctx, proto.InitRequest{Time: now, Entropy: entropy, SandboxID: "sb-42", Hostname: "child-42"}); err != nil {
		t.Fatal(err)
	}
	cd.sys.mu.Lock()
	gotTime, gotEntropy, gotHost := cd.sys.time, cd.sys.entropy, cd.sys.hostname
	cd.sys.mu.Unlock()
	if !gotTime.Equal(now) || !bytes.Equal(gotEntropy, entropy) || gotHost != "child-42" {
		t.Fatalf("system got time %v entropy %x host %q", gotTime, gotEntropy, gotHost)
	}
	p, err := c.Ping(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if p.SandboxID != "sb-42" || p.Hostname != "child-42" {
		t.Fatalf("ping after init = %+v", p)
	}
	err = c.Init(ctx, proto.InitRequest{Hostname: strings.Repeat("h", 65)})
	if !errdefs.IsInvalidArgument(err) {
		t.Fatalf("init with a long hostname = %v", err)
	}
}

func TestEvalWithoutPython(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	c := cd.dial()
	_, err := c.Eval(testCtx(t), proto.EvalRequest{Code: "1"})
	if !errdefs.IsNotImplemented(err) || !strings.Contains(err.Error(), "python is not available in this image") {
		t.Fatalf("Eval without python = %v", err)
	}
}

// rawHost speaks frames directly, for what the Client hides.
type rawHost struct {
	t    *testing.T
	conn net.Conn
	w    *proto.Writer
	r    *proto.Reader
}

func newRawHost(t *testing.T, conn net.Conn) *rawHost {
	conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	return &rawHost{t: t, conn: conn, w: proto.NewWriter(conn), r: proto.NewReader(conn)}
}

func (h *rawHost) send(typ proto.Type, id uint32, v any) {
	h.t.Helper()
	if err := h.w.WriteJSON(typ, id, v); err != nil {
		h.t.Fatal(err)
	}
}

// next returns the next frame of one of the given types.
func (h *rawHost) next(types ...proto.Type) proto.Frame {
	h.t.Helper()
	for {
		f, err := h.r.Next()
		if err != nil {
			h.t.Fatal(err)
		}
		for _, typ := range types {
			if f.Type == typ {
				f.Payload = append([]byte(nil), f.Payload...)
				return f
			}
		}
	}
}

// A repeated hello with the current nonce is acknowledged again and keeps
// the session: requests in flight go on.
func TestRepeatedHelloKeepsSession(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	h := newRawHost(t, cd.connect())
	h.send(proto.TypeHello, 0, proto.Hello{Version: 1, MinVersion: 1, Nonce: "same"})
	h.next(proto.TypeHelloAck)
	args, _ := json.Marshal(proto.ExecRequest{Shell: "sleep 0.5; echo ok"})
	h.send(proto.TypeRequest, 1, proto.Request{Op: proto.OpExec, Args: args})
	h.next(proto.TypeEvent) // started
	h.send(proto.TypeHello, 0, proto.Hello{Version: 1, MinVersion: 1, Nonce: "same"})
	h.next(proto.TypeHelloAck)
	var out []byte
	for {
		f := h.next(proto.TypeData, proto.TypeResult)
		if f.Type == proto.TypeData {
			out = append(out, f.Payload...)
			continue
		}
		var res proto.Result
		json.Unmarshal(f.Payload, &res)
		if res.Error != nil {
			t.Fatalf("exec across a repeated hello: %v", res.Error.Err())
		}
		var er proto.ExecResult
		json.Unmarshal(res.Result, &er)
		if er.ExitCode != 0 || string(out) != "ok\n" {
			t.Fatalf("result %+v output %q", er, out)
		}
		return
	}
}

// Frames of an old session never follow the new session's hello_ack.
func TestNoStaleFramesAfterNewHello(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	h := newRawHost(t, cd.connect())
	h.send(proto.TypeHello, 0, proto.Hello{Version: 1, MinVersion: 1, Nonce: "old"})
	h.next(proto.TypeHelloAck)
	args, _ := json.Marshal(proto.ExecRequest{Shell: "yes"}) // endless output
	h.send(proto.TypeRequest, 1, proto.Request{Op: proto.OpExec, Args: args})
	h.next(proto.TypeData)
	// Keep granting credit so that output keeps flowing.
	h.w.WriteFrame(proto.Frame{Type: proto.TypeWindow, ID: 1, Payload: proto.WindowPayload(1 << 30)})
	h.send(proto.TypeHello, 0, proto.Hello{Version: 1, MinVersion: 1, Nonce: "new"})
	for {
		f := h.next(proto.TypeHelloAck, proto.TypeData, proto.TypeResult, proto.TypeEvent)
		if f.Type == proto.TypeHelloAck {
			var ack proto.HelloAck
			json.Unmarshal(f.Payload, &ack)
			if ack.Nonce == "new" {
				break
			}
		}
	}
	// Nothing of request 1 may follow; a ping of the new session answers.
	h.send(proto.TypeRequest, 1, proto.Request{Op: proto.OpPing})
	f := h.next(proto.TypeData, proto.TypeResult, proto.TypeEvent)
	if f.Type != proto.TypeResult {
		t.Fatalf("got a %s frame of the old session after the new hello_ack", f.Type)
	}
	var res proto.Result
	json.Unmarshal(f.Payload, &res)
	var ping proto.PingResult
	if res.Error != nil || json.Unmarshal(res.Result, &ping) != nil || ping.ProtocolVersion != proto.ProtocolVersion {
		t.Fatalf("ping result %s", f.Payload)
	}
}

// slowConn is a host that reads slowly, so that the guest's output backs up
// into the chardev, which drops what the socket cannot take.
type slowConn struct{ net.Conn }

func (s slowConn) Read(p []byte) (int, error) {
	time.Sleep(2 * time.Millisecond)
	return s.Conn.Read(p[:min(len(p), 4096)])
}

// However slowly the host reads, the agent never has more in flight than
// the console can hold, so nothing is dropped.
func TestSlowHostLosesNothing(t *testing.T) {
	cd := startGuest(t, guest.Config{})
	ctx := testCtx(t)
	c, err := agent.Dial(ctx, slowConn{cd.connect()}, agent.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	data := make([]byte, 4<<20)
	rand.Read(data)
	path := filepath.Join(t.TempDir(), "f")
	testutil.WriteFile(t, path, data, 0o600)
	h := sha256.New()
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	wg.Add(3) // a file and two outputs at once, all competing for the console
	go func() {
		defer wg.Done()
		if _, err := c.ReadFile(ctx, path, h); err != nil {
			errs <- err
		}
	}()
	for range 2 {
		go func() {
			defer wg.Done()
			var out bytes.Buffer
			if _, err := c.Exec(ctx, agent.ExecRequest{Shell: "head -c 1000000 /dev/zero", Stdout: &out}); err != nil {
				errs <- err
			} else if out.Len() != 1000000 {
				errs <- fmt.Errorf("exec output %d bytes", out.Len())
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if want := sha256.Sum256(data); !bytes.Equal(h.Sum(nil), want[:]) {
		t.Error("file changed on the way")
	}
	if n := cd.dropped.Load(); n != 0 {
		t.Errorf("the console dropped %d bytes", n)
	}
}
