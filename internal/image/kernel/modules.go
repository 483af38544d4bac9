package kernel

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"debug/elf"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"

	"github.com/forkd/forkd/internal/errdefs"
)

// DefaultModules are the modules a forkd guest needs, by module name. Those
// the kernel has built in are skipped; the rest are loaded together with
// their dependencies.
var DefaultModules = []string{
	"virtio_ring", "virtio", "virtio_mmio", "virtio_pci",
	"virtio_console", "virtio_blk", "virtio_net",
	"overlay", "ext4",
	"vsock", "vmw_vsock_virtio_transport",
	"virtio_rng",
}

// moduleSuffixes are the file name endings of kernel modules, compressed or
// not, as the kernel's module loader accepts them with
// MODULE_INIT_COMPRESSED_FILE.
var moduleSuffixes = []string{".ko", ".ko.zst", ".ko.xz", ".ko.gz"}

// maxModuleSize bounds how much of one (decompressed) module is read.
const maxModuleSize = 256 << 20

// Module is one loadable module file of a kernel.
type Module struct {
	Name    string   // module name, "-" folded to "_" (virtio_rng)
	Path    string   // host path of the .ko[.zst|.xz|.gz] file
	Depends []string // from its .modinfo depends=, in the order given there
}

// File is the module's file name (virtio-rng.ko), the name it has in the
// initramfs under /lib/modules/.
func (m Module) File() string { return filepath.Base(m.Path) }

// ModuleName returns the module name for a module file name: the base name
// without its suffix, with "-" folded to "_", as the kernel names it.
func ModuleName(file string) (string, bool) {
	base := filepath.Base(file)
	for _, s := range moduleSuffixes {
		if strings.HasSuffix(base, s) {
			return strings.ReplaceAll(strings.TrimSuffix(base, s), "-", "_"), true
		}
	}
	return "", false
}

// Tree is the module tree of one kernel release as unpacked from packages:
// the module files by name and the names the kernel has built in.
type Tree struct {
	Dir     string            // lib/modules/<release>
	Files   map[string]string // module name -> path
	Builtin map[string]bool   // module names from modules.builtin
}

// ScanTree indexes the module files under dir (a lib/modules/<release>
// directory) and reads its modules.builtin, if any.
func ScanTree(dir string) (*Tree, error) {
	t := &Tree{Dir: dir, Files: map[string]string{}, Builtin: map[string]bool{}}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.Type().IsRegular() {
			return nil
		}
		if name, ok := ModuleName(p); ok {
			if prev, dup := t.Files[name]; dup {
				return errdefs.InvalidArgument("module %s found twice: %s and %s", name, prev, p)
			}
			t.Files[name] = p
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	f, err := os.Open(filepath.Join(dir, "modules.builtin"))
	if err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if name, ok := ModuleName(strings.TrimSpace(sc.Text())); ok {
				t.Builtin[name] = true
			}
		}
		if err := sc.Err(); err != nil {
			return nil, err
		}
	} else if !os.IsNotExist(err) {
		return nil, err
	}
	return t, nil
}

// LoadOrder resolves want (module names, "-" or "_") and their dependencies
// into the order they must be loaded in: every module after all of its
// dependencies, otherwise in the order of want and of each depends= list.
// Built-in modules are left out. A module that is neither a file nor built
// in, or a dependency cycle, is an error.
func (t *Tree) LoadOrder(want []string) ([]Module, error) {
	const (
		visiting = 1
		done     = 2
	)
	state := map[string]int{}
	var order []Module
	var visit func(name string, chain []string) error
	visit = func(name string, chain []string) error {
		name = strings.ReplaceAll(name, "-", "_")
		switch state[name] {
		case done:
			return nil
		case visiting:
			return errdefs.InvalidArgument("module dependency cycle: %s", strings.Join(append(chain, name), " -> "))
		}
		path, ok := t.Files[name]
		if !ok {
			if t.Builtin[name] {
				state[name] = done
				return nil
			}
			if len(chain) > 0 {
				return errdefs.NotFound("module %s (needed by %s): neither a file nor built in", name, chain[len(chain)-1])
			}
			return errdefs.NotFound("module %s: neither a file nor built in", name)
		}
		state[name] = visiting
		info, err := ReadModinfo(path)
		if err != nil {
			return err
		}
		deps := splitList(info["depends"])
		for _, d := range deps {
			if err := visit(d, append(chain, name)); err != nil {
				return err
			}
		}
		state[name] = done
		order = append(order, Module{Name: name, Path: path, Depends: deps})
		return nil
	}
	for _, name := range want {
		if err := visit(name, nil); err != nil {
			return nil, err
		}
	}
	return order, nil
}

// ReadModinfo returns the key=value pairs of the .modinfo ELF section of the
// module file at path, decompressing .zst, .xz and .gz files in memory. When
// a key repeats (alias=, parm=), the values are joined with "\n".
func ReadModinfo(path string) (map[string]string, error) {
	data, err := readModule(path)
	if err != nil {
		return nil, err
	}
	f, err := elf.NewFile(bytes.NewReader(data))
	if err != nil {
		return nil, errdefs.InvalidArgument("module %s: not an ELF file: %w", filepath.Base(path), err)
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, errdefs.InvalidArgument("module %s: no .modinfo section", filepath.Base(path))
	}
	raw, err := sec.Data()
	if err != nil {
		return nil, errdefs.InvalidArgument("module %s: .modinfo: %w", filepath.Base(path), err)
	}
	info := map[string]string{}
	for _, kv := range bytes.Split(raw, []byte{0}) {
		k, v, ok := bytes.Cut(kv, []byte("="))
		if !ok {
			continue
		}
		if prev, dup := info[string(k)]; dup {
			info[string(k)] = prev + "\n" + string(v)
		} else {
			info[string(k)] = string(v)
		}
	}
	return info, nil
}

func readModule(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var r io.Reader = f
	switch {
	case strings.HasSuffix(path, ".zst"):
		d, err := zstd.NewReader(f, zstd.WithDecoderConcurrency(1))
		if err != nil {
			return nil, err
		}
		defer d.Close()
		r = d
	case strings.HasSuffix(path, ".xz"):
		d, err := xz.NewReader(f)
		if err != nil {
			return nil, errdefs.InvalidArgument("module %s: %w", filepath.Base(path), err)
		}
		r = d
	case strings.HasSuffix(path, ".gz"):
		d, err := gzip.NewReader(f)
		if err != nil {
			return nil, errdefs.InvalidArgument("module %s: %w", filepath.Base(path), err)
		}
		defer d.Close()
		r = d
	}
	data, err := io.ReadAll(io.LimitReader(r, maxModuleSize+1))
	if err != nil {
		return nil, errdefs.InvalidArgument("module %s: %w", filepath.Base(path), err)
	}
	if len(data) > maxModuleSize {
		return nil, errdefs.InvalidArgument("module %s: larger than %d bytes", filepath.Base(path), maxModuleSize)
	}
	return data, nil
}

func splitList(s string) []string {
	var out []string
	for _, x := range strings.Split(s, ",") {
		if x = strings.TrimSpace(x); x != "" {
			out = append(out, x)
		}
	}
	return out
}
