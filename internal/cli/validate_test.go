package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

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
