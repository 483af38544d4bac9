package proc

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/forkd/forkd/internal/testutil"
)

// fakeZramHost points Root and SysBlock at a temporary tree with swaps
// (a zram swap device and a disk) and sysfs entries for zram0 (storing
// 8 MiB in 3 MiB), zram1 (empty) and zram2 (mm_stat garbled), and returns
// the sysfs directory.
func fakeZramHost(t *testing.T) string {
	t.Helper()
	root, sys := t.TempDir(), t.TempDir()
	oldRoot, oldSys := Root, SysBlock
	Root, SysBlock = root, sys
	t.Cleanup(func() { Root, SysBlock = oldRoot, oldSys })
	testutil.WriteFile(t, filepath.Join(root, "swaps"), []byte(`Filename				Type		Size		Used		Priority
/dev/zram0                              partition	12345672	8192		100
/dev/sda2                               partition	1000000		0		-2
`), 0o644)
	for dev, stat := range map[string]string{
		"zram0": "8388608  2000000  3145728        0  3145728        0        0        0        0\n",
		"zram1": "0 0 0 0 0 0 0 0 0\n",
		"zram2": "12 x\n",
	} {
		testutil.Check(t, os.Mkdir(filepath.Join(sys, dev), 0o755))
		testutil.WriteFile(t, filepath.Join(sys, dev, "mm_stat"), []byte(stat), 0o644)
		testutil.WriteFile(t, filepath.Join(sys, dev, "compact"), nil, 0o644)
	}
	return sys
}

func TestZramDevices(t *testing.T) {
	fakeZramHost(t)
	got, err := ZramDevices()
	if err == nil {
		t.Errorf("ZramDevices with zram2's mm_stat garbled: no error")
	}
	if len(got) != 1 || got[0] != (Zram{Device: "zram0", Stored: 8 << 20, Used: 3 << 20}) {
		t.Fatalf("ZramDevices = %+v, want zram0 storing 8 MiB in 3 MiB (zram1 stores nothing)", got)
	}
}

func TestCompactZramSwap(t *testing.T) {
	sys := fakeZramHost(t)
	n, freed, err := CompactZramSwap()
	if n != 1 || freed != 0 || err != nil {
		t.Fatalf("CompactZramSwap = %d, %d, %v; want 1 device, 0 freed (the fake's mm_stat stays), no error", n, freed, err)
	}
	for dev, want := range map[string]string{"zram0": "1", "zram1": "", "zram2": ""} {
		if b, _ := os.ReadFile(filepath.Join(sys, dev, "compact")); string(b) != want {
			t.Errorf("%s/compact = %q, want %q (only the swap device is compacted)", dev, b, want)
		}
	}
	// A swap device whose sysfs entry is gone is an error; the others
	// are still compacted.
	testutil.Check(t, os.RemoveAll(filepath.Join(sys, "zram0")))
	if _, _, err := CompactZramSwap(); err == nil {
		t.Fatal("CompactZramSwap with zram0's sysfs entry gone: no error")
	}
	// Without swaps (no procfs there), an error.
	testutil.Check(t, os.Remove(filepath.Join(Root, "swaps")))
	if _, _, err := CompactZramSwap(); err == nil {
		t.Fatal("CompactZramSwap without /proc/swaps: no error")
	}
}

// TestSwapsToZram: the swap the kernel fills first decides.
func TestSwapsToZram(t *testing.T) {
	old := Root
	Root = t.TempDir()
	t.Cleanup(func() { Root = old })
	const head = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
	for _, c := range []struct {
		swaps string
		want  bool
	}{
		{head, false},
		{head + "/dev/zram0                              partition\t12341888\t0\t\t100\n", true},
		{head + "/swapfile                               file\t\t1048572\t\t0\t\t-2\n/dev/zram0                              partition\t12341888\t0\t\t100\n", true},
		{head + "/dev/sda2                               partition\t1048572\t\t0\t\t10\n/dev/zram0                              partition\t12341888\t0\t\t5\n", false},
		{head + "/swap\\040file                          file\t\t1048572\t\t0\t\t-2\n", false},
	} {
		if err := os.WriteFile(filepath.Join(Root, "swaps"), []byte(c.swaps), 0o644); err != nil {
			t.Fatal(err)
		}
		if got, err := SwapsToZram(); err != nil || got != c.want {
			t.Errorf("%q: %v %v, want %v", c.swaps, got, err, c.want)
		}
	}
	os.Remove(filepath.Join(Root, "swaps"))
	if _, err := SwapsToZram(); err == nil {
		t.Error("no /proc/swaps: no error")
	}
}
