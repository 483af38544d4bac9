package testutil

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestFileSHA256(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, []byte("abc"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, want := FileSHA256(t, p), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"; got != want {
		t.Fatalf("FileSHA256 = %s, want %s", got, want)
	}
}

// fatalRecorder is a testing.TB whose Fatalf records the message and ends
// the goroutine, as the real one does.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (r *fatalRecorder) Helper() {}

func (r *fatalRecorder) Fatalf(format string, args ...any) {
	r.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// fatalOf runs fn with a fatalRecorder and returns what it failed with
// ("" when it did not fail).
func fatalOf(fn func(t testing.TB)) string {
	r := &fatalRecorder{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(r)
	}()
	<-done
	return r.msg
}

func TestFileHelpers(t *testing.T) {
	dir := t.TempDir()
	p := func(name string) string { return filepath.Join(dir, name) }
	MkdirAll(t, p("a/b"), 0o755)
	Mkdir(t, p("a/b/c"), 0o700)
	WriteFile(t, p("a/f"), []byte("x"), 0o600)
	Chmod(t, p("a/f"), 0o640)
	when := time.Unix(1600000000, 0)
	Chtimes(t, p("a/f"), when, when)
	Link(t, p("a/f"), p("a/hard"))
	Symlink(t, "f", p("a/soft"))
	Rename(t, p("a/hard"), p("a/hard2"))
	Remove(t, p("a/hard2"))
	fi, err := os.Stat(p("a/soft"))
	if err != nil || fi.Mode().Perm() != 0o640 || !fi.ModTime().Equal(when) {
		t.Fatalf("a/soft: %v, %v", fi, err)
	}
	var b strings.Builder
	Write(t, "builder", &b, []byte("hi"))
	if b.String() != "hi" {
		t.Fatalf("Write wrote %q", b.String())
	}
	RemoveAll(t, p("a"))
	if _, err := os.Lstat(p("a")); !os.IsNotExist(err) {
		t.Fatalf("after RemoveAll: %v", err)
	}

	missing := p("no/such")
	for name, fn := range map[string]func(t testing.TB){
		"write":    func(t testing.TB) { WriteFile(t, missing, nil, 0o600) },
		"mkdir":    func(t testing.TB) { Mkdir(t, missing, 0o755) },
		"mkdir -p": func(t testing.TB) { WriteFile(t, p("file"), nil, 0o600); MkdirAll(t, p("file/sub"), 0o755) },
		"symlink":  func(t testing.TB) { Symlink(t, "x", missing) },
		"link":     func(t testing.TB) { Link(t, missing, p("l")) },
		"chmod":    func(t testing.TB) { Chmod(t, missing, 0o600) },
		"chtimes":  func(t testing.TB) { Chtimes(t, missing, when, when) },
		"remove":   func(t testing.TB) { Remove(t, missing) },
		"rename":   func(t testing.TB) { Rename(t, missing, p("r")) },
		"close":    func(t testing.TB) { f, _ := os.Open(dir); f.Close(); Close(t, dir, f) },
	} {
		t.Run(name, func(t *testing.T) {
			msg := fatalOf(fn)
			if !strings.HasPrefix(msg, name+" ") || !strings.Contains(msg, dir) {
				t.Errorf("failed with %q, want the operation and the path", msg)
			}
		})
	}
}

func TestProcessesUnder(t *testing.T) {
	dir := t.TempDir()
	work := filepath.Join(dir, "run", "x")
	if err := os.MkdirAll(work, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "60")
	cmd.Dir = work
	if err := cmd.Start(); err != nil {
		Unavailable(t, "no sleep: "+err.Error())
	}
	pid := strconv.Itoa(cmd.Process.Pid)
	found := func() bool {
		return slices.ContainsFunc(ProcessesUnder(filepath.Join(dir, "run")), func(p string) bool {
			return strings.HasPrefix(p, pid+" ")
		})
	}
	if !found() {
		t.Errorf("ProcessesUnder misses %s working in %s", pid, work)
	}
	if got := ProcessesUnder(work); len(got) != 0 {
		t.Errorf("ProcessesUnder(%s) = %v: a process working in dir itself is not below it", work, got)
	}
	cmd.Process.Kill()
	// Killed but not yet waited for: a zombie, which does not count.
	for range 100 {
		if !found() {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if found() {
		t.Errorf("ProcessesUnder lists the zombie %s", pid)
	}
	cmd.Wait()
}
