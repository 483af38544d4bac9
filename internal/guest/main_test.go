package guest_test

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/guest"
)

// TestMain lets the test binary stand in for forkd-agent.
func TestMain(m *testing.M) {
	if os.Getenv("FORKD_AGENT_MAIN") == "1" {
		os.Exit(guest.Main(os.Args[1:]))
	}
	os.Exit(m.Run())
}

func agentCommand(args ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "FORKD_AGENT_MAIN=1")
	return cmd
}

func TestMainVersion(t *testing.T) {
	out, err := agentCommand("--version").Output()
	if err != nil || string(out) != guest.Version+"\n" {
		t.Fatalf("--version: %q, %v", out, err)
	}
	if err := agentCommand("--no-such-flag").Run(); err == nil {
		t.Fatal("unknown flag accepted")
	}
}

// forkd-agent --serve-stdio serves a host on its stdin and stdout and exits
// when the host hangs up.
func TestMainServeStdio(t *testing.T) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	hostFile, agentFile := os.NewFile(uintptr(fds[0]), "host"), os.NewFile(uintptr(fds[1]), "agent")
	conn, err := net.FileConn(hostFile)
	hostFile.Close()
	if err != nil {
		t.Fatal(err)
	}
	cmd := agentCommand("--serve-stdio")
	var logs bytes.Buffer
	cmd.Stdin, cmd.Stdout, cmd.Stderr = agentFile, agentFile, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	agentFile.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := agent.Dial(ctx, conn, agent.Options{})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	res, err := c.Exec(ctx, agent.ExecRequest{Shell: "echo $((6 * 7))", Stdout: &out})
	if err != nil || res.ExitCode != 0 || out.String() != "42\n" {
		t.Fatalf("exec: %+v, %v, %q", res, err, out.String())
	}
	c.Close()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("agent exited with %v: %s", err, logs.String())
		}
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		t.Fatalf("agent still running after the host hung up: %s", logs.String())
	}
	if strings.Contains(logs.String(), "level=ERROR") {
		t.Fatalf("agent logged errors: %s", logs.String())
	}
}
