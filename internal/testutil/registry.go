package testutil

import (
	"bytes"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// StartRegistry runs Debian's docker-registry on a free loopback port with
// storage in a temporary directory, and returns its host:port.
func StartRegistry(t testing.TB) string {
	t.Helper()
	bin := RequireCommand(t, "docker-registry")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.yml")
	WriteFile(t, cfg, []byte(fmt.Sprintf(`version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: true
http:
  addr: %s
`, filepath.Join(dir, "storage"), addr)), 0o644)
	cmd := exec.Command(bin, "serve", cfg)
	var logBuf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logBuf, &logBuf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Teardown: the registry is killed, so Wait reports the signal.
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	for i := 0; ; i++ {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return addr
		}
		if i > 100 {
			t.Fatalf("registry on %s did not start: %v\n%s", addr, err, logBuf.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}
