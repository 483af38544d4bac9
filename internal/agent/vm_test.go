package agent_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
)

// TestAgentInVM is the VM tier of the agent: the real forkd-agent as PID 1
// of the python image (overlay root, hvc console, numpy preloaded before the
// snapshot), restored twice.
func TestAgentInVM(t *testing.T) {
	// The VM tier runs as root, like CI: it shares the root-owned image
	// cache and QEMU may need /dev/kvm.
	testutil.RequireRoot(t)
	e := testvm.Engine(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	if _, err := e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: "agentvm", Image: "python"}); err != nil {
		t.Fatal(err)
	}
	res, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "agentvm", N: 2})
	if err != nil {
		t.Fatal(err)
	}
	clients := make([]*agent.Client, 2)
	for i, child := range res.Children {
		c, release, err := e.Agent(ctx, child.ID)
		if err != nil {
			t.Fatal(err)
		}
		defer release()
		clients[i] = c
		p, err := c.Ping(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if p.SandboxID != child.ID || p.Hostname != child.ID || p.Python != "ready" {
			t.Fatalf("child %d ping: %+v", i, p)
		}
	}
	c0, c1 := clients[0], clients[1]
	sh := func(c *agent.Client, cmd string) string {
		t.Helper()
		var out, errb bytes.Buffer
		r, err := c.Exec(ctx, agent.ExecRequest{Shell: cmd, Stdout: &out, Stderr: &errb, Timeout: time.Minute})
		if err != nil || r.ExitCode != 0 {
			t.Fatalf("%q: %+v, %v: %s", cmd, r, err, errb.String())
		}
		return out.String()
	}

	// PID 1 is the agent, on an overlay root, with the host's clock.
	if got := sh(c0, "echo $PPID; hostname; awk '$2 == \"/\" {print $3}' /proc/mounts | tail -1"); got != "1\n"+res.Children[0].ID+"\noverlay\n" {
		t.Fatalf("guest identity: %q", got)
	}
	// The guest's second must fall between the host's just before and just
	// after the call (a loaded host can take seconds to answer), give or
	// take a second of rounding.
	before := time.Now()
	guestNow, err := strconv.ParseInt(strings.TrimSpace(sh(c0, "date +%s")), 10, 64)
	after := time.Now()
	if err != nil {
		t.Fatalf("guest date: %v", err)
	}
	if g := time.Unix(guestNow, 0); g.Before(before.Add(-2*time.Second)) || g.After(after.Add(2*time.Second)) {
		t.Fatalf("guest clock %v after restore, host clock %v to %v", g, before, after)
	}

	// Each child's writes stay its own.
	sh(c0, "echo zero > /etc/forkd-agent-test")
	if got := sh(c1, "cat /etc/forkd-agent-test 2>/dev/null || echo absent"); got != "absent\n" {
		t.Fatalf("child 1 sees child 0's file: %q", got)
	}

	// A foreground command's leftover child that keeps writing neither
	// holds the call open nor outlives it.
	left := sh(c0, "while :; do echo x; sleep .1; done & echo pid=$!")
	_, rest, _ := strings.Cut(left, "pid=")
	leftPID := strings.Fields(rest + " ")[0]
	if got := sh(c0, "sleep 1; kill -0 "+leftPID+" 2>/dev/null && echo alive || echo gone"); got != "gone\n" {
		t.Fatalf("leftover child %q of a foreground command: %q", leftPID, got)
	}

	// A file through the console, every byte value included.
	data := make([]byte, 3<<20)
	rand.Read(data)
	if _, err := c1.WriteFile(ctx, "/root/blob", bytes.NewReader(data), 0o600); err != nil {
		t.Fatal(err)
	}
	h := sha256.New()
	if _, err := c1.ReadFile(ctx, "/root/blob", h); err != nil {
		t.Fatal(err)
	}
	if want := sha256.Sum256(data); !bytes.Equal(h.Sum(nil), want[:]) {
		t.Fatal("file changed crossing the console")
	}

	// numpy was imported before the snapshot; each child's RNG was reseeded.
	draws := make([]string, 2)
	for i, c := range clients {
		r, err := c.Eval(ctx, proto.EvalRequest{Code: "import sys\nassert 'numpy' in sys.modules\nimport numpy, random\n(numpy.random.rand(), random.random())", Timeout: time.Minute})
		if err != nil || r.Error != nil {
			t.Fatalf("child %d eval: %+v, %v", i, r, err)
		}
		draws[i] = r.Value
	}
	if draws[0] == draws[1] {
		t.Fatalf("both children drew %s: RNGs not reseeded", draws[0])
	}

	// A runaway cell is interrupted inside the VM too.
	r, err := c0.Eval(ctx, proto.EvalRequest{Code: "x = 1\nwhile True: pass", Timeout: 2 * time.Second})
	if err != nil || !r.TimedOut || r.Restarted {
		t.Fatalf("timeout in the VM: %+v, %v", r, err)
	}
	if r, err := c0.Eval(ctx, proto.EvalRequest{Code: "x + 1"}); err != nil || r.Value != "2" {
		t.Fatalf("after the timeout: %+v, %v", r, err)
	}
}
