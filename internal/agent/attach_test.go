package agent_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/guest"
	"github.com/forkd/forkd/internal/testutil"
)

// An attached background process streams all of its output, paced by
// the host (a slow reader loses nothing, unlike the rings), and the call
// ends with its result; its pid comes first.
func TestAttachedExecStreamsEverything(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	const size = 3 << 20 // far more than the 64 KiB rings
	var out slowWriter
	started := -1
	res, err := c.Exec(ctx, agent.ExecRequest{
		Shell: "head -c 3145728 /dev/zero | tr '\\0' x; echo err >&2; exit 4", Background: true, Attach: true,
		Stdout: &out, Stderr: &out.err, OnStart: func(pid int) { started = pid },
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 4 || res.PID != started || started <= 0 {
		t.Fatalf("result %+v, started %d", res, started)
	}
	if out.n != size || out.err.String() != "err\n" {
		t.Fatalf("stdout %d bytes (want %d), stderr %q", out.n, size, out.err.String())
	}
}

// slowWriter counts what it is given, slowly.
type slowWriter struct {
	n   int
	err safeBuffer
}

func (w *slowWriter) Write(p []byte) (int, error) {
	time.Sleep(time.Millisecond)
	w.n += len(p)
	return len(p), nil
}

// Cancelling an attached call detaches: the process runs on, takes stdin,
// is followed live from a new call and ends with its result.
func TestAttachedExecDetaches(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	actx, cancel := context.WithCancel(ctx)
	pids := make(chan int, 1)
	var out safeBuffer
	done := make(chan error, 1)
	go func() {
		_, err := c.Exec(actx, agent.ExecRequest{
			Shell: "echo ready; while read l; do echo got $l; done; exit 7", Background: true, Attach: true, StdinOpen: true,
			Stdout: &out, OnStart: func(pid int) { pids <- pid },
		})
		done <- err
	}()
	pid := <-pids
	waitFor(t, func() bool { return out.String() == "ready\n" })
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled attached exec = %v", err)
	}
	if err := c.SendStdin(ctx, pid, []byte("a\n")); err != nil {
		t.Fatalf("stdin after detaching: %v", err)
	}
	var live safeBuffer
	followed := make(chan *proto.ExecResult, 1)
	go func() {
		res, err := c.FollowProcess(ctx, pid, &live, nil)
		if err != nil {
			t.Error(err)
		}
		followed <- res
	}()
	// Nothing tells when the follower has joined, and it is not sent
	// what came before: send "b" until it sees an answer.
	var sent time.Time
	waitFor(t, func() bool {
		if strings.Contains(live.String(), "got b\n") {
			return true
		}
		if time.Since(sent) >= 100*time.Millisecond {
			if err := c.SendStdin(ctx, pid, []byte("b\n")); err != nil {
				t.Fatal(err)
			}
			sent = time.Now()
		}
		return false
	})
	if strings.Contains(live.String(), "ready") {
		t.Errorf("follow replayed old output: %q", live.String())
	}
	if err := c.CloseStdin(ctx, pid); err != nil {
		t.Fatal(err)
	}
	if res := <-followed; res == nil || res.ExitCode != 7 {
		t.Fatalf("followed result %+v", res)
	}
}

// A process on a terminal sees one, of the size asked and then resized;
// its input and output go through it.
func TestPTYProcess(t *testing.T) {
	if _, err := os.Stat("/dev/ptmx"); err != nil {
		testutil.Unavailable(t, "test needs /dev/ptmx")
	}
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	pids := make(chan int, 1)
	var out safeBuffer
	done := make(chan *proto.ExecResult, 1)
	go func() {
		res, err := c.Exec(ctx, agent.ExecRequest{
			Shell:      `stty size; tty -s && echo is-a-tty; read l; stty size; echo "line=$l"`,
			Background: true, Attach: true, PTY: &proto.PTYSize{Cols: 100, Rows: 30},
			Stdout: &out, OnStart: func(pid int) { pids <- pid },
		})
		if err != nil {
			t.Error(err)
		}
		done <- res
	}()
	pid := <-pids
	waitFor(t, func() bool { return strings.Contains(out.String(), "is-a-tty") })
	if err := c.ResizeProcess(ctx, pid, proto.PTYSize{Cols: 132, Rows: 43}); err != nil {
		t.Fatal(err)
	}
	if err := c.SendStdin(ctx, pid, []byte("hello\r")); err != nil {
		t.Fatal(err)
	}
	res := <-done
	if res == nil || res.ExitCode != 0 {
		t.Fatalf("result %+v, output %q", res, out.String())
	}
	got := strings.ReplaceAll(out.String(), "\r\n", "\n")
	for _, want := range []string{"30 100\n", "is-a-tty\n", "hello\n", "43 132\n", "line=hello\n"} {
		if !strings.Contains(got, want) {
			t.Errorf("terminal output %q lacks %q", got, want)
		}
	}
	if err := c.ResizeProcess(ctx, pid, proto.PTYSize{Cols: 1, Rows: 1}); !errdefs.IsFailedPrecondition(err) && !errdefs.IsNotFound(err) {
		t.Fatalf("resize of an ended process = %v", err)
	}
	p, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"true"}, Background: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.WaitProcess(ctx, p.PID); err != nil {
		t.Fatal(err)
	}
	if err := c.ResizeProcess(ctx, p.PID, proto.PTYSize{Cols: 1, Rows: 1}); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("resize without a terminal = %v", err)
	}
	if _, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"true"}, PTY: &proto.PTYSize{}}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("foreground pty = %v", err)
	}
}

// A watch reports creations, writes, renames and removals, relative to
// its directory, in subdirectories made after it started when recursive.
func TestWatch(t *testing.T) {
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	dir := t.TempDir()
	var mu sync.Mutex
	var got []proto.WatchEvent
	started := make(chan struct{})
	wctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- c.Watch(wctx, dir, true, func() { close(started) }, func(ev proto.WatchEvent) error {
			mu.Lock()
			got = append(got, ev)
			mu.Unlock()
			return nil
		})
	}()
	<-started
	testutil.Check(t, os.WriteFile(filepath.Join(dir, "a.txt"), []byte("x"), 0o644))
	testutil.Check(t, os.Mkdir(filepath.Join(dir, "sub"), 0o755))
	// The new directory's watch is added before its creation is sent.
	waitFor(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return slices.Contains(got, proto.WatchEvent{Name: "sub", Op: proto.WatchCreate})
	})
	testutil.Check(t, os.WriteFile(filepath.Join(dir, "sub", "b.txt"), []byte("y"), 0o644))
	testutil.Check(t, os.Rename(filepath.Join(dir, "a.txt"), filepath.Join(dir, "c.txt")))
	testutil.Check(t, os.Remove(filepath.Join(dir, "c.txt")))
	want := []proto.WatchEvent{
		{Name: "a.txt", Op: proto.WatchCreate}, {Name: "a.txt", Op: proto.WatchWrite},
		{Name: "sub", Op: proto.WatchCreate},
		{Name: "sub/b.txt", Op: proto.WatchCreate}, {Name: "sub/b.txt", Op: proto.WatchWrite},
		{Name: "a.txt", Op: proto.WatchRename}, {Name: "c.txt", Op: proto.WatchCreate},
		{Name: "c.txt", Op: proto.WatchRemove},
	}
	waitFor(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(got) >= len(want)
	})
	stop()
	if err := <-done; err != nil {
		t.Fatalf("watch ended with %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("events %+v, want %+v", got, want)
		}
	}

	if err := c.Watch(ctx, filepath.Join(dir, "nope"), false, nil, nil); !errdefs.IsNotFound(err) {
		t.Fatalf("watch of a missing directory = %v", err)
	}
	testutil.Check(t, os.WriteFile(filepath.Join(dir, "f"), nil, 0o644))
	if err := c.Watch(ctx, filepath.Join(dir, "f"), false, nil, nil); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("watch of a file = %v", err)
	}
}

// Files written and directories made for a user belong to it; stat can
// follow a symlink; entries name their owner and group.
func TestFilesForUser(t *testing.T) {
	testutil.RequireRoot(t)
	c := startGuest(t, guest.Config{}).dial()
	ctx := testCtx(t)
	dir := t.TempDir()
	data := make([]byte, 100000)
	rand.Read(data)
	p := filepath.Join(dir, "new", "deep", "f.bin")
	if _, err := c.WriteFileAs(ctx, p, bytes.NewReader(data), 0, "nobody"); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{p, filepath.Dir(p), filepath.Dir(filepath.Dir(p))} {
		fi, err := c.Stat(ctx, q)
		if err != nil || fi.Owner != "nobody" {
			t.Fatalf("%s: %+v, %v", q, fi, err)
		}
	}
	if fi, _ := c.Stat(ctx, dir); fi == nil || fi.Owner != "root" || fi.Group != "root" {
		t.Fatalf("%s: %+v (an existing directory keeps its owner)", dir, fi)
	}
	if _, err := c.MakeDirAs(ctx, filepath.Join(dir, "m", "n"), "nobody"); err != nil {
		t.Fatal(err)
	}
	if fi, _ := c.Stat(ctx, filepath.Join(dir, "m")); fi == nil || fi.Owner != "nobody" {
		t.Fatalf("made directory: %+v", fi)
	}
	testutil.Check(t, os.Symlink("new/deep/f.bin", filepath.Join(dir, "link")))
	fi, err := c.StatFollow(ctx, filepath.Join(dir, "link"))
	if err != nil || fi.Type != proto.FileTypeFile || fi.Size != int64(len(data)) || fi.Target != p || fi.Name != "link" {
		t.Fatalf("stat following a symlink: %+v, %v", fi, err)
	}
	var back bytes.Buffer
	if _, err := c.ReadFile(ctx, p, &back); err != nil || sha256.Sum256(back.Bytes()) != sha256.Sum256(data) {
		t.Fatalf("read back: %v", err)
	}
	if _, err := c.WriteFileAs(ctx, filepath.Join(dir, "x"), strings.NewReader(""), 0, "no-such-user"); !errdefs.IsNotFound(err) {
		t.Fatalf("write for an unknown user = %v", err)
	}
}

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 10 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
