package guest

import (
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/testutil"
)

func TestParseCmdline(t *testing.T) {
	got := parseCmdline(`console=ttyS0 quiet forkd.root=/dev/vda forkd.preload=numpy,json  init="/init x" forkd.python=` + "\n")
	want := map[string]string{
		"console": "ttyS0", "quiet": "", "forkd.root": "/dev/vda",
		"forkd.preload": "numpy,json", "init": "/init x", "forkd.python": "",
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v", got)
	}
}

func TestLoadBootConfig(t *testing.T) {
	dir := t.TempDir()
	fakePy := filepath.Join(dir, "python3")
	testutil.WriteFile(t, fakePy, []byte("#!/bin/sh\n"), 0o755)
	cfgPath := filepath.Join(dir, "agent.json")
	testutil.WriteFile(t, cfgPath, []byte(`{"python": "`+fakePy+`", "preload": ["numpy"], "env": ["A=1"], "eval_grace_ms": 500}`), 0o644)

	bc, err := loadBootConfig(map[string]string{}, cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	if bc.agent.Python != fakePy || !reflect.DeepEqual(bc.agent.Preload, []string{"numpy"}) ||
		bc.agent.EvalGrace != 500*time.Millisecond || bc.console != DefaultConsole || bc.rootFSType != "ext4" {
		t.Fatalf("from file: %+v", bc)
	}
	if env := bc.agent.Env; len(env) != len(DefaultEnv)+1 || env[len(env)-1] != "A=1" {
		t.Fatalf("env %v", env)
	}

	// The command line wins over the file.
	bc, err = loadBootConfig(map[string]string{
		KeyPreload: "json, os", KeyRoot: "/dev/vda", KeyRootFSType: "xfs", KeyConsole: "/dev/hvc1", KeyDebug: "1",
	}, cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(bc.agent.Preload, []string{"json", "os"}) || bc.root != "/dev/vda" ||
		bc.rootFSType != "xfs" || bc.console != "/dev/hvc1" || !bc.debug {
		t.Fatalf("from cmdline: %+v", bc)
	}
	bc, _ = loadBootConfig(map[string]string{KeyPython: "none"}, cfgPath)
	if bc.agent.Python != "" {
		t.Fatalf("python=none kept %q", bc.agent.Python)
	}
	// A configured interpreter that is missing disables eval, with a reason.
	bc, err = loadBootConfig(map[string]string{KeyPython: "/no/python"}, cfgPath)
	if bc.agent.Python != "" || err == nil || !strings.Contains(err.Error(), "/no/python") {
		t.Fatalf("missing python: %q, %v", bc.agent.Python, err)
	}
	// A broken file is reported; defaults remain.
	testutil.WriteFile(t, cfgPath, []byte(`{`), 0o644)
	if _, err := loadBootConfig(nil, cfgPath); err == nil {
		t.Fatal("broken agent.json accepted silently")
	}
}

func TestRing(t *testing.T) {
	r := newRing(8)
	buf := make([]byte, 16)
	n, next, ended, _ := r.readAt(0, buf)
	if n != 0 || next != 0 || ended {
		t.Fatalf("empty ring: %d %d %v", n, next, ended)
	}
	r.Write([]byte("abcde"))
	n, next, _, _ = r.readAt(0, buf)
	if string(buf[:n]) != "abcde" || next != 5 {
		t.Fatalf("read %q next %d", buf[:n], next)
	}
	r.Write([]byte("fghijk")) // wraps; "abc" is overwritten
	n, next, _, _ = r.readAt(0, buf)
	if string(buf[:n]) != "defghijk" || next != 11 {
		t.Fatalf("after wrap %q next %d", buf[:n], next)
	}
	r.Write([]byte("0123456789xyz")) // longer than the ring
	_, _, _, wake := r.readAt(11, buf)
	r.close()
	select {
	case <-wake:
	default:
		t.Fatal("close did not wake readers")
	}
	n, next, ended, _ = r.readAt(11, buf)
	if string(buf[:n]) != "56789xyz" || !ended || next != 24 {
		t.Fatalf("after overflow %q next %d ended %v", buf[:n], next, ended)
	}
}

func TestLookupUser(t *testing.T) {
	root := t.TempDir()
	testutil.MkdirAll(t, root+"/etc", 0o755)
	testutil.WriteFile(t, root+"/etc/passwd", []byte("root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/bash\nbroken\n"), 0o644)
	testutil.WriteFile(t, root+"/etc/group", []byte("alice:x:1000:\nwheel:x:10:alice,bob\nother:x:11:bob\n"), 0o644)
	a, err := lookupUser(root, "alice")
	if err != nil || a.uid != 1000 || a.gid != 1000 || a.home != "/home/alice" || !reflect.DeepEqual(a.groups, []uint32{10}) {
		t.Fatalf("alice: %+v, %v", a, err)
	}
	a, err = lookupUser(root, "1000")
	if err != nil || a.name != "alice" {
		t.Fatalf("uid 1000: %+v, %v", a, err)
	}
	a, err = lookupUser(root, "4242")
	if err != nil || a.uid != 4242 || a.gid != 4242 || a.home != "/" {
		t.Fatalf("unlisted uid: %+v, %v", a, err)
	}
	if _, err := lookupUser(root, "mallory"); err == nil {
		t.Fatal("unknown user found")
	}
}

// The reaper collects every child, including one that exits before it is
// registered, and leaves processes it did not start alone.
func TestReaper(t *testing.T) {
	r := processReaper()
	var chans []<-chan exitStatus
	for i := range 20 {
		code := i % 3
		_, ch, err := r.start(func() (int, error) {
			return syscall.ForkExec("/bin/sh", []string{"sh", "-c", "exit " + string(rune('0'+code))}, &syscall.ProcAttr{})
		})
		if err != nil {
			t.Fatal(err)
		}
		chans = append(chans, ch)
	}
	for i, ch := range chans {
		select {
		case st := <-ch:
			if st.err != nil || st.ws.ExitStatus() != i%3 {
				t.Fatalf("child %d: %+v", i, st)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("child %d never reaped", i)
		}
	}
	// A child this package did not start stays for its owner to wait for.
	pid, err := syscall.ForkExec("/bin/true", []string{"true"}, &syscall.ProcAttr{})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	r.kick <- struct{}{}
	time.Sleep(100 * time.Millisecond)
	var ws syscall.WaitStatus
	if got, err := syscall.Wait4(pid, &ws, 0, nil); got != pid || err != nil {
		t.Fatalf("foreign child: wait4 = %d, %v (reaped by the agent?)", got, err)
	}
}

func TestSyncScanner(t *testing.T) {
	stream := "hello\x00\x1bforkd-sync-7\x1b\x00world\x00\x1bforkd-sync-8\x1b\x00\x00\x1bforkd-x"
	// Fed in every possible split, the output and the ids come out whole.
	for split := 0; split <= len(stream); split++ {
		var s syncScanner
		out1, ids1 := s.feed([]byte(stream[:split]))
		out2, ids2 := s.feed([]byte(stream[split:]))
		out3, _ := s.feed([]byte(strings.Repeat("-", 30)))
		got := string(out1) + string(out2) + string(out3)
		if got != "helloworld\x00\x1bforkd-x"+strings.Repeat("-", 30) {
			t.Fatalf("split %d: output %q", split, got)
		}
		if ids := append(ids1, ids2...); !reflect.DeepEqual(ids, []int64{7, 8}) {
			t.Fatalf("split %d: ids %v", split, ids)
		}
	}
}

func TestParseNetConfig(t *testing.T) {
	nc, ok, err := parseNetConfig(map[string]string{KeyIP: "172.16.0.2/30", KeyGW: "172.16.0.1", KeyDNS: "1.1.1.1,9.9.9.9"})
	if err != nil || !ok || nc.addr.String() != "172.16.0.2/30" || nc.gw.String() != "172.16.0.1" || len(nc.dns) != 2 {
		t.Fatalf("parseNetConfig = %+v, %v, %v", nc, ok, err)
	}
	if _, ok, err := parseNetConfig(map[string]string{}); ok || err != nil {
		t.Fatalf("no keys: %v %v", ok, err)
	}
	for _, c := range []struct {
		name string
		keys map[string]string
	}{
		{"no prefix", map[string]string{KeyIP: "172.16.0.2"}},
		{"ipv6", map[string]string{KeyIP: "::1/64"}},
		{"bad gateway", map[string]string{KeyIP: "10.0.0.2/24", KeyGW: "x"}},
		{"bad dns", map[string]string{KeyIP: "10.0.0.2/24", KeyDNS: "a"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if _, _, err := parseNetConfig(c.keys); err == nil {
				t.Errorf("parseNetConfig(%v) accepted", c.keys)
			}
		})
	}
}

// TestEmulatedCPUEnv: OpenBLAS gets a core type its kernels run on under
// QEMU's emulated CPU, unless one is set; other CPUs keep the environment.
func TestEmulatedCPUEnv(t *testing.T) {
	qemu := "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: QEMU Virtual CPU version 2.5+\n"
	host := "processor\t: 0\nmodel name\t: AMD EPYC 7B13\n"
	if got := emulatedCPUEnv(qemu, nil); !reflect.DeepEqual(got, append(append([]string(nil), DefaultEnv...), "OPENBLAS_CORETYPE=Prescott")) {
		t.Errorf("qemu64, default env: %v", got)
	}
	set := []string{"PATH=/bin", "OPENBLAS_CORETYPE=Haswell"}
	if got := emulatedCPUEnv(qemu, set); !reflect.DeepEqual(got, set) {
		t.Errorf("qemu64, core type set: %v", got)
	}
	if got := emulatedCPUEnv(host, set[:1]); !reflect.DeepEqual(got, set[:1]) {
		t.Errorf("host CPU: %v", got)
	}
	if got := emulatedCPUEnv(host, nil); !reflect.DeepEqual(got, DefaultEnv) {
		t.Errorf("host CPU, default env: %v", got)
	}
}
