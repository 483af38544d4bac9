package sandbox_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/cgroup"
	"github.com/forkd/forkd/internal/netns"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/state"
	"github.com/forkd/forkd/internal/testutil"
	"github.com/forkd/forkd/internal/testvm"
)

// outsideHost is a server in a network namespace of its own, joined to the
// host by a veth: "the internet" (a public address) or a host-side private
// network, depending on the address.
type outsideHost struct {
	ns, link string
	addr     netip.Addr
}

func ipcmd(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// newOutsideHost makes namespace name with addr/24 and an HTTP server on
// port 80 answering body.
func newOutsideHost(t *testing.T, name string, addr netip.Addr, body string) *outsideHost {
	t.Helper()
	testutil.RequireCommand(t, "ip")
	h := &outsideHost{ns: name, link: name + "h", addr: addr}
	exec.Command("ip", "netns", "del", h.ns).Run()
	exec.Command("ip", "link", "del", h.link).Run()
	ipcmd(t, "netns", "add", h.ns)
	t.Cleanup(func() {
		exec.Command("ip", "netns", "del", h.ns).Run()
		exec.Command("ip", "link", "del", h.link).Run()
	})
	hostSide := addr.As4()
	hostSide[3] = 254
	gw := netip.AddrFrom4(hostSide).String()
	ipcmd(t, "link", "add", h.link, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
	ipcmd(t, "addr", "add", gw+"/24", "dev", h.link)
	ipcmd(t, "link", "set", h.link, "up")
	ipcmd(t, "-n", h.ns, "addr", "add", addr.String()+"/24", "dev", "eth0")
	ipcmd(t, "-n", h.ns, "link", "set", "eth0", "up")
	ipcmd(t, "-n", h.ns, "link", "set", "lo", "up")
	ipcmd(t, "-n", h.ns, "route", "add", "default", "via", gw)
	www := t.TempDir()
	testutil.WriteFile(t, filepath.Join(www, "index.html"), []byte(body), 0o644)
	srv := exec.Command("ip", "netns", "exec", h.ns, "busybox", "httpd", "-f", "-p", "80", "-h", www)
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	return h
}

// fetch runs an HTTP GET of url inside sandbox id (busybox nc) and returns
// what came back, "" when nothing did.
func fetch(t *testing.T, e *sandbox.Engine, id string, addr netip.Addr) string {
	t.Helper()
	out, _ := run(t, e, id, fmt.Sprintf(`printf 'GET /index.html HTTP/1.0\r\n\r\n' | nc -w 3 %s 80 2>&1`, addr))
	return out
}

// hostNet reads the data dir's share of the host network (prefix).
func hostNet(t *testing.T, e *sandbox.Engine) sandbox.HostNet {
	b, err := os.ReadFile(filepath.Join(e.Config().DataDir, "network.json"))
	if err != nil {
		t.Fatal(err)
	}
	var hn sandbox.HostNet
	json.Unmarshal(b, &hn)
	return hn
}

func httpGet(url string) (string, error) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// TestIsolation: children with networking serve HTTP started in the
// parent, the host reaches each at its own address, children cannot reach
// each other, egress follows each sandbox's policy, ports publish, and
// limits hold.
func TestIsolation(t *testing.T) {
	testutil.RequireRoot(t)
	e := testvm.Engine(t)
	ctx := ctxT(t, 15*time.Minute)
	_, err := e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: "web", Image: "minimal", Network: true,
		Warmup: []string{"busybox httpd -p 80 -h /etc", "sh -c 'cat /sys/class/net/eth0/statistics/tx_packets >/tmp/tx-parent'"}})
	if err != nil {
		t.Fatal(err)
	}
	hn := hostNet(t, e)
	inet := newOutsideHost(t, hn.Prefix+"inet", netip.MustParseAddr("203.0.113.1"), "internet") // TEST-NET-3: the netns tests own TEST-NET-2
	private := newOutsideHost(t, hn.Prefix+"priv", netip.MustParseAddr("10.99.77.1"), "private")

	res, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "web", N: 3, Net: &sandbox.NetSpec{Publish: []int{80}}})
	if err != nil {
		t.Fatal(err)
	}
	forked := time.Now()
	kids := make([]*state.Sandbox, 3)
	for i, c := range res.Children {
		kids[i] = c.Sandbox
		if c.Sandbox.Net == nil || c.Sandbox.Net.Address == "" || len(c.Sandbox.Net.Ports) != 1 {
			t.Fatalf("child %s network %+v", c.ID, c.Sandbox.Net)
		}
	}

	t.Run("NoAnnouncementAfterRestore", func(t *testing.T) {
		// A restored child has not moved, so QEMU does not have it
		// announce its address as after a migration (a gratuitous ARP a
		// round, five rounds in 0.8 s): before anyone talks to it, it
		// has sent nothing since its parent was saved.
		time.Sleep(time.Until(forked.Add(2 * time.Second)))
		out, code := run(t, e, kids[0].ID, "cat /tmp/tx-parent /sys/class/net/eth0/statistics/tx_packets")
		if f := strings.Fields(out); code != 0 || len(f) != 2 || f[0] != f[1] {
			t.Fatalf("packets the parent had sent, then the child: %q (exit %d); want the same", out, code)
		}
	})
	t.Run("HostReachesEachChild", func(t *testing.T) {
		for _, k := range kids {
			body, err := httpGet("http://" + k.Net.Address + "/hostname")
			if err != nil || strings.TrimSpace(body) != k.ID {
				t.Fatalf("GET %s/hostname = %q, %v; want %s", k.Net.Address, body, err, k.ID)
			}
			// And through its published port on loopback.
			body, err = httpGet(fmt.Sprintf("http://127.0.0.1:%d/hostname", k.Net.Ports[0].HostPort))
			if err != nil || strings.TrimSpace(body) != k.ID {
				t.Fatalf("published port of %s = %q, %v", k.ID, body, err)
			}
		}
	})
	t.Run("IPv4OnlyOnTheLink", func(t *testing.T) {
		// IPv6 is off on the guest's NIC (the host's end and the policy
		// drop it: the guest would solicit a router there for ever);
		// loopback keeps ::1.
		out, code := run(t, e, kids[0].ID, "cat /proc/sys/net/ipv6/conf/eth0/disable_ipv6 /proc/sys/net/ipv6/conf/lo/disable_ipv6; grep -c ' lo$' /proc/net/if_inet6")
		if f := strings.Fields(out); code != 0 || !slices.Equal(f, []string{"1", "0", "1"}) {
			t.Fatalf("disable_ipv6 of eth0 and lo, and loopback's IPv6 addresses: %q (exit %d); want 1, 0 and 1", out, code)
		}
	})
	t.Run("ChildrenCannotReachEachOther", func(t *testing.T) {
		b := netip.MustParseAddr(kids[1].Net.Address)
		if out := fetch(t, e, kids[0].ID, b); strings.Contains(out, "HTTP/") {
			t.Fatalf("child A reached child B: %q", out)
		}
	})
	t.Run("Egress", func(t *testing.T) {
		a := kids[0].ID
		if out := fetch(t, e, a, inet.addr); !strings.Contains(out, "internet") {
			t.Fatalf("allow: internet unreachable: %q", out)
		}
		if out := fetch(t, e, a, private.addr); strings.Contains(out, "private") {
			t.Fatalf("allow: host-side private range reachable: %q", out)
		}
		// Changed on the running sandbox: deny.
		if _, err := e.SetPolicy(ctx, a, netns.Policy{Mode: netns.ModeDeny}); err != nil {
			t.Fatal(err)
		}
		if out := fetch(t, e, a, inet.addr); strings.Contains(out, "internet") {
			t.Fatalf("deny: internet reachable: %q", out)
		}
		// An allowlist naming the server, then one naming something else.
		named := netns.Policy{Mode: netns.ModeAllowlist, Allow: []netns.Rule{{CIDR: netip.MustParsePrefix("203.0.113.1/32"), Proto: "tcp"}}}
		if _, err := e.SetPolicy(ctx, a, named); err != nil {
			t.Fatal(err)
		}
		if out := fetch(t, e, a, inet.addr); !strings.Contains(out, "internet") {
			t.Fatalf("allowlist naming it: unreachable: %q", out)
		}
		other := netns.Policy{Mode: netns.ModeAllowlist, Allow: []netns.Rule{{CIDR: netip.MustParsePrefix("198.51.100.0/24")}}}
		if _, err := e.SetPolicy(ctx, a, other); err != nil {
			t.Fatal(err)
		}
		if out := fetch(t, e, a, inet.addr); strings.Contains(out, "internet") {
			t.Fatalf("allowlist not naming it: reachable: %q", out)
		}
		// The private range is reachable only when named explicitly.
		priv := netns.Policy{Mode: netns.ModeAllow, Allow: []netns.Rule{{CIDR: netip.MustParsePrefix("10.99.77.0/24")}}}
		if _, err := e.SetPolicy(ctx, a, priv); err != nil {
			t.Fatal(err)
		}
		if out := fetch(t, e, a, private.addr); !strings.Contains(out, "private") {
			t.Fatalf("named private range unreachable: %q", out)
		}
		// A child forked with deny never reaches out.
		d, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "web", N: 1, Net: &sandbox.NetSpec{Policy: netns.Policy{Mode: netns.ModeDeny}}})
		if err != nil {
			t.Fatal(err)
		}
		if out := fetch(t, e, d.Children[0].ID, inet.addr); strings.Contains(out, "internet") {
			t.Fatalf("child forked with deny reached the internet: %q", out)
		}
		e.Kill(ctx, d.Children[0].ID)
	})
	t.Run("MemoryLimitOOM", func(t *testing.T) {
		r, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "web", N: 2, Limits: &state.Limits{MemoryMiB: 128}})
		if err != nil {
			t.Fatal(err)
		}
		victim, sibling := r.Children[0].Sandbox, r.Children[1].Sandbox
		c, release, err := e.Agent(ctx, victim.ID)
		if err != nil {
			t.Fatal(err)
		}
		ectx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		_, err = c.Exec(ectx, agent.ExecRequest{Shell: "dd if=/dev/zero of=/tmp/fill bs=1M count=220"})
		cancel()
		release()
		if err == nil {
			t.Fatal("a guest writing 220 MiB under a 128 MiB limit survived")
		}
		deadline := time.Now().Add(20 * time.Second)
		for proc.Alive(victim.Handle.Process) && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		got, err := e.Get(ctx, victim.ID)
		if err != nil || got.Status != state.StatusOOM {
			t.Fatalf("victim status %v, %v; want oom", got.Status, err)
		}
		if out, code := run(t, e, sibling.ID, "echo alive"); code != 0 || strings.TrimSpace(out) != "alive" {
			t.Fatalf("sibling after the OOM kill: %q %d", out, code)
		}
		if err := e.Kill(ctx, victim.ID); err != nil {
			t.Fatal(err)
		}
		e.Kill(ctx, sibling.ID)
	})
	t.Run("IOLimits", func(t *testing.T) {
		r, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "web", N: 1, Limits: &state.Limits{IOReadBps: 10 << 20, IOWriteBps: 5 << 20}})
		if err != nil {
			t.Fatal(err)
		}
		id := r.Children[0].ID
		maj, min, err := cgroup.DeviceOf(e.Config().DataDir)
		if err != nil {
			t.Fatal(err)
		}
		for file, want := range map[string]string{
			"blkio.throttle.read_bps_device":  fmt.Sprintf("%d:%d %d", maj, min, 10<<20),
			"blkio.throttle.write_bps_device": fmt.Sprintf("%d:%d %d", maj, min, 5<<20),
		} {
			paths, _ := filepath.Glob("/sys/fs/cgroup/blkio/*/*/forkd-" + hostNet(t, e).Prefix + "/" + id + "/" + file)
			more, _ := filepath.Glob("/sys/fs/cgroup/blkio/forkd-" + hostNet(t, e).Prefix + "/" + id + "/" + file)
			paths = append(paths, more...)
			if len(paths) != 1 {
				t.Fatalf("%s of %s: found %v", file, id, paths)
			}
			b, _ := os.ReadFile(paths[0])
			if strings.TrimSpace(string(b)) != want {
				t.Fatalf("%s = %q, want %q", file, b, want)
			}
		}
		if out, code := run(t, e, id, "echo io"); code != 0 || strings.TrimSpace(out) != "io" {
			t.Fatalf("child with IO limits: %q %d", out, code)
		}
		e.Kill(ctx, id)
	})
	t.Run("ForkBombStaysInItsShare", func(t *testing.T) {
		r, err := e.Fork(ctx, sandbox.ForkSpec{Tag: "web", N: 1, Limits: &state.Limits{CPUs: 0.5, PIDs: 64}})
		if err != nil {
			t.Fatal(err)
		}
		bomb := r.Children[0].Sandbox
		c, release, err := e.Agent(ctx, bomb.ID)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Exec(ctx, agent.ExecRequest{Shell: "f(){ f|f& }; f", Background: true}); err != nil {
			t.Fatal(err)
		}
		release()
		time.Sleep(time.Second)
		before, _ := cpuTicks(bomb.Handle.Process.PID)
		start := time.Now()
		// The host stays responsive: a sibling answers and host processes
		// start promptly while the bomb runs.
		for i := 0; i < 5; i++ {
			t0 := time.Now()
			if out, code := run(t, e, kids[2].ID, "echo ok"); code != 0 || strings.TrimSpace(out) != "ok" {
				t.Fatalf("sibling during the fork bomb: %q %d", out, code)
			}
			if err := exec.Command("true").Run(); err != nil {
				t.Fatal(err)
			}
			if d := time.Since(t0); d > 15*time.Second {
				t.Fatalf("sibling exec took %s during the fork bomb", d)
			}
			time.Sleep(300 * time.Millisecond)
		}
		after, _ := cpuTicks(bomb.Handle.Process.PID)
		cores := float64(after-before) / 100 / time.Since(start).Seconds()
		if cores > 0.6 {
			t.Fatalf("fork-bombed sandbox used %.2f cores under a 0.5 limit", cores)
		}
		t.Logf("fork-bombed sandbox used %.2f cores (limit 0.5)", cores)
		if err := e.Kill(ctx, bomb.ID); err != nil {
			t.Fatal(err)
		}
	})
}

// cpuTicks is a process's utime+stime in clock ticks.
func cpuTicks(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	var ut, st int64
	fmt.Sscan(f[11], &ut)
	fmt.Sscan(f[12], &st)
	return ut + st, nil
}

// TestCreateDestroyCyclesLeaveNothing runs 200 create/destroy cycles with
// networking, limits and a published port, most of them made to fail at
// one step of the creation, and then checks by listing that nothing of
// ours is left: namespaces, links, nftables tables, cgroups, run dirs,
// records, VMM processes.
func TestCreateDestroyCyclesLeaveNothing(t *testing.T) {
	testutil.RequireRoot(t)
	steps := []string{"recorded", "isolated", "restored", "published"}
	var failAt atomic.Value
	failAt.Store("")
	e := testvm.EngineWith(t, func(c *sandbox.Config) {
		c.Fault = func(step string) error {
			if failAt.Load().(string) == step {
				return errors.New("injected failure at " + step)
			}
			return nil
		}
	})
	ctx := ctxT(t, 15*time.Minute)
	if _, err := e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: "cyc", Image: "minimal", Network: true}); err != nil {
		t.Fatal(err)
	}
	spec := sandbox.ForkSpec{Tag: "cyc", N: 1, Net: &sandbox.NetSpec{Publish: []int{80}}, Limits: &state.Limits{MemoryMiB: 512, PIDs: 128}}
	const cycles = 200
	var mu sync.Mutex // failAt is one value: cycles that inject run alone
	fails, oks := 0, 0
	var wg sync.WaitGroup
	sem := make(chan struct{}, 2)
	for i := 0; i < cycles && !t.Failed(); i++ {
		inject := ""
		if i%5 != 0 {
			inject = steps[i%len(steps)]
		}
		if inject != "" {
			mu.Lock()
			failAt.Store(inject)
			_, err := e.Fork(ctx, spec)
			failAt.Store("")
			mu.Unlock()
			if err == nil || !strings.Contains(err.Error(), "injected failure at "+inject) {
				t.Errorf("cycle %d: fork with a failure at %s = %v", i, inject, err)
			}
			fails++
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			mu.Lock()
			r, err := e.Fork(ctx, spec)
			mu.Unlock()
			if err != nil {
				t.Errorf("cycle %d: %v", i, err)
				return
			}
			if err := e.Kill(ctx, r.Children[0].ID); err != nil {
				t.Errorf("cycle %d kill: %v", i, err)
			}
		}(i)
		oks++
	}
	wg.Wait()
	t.Logf("%d cycles: %d completed, %d failed on purpose", cycles, oks, fails)
	assertNothingLeft(t, e)
}

// assertNothingLeft lists the host for anything of e's: it must be empty.
func assertNothingLeft(t *testing.T, e *sandbox.Engine) {
	t.Helper()
	hn := hostNet(t, e)
	if list, _ := e.State().List(); len(list) != 0 {
		t.Errorf("%d records left", len(list))
	}
	if ents, _ := os.ReadDir(filepath.Join(e.Config().DataDir, "run")); len(ents) != 0 {
		t.Errorf("run dirs left: %v", ents)
	}
	if ents, _ := os.ReadDir("/run/netns"); ents != nil {
		for _, ent := range ents {
			if strings.HasPrefix(ent.Name(), hn.Prefix+"-") {
				t.Errorf("netns left: %s", ent.Name())
			}
		}
	}
	links, _ := os.ReadDir("/sys/class/net")
	for _, l := range links {
		if strings.HasPrefix(l.Name(), hn.Prefix) {
			t.Errorf("link left: %s", l.Name())
		}
	}
	if out, err := exec.Command("nft", "list", "tables").Output(); err != nil {
		t.Errorf("nft list tables: %v", err)
	} else if strings.Contains(string(out), hn.Prefix) {
		t.Errorf("nftables tables left:\n%s", out)
	}
	parents, _ := filepath.Glob("/sys/fs/cgroup/*/*/*/forkd-" + hn.Prefix)
	more, _ := filepath.Glob("/sys/fs/cgroup/*/forkd-" + hn.Prefix)
	for _, p := range append(parents, more...) {
		t.Errorf("cgroup left: %s", p)
	}
	if procs := testutil.ProcessesUnder(filepath.Join(e.Config().DataDir, "run")); len(procs) != 0 {
		t.Errorf("VMM processes of this data dir left: %v", procs)
	}
	out, err := exec.Command("pgrep", "-f", e.Config().DataDir).Output()
	if ee := (*exec.ExitError)(nil); err != nil && !(errors.As(err, &ee) && ee.ExitCode() == 1) { // 1: none matched
		t.Errorf("pgrep: %v", err)
	}
	if len(bytes.TrimSpace(out)) != 0 {
		t.Errorf("processes of this data dir left: %s", out)
	}
}
