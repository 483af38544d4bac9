package e2e

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/testutil"
)

// daemonProc is `forkd serve` running as a separate process.
type daemonProc struct {
	t     *testing.T
	c     *cli
	cmd   *exec.Cmd
	log   string // its stderr
	sock  string
	url   string
	token string
	args  []string
}

// startServe starts forkd serve on a socket and a free loopback port.
func startServe(t *testing.T, c *cli, extra ...string) *daemonProc {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	sockDir, err := os.MkdirTemp("", "fd-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	d := &daemonProc{t: t, c: c, sock: filepath.Join(sockDir, "s"), url: "http://" + addr}
	d.args = append([]string{"serve", "--socket", d.sock, "--listen", addr}, extra...)
	d.start()
	// As an operator stops it: a SIGKILLed daemon leaves the VMMs it
	// parked for its pool (and their namespaces) for the next daemon of
	// the data dir to reclaim, and the test's data dir goes with it.
	t.Cleanup(d.stop)
	return d
}

func (d *daemonProc) start() {
	d.t.Helper()
	f, err := os.CreateTemp(d.t.TempDir(), "serve-*.log")
	if err != nil {
		d.t.Fatal(err)
	}
	d.log = f.Name()
	d.cmd = exec.Command(forkdBin, d.args...)
	d.cmd.Env = d.c.env
	d.cmd.Stdout, d.cmd.Stderr = f, f
	if err := d.cmd.Start(); err != nil {
		d.t.Fatal(err)
	}
	f.Close()
	uc, _ := client.New("unix://"+d.sock, "")
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := uc.Health(ctx)
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) || d.cmd.ProcessState != nil {
			d.t.Fatalf("daemon did not come up: %v\n%s", err, d.output())
		}
		time.Sleep(50 * time.Millisecond)
	}
	tok, err := os.ReadFile(filepath.Join(d.c.data, "token"))
	if err != nil {
		d.t.Fatal(err)
	}
	d.token = strings.TrimSpace(string(tok))
}

func (d *daemonProc) output() string {
	b, _ := os.ReadFile(d.log)
	return string(b)
}

// kill9 kills the daemon the hard way and reaps it.
func (d *daemonProc) kill9() {
	if d.cmd == nil || d.cmd.Process == nil {
		return
	}
	d.cmd.Process.Kill()
	d.cmd.Wait()
	d.cmd = nil
}

// stop ends the daemon as an operator would, with SIGTERM, and reaps it
// (SIGKILL after a minute): a SIGTERMed daemon takes down the VMMs it
// parked for its pool, which a SIGKILLed one leaves running.
func (d *daemonProc) stop() {
	if d.cmd == nil || d.cmd.Process == nil {
		return
	}
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { d.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Minute):
		d.t.Errorf("daemon still running a minute after SIGTERM; killed\n%s", d.output())
		d.cmd.Process.Kill()
		<-done
	}
	d.cmd = nil
}

func (d *daemonProc) client(token string) *client.Client {
	c, err := client.New(d.url, token)
	if err != nil {
		d.t.Fatal(err)
	}
	return c
}

// TestServeRefusesWeakSetup: a placeholder, short, empty or world-readable
// token, and a non-loopback bind without token or TLS, stop the daemon at
// start.
func TestServeRefusesWeakSetup(t *testing.T) {
	c := newCLI(t)
	tf := filepath.Join(c.data, "tok")
	for _, tc := range []struct{ name, content, want string }{
		{"changeme", "changeme\n", "placeholder"},
		{"your token here", "your-token-here-your-token\n", "placeholder"},
		{"short", "abc123\n", "want at least 16"},
		{"empty", "", "empty"},
		{"one letter", "aaaaaaaaaaaaaaaaaaaaaaaaaaaa\n", "distinct"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testutil.WriteFile(t, tf, []byte(tc.content), 0o600)
			errs, code := refused(t, c, "serve", "--socket", "", "--listen", "127.0.0.1:0", "--token-file", tf)
			if code == 0 || !strings.Contains(errs, tc.want) {
				t.Errorf("token %q: exit %d, %q", tc.content, code, errs)
			}
		})
	}
	testutil.WriteFile(t, tf, []byte("3f9c2b1e7a6d5c4b3a29181706f5e4d3\n"), 0o600)
	testutil.Chmod(t, tf, 0o644)
	if errs, code := refused(t, c, "serve", "--socket", "", "--listen", "127.0.0.1:0", "--token-file", tf); code == 0 || !strings.Contains(errs, "chmod 600") {
		t.Errorf("0644 token file: exit %d, %q", code, errs)
	}
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"public without tls", []string{"serve", "--socket", "", "--listen", "0.0.0.0:0"}},
		{"public without auth", []string{"serve", "--socket", "", "--listen", "0.0.0.0:0", "--no-auth"}},
		{"plaintext without auth", []string{"serve", "--socket", "", "--listen", ":0", "--no-auth", "--allow-plaintext"}},
		{"cert without key", []string{"serve", "--socket", "", "--listen", "127.0.0.1:0", "--tls-cert", "x"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if errs, code := refused(t, c, tc.args...); code != 2 {
				t.Errorf("forkd %v: exit %d, %q", tc.args, code, errs)
			}
		})
	}
	// spawn needs a daemon.
	if _, errs, code := c.run("spawn", "--tag", "x"); code == 0 || !strings.Contains(errs, "forkd serve") {
		t.Errorf("spawn without daemon: exit %d %q", code, errs)
	}
}

// refused runs a forkd command that should fail at once; one that runs
// (a daemon that started) is killed after 10 s and reported as exit 0.
func refused(t *testing.T, c *cli, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, forkdBin, args...)
	cmd.Env = c.env
	var errb bytes.Buffer
	cmd.Stderr = &errb
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case ctx.Err() != nil:
		return errb.String(), 0
	case errors.As(err, &ee):
		return errb.String(), ee.ExitCode()
	case err != nil:
		t.Fatal(err)
	}
	return errb.String(), 0
}

// TestServeAcceptance drives the real daemon binary over real HTTP with
// real VMs: auth, 5 children, exec and eval, streaming, the CLI through the
// daemon, TTL expiry, kill -9 and restart (re-adoption, dead and orphan
// VMMs), SIGTERM that leaves sandboxes running.
func TestServeAcceptance(t *testing.T) {
	c := newCLI(t)
	d := startServe(t, c, "--max-sandboxes", "20")
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()

	// Auth: /healthz open, everything else needs the token.
	for _, tc := range []struct{ name, tok string }{
		{"no token", ""},
		{"wrong token", "wrong-wrong-wrong-wrong-wrong-1"},
		{"token prefix", d.token[:16]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, err := http.NewRequest("GET", d.url+"/v1/sandboxes", nil)
			if err != nil {
				t.Fatal(err)
			}
			if tc.tok != "" {
				req.Header.Set("Authorization", "Bearer "+tc.tok)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 401 || !strings.Contains(string(body), `"code":"unauthenticated"`) {
				t.Errorf("token %q: %d %s", tc.tok, resp.StatusCode, body)
			}
		})
	}
	if err := d.client("").Health(ctx); err != nil {
		t.Errorf("healthz without token: %v", err)
	}
	api := d.client(d.token)

	// A snapshot of the python image, built through the API.
	op, err := api.CreateSnapshot(ctx, apiv1.CreateSnapshotRequest{Tag: "py", Image: "python"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := api.WaitOperation(ctx, op.ID); err != nil {
		t.Fatalf("snapshot: %v\n%s", err, d.output())
	}

	res, err := api.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: "py", N: 5})
	if err != nil || len(res.Sandboxes) != 5 {
		t.Fatalf("create 5: %+v %v", res, err)
	}
	var ids []string
	for _, sb := range res.Sandboxes {
		if sb.Status != apiv1.SandboxRunning {
			t.Errorf("%s is %s", sb.ID, sb.Status)
		}
		ids = append(ids, sb.ID)
	}
	for _, id := range ids {
		r, err := api.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"hostname"}})
		if err != nil || strings.TrimSpace(r.Stdout) != id {
			t.Errorf("exec in %s: %+v %v", id, r, err)
		}
	}
	ev, err := api.Eval(ctx, ids[0], apiv1.EvalRequest{Code: "import numpy\nx = numpy.arange(4)\nx.sum()"})
	if err != nil || ev.Value != "6" || ev.Error != nil {
		t.Errorf("eval: %+v %v", ev, err)
	}
	ev, err = api.Eval(ctx, ids[0], apiv1.EvalRequest{Code: "x * 2"}) // state kept
	if err != nil || !strings.Contains(ev.Value, "0, 2, 4, 6") {
		t.Errorf("eval keeps state: %+v %v", ev, err)
	}
	ev, err = api.Eval(ctx, ids[0], apiv1.EvalRequest{Code: "1/0"})
	if err != nil || ev.Error == nil || ev.Error.Name != "ZeroDivisionError" {
		t.Errorf("eval exception: %+v %v", ev, err)
	}
	var times []time.Time
	var out bytes.Buffer
	w := writerFunc(func(p []byte) (int, error) { times = append(times, time.Now()); return out.Write(p) })
	if r, err := api.ExecStream(ctx, ids[1], apiv1.ExecRequest{Shell: "for i in 1 2 3; do echo $i; sleep 0.5; done"}, nil, w, w); err != nil || r.ExitCode != 0 {
		t.Fatalf("stream: %+v %v", r, err)
	}
	if out.String() != "1\n2\n3\n" || len(times) < 3 || times[len(times)-1].Sub(times[0]) < 800*time.Millisecond {
		t.Errorf("streamed %q at %v: not as produced", out.String(), times)
	}

	// The CLI goes through the daemon (found through the data dir), and
	// through FORKD_URL/FORKD_TOKEN.
	var ls struct{ Sandboxes []struct{ ID, Status string } }
	if err := json.Unmarshal([]byte(c.ok("ls", "--json")), &ls); err != nil || len(ls.Sandboxes) != 5 {
		t.Fatalf("ls through the daemon: %+v %v", ls, err)
	}
	if out, errs, code := c.run("exec", ids[2], "--", "sh", "-c", "echo out; echo err >&2; exit 5"); out != "out\n" || errs != "err\n" || code != 5 {
		t.Errorf("cli exec: %q %q %d", out, errs, code)
	}
	if out := c.ok("eval", ids[0], "--", "x.sum() + 1"); strings.TrimSpace(out) != "7" {
		t.Errorf("cli eval: %q", out)
	}
	viaURL := append(append([]string{}, c.env...), "FORKD_URL="+d.url, "FORKD_TOKEN="+d.token)
	if out := runEnv(t, viaURL, "exec", ids[3], "--", "echo", "tcp"); out != "tcp\n" {
		t.Errorf("exec via FORKD_URL: %q", out)
	}
	if _, errs, code := c.run("rmi", "py"); code == 0 || !strings.Contains(errs, "in use") {
		t.Errorf("rmi of a snapshot in use: %q", errs)
	}
	var images struct {
		Snapshots []struct {
			Tag      string `json:"tag"`
			Refcount int    `json:"refcount"`
		} `json:"snapshots"`
	}
	if err := json.Unmarshal([]byte(c.ok("images", "--json")), &images); err != nil || len(images.Snapshots) != 1 || images.Snapshots[0].Refcount != 5 {
		t.Errorf("images through the daemon: %+v %v", images, err)
	}

	// TTL: spawned with timeout 5 s, gone within a few seconds of expiry,
	// with its VMM and run dir.
	var spawned apiv1.CreateSandboxesResponse
	if err := json.Unmarshal([]byte(c.ok("spawn", "--tag", "py", "--timeout-secs", "5", "--json")), &spawned); err != nil || len(spawned.Sandboxes) != 1 {
		t.Fatalf("spawn: %+v %v", spawned, err)
	}
	ttl := spawned.Sandboxes[0]
	for {
		_, err := api.GetSandbox(ctx, ttl.ID)
		if errdefs.IsNotFound(err) {
			break
		}
		if time.Now().After(ttl.ExpiresAt.Add(5 * time.Second)) {
			t.Fatalf("sandbox with timeout 5 s still there 5 s after expiry (%v)", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if late := time.Since(ttl.ExpiresAt); late < 0 {
		t.Errorf("killed %v before its deadline", -late)
	}
	if _, err := os.Stat(filepath.Join(c.data, "run", ttl.ID)); !os.IsNotExist(err) {
		t.Errorf("expired sandbox's run dir: %v", err)
	}

	// kill -9 the daemon: the VMs live on; a new daemon re-adopts them.
	d.kill9()
	for _, id := range ids {
		if sb := record(t, c, id); !proc.Alive(sb.Handle.Process) {
			t.Fatalf("%s died with the daemon", id)
		}
	}
	d.start()
	api = d.client(d.token)
	list, err := api.ListSandboxes(ctx, client.ListOptions{})
	if err != nil || len(list) != 5 {
		t.Fatalf("after restart: %d sandboxes, %v\n%s", len(list), err, d.output())
	}
	// Concurrent first calls to a re-adopted sandbox share one agent
	// session (a second session would cancel the first one's calls).
	errc := make(chan error, 8)
	for range 8 {
		go func() {
			r, err := api.Exec(ctx, ids[4], apiv1.ExecRequest{Shell: "sleep 0.2; hostname"})
			if err == nil && strings.TrimSpace(r.Stdout) != ids[4] {
				err = fmt.Errorf("hostname %q", r.Stdout)
			}
			errc <- err
		}()
	}
	for range 8 {
		if err := <-errc; err != nil {
			t.Errorf("concurrent exec after restart: %v", err)
		}
	}
	for _, id := range ids {
		if r, err := api.Exec(ctx, id, apiv1.ExecRequest{Args: []string{"hostname"}}); err != nil || strings.TrimSpace(r.Stdout) != id {
			t.Errorf("exec in %s after restart: %+v %v", id, r, err)
		}
	}
	if ev, err := api.Eval(ctx, ids[0], apiv1.EvalRequest{Code: "x.sum()"}); err != nil || ev.Value != "6" {
		t.Errorf("interpreter state after restart: %+v %v", ev, err)
	}

	// kill -9 again; meanwhile one VMM dies, one record is lost (its VMM
	// becomes an orphan) and a stray run dir appears. The next daemon marks
	// the first dead, kills the orphan and removes the stray dir.
	d.kill9()
	dead, orphan := record(t, c, ids[0]), record(t, c, ids[1])
	if err := proc.Kill(ctx, dead.Handle.Process); err != nil {
		t.Fatal(err)
	}
	st, err := state.Open(filepath.Join(c.data, "state.db"), state.Options{})
	if err != nil {
		t.Fatal(err)
	}
	testutil.Check(t, st.Delete(orphan.ID))
	stray := filepath.Join(c.data, "run", "sb-straystray")
	testutil.MkdirAll(t, stray, 0o700)
	d.start()
	if !strings.Contains(d.output(), "3 sandbox(es) re-adopted, 1 found dead, 0 half-started aborted, 1 orphan VMM(s) killed") {
		t.Errorf("reconcile report:\n%s", d.output())
	}
	if proc.Alive(orphan.Handle.Process) {
		t.Errorf("orphan VMM %d still runs", orphan.Handle.Process.PID)
	}
	for _, dir := range []string{stray, orphan.Handle.RunDir, dead.Handle.RunDir} {
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("%s survived reconcile: %v", dir, err)
		}
	}
	api = d.client(d.token)
	if sb, err := api.GetSandbox(ctx, dead.ID); err != nil || sb.Status != apiv1.SandboxDead {
		t.Errorf("dead sandbox: %+v %v", sb, err)
	}

	// SIGTERM: the daemon stops cleanly and the sandboxes keep running.
	d.cmd.Process.Signal(syscall.SIGTERM)
	if err := d.cmd.Wait(); err != nil {
		t.Errorf("daemon after SIGTERM: %v\n%s", err, d.output())
	}
	d.cmd = nil
	for _, id := range ids[2:] {
		if sb := record(t, c, id); !proc.Alive(sb.Handle.Process) {
			t.Errorf("%s died with a SIGTERMed daemon", id)
		}
	}
	d.start()
	api = d.client(d.token)
	for _, id := range []string{ids[0], ids[2], ids[3], ids[4]} {
		if err := api.DeleteSandbox(ctx, id); err != nil {
			t.Errorf("delete %s: %v", id, err)
		}
	}
	if list, _ := api.ListSandboxes(ctx, client.ListOptions{}); len(list) != 0 {
		t.Errorf("left after deleting all: %+v", list)
	}
	if pids := testutil.ProcessesUnder(filepath.Join(c.data, "run")); len(pids) != 0 {
		t.Errorf("QEMU processes left: %v", pids)
	}
	if ents, _ := os.ReadDir(filepath.Join(c.data, "run")); len(ents) != 0 {
		t.Errorf("run dirs left: %v", ents)
	}
	if err := api.DeleteSnapshot(ctx, "py"); err != nil {
		t.Errorf("delete snapshot: %v", err)
	}
	// The audit log saw every request.
	if b, _ := os.ReadFile(filepath.Join(c.data, "audit.log")); !bytes.Contains(b, []byte(`"route":"POST /v1/sandboxes","status":201`)) {
		t.Errorf("audit log lacks the create: %.500s", b)
	}
}

// record reads a sandbox's record from the state store while no daemon
// holds it, or through the daemon's data when one does not matter.
func record(t *testing.T, c *cli, id string) *state.Sandbox {
	t.Helper()
	st, err := state.Open(filepath.Join(c.data, "state.db"), state.Options{LockTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	sb, err := st.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

func runEnv(t *testing.T, env []string, args ...string) string {
	t.Helper()
	cmd := exec.Command(forkdBin, args...)
	cmd.Env = env
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) {
			t.Fatal(err)
		}
		t.Errorf("forkd %v: %v: %s", args, err, errb.String())
	}
	return out.String()
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// TestServeTLS: with --tls-cert/--tls-key the TCP listener speaks TLS and
// still wants the token.
func TestServeTLS(t *testing.T) {
	c := newCLI(t)
	certFile, keyFile := filepath.Join(c.data, "cert.pem"), filepath.Join(c.data, "key.pem")
	testutil.SelfSigned(t, certFile, keyFile)

	d := startServe(t, c, "--tls-cert", certFile, "--tls-key", keyFile)
	pool := x509.NewCertPool()
	if pemBytes, _ := os.ReadFile(certFile); !pool.AppendCertsFromPEM(pemBytes) {
		t.Fatal("no certificate in " + certFile)
	}
	url := strings.Replace(d.url, "http://", "https://", 1)
	ctx := context.Background()
	api, err := client.New(url, d.token, client.Options{TLS: &tls.Config{RootCAs: pool}})
	if err != nil {
		t.Fatal(err)
	}
	if v, err := api.Version(ctx); err != nil || v.DataDir != c.data {
		t.Errorf("version over TLS: %+v %v", v, err)
	}
	noTok, _ := client.New(url, "", client.Options{TLS: &tls.Config{RootCAs: pool}})
	if _, err := noTok.Version(ctx); !errors.Is(err, client.ErrUnauthenticated) {
		t.Errorf("no token over TLS: %v", err)
	}
	if err := d.client(d.token).Health(ctx); err == nil {
		t.Errorf("plain HTTP answered on the TLS listener")
	}
}
