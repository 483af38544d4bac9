package agent_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/guest"
	"github.com/forkd/forkd/internal/testutil"
)

func TestExecOutputAndExitCode(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	var out, errb bytes.Buffer
	res, err := c.Exec(testCtx(t), agent.ExecRequest{
		Shell:  "echo out; echo err >&2; exit 3",
		Stdout: &out, Stderr: &errb,
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 3 || res.Signal != "" || res.TimedOut || res.PID <= 0 {
		t.Fatalf("result = %+v", res)
	}
	if out.String() != "out\n" || errb.String() != "err\n" {
		t.Fatalf("stdout %q stderr %q", out.String(), errb.String())
	}
}

// safeBuffer is a bytes.Buffer that records when it was first written.
type safeBuffer struct {
	mu    sync.Mutex
	b     bytes.Buffer
	first time.Time
}

func (s *safeBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.first.IsZero() {
		s.first = time.Now()
	}
	return s.b.Write(p)
}

func (s *safeBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Output is streamed as produced: the first line arrives long before the
// command ends.
func TestExecStreamsOutput(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	var out safeBuffer
	res, err := c.Exec(testCtx(t), agent.ExecRequest{
		Shell:  "for i in 1 2 3 4 5 6 7 8 9 10; do echo line$i; sleep 0.2; done",
		Stdout: &out,
	})
	ended := time.Now()
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("exec: %+v, %v", res, err)
	}
	if !strings.HasPrefix(out.String(), "line1\n") || !strings.HasSuffix(out.String(), "line10\n") {
		t.Fatalf("output %q", out.String())
	}
	// The command sleeps 1.8 s after its first line; streaming delivers that
	// line well before the end however slow the machine is.
	if gap := ended.Sub(out.first); gap < time.Second {
		t.Fatalf("first line arrived only %v before the command ended: output is not streamed", gap)
	}
}

func TestExecStdin(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	var out bytes.Buffer
	res, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"cat"}, Stdin: strings.NewReader("hello\n"), Stdout: &out})
	if err != nil || res.ExitCode != 0 || out.String() != "hello\n" {
		t.Fatalf("cat: %+v, %v, %q", res, err, out.String())
	}
	// Far more than the flow-control window, through a pipe both ways.
	data := make([]byte, 3<<20)
	rand.Read(data)
	sum := sha256.Sum256(data)
	out.Reset()
	res, err = c.Exec(ctx, agent.ExecRequest{Args: []string{"sha256sum"}, Stdin: bytes.NewReader(data), Stdout: &out})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("sha256sum: %+v, %v", res, err)
	}
	if got := strings.Fields(out.String()); len(got) == 0 || got[0] != hex.EncodeToString(sum[:]) {
		t.Fatalf("sha256sum printed %q", out.String())
	}
	out.Reset()
	res, err = c.Exec(ctx, agent.ExecRequest{Args: []string{"cat"}, Stdin: bytes.NewReader(data), Stdout: &out})
	if err != nil || res.ExitCode != 0 || !bytes.Equal(out.Bytes(), data) {
		t.Fatalf("cat of 3 MiB: %+v, %v, %d bytes back", res, err, out.Len())
	}
	// A process that ignores its stdin still ends.
	res, err = c.Exec(ctx, agent.ExecRequest{Args: []string{"true"}, Stdin: bytes.NewReader(data)})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("true with stdin: %+v, %v", res, err)
	}
}

// The timeout kills the whole process group, grandchildren included.
func TestExecTimeoutKillsGroup(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	var out safeBuffer
	start := time.Now()
	res, err := c.Exec(testCtx(t), agent.ExecRequest{
		Shell:   "sleep 60 & echo $!; wait",
		Stdout:  &out,
		Timeout: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	if !res.TimedOut || res.Signal != "SIGKILL" || res.ExitCode != -1 {
		t.Fatalf("result = %+v", res)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("timeout took %v", d)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(out.String()))
	if err != nil {
		t.Fatalf("grandchild pid %q", out.String())
	}
	waitGone(t, pid, 10*time.Second)
}

func TestExecSignals(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	res, err := c.Exec(testCtx(t), agent.ExecRequest{Shell: "kill -TERM $$"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Signal != "SIGTERM" || res.ExitCode != -1 || res.TimedOut {
		t.Fatalf("result = %+v", res)
	}
}

// Ending the caller's context kills the process and returns a deadline
// error.
func TestExecContextKillsProcess(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	var out safeBuffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err := c.Exec(ctx, agent.ExecRequest{Shell: "echo $$; exec sleep 60", Stdout: &out})
	if !errors.Is(err, errdefs.ErrDeadlineExceeded) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Exec = %v", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(out.String()))
	if err != nil {
		t.Fatalf("pid %q", out.String())
	}
	waitGone(t, pid, 10*time.Second)
}

func TestExecManyConcurrent(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	const n = 32
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var out bytes.Buffer
			res, err := c.Exec(ctx, agent.ExecRequest{
				Args:   []string{"sh", "-c", "sleep 0.2; echo $N", "x"},
				Env:    map[string]string{"N": strconv.Itoa(i)},
				Stdout: &out,
			})
			if err != nil {
				errs <- err
				return
			}
			if res.ExitCode != 0 || out.String() != strconv.Itoa(i)+"\n" {
				errs <- fmt.Errorf("exec %d: %+v %q", i, res, out.String())
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestExecEnvDirAndErrors(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	dir := t.TempDir()
	var out bytes.Buffer
	res, err := c.Exec(ctx, agent.ExecRequest{
		Shell: `echo "$FOO|$PWD|$PATH"; pwd`, Dir: dir, Env: map[string]string{"FOO": "bar"}, Stdout: &out,
	})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("%+v %v", res, err)
	}
	want := "bar|" + dir + "|" + strings.TrimPrefix(guest.DefaultEnv[0], "PATH=") + "\n" + dir + "\n"
	if out.String() != want {
		t.Fatalf("output %q, want %q", out.String(), want)
	}
	for _, tc := range []struct {
		name  string
		req   agent.ExecRequest
		class error
	}{
		{"missing binary", agent.ExecRequest{Args: []string{"no-such-binary-forkd"}}, errdefs.ErrNotFound},
		{"missing path", agent.ExecRequest{Args: []string{"/no/such/binary"}}, errdefs.ErrNotFound},
		{"missing dir", agent.ExecRequest{Args: []string{"true"}, Dir: dir + "/nope"}, errdefs.ErrNotFound},
		{"relative dir", agent.ExecRequest{Args: []string{"true"}, Dir: "tmp"}, errdefs.ErrInvalidArgument},
		{"args and shell", agent.ExecRequest{Args: []string{"true"}, Shell: "true"}, errdefs.ErrInvalidArgument},
		{"nothing", agent.ExecRequest{}, errdefs.ErrInvalidArgument},
		{"unknown user", agent.ExecRequest{Args: []string{"true"}, User: "no-such-user-forkd"}, errdefs.ErrNotFound},
		{"not executable", agent.ExecRequest{Args: []string{dir}}, errdefs.ErrFailedPrecondition},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := c.Exec(ctx, tc.req); !errors.Is(err, tc.class) {
				t.Errorf("%v, want class %v", err, tc.class)
			}
		})
	}
}

func TestExecAsUser(t *testing.T) {
	testutil.RequireRoot(t)
	c := startGuest(t, guest.Config{}).dial()
	var out bytes.Buffer
	res, err := c.Exec(testCtx(t), agent.ExecRequest{Shell: "id -u; id -g; echo $HOME $USER", User: "nobody", Stdout: &out})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("%+v %v", res, err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 3 || lines[0] != "65534" || !strings.HasSuffix(lines[2], " nobody") {
		t.Fatalf("as nobody: %q", out.String())
	}
	out.Reset()
	res, err = c.Exec(testCtx(t), agent.ExecRequest{Args: []string{"id", "-u"}, User: "65534", Stdout: &out})
	if err != nil || res.ExitCode != 0 || out.String() != "65534\n" {
		t.Fatalf("as uid 65534: %+v %v %q", res, err, out.String())
	}
}

func TestExecAsOtherUserUnprivileged(t *testing.T) {
	if testutil.AsNobody(t) {
		return
	}
	c := startGuest(t, guest.Config{}).dial()
	_, err := c.Exec(testCtx(t), agent.ExecRequest{Args: []string{"true"}, User: "0"})
	if !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("exec as root from non-root = %v", err)
	}
}

func TestBackgroundProcesses(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	res, err := c.Exec(ctx, agent.ExecRequest{Shell: "echo hello; echo oops >&2; sleep 0.3; echo done", Background: true, Tag: "t1"})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Running || res.PID <= 0 || res.Tag != "t1" {
		t.Fatalf("start = %+v", res)
	}
	ps, err := c.Processes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ps) != 1 || ps[0].PID != res.PID || ps[0].Tag != "t1" || ps[0].Args[0] != "/bin/sh" {
		t.Fatalf("processes = %+v", ps)
	}
	end, err := c.WaitProcess(ctx, res.PID)
	if err != nil || end.ExitCode != 0 || end.PID != res.PID || end.Tag != "t1" {
		t.Fatalf("wait = %+v, %v", end, err)
	}
	// Connecting after the end replays the kept output.
	var out, errb safeBuffer
	end, err = c.ConnectProcess(ctx, res.PID, &out, &errb)
	if err != nil || end.ExitCode != 0 {
		t.Fatalf("connect = %+v, %v", end, err)
	}
	if out.String() != "hello\ndone\n" || errb.String() != "oops\n" {
		t.Fatalf("replayed stdout %q stderr %q", out.String(), errb.String())
	}
	ps, _ = c.Processes(ctx)
	if len(ps) != 1 || ps[0].Running || ps[0].Result == nil || ps[0].Result.ExitCode != 0 {
		t.Fatalf("processes after the end = %+v", ps)
	}
}

func TestBackgroundSignalKillStdin(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	sleeper, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"sleep", "60"}, Background: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.SignalProcess(ctx, sleeper.PID, "TERM"); err != nil {
		t.Fatal(err)
	}
	end, err := c.WaitProcess(ctx, sleeper.PID)
	if err != nil || end.Signal != "SIGTERM" {
		t.Fatalf("after TERM: %+v, %v", end, err)
	}
	if err := c.SignalProcess(ctx, sleeper.PID, "TERM"); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("signal to an ended process = %v", err)
	}
	if err := c.SignalProcess(ctx, sleeper.PID, "SIGNOPE"); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("unknown signal = %v", err)
	}
	if err := c.KillProcess(ctx, 1<<30); !errdefs.IsNotFound(err) {
		t.Fatalf("kill of an unknown pid = %v", err)
	}

	sleeper, _ = c.Exec(ctx, agent.ExecRequest{Args: []string{"sleep", "60"}, Background: true})
	if err := c.KillProcess(ctx, sleeper.PID); err != nil {
		t.Fatal(err)
	}
	if end, _ := c.WaitProcess(ctx, sleeper.PID); end == nil || end.Signal != "SIGKILL" {
		t.Fatalf("after kill: %+v", end)
	}

	// A background cat fed through processes.stdin, followed live.
	cat, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"cat"}, Stdin: strings.NewReader("first\n"), Background: true})
	if err != nil {
		t.Fatal(err)
	}
	var out safeBuffer
	done := make(chan error, 1)
	go func() {
		_, err := c.ConnectProcess(ctx, cat.PID, &out, nil)
		done <- err
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if out.String() != "first\n" {
		t.Fatalf("background cat said %q", out.String())
	}

	timed, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"sleep", "60"}, Background: true, Timeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if end, _ := c.WaitProcess(ctx, timed.PID); end == nil || !end.TimedOut || end.Signal != "SIGKILL" {
		t.Fatalf("background timeout: %+v", end)
	}
}

// Live output of a running background process reaches a connected host as
// it is produced, and SendStdin feeds it.
func TestBackgroundConnectLive(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	stdin, stdinW := io.Pipe() // nothing written: the client keeps stdin open
	defer stdinW.Close()
	p, err := c.Exec(ctx, agent.ExecRequest{Shell: "while read l; do echo got $l; done", Background: true, Stdin: stdin})
	if err != nil {
		t.Fatal(err)
	}
	var out safeBuffer
	done := make(chan error, 1)
	go func() {
		_, err := c.ConnectProcess(ctx, p.PID, &out, nil)
		done <- err
	}()
	if err := c.SendStdin(ctx, p.PID, []byte("a\n")); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); out.String() != "got a\n"; {
		if time.Now().After(deadline) {
			t.Fatalf("live output %q", out.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := c.CloseStdin(ctx, p.PID); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// A foreground command's leftover children end with it: one that keeps
// writing to the command's output neither holds the call open (the old
// agent never returned) nor outlives it. A background process with such a
// child still ends and can be waited for.
func TestExecLeftoverChildrenEndWithCommand(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const script = "while :; do echo x; sleep .1; done & echo pid=$!"
	var out safeBuffer
	res, err := c.Exec(ctx, agent.ExecRequest{Shell: script, Stdout: &out, Timeout: time.Minute})
	if err != nil || res.ExitCode != 0 || res.TimedOut {
		t.Fatalf("exec with a writing grandchild = %+v, %v", res, err)
	}
	_, rest, ok := strings.Cut(out.String(), "pid=")
	pid, perr := strconv.Atoi(strings.Fields(rest + " ")[0])
	if !ok || perr != nil {
		t.Fatalf("no grandchild pid in %q", out.String())
	}
	waitGone(t, pid, 10*time.Second)

	bg, err := c.Exec(ctx, agent.ExecRequest{Shell: script, Background: true})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := c.WaitProcess(ctx, bg.PID); err != nil || res.ExitCode != 0 {
		t.Fatalf("wait for a background process with a writing child = %+v, %v", res, err)
	}
}
