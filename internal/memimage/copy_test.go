package memimage

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/vmm"
)

// extentsOf returns the data extents of the file at path, as
// {offset, length} pairs.
func extentsOf(t testing.TB, path string) [][2]int64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	out := [][2]int64{}
	err = dataExtents(f, st.Size(), func(off, n int64) error {
		out = append(out, [2]int64{off, n})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// runExtents returns p's runs as {offset, length} pairs in bytes.
func runExtents(p Pages) [][2]int64 {
	out := [][2]int64{}
	for _, r := range p.Runs {
		out = append(out, [2]int64{int64(r.Start) * int64(p.PageSize), int64(r.Count) * int64(p.PageSize)})
	}
	return out
}

// imageOf returns the image of mm's regions (slices of this process's
// memory, in parts) with only the pages in p: the rest zeros.
func imageOf(parts [][]byte, p Pages) []byte {
	var all []byte
	for _, b := range parts {
		all = append(all, b...)
	}
	out := make([]byte, len(all))
	for _, r := range p.Runs {
		lo, hi := int(r.Start)*p.PageSize, int(r.Start+r.Count)*p.PageSize
		copy(out[lo:hi], all[lo:hi])
	}
	return out
}

// newImageFile creates an empty file of size bytes.
func newImageFile(t testing.TB, path string, size int64) *os.File {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return f
}

// withoutReadv makes Copy find process_vm_readv refused with errno for
// the rest of the test.
func withoutReadv(t *testing.T, errno unix.Errno) {
	old := processVMReadv
	processVMReadv = func(int, []unix.Iovec, []unix.RemoteIovec, uint) (int, error) { return 0, errno }
	t.Cleanup(func() { processVMReadv = old })
}

func TestCopy(t *testing.T) {
	for _, tc := range []struct {
		name  string
		errno unix.Errno // process_vm_readv refused with this, 0 for not
	}{{"process_vm_readv", 0}, {"proc mem after ENOSYS", unix.ENOSYS}, {"proc mem after EPERM", unix.EPERM}} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.errno != 0 {
				withoutReadv(t, tc.errno)
			}
			dir := t.TempDir()
			base := filepath.Join(dir, "memory")
			writeImage(t, base, 64, map[int]bool{40: true, 41: true})
			mem := mapPrivate(t, base)
			touch(mem, []int{3, 4, 5, 40, 63}, []int{10}, []int{0, 20})
			mm := selfMap(mem)
			pages, err := Private(mm)
			if err != nil {
				t.Fatal(err)
			}

			path := filepath.Join(dir, "layer")
			dst := newImageFile(t, path, ImageSize(mm))
			n, err := Copy(mm, pages, dst)
			if err != nil || n != pages.Bytes() || n != 6*int64(ps) {
				t.Fatalf("Copy = %d, %v; want %d bytes", n, err, pages.Bytes())
			}
			got, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, imageOf([][]byte{mem}, pages)) {
				t.Fatal("the layer differs from the written pages")
			}
			if ext := extentsOf(t, path); !reflect.DeepEqual(ext, runExtents(pages)) {
				t.Fatalf("layer extents %v, want %v", ext, runExtents(pages))
			}
			if a, err := Allocated(path); err != nil || a < pages.Bytes() || a > pages.Bytes()+64<<10 {
				t.Fatalf("Allocated = %d, %v; want about %d", a, err, pages.Bytes())
			}
		})
	}
}

// TestCopyBatches copies runs longer than a read, more runs than one
// read takes, and a run across two regions, in few syscalls.
func TestCopyBatches(t *testing.T) {
	for _, tc := range []struct {
		name  string
		errno unix.Errno
	}{{"process_vm_readv", 0}, {"proc mem", unix.ENOSYS}} {
		t.Run(tc.name, func(t *testing.T) {
			calls := 0
			old := processVMReadv
			processVMReadv = func(pid int, l []unix.Iovec, r []unix.RemoteIovec, f uint) (int, error) {
				calls++
				if tc.errno != 0 {
					return 0, tc.errno
				}
				return old(pid, l, r, f)
			}
			t.Cleanup(func() { processVMReadv = old })

			dir := t.TempDir()
			const n, half = 4096, 2048
			base := filepath.Join(dir, "memory")
			writeImage(t, base, n, nil)
			mem := mapPrivate(t, base)
			parts := [][]byte{mem[half*ps:], mem[:half*ps]} // image page i is mem page (i+half)%n
			want := Pages{PageSize: ps, Runs: []Run{{1500, 801}}}
			for i := uint64(2400); i < 4000; i += 2 {
				want.Runs = append(want.Runs, Run{i, 1})
			}
			for _, r := range want.Runs {
				for i := r.Start; i < r.Start+r.Count; i++ {
					mem[(int(i)+half)%n*ps+7]++
				}
			}
			mm := selfMap(parts...)
			pages, err := Private(mm)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(pages, want) {
				t.Fatalf("Private = %d runs, want %d", len(pages.Runs), len(want.Runs))
			}
			path := filepath.Join(dir, "layer")
			if _, err := Copy(mm, pages, newImageFile(t, path, ImageSize(mm))); err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, imageOf(parts, pages)) {
				t.Fatal("the layer differs from the written pages")
			}
			// 6.3 MiB in 2 MiB reads, 800 single pages in reads of 512 runs.
			if tc.errno == 0 && calls > 6 {
				t.Errorf("%d process_vm_readv calls", calls)
			}
		})
	}
}

func TestCopyErrors(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "memory")
	writeImage(t, base, 8, nil)
	mem := mapPrivate(t, base)
	mm := selfMap(mem)
	dst := newImageFile(t, filepath.Join(dir, "layer"), ImageSize(mm))

	for name, p := range map[string]Pages{
		"beyond the image": {PageSize: ps, Runs: []Run{{7, 2}}},
		"unsorted":         {PageSize: ps, Runs: []Run{{3, 1}, {1, 1}}},
		"odd page size":    {PageSize: 3 * ps, Runs: []Run{{0, 1}}},
	} {
		if _, err := Copy(mm, p, dst); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%s: Copy = %v, want InvalidArgument", name, err)
		}
	}
	if n, err := Copy(mm, Pages{}, dst); n != 0 || err != nil {
		t.Errorf("no pages: Copy = %d, %v", n, err)
	}

	// Part of a region unmapped: reads stop at it, whichever way they go.
	part, err := unix.MmapPtr(-1, 0, nil, uintptr(8*ps), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.MunmapPtr(part, uintptr(4*ps))
	if err := unix.MunmapPtr(unsafe.Add(part, 4*ps), uintptr(4*ps)); err != nil {
		t.Fatal(err)
	}
	mmPart := vmm.MemoryMap{PID: os.Getpid(), Regions: []vmm.Region{{HostAddr: uint64(uintptr(part)), Size: uint64(8 * ps)}}}
	pages := Pages{PageSize: ps, Runs: []Run{{1, 1}, {5, 1}}}
	if _, err := Copy(mmPart, pages, dst); !errdefs.IsNotFound(err) {
		t.Errorf("partly unmapped: Copy = %v, want NotFound", err)
	}
	t.Run("proc mem", func(t *testing.T) {
		withoutReadv(t, unix.ENOSYS)
		if _, err := Copy(mmPart, pages, dst); !errdefs.IsNotFound(err) {
			t.Errorf("partly unmapped: Copy = %v, want NotFound", err)
		}
	})
}
