package cgroup

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

// fakeHost is a cgroup tree in a temporary directory: a mountinfo, a
// /proc/self/cgroup, and directories for each mounted hierarchy.
type fakeHost struct {
	root            string
	mountInfo, self string
	mounts          map[string]string // hierarchy name ("memory", "cpu,cpuacct", "unified") -> mount point
	v2ctrls         string
}

// fakeFiles are the control files the kernel creates in a new cgroup, by
// controller.
var fakeFiles = map[string]map[string]string{
	"memory": {"memory.limit_in_bytes": "9223372036854771712", "memory.memsw.limit_in_bytes": "9223372036854771712",
		"memory.move_charge_at_immigrate": "0", "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
		"memory.usage_in_bytes": "0", "memory.max_usage_in_bytes": "0", "memory.failcnt": "0"},
	"cpu":     {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "-1", "cpu.shares": "1024", "cpu.stat": "nr_periods 0\nnr_throttled 0\n"},
	"cpuacct": {"cpuacct.usage": "0"},
	"freezer": {"freezer.state": "THAWED"},
	"pids":    {"pids.max": "max", "pids.current": "0", "pids.events": "max 0\n"},
	"blkio":   {"blkio.bfq.weight": "100", "blkio.throttle.read_bps_device": "", "blkio.throttle.write_bps_device": "", "blkio.throttle.read_iops_device": "", "blkio.throttle.write_iops_device": ""},
	"v2": {"memory.max": "max", "memory.swap.max": "max", "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n",
		"memory.current": "0", "cpu.max": "max 100000", "cpu.weight": "100", "cpu.stat": "usage_usec 0\n",
		"pids.max": "max", "pids.current": "0", "pids.events": "max 0\n", "io.weight": "default 100", "io.max": "",
		"cgroup.subtree_control": "", "cgroup.controllers": "", "cgroup.kill": "",
		"cgroup.freeze": "0", "cgroup.events": "populated 0\nfrozen 0\n"},
}

// newFake builds a host. v1 names hierarchies mounted as v1 (each
// "a,b" for co-mounted controllers); v2ctrls, if not "-", mounts a v2
// hierarchy offering those controllers. Our own cgroup is ownPath in every
// hierarchy.
func newFake(t *testing.T, v1 []string, v2ctrls, ownPath string) *fakeHost {
	t.Helper()
	f := &fakeHost{root: t.TempDir(), mounts: map[string]string{}, v2ctrls: v2ctrls}
	var mi, self strings.Builder
	id := 30
	add := func(name, fstype, opts string, n int) {
		mnt := filepath.Join(f.root, "sys/fs/cgroup", name)
		own := filepath.Join(mnt, ownPath)
		if err := os.MkdirAll(own, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, file := range []string{"cgroup.procs", "tasks"} {
			testutil.WriteFile(t, filepath.Join(own, file), nil, 0o644)
		}
		f.mounts[name] = mnt
		fmt.Fprintf(&mi, "%d 25 0:%d / %s rw,relatime shared:%d - %s %s %s\n", id, id, mnt, id, fstype, fstype, opts)
		id++
		_ = n
	}
	fmt.Fprintf(&mi, "24 1 0:22 / / rw - ext4 /dev/vda rw\n")
	for i, name := range v1 {
		add(name, "cgroup", "rw,"+name, i)
		fmt.Fprintf(&self, "%d:%s:%s\n", i+1, name, ownPath)
	}
	fmt.Fprintf(&self, "%d:name=systemd:/\n", len(v1)+1)
	if v2ctrls != "-" {
		add("unified", "cgroup2", "rw", 0)
		fmt.Fprintf(&self, "0::%s\n", ownPath)
		own := filepath.Join(f.mounts["unified"], ownPath)
		testutil.WriteFile(t, filepath.Join(own, "cgroup.controllers"), []byte(v2ctrls+"\n"), 0o644)
		testutil.WriteFile(t, filepath.Join(own, "cgroup.subtree_control"), nil, 0o644)
	}
	f.mountInfo = filepath.Join(f.root, "mountinfo")
	f.self = filepath.Join(f.root, "cgroup")
	testutil.WriteFile(t, f.mountInfo, []byte(mi.String()), 0o644)
	testutil.WriteFile(t, f.self, []byte(self.String()), 0o644)
	return f
}

// manager returns a Manager on the fake host whose mkdir populates the
// control files as the kernel would, and whose rmdir refuses a group with
// processes.
func (f *fakeHost) manager(t *testing.T) *Manager {
	t.Helper()
	m, err := New(Options{MountInfo: f.mountInfo, SelfCgroup: f.self})
	if err != nil {
		t.Fatal(err)
	}
	m.mkdir = func(dir string) error {
		if err := os.Mkdir(dir, 0o755); err != nil {
			return err
		}
		var files map[string]string
		for name, mnt := range f.mounts {
			if !strings.HasPrefix(dir, mnt+"/") {
				continue
			}
			files = map[string]string{"cgroup.procs": "", "tasks": ""}
			kinds := strings.Split(name, ",")
			if name == "unified" {
				kinds = []string{"v2"}
			}
			for _, k := range kinds {
				for file, v := range fakeFiles[k] {
					files[file] = v
				}
			}
		}
		for file, v := range files {
			if err := os.WriteFile(filepath.Join(dir, file), []byte(v), 0o644); err != nil {
				return err
			}
		}
		return nil
	}
	m.destroyWait = 50 * time.Millisecond
	m.rmdir = func(dir string) error {
		if pids, _ := readPIDs(dir); len(pids) > 0 {
			return unix.EBUSY
		}
		if _, err := os.Stat(dir); err != nil {
			return err
		}
		return os.RemoveAll(dir)
	}
	return m
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// thisHost is the layout of the machine forkd is developed on: every
// controller on v1, v2 mounted with hugetlb only, our memory cgroup nested.
func thisHost(t *testing.T) *fakeHost {
	return newFake(t, []string{"cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids"}, "hugetlb", "/process_api/4ea8")
}

func TestDiscoverHybrid(t *testing.T) {
	f := thisHost(t)
	m := f.manager(t)
	for _, kind := range kinds {
		if v := m.Version(kind); v != 1 {
			t.Errorf("%s on v%d, want v1", kind, v)
		}
	}
	if got := m.Layout()[Memory]; got != "v1 "+filepath.Join(f.mounts["memory"], "process_api/4ea8/forkd") {
		t.Errorf("layout memory = %q", got)
	}
	g, err := m.Create("sb1", Limits{MemoryMiB: 64, CPUs: 1.5, CPUWeight: 50, PIDs: 100, IOWeight: 500,
		IO: []IOLimit{{Major: 8, Minor: 0, ReadBps: 1 << 20, WriteIOPS: 100}}})
	if err != nil {
		t.Fatal(err)
	}
	p := g.Placement()
	if p.CgroupFD != -1 {
		t.Errorf("CgroupFD = %d on a host whose v2 has no controller of ours", p.CgroupFD)
	}
	var hs []string
	for _, proc := range p.Procs {
		rel, _ := filepath.Rel(filepath.Join(f.root, "sys/fs/cgroup"), proc)
		hs = append(hs, rel)
	}
	want := []string{"cpu/process_api/4ea8/forkd/sb1/cgroup.procs", "cpuacct/process_api/4ea8/forkd/sb1/cgroup.procs",
		"memory/process_api/4ea8/forkd/sb1/cgroup.procs", "blkio/process_api/4ea8/forkd/sb1/cgroup.procs",
		"pids/process_api/4ea8/forkd/sb1/cgroup.procs", "freezer/process_api/4ea8/forkd/sb1/cgroup.procs"}
	slices.Sort(hs)
	slices.Sort(want)
	if !slices.Equal(hs, want) {
		t.Errorf("Procs = %v, want %v", hs, want)
	}
	dir := func(h string) string { return filepath.Join(f.mounts[h], "process_api/4ea8/forkd/sb1") }
	for file, want := range map[string]string{
		"memory/memory.limit_in_bytes":           "67108864",
		"memory/memory.memsw.limit_in_bytes":     "67108864",
		"memory/memory.move_charge_at_immigrate": "3",
		"cpu/cpu.cfs_period_us":                  "100000",
		"cpu/cpu.cfs_quota_us":                   "150000",
		"cpu/cpu.shares":                         "512",
		"pids/pids.max":                          "100",
		"blkio/blkio.bfq.weight":                 "50",
		"blkio/blkio.throttle.read_bps_device":   "8:0 1048576",
		"blkio/blkio.throttle.write_iops_device": "8:0 100",
		"blkio/blkio.throttle.write_bps_device":  "",
	} {
		h, name, _ := strings.Cut(file, "/")
		if got := readFile(t, filepath.Join(dir(h), name)); got != want {
			t.Errorf("%s = %q, want %q", file, got, want)
		}
	}
	// Nothing outside our own cgroup was touched.
	if _, err := os.Stat(filepath.Join(f.mounts["memory"], "forkd")); err == nil {
		t.Error("created a group at the root of the memory hierarchy")
	}
	if err := g.Add(4242); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(dir("pids"), "cgroup.procs")); got != "4242" {
		t.Errorf("pids cgroup.procs = %q", got)
	}
	if err := g.Destroy(); !errdefs.IsUnavailable(err) {
		t.Fatalf("destroy with a process that never leaves: %v", err)
	}
	for _, h := range []string{"memory", "cpu", "cpuacct", "pids", "blkio", "freezer"} {
		testutil.WriteFile(t, filepath.Join(dir(h), "cgroup.procs"), nil, 0o644)
	}
	if err := g.Destroy(); err != nil {
		t.Fatal(err)
	}
	if err := g.Destroy(); err != nil {
		t.Fatalf("second destroy: %v", err)
	}
	for _, h := range []string{"memory", "cpu", "cpuacct", "pids", "blkio", "cpuset", "devices", "freezer"} {
		if _, err := os.Stat(dir(h)); err == nil {
			t.Errorf("%s left", dir(h))
		}
	}
}

func TestDiscoverV2(t *testing.T) {
	f := newFake(t, nil, "cpuset cpu io memory hugetlb pids", "/system.slice/forkd.service")
	m := f.manager(t)
	for _, kind := range kinds {
		if v := m.Version(kind); v != 2 {
			t.Errorf("%s on v%d, want v2", kind, v)
		}
	}
	g, err := m.Create("sb", Limits{MemoryMiB: 512, CPUs: 0.5, PIDs: 64, IOWeight: 200,
		IO: []IOLimit{{Major: 253, Minor: 1, ReadBps: 1000, WriteIOPS: 10}}})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Destroy()
	p := g.Placement()
	if p.CgroupFD < 0 || len(p.Procs) != 0 {
		t.Fatalf("placement %+v: want a v2 fd and no v1 files", p)
	}
	own := filepath.Join(f.mounts["unified"], "system.slice/forkd.service")
	d := filepath.Join(own, "forkd", "sb")
	var st unix.Stat_t
	if err := unix.Fstat(p.CgroupFD, &st); err != nil {
		t.Fatal(err)
	}
	var want unix.Stat_t
	unix.Stat(d, &want)
	if st.Ino != want.Ino {
		t.Fatal("CgroupFD is not the group's directory")
	}
	for file, want := range map[string]string{
		filepath.Join(own, "cgroup.subtree_control"):          "+memory +cpu +pids +io",
		filepath.Join(own, "forkd", "cgroup.subtree_control"): "+memory +cpu +pids +io",
		filepath.Join(d, "memory.max"):                        "536870912",
		filepath.Join(d, "memory.swap.max"):                   "0",
		filepath.Join(d, "cpu.max"):                           "50000 100000",
		filepath.Join(d, "pids.max"):                          "64",
		filepath.Join(d, "io.weight"):                         "default 200",
		filepath.Join(d, "io.max"):                            "253:1 rbps=1000 wiops=10",
	} {
		if got := readFile(t, file); got != want {
			t.Errorf("%s = %q, want %q", file, got, want)
		}
	}
	testutil.WriteFile(t, filepath.Join(d, "memory.events"), []byte("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\n"), 0o644)
	testutil.WriteFile(t, filepath.Join(d, "cpu.stat"), []byte("usage_usec 1500000\nuser_usec 1000000\nnr_throttled 3\n"), 0o644)
	testutil.WriteFile(t, filepath.Join(d, "memory.current"), []byte("1234\n"), 0o644)
	if oom, err := g.OOMKilled(); err != nil || !oom {
		t.Errorf("OOMKilled = %v, %v", oom, err)
	}
	s, err := g.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if s.MemoryBytes != 1234 || s.MemoryLimitBytes != 512<<20 || s.MemoryFailures != 7 || s.OOMKills != 1 ||
		s.CPU.Seconds() != 1.5 || s.CPUThrottled != 3 {
		t.Errorf("stats %+v", s)
	}
	if err := g.Destroy(); err != nil {
		t.Fatal(err)
	}
	if g.Placement().CgroupFD != -1 {
		t.Error("fd still open after destroy")
	}
}

// A v2 controller we cannot delegate (our process sits in our own cgroup)
// is a clear precondition failure, and nothing is left behind.
func TestV2NotDelegable(t *testing.T) {
	f := newFake(t, nil, "memory pids", "/user.slice")
	m := f.manager(t)
	own := filepath.Join(f.mounts["unified"], "user.slice")
	testutil.Remove(t, filepath.Join(own, "cgroup.subtree_control")) // stands for EBUSY
	testutil.Mkdir(t, filepath.Join(own, "cgroup.subtree_control"), 0o755)
	if _, err := m.Create("x", Limits{MemoryMiB: 64}); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("create: %v", err)
	}
	if names, _ := m.List(); len(names) != 0 {
		t.Fatalf("left %v", names)
	}
}

func TestNestedMountRoot(t *testing.T) {
	// A cgroup namespace (or a container's mount) shows the hierarchy from
	// /process_api down: our path /process_api/abc lives at <mount>/abc.
	dir := t.TempDir()
	mnt := filepath.Join(dir, "memory")
	testutil.MkdirAll(t, filepath.Join(mnt, "abc"), 0o755)
	mi := filepath.Join(dir, "mountinfo")
	testutil.WriteFile(t, mi, []byte("35 31 0:32 /process_api "+mnt+" rw - cgroup cgroup rw,memory\n"+
		"36 31 0:33 /elsewhere "+filepath.Join(dir, "pids")+" rw - cgroup cgroup rw,pids\n"), 0o644)
	self := filepath.Join(dir, "cgroup")
	testutil.WriteFile(t, self, []byte("4:memory:/process_api/abc\n8:pids:/process_api/abc\n"), 0o644)
	m, err := New(Options{MountInfo: mi, SelfCgroup: self, Parent: "fk"})
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Layout(); len(got) != 1 || got[Memory] != "v1 "+filepath.Join(mnt, "abc/fk") {
		t.Fatalf("layout %v (pids is mounted from a root that does not hold us)", got)
	}
	if m.Version(PIDs) != 0 {
		t.Fatal("pids usable")
	}
	if _, err := m.Create("x", Limits{PIDs: 10}); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("pids limit without pids controller: %v", err)
	}
}

func TestNoControllers(t *testing.T) {
	f := newFake(t, []string{"devices"}, "-", "/")
	if _, err := New(Options{MountInfo: f.mountInfo, SelfCgroup: f.self}); !errdefs.IsUnavailable(err) {
		t.Fatalf("New = %v", err)
	}
}

func TestCreateErrors(t *testing.T) {
	m := thisHost(t).manager(t)
	for _, name := range []string{"", ".", "..", "a/b", "a b", strings.Repeat("x", 200)} {
		t.Run("name "+name, func(t *testing.T) {
			if _, err := m.Create(name, Limits{}); !errdefs.IsInvalidArgument(err) {
				t.Errorf("name %q: %v", name, err)
			}
		})
	}
	for _, c := range []struct {
		name string
		l    Limits
	}{
		{"memory", Limits{MemoryMiB: -1}},
		{"cpus", Limits{CPUs: -1}},
		{"cpus tiny", Limits{CPUs: 0.001}},
		{"cpu weight", Limits{CPUWeight: 20000}},
		{"pids", Limits{PIDs: -5}},
		{"io weight", Limits{IOWeight: 10001}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if _, err := m.Create("ok", c.l); !errdefs.IsInvalidArgument(err) {
				t.Errorf("limits %+v: %v", c.l, err)
			}
		})
	}
	g, err := m.Create("dup", Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Create("dup", Limits{}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("duplicate: %v", err)
	}
	if err := g.Destroy(); err != nil {
		t.Fatal(err)
	}
	// A limit the kernel refuses rolls everything back.
	m.mkdir = func(inner func(string) error) func(string) error {
		return func(dir string) error {
			if err := inner(dir); err != nil {
				return err
			}
			// Only the pids hierarchy has the file.
			if err := os.Remove(filepath.Join(dir, "pids.max")); err != nil && !errors.Is(err, fs.ErrNotExist) {
				t.Fatal(err)
			}
			return nil
		}
	}(m.mkdir)
	if _, err := m.Create("half", Limits{MemoryMiB: 10, PIDs: 10}); err == nil {
		t.Fatal("create without pids.max succeeded")
	}
	if names, _ := m.List(); len(names) != 0 {
		t.Fatalf("left %v", names)
	}
}

func TestOOMKilledV1(t *testing.T) {
	f := thisHost(t)
	m := f.manager(t)
	g, err := m.Create("o", Limits{MemoryMiB: 64})
	if err != nil {
		t.Fatal(err)
	}
	d := filepath.Join(f.mounts["memory"], "process_api/4ea8/forkd/o")
	if oom, err := g.OOMKilled(); err != nil || oom {
		t.Fatalf("fresh group OOMKilled = %v, %v", oom, err)
	}
	testutil.WriteFile(t, filepath.Join(d, "memory.oom_control"), []byte("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"), 0o644)
	testutil.WriteFile(t, filepath.Join(d, "memory.failcnt"), []byte("188\n"), 0o644)
	testutil.WriteFile(t, filepath.Join(filepath.Join(f.mounts["cpuacct"], "process_api/4ea8/forkd/o"), "cpuacct.usage"), []byte("2000000000\n"), 0o644)
	if oom, err := g.OOMKilled(); err != nil || !oom {
		t.Fatalf("OOMKilled = %v, %v", oom, err)
	}
	s, _ := g.Stats()
	if s.OOMKills != 2 || s.MemoryFailures != 188 || s.MemoryLimitBytes != 64<<20 || s.CPU.Seconds() != 2 {
		t.Fatalf("stats %+v", s)
	}
	// Old kernels have no oom_kill counter: under_oom stands in.
	testutil.WriteFile(t, filepath.Join(d, "memory.oom_control"), []byte("oom_kill_disable 0\nunder_oom 1\n"), 0o644)
	if oom, _ := g.OOMKilled(); !oom {
		t.Fatal("under_oom not reported")
	}
}

func TestReclaim(t *testing.T) {
	m := thisHost(t).manager(t)
	for _, n := range []string{"a", "b", "c"} {
		if _, err := m.Create(n, Limits{MemoryMiB: 32}); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.Reclaim(func(n string) bool { return n == "b" }); err != nil {
		t.Fatal(err)
	}
	if names, _ := m.List(); !slices.Equal(names, []string{"b"}) {
		t.Fatalf("after reclaim: %v", names)
	}
	g, err := m.Open("b")
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Destroy(); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Open("b"); !errdefs.IsNotFound(err) {
		t.Fatalf("open destroyed: %v", err)
	}
}

func TestWithin(t *testing.T) {
	if _, ok := within("/x/y", "/x"); !ok {
		t.Fatal("within")
	}
	if _, ok := within("/xy", "/x"); ok {
		t.Fatal("within prefix")
	}
}

func TestDeviceOf(t *testing.T) {
	// The test binary lives on some disk or in tmpfs; either it names a
	// block device that /sys knows, or it says why not.
	maj, min, err := DeviceOf(os.Args[0])
	if err != nil {
		if !strings.Contains(err.Error(), "not a block device") {
			t.Fatal(err)
		}
		return
	}
	if _, err := os.Stat(fmt.Sprintf("/sys/dev/block/%d:%d", maj, min)); err != nil {
		t.Fatalf("DeviceOf = %d:%d, unknown to /sys: %v", maj, min, err)
	}
	if _, err := os.Stat(fmt.Sprintf("/sys/dev/block/%d:%d/partition", maj, min)); err == nil {
		t.Fatalf("DeviceOf = %d:%d, a partition", maj, min)
	}
	if _, _, err := DeviceOf("/nonexistent/forkd"); err == nil {
		t.Fatal("DeviceOf of a missing path succeeded")
	}
}
