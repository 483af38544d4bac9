package e2e

import (
	"context"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

// TestBranchSurvivesCrashAndWorkspaces drives a real daemon: a branch
// asked for without waiting, the daemon SIGKILLed meanwhile, then
// restarted: the snapshot is ready and correct or failed and removable,
// and nothing leaks; then a workspace is created, given state,
// suspended (no VMM left for it), the daemon restarted, and resumed with
// its state.
func TestBranchSurvivesCrashAndWorkspaces(t *testing.T) {
	testutil.RequireRoot(t)
	c := newCLI(t)
	d := startServe(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	api := d.client(d.token)
	op, err := api.CreateSnapshot(ctx, apiv1.CreateSnapshotRequest{Tag: "py", Image: "python"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := api.WaitOperation(ctx, op.ID); err != nil {
		t.Fatalf("snapshot: %v\n%s", err, d.output())
	}
	res, err := api.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: "py"})
	if err != nil {
		t.Fatal(err)
	}
	src := res.Sandboxes[0].ID
	if _, err := api.Eval(ctx, src, apiv1.EvalRequest{Code: "x = 41"}); err != nil {
		t.Fatal(err)
	}

	// A branch without waiting, and the daemon killed right away.
	noWait := false
	snap, err := api.Branch(ctx, src, apiv1.BranchRequest{Tag: "crashed", Wait: &noWait})
	if err != nil || snap.Status != apiv1.SnapshotWriting {
		t.Fatalf("branch --no-wait: %+v %v", snap, err)
	}
	time.Sleep(300 * time.Millisecond)
	d.kill9()
	d.start()
	api = d.client(d.token)
	got, err := api.GetSnapshot(ctx, "crashed")
	switch {
	case err != nil:
		t.Fatalf("the branch after a crash: %v", err)
	case got.Status == apiv1.SnapshotReady:
		kid, err := api.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: "crashed"})
		if err != nil {
			t.Fatalf("fork of a branch finished before the crash: %v", err)
		}
		if r, err := api.Eval(ctx, kid.Sandboxes[0].ID, apiv1.EvalRequest{Code: "x"}); err != nil || r.Value != "41" {
			t.Fatalf("x in a child of the branch: %+v %v", r, err)
		}
		t.Log("the branch finished before the crash")
	case got.Status == apiv1.SnapshotFailed:
		if err := api.DeleteSnapshot(ctx, "crashed"); err != nil {
			t.Fatalf("rmi of a failed branch: %v", err)
		}
		t.Logf("the branch was cut by the crash: %s", got.Error)
	default:
		t.Fatalf("the branch after a crash is %s", got.Status)
	}
	// The source still runs, unpaused, and nothing is left half-made.
	if r, err := api.Eval(ctx, src, apiv1.EvalRequest{Code: "x"}); err != nil || r.Value != "41" {
		t.Fatalf("the source after the crash: %+v %v", r, err)
	}
	if out, _ := exec.Command("sh", "-c", "ls -a "+c.data+"/snapshots | grep -c staging || true").Output(); strings.TrimSpace(string(out)) != "0" {
		t.Fatalf("staging dirs left: %s", out)
	}

	// A workspace survives suspension and a daemon restart.
	w, err := api.CreateWorkspace(ctx, apiv1.CreateWorkspaceRequest{Name: "ws", CreateSandboxesRequest: apiv1.CreateSandboxesRequest{SnapshotTag: "py"}})
	if err != nil || w.Status != apiv1.WorkspaceRunning || w.Sandbox == "" {
		t.Fatalf("create workspace: %+v %v", w, err)
	}
	if _, err := api.Eval(ctx, w.Sandbox, apiv1.EvalRequest{Code: "plan = ['clone', 'build']"}); err != nil {
		t.Fatal(err)
	}
	if _, err := api.Exec(ctx, w.Sandbox, apiv1.ExecRequest{Shell: "echo progress > /root/notes.txt"}); err != nil {
		t.Fatal(err)
	}
	old := w.Sandbox
	sb, err := api.GetSandbox(ctx, old)
	if err != nil {
		t.Fatal(err)
	}
	w, err = api.SuspendWorkspace(ctx, "ws")
	if err != nil || w.Status != apiv1.WorkspaceSuspended || w.Sandbox != "" || len(w.States) != 1 {
		t.Fatalf("suspend: %+v %v", w, err)
	}
	if _, err := api.GetSandbox(ctx, old); !errdefs.IsNotFound(err) {
		t.Fatalf("the suspended workspace's sandbox: %v", err)
	}
	if alive(sb.PID) {
		t.Fatalf("the suspended workspace's VMM %d still runs", sb.PID)
	}
	d.kill9()
	d.start()
	api = d.client(d.token)
	w, err = api.ResumeWorkspace(ctx, "ws")
	if err != nil || w.Status != apiv1.WorkspaceRunning || w.Sandbox == "" || w.Sandbox == old {
		t.Fatalf("resume after a restart: %+v %v", w, err)
	}
	if r, err := api.Eval(ctx, w.Sandbox, apiv1.EvalRequest{Code: "plan"}); err != nil || r.Value != "['clone', 'build']" {
		t.Fatalf("plan after resume: %+v %v", r, err)
	}
	if r, err := api.Exec(ctx, w.Sandbox, apiv1.ExecRequest{Args: []string{"cat", "/root/notes.txt"}}); err != nil || r.Stdout != "progress\n" {
		t.Fatalf("notes after resume: %+v %v", r, err)
	}
	if err := api.DeleteWorkspace(ctx, "ws"); err != nil {
		t.Fatal(err)
	}
	if _, err := api.GetSnapshot(ctx, w.States[0]); !errdefs.IsNotFound(err) {
		t.Fatalf("workspace state after rm: %v", err)
	}
	if _, err := api.GetSnapshot(ctx, "py"); err != nil {
		t.Fatalf("the workspace's source after rm: %v", err)
	}
}

// alive reports whether a process of that pid still runs.
func alive(pid int) bool { return pid > 0 && syscall.Kill(pid, 0) == nil }
