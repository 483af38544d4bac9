package memimage

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/forkd/forkd/internal/vmm"
)

// benchMapping is a MAP_PRIVATE mapping of a sparse file with about 5% of
// its pages written.
type benchMapping struct {
	name  string
	mm    vmm.MemoryMap
	pages Pages
	dir   string
}

// benchMappings returns mappings of 256 MiB and 1 GiB, each with 5% of
// its pages written scattered (single pages, the worst case for runs) and
// clustered (runs of 64 pages, 256 KiB).
func benchMappings(b *testing.B) []benchMapping {
	b.Helper()
	var out []benchMapping
	for _, size := range []struct {
		name  string
		bytes int
	}{{"256MiB", 256 << 20}, {"1GiB", 1 << 30}} {
		for _, clustered := range []bool{false, true} {
			dir := b.TempDir()
			path := filepath.Join(dir, "memory")
			f, err := os.Create(path)
			if err != nil {
				b.Fatal(err)
			}
			if err := f.Truncate(int64(size.bytes)); err != nil {
				b.Fatal(err)
			}
			f.Close()
			mem := mapPrivate(b, path)
			n := size.bytes / ps
			rng := rand.New(rand.NewPCG(1, 2))
			name := size.name + "/scattered"
			if clustered {
				name = size.name + "/runs64"
				for w := 0; w < n/20; w += 64 {
					start := rng.IntN(n-64) / 64 * 64
					for i := start; i < start+64; i++ {
						mem[i*ps] = 1
					}
				}
			} else {
				for i := 0; i < n; i++ {
					if rng.IntN(20) == 0 {
						mem[i*ps] = 1
					}
				}
			}
			mm := selfMap(mem)
			pages, err := Private(mm)
			if err != nil {
				b.Fatal(err)
			}
			out = append(out, benchMapping{name: name, mm: mm, pages: pages, dir: dir})
		}
	}
	return out
}

func (m benchMapping) String() string {
	return fmt.Sprintf("%s: %d pages written (%.1f MiB) in %d runs", m.name, m.pages.Len(), float64(m.pages.Bytes())/(1<<20), len(m.pages.Runs))
}

// BenchmarkPrivate scans the pagemap of a mapping; bytes/s is guest RAM
// scanned.
func BenchmarkPrivate(b *testing.B) {
	for _, m := range benchMappings(b) {
		b.Logf("%v", m)
		b.Run(m.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(ImageSize(m.mm))
			for b.Loop() {
				if _, err := Private(m.mm); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkCopy copies the written pages of a mapping into a new sparse
// file (new page cache, as a pause without a pre-copy) and over the same
// pages of a file that already holds them (as a pause after a pre-copy);
// bytes/s is pages copied.
func BenchmarkCopy(b *testing.B) {
	for _, m := range benchMappings(b) {
		b.Logf("%v", m)
		size := ImageSize(m.mm)
		b.Run(m.name+"/new", func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(m.pages.Bytes())
			path := filepath.Join(m.dir, "layer")
			for b.Loop() {
				b.StopTimer()
				f, err := os.Create(path)
				if err != nil {
					b.Fatal(err)
				}
				if err := f.Truncate(size); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if _, err := Copy(m.mm, m.pages, f); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				f.Close()
				os.Remove(path)
				b.StartTimer()
			}
		})
		b.Run(m.name+"/overwrite", func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(m.pages.Bytes())
			f := newImageFile(b, filepath.Join(m.dir, "layer"), size)
			if _, err := Copy(m.mm, m.pages, f); err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				if _, err := Copy(m.mm, m.pages, f); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkMaterialize writes base + layer for a 256 MiB image whose base
// holds data in half its pages (runs of 64) and whose layer holds 5%
// (runs of 64); bytes/s is image size. The output is fsynced.
func BenchmarkMaterialize(b *testing.B) {
	const size = 256 << 20
	dir := b.TempDir()
	base, layer, out := filepath.Join(dir, "base"), filepath.Join(dir, "layer"), filepath.Join(dir, "out")
	run := make([]byte, 64*ps)
	for i := range run {
		run[i] = byte(i)
	}
	bf, lf := newImageFile(b, base, size), newImageFile(b, layer, size)
	rng := rand.New(rand.NewPCG(1, 2))
	for off := int64(0); off < size; off += 2 * int64(len(run)) {
		if _, err := bf.WriteAt(run, off); err != nil {
			b.Fatal(err)
		}
	}
	for w := 0; w < size/20; w += len(run) {
		if _, err := lf.WriteAt(run, int64(rng.IntN(size/len(run)))*int64(len(run))); err != nil {
			b.Fatal(err)
		}
	}
	if err := bf.Sync(); err != nil {
		b.Fatal(err)
	}
	if err := lf.Sync(); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.SetBytes(size)
	for b.Loop() {
		if err := Materialize(base, layer, out); err != nil {
			b.Fatal(err)
		}
	}
}
