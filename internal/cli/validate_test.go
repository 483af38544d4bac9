package cli

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
)

// runCLI runs forkd with args on a data dir that does not exist yet and
// returns the command's error and whether the data dir was created.
func runCLI(t *testing.T, args ...string) (touched bool, err error) {
	t.Helper()
	t.Setenv("FORKD_URL", "")
	t.Setenv("FORKD_TOKEN", "")
	t.Setenv("XDG_RUNTIME_DIR", t.TempDir())
	data := filepath.Join(t.TempDir(), "data")
	var out, errb bytes.Buffer
	g := &globals{stdout: &out, stderr: &errb, stdin: strings.NewReader("")}
	root := newRoot(g)
	root.SetArgs(append([]string{"--data-dir", data}, args...))
	err = root.Execute()
	_, serr := os.Stat(data)
	return serr == nil, err
}

// badArgs is one refused command line: want is in its error.
type badArgs struct {
	args []string
	want string
}

// checkRefused runs each case and wants an InvalidArgument error naming
// want, with no data dir made.
func checkRefused(t *testing.T, cases []badArgs) {
	t.Helper()
	for _, c := range cases {
		touched, err := runCLI(t, c.args...)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("forkd %s: %v, want an invalid argument naming %q", strings.Join(c.args, " "), err, c.want)
		}
		if touched {
			t.Errorf("forkd %s made the data dir", strings.Join(c.args, " "))
		}
	}
}

func TestLogLevelRefused(t *testing.T) {
	checkRefused(t, []badArgs{
		{[]string{"--log-level", "verbose", "ls"}, "--log-level"},
		{[]string{"--log-level", "warn+2", "images"}, "--log-level"},
	})
	for _, lvl := range []string{"debug", "info", "warn", "error", "WARN"} {
		if _, err := parseLogLevel(lvl); err != nil {
			t.Errorf("--log-level %s: %v", lvl, err)
		}
	}
}

func TestLimitFlagsRefused(t *testing.T) {
	var cases []badArgs
	for _, cmd := range [][]string{{"fork", "--tag", "base"}, {"spawn", "--tag", "base"}} {
		for _, c := range []badArgs{
			{[]string{"--cpus", "NaN"}, "--cpus"},
			{[]string{"--cpus", "+Inf"}, "--cpus"},
			{[]string{"--cpus", "0.001"}, "--cpus"},
			{[]string{"--cpus", "2000"}, "--cpus"},
			{[]string{"--cpus", "-1"}, "--cpus"},
			{[]string{"--io-read-mbps", "1e13"}, "--io-read-mbps"},
			{[]string{"--io-read-mbps", "1e-7"}, "--io-read-mbps"},
			{[]string{"--io-read-mbps", "NaN"}, "--io-read-mbps"},
			{[]string{"--io-write-mbps", "-Inf"}, "--io-write-mbps"},
			{[]string{"--io-write-mbps", "-3"}, "--io-write-mbps"},
			{[]string{"--guest-pids-limit", "-1"}, "guest_pids_limit = -1"},
			{[]string{"--guest-pids-limit", "8"}, "guest_pids_limit = 8: want 0 (the guest's default) or 16 to 4194304"},
			{[]string{"--guest-pids-limit", "4194305"}, "guest_pids_limit"},
			{[]string{"--disk-mib", "10"}, "disk_mib = 10: want 0 (no disk) or 64 to 1048576"},
			{[]string{"--disk-mib", "-64"}, "disk_mib = -64"},
			{[]string{"--disk-mib", "1048577"}, "disk_mib = 1048577"},
			{[]string{"--disk-mib", "99999999999999999999"}, "--disk-mib"},
			{[]string{"--disk-mib", "64.5"}, "--disk-mib"},
			{[]string{"--disk-mib", "lots"}, "--disk-mib"},
			{[]string{"--idle-freeze-secs", "-2"}, "idle_freeze_secs = -2"},
			{[]string{"--idle-freeze-secs", "86401"}, "idle_freeze_secs = 86401: want 1 to 86400, 0 (the daemon's --idle-freeze) or -1 (never)"},
		} {
			cases = append(cases, badArgs{append(append([]string(nil), cmd...), c.args...), c.want})
		}
	}
	checkRefused(t, cases)
	for mb, want := range map[float64]int64{0: 0, 0.000001: 1, 1.5: 1500000, 1e6: 1e12} {
		if got, err := bytesPerSecond("--io-read-mbps", mb); err != nil || got != want {
			t.Errorf("bytesPerSecond(%g) = %d, %v; want %d", mb, got, err, want)
		}
	}
}

func TestTimeoutsRefused(t *testing.T) {
	checkRefused(t, []badArgs{
		{[]string{"exec", "--timeout", "-5s", "sb-aaaaaaaaaa", "--", "true"}, "--timeout"},
		{[]string{"exec", "--timeout", "25h", "sb-aaaaaaaaaa", "--", "true"}, "--timeout"},
		{[]string{"exec", "--timeout", "9999999999h", "sb-aaaaaaaaaa", "--", "true"}, "--timeout"},
		{[]string{"eval", "--timeout", "-1", "sb-aaaaaaaaaa", "--", "1+1"}, "--timeout"},
		{[]string{"eval", "--timeout", "NaN", "sb-aaaaaaaaaa", "--", "1+1"}, "--timeout"},
		{[]string{"eval", "--timeout", "Inf", "sb-aaaaaaaaaa", "--", "1+1"}, "--timeout"},
		{[]string{"eval", "--timeout", "86401", "sb-aaaaaaaaaa", "--", "1+1"}, "--timeout"},
		{[]string{"eval", "--timeout", "1e400", "sb-aaaaaaaaaa", "--", "1+1"}, "--timeout"},
	})
}

// TestBulkArgumentsCheckedFirst: one bad argument stops the command
// before it acts on the good ones before it.
func TestBulkArgumentsCheckedFirst(t *testing.T) {
	checkRefused(t, []badArgs{
		{[]string{"kill", "sb-aaaaaaaaaa", "../etc"}, `sandbox id "../etc"`},
		{[]string{"kill", "sb-aaaaaaaaaa", "sb-AAAAAAAAAA"}, "sb-AAAAAAAAAA"},
		{[]string{"kill", "--tag", "../x"}, `tag "../x"`},
		{[]string{"kill", "--tag", ""}, "give sandbox ids"},
		{[]string{"rmi", "good", "bad/tag"}, `tag "bad/tag"`},
		{[]string{"rmi", "good", ""}, "tag is empty"},
	})
}

func TestServeFlagsRefused(t *testing.T) {
	checkRefused(t, []badArgs{
		{[]string{"serve", "--pool", "-1"}, "--pool -1: want 0 to 64"},
		{[]string{"serve", "--pool", "65"}, "--pool"},
		{[]string{"serve", "--max-sandboxes", "-1"}, "--max-sandboxes -1: want 0 (no limit)"},
		{[]string{"serve", "--max-sandboxes", "100001"}, "--max-sandboxes"},
		{[]string{"serve", "--max-per-request", "0"}, "--max-per-request 0: want 1 to 1000"},
		{[]string{"serve", "--max-per-request", "1001"}, "--max-per-request"},
		{[]string{"serve", "--max-parallel-restores", "-2"}, "--max-parallel-restores"},
		{[]string{"serve", "--max-pending-restores", "-5"}, "--max-pending-restores"},
		{[]string{"serve", "--max-body-bytes", "0"}, "--max-body-bytes 0: want 1024 to 67108864"},
		{[]string{"serve", "--max-body-bytes", "1099511627776"}, "--max-body-bytes"},
		{[]string{"serve", "--max-ports-per-sandbox", "0"}, "--max-ports-per-sandbox 0: want 1 to 1000"},
		{[]string{"serve", "--max-ports-per-sandbox", "1001"}, "--max-ports-per-sandbox"},
		{[]string{"serve", "--max-body-bytes-in-flight", "0"}, "--max-body-bytes-in-flight 0: want 1048576 to 4294967296"},
		{[]string{"serve", "--max-body-bytes", "4096", "--max-body-bytes-in-flight", "2048"}, "--max-body-bytes-in-flight 2048: want 4096 to"},
		{[]string{"serve", "--body-timeout", "0"}, "--body-timeout 0s: want 1s to 1h"},
		{[]string{"serve", "--body-timeout", "2h"}, "--body-timeout"},
		{[]string{"serve", "--shutdown-grace", "-1s"}, "--shutdown-grace"},
		{[]string{"serve", "--shutdown-grace", "2h"}, "--shutdown-grace"},
		{[]string{"serve", "--idle-freeze", "-1s"}, "--idle-freeze"},
		{[]string{"serve", "--idle-freeze", "500ms"}, "--idle-freeze 500ms: want 0 (never) or 1s to 24h"},
		{[]string{"serve", "--idle-freeze", "25h"}, "--idle-freeze"},
		{[]string{"serve", "--idle-reclaim", "-1s"}, "--idle-reclaim"},
		{[]string{"serve", "--idle-reclaim", "10ms"}, "--idle-reclaim 10ms: want 0 (never) or 1s to 24h"},
		{[]string{"serve", "--idle-reclaim", "25h"}, "--idle-reclaim"},
		{[]string{"serve", "--pool", "1e3"}, "--pool"},
		{[]string{"serve", "--listen", "0.0.0.0:1", "--no-auth"}, "not a loopback address"},
	})
}

func TestBenchFlagsRefused(t *testing.T) {
	checkRefused(t, []badArgs{
		{[]string{"bench", "-n", "0"}, "-n 0: want 1 to 1000"},
		{[]string{"bench", "-n", "-3"}, "-n -3"},
		{[]string{"bench", "-n", "1001"}, "-n 1001"},
		{[]string{"bench", "--mem-size-mib", "-1"}, "--mem-size-mib -1: want 64 to 65536"},
		{[]string{"bench", "--mem-size-mib", "70000"}, "--mem-size-mib"},
		{[]string{"bench", "--cold-runs", "-1"}, "--cold-runs"},
		{[]string{"bench", "--exec-runs", "-1"}, "--exec-runs"},
		{[]string{"bench", "--idle", "-1s"}, "--idle"},
		{[]string{"bench", "--image", "../x"}, "--image"},
		{[]string{"bench", "--scale", "0"}, "--scale 0: want 1 to 1000"},
		{[]string{"bench", "--scale", "1001"}, "--scale 1001"},
		{[]string{"bench", "--scale", "10", "--idle-reclaim", "500ms"}, "--idle-reclaim 500ms: want 0 (no reclaim phase) or 1s to 10m"},
		{[]string{"bench", "--scale", "10", "--idle-reclaim", "11m"}, "--idle-reclaim 11m0s"},
		{[]string{"bench", "--idle-reclaim", "5s"}, "--idle-reclaim goes with --scale"},
	})
}

func TestDaemonTokenStaysLocal(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "token"), []byte("local-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		url, token, insecure string
		want                 string // the token sent
		refused              bool
	}{
		{url: "http://127.0.0.1:8889", want: "local-secret"},
		{url: "http://localhost:8889", want: "local-secret"},
		{url: "https://[::1]:8889", want: "local-secret"},
		{url: "http://127.0.0.1:8889", token: "mine", want: "mine"},
		{url: "unix:///run/forkd/forkd.sock", want: ""},
		{url: "https://forkd.example.com", want: ""},
		{url: "https://forkd.example.com", token: "mine", want: "mine"},
		{url: "http://forkd.example.com:8889", refused: true},
		{url: "http://192.0.2.1:8889", token: "mine", refused: true},
		{url: "http://192.0.2.1:8889", token: "mine", insecure: "1", want: "mine"},
		{url: "http://192.0.2.1:8889", insecure: "1", want: ""},
	} {
		t.Setenv("FORKD_TOKEN", c.token)
		t.Setenv("FORKD_INSECURE", c.insecure)
		tok, err := daemonToken(c.url, dir)
		switch {
		case c.refused && !errdefs.IsInvalidArgument(err):
			t.Errorf("%s (token %q): %q, %v; want refused", c.url, c.token, tok, err)
		case !c.refused && (err != nil || tok != c.want):
			t.Errorf("%s (token %q, insecure %q): %q, %v; want %q", c.url, c.token, c.insecure, tok, err, c.want)
		}
	}
	// Through a command: refused before any connection.
	t.Setenv("FORKD_URL", "http://192.0.2.1:8889")
	t.Setenv("FORKD_TOKEN", "")
	t.Setenv("FORKD_INSECURE", "")
	g := &globals{stdout: io.Discard, stderr: io.Discard, stdin: strings.NewReader("")}
	root := newRoot(g)
	root.SetArgs([]string{"--data-dir", dir, "kill", "sb-aaaaaaaaaa"})
	if err := root.Execute(); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "in clear") {
		t.Errorf("kill with FORKD_URL=http://192.0.2.1:8889: %v", err)
	}
}

// TestFromImageCheckedBeforeImport: from-image refuses a bad snapshot
// shape or import option before it opens the data dir or reads the image.
func TestFromImageCheckedBeforeImport(t *testing.T) {
	tarball := filepath.Join(t.TempDir(), "img.tar")
	os.WriteFile(tarball, []byte("not read"), 0o644)
	checkRefused(t, []badArgs{
		{[]string{"from-image", tarball, "--tag", "x", "--vcpus", "65"}, "vcpus = 65"},
		{[]string{"from-image", tarball, "--tag", "x", "--vcpus", "-1"}, "vcpus = -1"},
		{[]string{"from-image", tarball, "--tag", "x", "--mem-size-mib", "1"}, "memory_mib = 1"},
		{[]string{"from-image", tarball, "--tag", "x", "--warmup", ""}, "warmup"},
		{[]string{"from-image", tarball, "--tag", "x", "--extra", "--force-yes"}, `extra package name "--force-yes"`},
		{[]string{"from-image", tarball, "--tag", "x", "--preload", "os; rm -rf /"}, "preload module"},
		{[]string{"from-image", "UPPER/case::x", "--tag", "x"}, "image reference"},
		{[]string{"from-image", tarball, "--tag", "../x"}, "tag"},
	})
	touched, err := runCLI(t, "from-image", tarball, "--tag", "python")
	if !errdefs.IsAlreadyExists(err) || touched {
		t.Errorf("from-image --tag python: %v (data dir made: %v), want a built-in name refused", err, touched)
	}
}

func TestSplitRemote(t *testing.T) {
	for arg, want := range map[string][2]string{
		"sb-abcdefghij:/root/f": {"sb-abcdefghij", "/root/f"},
		"sb-notes:v2.txt":       {"", "sb-notes:v2.txt"}, // a host file
		"./a:b":                 {"", "./a:b"},
		"/tmp/x":                {"", "/tmp/x"},
	} {
		if id, path := splitRemote(arg); id != want[0] || path != want[1] {
			t.Errorf("splitRemote(%q) = %q, %q; want %q, %q", arg, id, path, want[0], want[1])
		}
	}
}

func TestReadInput(t *testing.T) {
	if b, err := readInput(context.Background(), strings.NewReader("print(1)"), "code", 1<<20); err != nil || string(b) != "print(1)" {
		t.Fatalf("readInput = %q, %v", b, err)
	}
	if _, err := readInput(context.Background(), strings.NewReader(strings.Repeat("x", 1<<20+1)), "code", 1<<20); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("over the limit: %v", err)
	}
	// A reader that never ends (a terminal nobody types into) gives way
	// to a cancel.
	pr, pw := io.Pipe()
	defer pw.Close()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := readInput(ctx, pr, "code", 1<<20); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled read = %v", err)
	}
}

func TestTimeoutSpellings(t *testing.T) {
	for in, want := range map[string]time.Duration{
		"30s": 30 * time.Second, "1m30s": 90 * time.Second, "90": 90 * time.Second,
		"2.5": 2500 * time.Millisecond, "0": 0,
	} {
		t.Run(in, func(t *testing.T) {
			if got, err := parseTimeout(in); err != nil || got != want {
				t.Fatalf("parseTimeout(%q) = %v, %v; want %v", in, got, err, want)
			}
		})
	}
	for _, in := range []string{"-1", "-1s", "NaN", "Inf", "1e300", "soon", ""} {
		t.Run("bad "+in, func(t *testing.T) {
			if _, err := parseTimeout(in); !errdefs.IsInvalidArgument(err) {
				t.Fatalf("parseTimeout(%q) = %v, want refused", in, err)
			}
		})
	}
	// Every command takes the one spelling; the older ones still parse.
	checkRefused(t, []badArgs{
		{[]string{"exec", "sb-aaaaaaaaaa", "--timeout", "25h", "--", "true"}, "--timeout"},
		{[]string{"eval", "sb-aaaaaaaaaa", "--timeout", "100000", "--", "1"}, "--timeout"},
		{[]string{"eval", "sb-aaaaaaaaaa", "--timeout", "soon", "--", "1"}, "--timeout"},
		{[]string{"spawn", "--tag", "t", "--timeout", "1.5s"}, "whole seconds"},
	})
	if _, err := runCLI(t, "spawn", "--tag", "t", "--timeout-secs", "60"); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "needs a running daemon") {
		t.Errorf("spawn --timeout-secs 60: %v, want the daemon asked for", err)
	}
	if _, err := runCLI(t, "fork", "--tag", "b@d", "--per-child-netns"); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "b@d") {
		t.Errorf("fork --per-child-netns: %v, want the flag accepted and the tag refused", err)
	}
}
