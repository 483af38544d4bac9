package agent_test

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/guest"
	"github.com/forkd/forkd/internal/testutil"
)

func evalGuest(t *testing.T) *agent.Client {
	t.Helper()
	return startGuest(t, guest.Config{
		Python:    python(t),
		Preload:   []string{"json", "no_such_module_forkd"},
		PythonDir: t.TempDir(),
		EvalGrace: time.Second,
	}).dial()
}

func mustEval(t *testing.T, c *agent.Client, code string) *proto.EvalResult {
	t.Helper()
	res, err := c.Eval(testCtx(t), proto.EvalRequest{Code: code, Timeout: 30 * time.Second})
	if err != nil {
		t.Fatalf("eval %q: %v", code, err)
	}
	return res
}

func TestEvalPersistentState(t *testing.T) {
	c := evalGuest(t)
	if res := mustEval(t, c, "x = 41"); res.Value != "" || res.Error != nil {
		t.Fatalf("x = 41: %+v", res)
	}
	if res := mustEval(t, c, "x + 1"); res.Value != "42" || res.Error != nil {
		t.Fatalf("x + 1: %+v", res)
	}
	res := mustEval(t, c, "import sys\nprint('hi')\nprint('warn', file=sys.stderr)\ny = [x, 'a']\ny")
	if res.Value != "[41, 'a']" || res.Stdout != "hi\n" || res.Stderr != "warn\n" || res.Error != nil {
		t.Fatalf("statements + expression: %+v", res)
	}
	if res := mustEval(t, c, "None"); res.Value != "" {
		t.Fatalf("None: %+v", res)
	}
	if res := mustEval(t, c, "'json' in sys.modules, __name__"); res.Value != "(True, '__main__')" {
		t.Fatalf("preload: %+v", res)
	}
	// A preloaded module is bound as if the cell had imported it.
	if res := mustEval(t, c, "json.dumps([1])"); res.Value != "'[1]'" {
		t.Fatalf("preloaded name: %+v", res)
	}
	// Output of child processes, written to the interpreter's fd 1, is
	// captured too.
	if res := mustEval(t, c, "import os\nos.system('echo from-child')"); !strings.Contains(res.Stdout, "from-child") {
		t.Fatalf("child output: %+v", res)
	}
	// exit() does not end the interpreter.
	if res := mustEval(t, c, "exit(3)"); res.Error == nil || res.Error.Name != "SystemExit" {
		t.Fatalf("exit(3): %+v", res)
	}
	if res := mustEval(t, c, "x"); res.Value != "41" {
		t.Fatalf("after exit(): %+v", res)
	}
}

func TestEvalErrors(t *testing.T) {
	c := evalGuest(t)
	res := mustEval(t, c, "def f():\n    return 1 / 0\n\nf()")
	if res.Error == nil || res.Error.Name != "ZeroDivisionError" || res.Error.Message != "division by zero" {
		t.Fatalf("exception: %+v", res)
	}
	tb := res.Error.Traceback
	if !strings.Contains(tb, "Traceback (most recent call last)") || !strings.Contains(tb, "<cell-") ||
		!strings.Contains(tb, "return 1 / 0") || !strings.Contains(tb, "in f") || strings.Contains(tb, "_run") {
		t.Fatalf("traceback:\n%s", tb)
	}
	res = mustEval(t, c, "def (:")
	if res.Error == nil || res.Error.Name != "SyntaxError" {
		t.Fatalf("syntax error: %+v", res)
	}
	res = mustEval(t, c, "print('partial')\nraise ValueError('bad')")
	if res.Error == nil || res.Error.Name != "ValueError" || res.Stdout != "partial\n" {
		t.Fatalf("output before an exception: %+v", res)
	}
}

// A runaway cell is interrupted without losing the interpreter's state.
func TestEvalTimeoutKeepsState(t *testing.T) {
	c := evalGuest(t)
	mustEval(t, c, "x = 41")
	start := time.Now()
	res, err := c.Eval(testCtx(t), proto.EvalRequest{Code: "while True: pass", Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if !res.TimedOut || res.Restarted || res.Error == nil || res.Error.Name != "TimeoutError" {
		t.Fatalf("timeout: %+v", res)
	}
	if !strings.Contains(res.Error.Traceback, "KeyboardInterrupt") {
		t.Fatalf("traceback of the interrupt:\n%s", res.Error.Traceback)
	}
	if d := time.Since(start); d < 2*time.Second || d > 20*time.Second {
		t.Fatalf("timed out after %v", d)
	}
	if res := mustEval(t, c, "x + 1"); res.Value != "42" {
		t.Fatalf("after a timeout: %+v", res)
	}
}

// A cell that does not yield to SIGINT is killed; the interpreter comes back
// without its state and says so.
func TestEvalTimeoutRestartsStuckInterpreter(t *testing.T) {
	c := evalGuest(t)
	mustEval(t, c, "x = 41")
	res, err := c.Eval(testCtx(t), proto.EvalRequest{
		Code:    "import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])\nwhile True: pass",
		Timeout: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	if !res.TimedOut || !res.Restarted || res.Error == nil || !strings.Contains(res.Error.Message, "state lost") {
		t.Fatalf("stuck cell: %+v", res)
	}
	if res := mustEval(t, c, "'x' in globals(), 1 + 1"); res.Value != "(False, 2)" {
		t.Fatalf("after a restart: %+v", res)
	}
}

// Concurrent evals run one at a time on the one interpreter.
func TestEvalSerialised(t *testing.T) {
	c := evalGuest(t)
	mustEval(t, c, "import time\nactive = 0\npeak = 0")
	code := "active += 1\npeak = max(peak, active)\ntime.sleep(0.1)\nactive -= 1"
	errs := make(chan error, 4)
	for range 4 {
		go func() {
			_, err := c.Eval(testCtx(t), proto.EvalRequest{Code: code})
			errs <- err
		}()
	}
	for range 4 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if res := mustEval(t, c, "peak"); res.Value != "1" {
		t.Fatalf("peak concurrency %s", res.Value)
	}
}

func TestEvalStreamsOutput(t *testing.T) {
	c := evalGuest(t)
	var out safeBuffer
	var errb bytes.Buffer
	res, err := c.EvalStream(testCtx(t), proto.EvalRequest{
		Code: "import time\nfor i in range(5):\n    print(i, flush=True)\n    time.sleep(0.3)\n'end'",
	}, &out, &errb)
	ended := time.Now()
	if err != nil || res.Value != "'end'" || res.Stdout != "0\n1\n2\n3\n4\n" {
		t.Fatalf("%+v %v", res, err)
	}
	if out.String() != res.Stdout {
		t.Fatalf("streamed %q", out.String())
	}
	if gap := ended.Sub(out.first); gap < 800*time.Millisecond {
		t.Fatalf("first line streamed only %v before the end", gap)
	}
}

// init reseeds the interpreter's random module from the host's entropy.
func TestEvalReseededByInit(t *testing.T) {
	c := evalGuest(t)
	ctx := testCtx(t)
	mustEval(t, c, "import random")
	draw := func(entropy byte) string {
		if err := c.Init(ctx, proto.InitRequest{Entropy: bytes.Repeat([]byte{entropy}, 32)}); err != nil {
			t.Fatal(err)
		}
		return mustEval(t, c, "random.random()").Value
	}
	a1, a2, b := draw(1), draw(1), draw(2)
	if a1 != a2 || a1 == b {
		t.Fatalf("draws after init: %s %s %s", a1, a2, b)
	}
}

func TestEvalMissingInterpreter(t *testing.T) {
	c := startGuest(t, guest.Config{Python: "/no/such/python3"}).dial()
	_, err := c.Eval(testCtx(t), proto.EvalRequest{Code: "1"})
	if !errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), "/no/such/python3") {
		t.Fatalf("eval with a missing interpreter = %v", err)
	}
}

func TestWaitReady(t *testing.T) {
	ctx := testCtx(t)
	c := evalGuest(t)
	if err := c.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if p, err := c.Ping(ctx); err != nil || !p.PythonReady || p.Python != "ready" || !contains(p.Features, proto.FeatureEval) {
		t.Fatalf("ping after WaitReady: %+v, %v", p, err)
	}
	if err := startGuest(t, guest.Config{}).dial().WaitReady(ctx); err != nil {
		t.Fatalf("WaitReady without python: %v", err)
	}
	err := startGuest(t, guest.Config{Python: "/no/such/python3"}).dial().WaitReady(ctx)
	if !errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), "failed") {
		t.Fatalf("WaitReady with a missing interpreter: %v", err)
	}
}

// An eval whose result would not fit one message (1 MiB each of stdout,
// stderr and value, escaped 6x in JSON) fails with a clear
// resource-exhausted error instead of leaving the call waiting, and the
// interpreter keeps serving.
func TestEvalResultTooLargeForOneMessage(t *testing.T) {
	c := evalGuest(t)
	code := "import sys\ns = '<' * (1 << 20)\nsys.stdout.write(s)\nsys.stderr.write(s)\ns"
	_, err := c.Eval(testCtx(t), proto.EvalRequest{Code: code, Timeout: 30 * time.Second})
	if !errdefs.IsResourceExhausted(err) || !strings.Contains(err.Error(), "message limit") {
		t.Fatalf("eval with a huge result = %v", err)
	}
	if res := mustEval(t, c, "len(s)"); res.Value != "1048576" {
		t.Fatalf("after the huge result: %+v", res)
	}
}

// A host that returns no credit for an eval's streamed output does not
// hold up the eval's timeout: the runaway cell is interrupted and its
// result arrives, with no more streamed data than the window allowed.
func TestEvalTimeoutWhileStreamBlocked(t *testing.T) {
	cd := startGuest(t, guest.Config{Python: python(t), PythonDir: t.TempDir(), EvalGrace: time.Second})
	h := newRawHost(t, cd.connect())
	h.send(proto.TypeHello, 0, proto.Hello{Version: 1, MinVersion: 1, Nonce: "n"})
	h.next(proto.TypeHelloAck)
	args, _ := json.Marshal(struct {
		proto.EvalRequest
		Stream bool `json:"stream"`
	}{proto.EvalRequest{Code: "while True: print('x' * 1000)", Timeout: time.Second}, true})
	h.send(proto.TypeRequest, 1, proto.Request{Op: proto.OpEval, Args: args})
	streamed := 0
	var asm proto.Assembler
	for {
		// Return connection credit, never the call's data credit.
		f := h.next(proto.TypeData, proto.TypeResult)
		h.w.WriteFrame(proto.Frame{Type: proto.TypeWindow, Payload: proto.WindowPayload(uint32(proto.FrameCost(len(f.Payload))))})
		if f.Type == proto.TypeData {
			streamed += len(f.Payload)
			continue
		}
		msg, ok, err := asm.Add(f)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			continue
		}
		var res proto.Result
		var ev proto.EvalResult
		if err := json.Unmarshal(msg, &res); err != nil || res.Error != nil || json.Unmarshal(res.Result, &ev) != nil {
			t.Fatalf("result %.200s", msg)
		}
		if !ev.TimedOut || !ev.Truncated {
			t.Fatalf("eval = timed out %v, truncated %v, error %+v", ev.TimedOut, ev.Truncated, ev.Error)
		}
		break
	}
	if streamed > proto.InitialWindow {
		t.Fatalf("%d bytes streamed past a %d-byte window", streamed, proto.InitialWindow)
	}
}

// TestInitDisk attaches a disk by init: once (a second init naming it, a
// child of a branch, has nothing to do), never another one; the warm
// interpreter follows the root, working in the directory of the same path
// afterwards.
func TestInitDisk(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "home")
	testutil.Mkdir(t, dir, 0o755)
	cd := startGuest(t, guest.Config{Python: python(t), PythonDir: dir})
	cd.sys.mu.Lock()
	cd.sys.attach = func(proto.Disk) error {
		// In the new root the path names another directory.
		if err := os.Rename(dir, dir+".old"); err != nil {
			return err
		}
		return os.Mkdir(dir, 0o755)
	}
	cd.sys.mu.Unlock()
	c := cd.dial()
	if !slices.Contains(c.Features(), proto.FeatureDisk) {
		t.Fatalf("features %v lack %s", c.Features(), proto.FeatureDisk)
	}
	ctx := testCtx(t)
	d := proto.Disk{Serial: "forkd-scratch", MiB: 64}
	testutil.Check(t, c.Init(ctx, proto.InitRequest{Hostname: "a", Disk: &d}))
	if res := mustEval(t, c, "open('f', 'w').write('x')"); res.Error != nil {
		t.Fatalf("write in the interpreter: %+v", res.Error)
	}
	if _, err := os.Stat(filepath.Join(dir, "f")); err != nil {
		t.Fatalf("the interpreter did not follow the root: %v", err)
	}
	testutil.Check(t, c.Init(ctx, proto.InitRequest{Hostname: "b", Disk: &d}))
	if err := c.Init(ctx, proto.InitRequest{Disk: &proto.Disk{Serial: "forkd-scratch", MiB: 128}}); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("init with another disk = %v, want FailedPrecondition", err)
	}
	if err := c.Init(ctx, proto.InitRequest{Disk: &proto.Disk{}}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("init with an empty disk = %v, want InvalidArgument", err)
	}
	cd.sys.mu.Lock()
	n := len(cd.sys.disks)
	cd.sys.mu.Unlock()
	if n != 1 {
		t.Fatalf("the disk was attached %d times", n)
	}
}
