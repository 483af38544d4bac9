package proc

import (
	"bytes"
	"cmp"
	"math/bits"
	"os"
	"path/filepath"
	"slices"
	"strconv"
)

// Notes name runs of a process's private pages by the mapping they lie in
// and their offset into it, not by address, so that another process of
// the same program, started with the same arguments, can find its own
// pages at the same places (Place): its mappings lie at other addresses,
// and in another order. A file mapping is known by its permissions, file
// and offset into the file, [heap] and the like by their name; either
// pairs with the mapping of the same name in the other process. An
// anonymous one pairs with one of the same permissions and size there,
// in address order, and those left over with one of the same
// permissions and size rounded up to a power of two (a malloc arena, a
// buffer that grew). The zero Notes name nothing.
type Notes struct {
	layout []mapDesc // the noted process's private mappings
	runs   []noteRun // in the order of Note's spans
	// code holds the keys of the blocks on the noted pages of the
	// process's code buffer (WithCode), sorted; nil if not known.
	code []uint32
}

// noteRun is len bytes from off into the mapping layout[m].
type noteRun struct {
	m        int
	off, len uint64
}

// mapDesc is a private mapping of /proc/PID/maps: at start, size bytes;
// name is its file (permissions, offset and path) or its name in
// brackets, or empty for an anonymous mapping, then perms its
// permissions.
type mapDesc struct {
	start, size uint64
	name, perms string
}

// CodeBlocks returns how many blocks of translated code the notes know
// by what they translate (WithCode).
func (n Notes) CodeBlocks() int { return len(n.code) }

// Bytes returns how many bytes the notes name.
func (n Notes) Bytes() uint64 {
	var b uint64
	for _, r := range n.runs {
		b += r.len
	}
	return b
}

// privateLayout returns the private (copy-on-write) mappings of a
// /proc/PID/maps text, in its order: the kernel's is by address. The
// top half of the address space is the kernel's ([vsyscall]): left out.
func privateLayout(maps []byte) []mapDesc {
	var out []mapDesc
	for line := range bytes.Lines(maps) {
		f := bytes.Fields(line)
		if len(f) < 5 || len(f[1]) != 4 || f[1][3] != 'p' {
			continue
		}
		lo, hi, ok := bytes.Cut(f[0], []byte("-"))
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(string(lo), 16, 64)
		end, err2 := strconv.ParseUint(string(hi), 16, 64)
		if err1 != nil || err2 != nil || end <= start || end > 1<<63 {
			continue
		}
		d := mapDesc{start: start, size: end - start, perms: string(f[1])}
		switch name := string(bytes.Join(f[5:], []byte(" "))); {
		case name == "", name[0] == '[':
			d.name = name
		default:
			d.name = string(f[2]) + " " + name
		}
		out = append(out, d)
	}
	return out
}

// pairLayouts returns, for each mapping of from, the index of the mapping
// of to it pairs with (see Notes), or -1.
func pairLayouts(from, to []mapDesc) []int {
	pair := make([]int, len(from))
	for i := range pair {
		pair[i] = -1
	}
	taken := make([]bool, len(to))
	// Each pass pairs the mappings left on both sides whose key (none:
	// "") is the same, in address order.
	pass := func(key func(mapDesc) string) {
		free := map[string][]int{}
		for j, d := range to {
			if k := key(d); k != "" && !taken[j] {
				free[k] = append(free[k], j)
			}
		}
		for i, d := range from {
			k := key(d)
			if k == "" || pair[i] >= 0 || len(free[k]) == 0 {
				continue
			}
			j := free[k][0]
			free[k] = free[k][1:]
			pair[i], taken[j] = j, true
		}
	}
	pass(func(d mapDesc) string {
		if d.name != "" {
			return d.perms + " " + d.name
		}
		return d.perms + " anon " + strconv.FormatUint(d.size, 10)
	})
	pass(func(d mapDesc) string {
		if d.name != "" {
			return ""
		}
		return d.perms + " anon ~" + strconv.Itoa(bits.Len64(d.size-1))
	})
	return pair
}

// noteSpans names spans (in address order, as ResidentAnon returns them)
// by the mappings of maps they lie in; the parts of spans outside every
// private mapping are left out.
func noteSpans(maps []byte, spans []Span) Notes {
	n := Notes{layout: privateLayout(maps)}
	i := 0
	for _, s := range spans {
		for at, end := s.Start, s.Start+s.Len; at < end; {
			for i < len(n.layout) && n.layout[i].start+n.layout[i].size <= at {
				i++
			}
			if i == len(n.layout) || n.layout[i].start >= end {
				break
			}
			m := n.layout[i]
			at = max(at, m.start)
			stop := min(end, m.start+m.size)
			n.runs = append(n.runs, noteRun{i, at - m.start, stop - at})
			at = stop
		}
	}
	return n
}

// WithCode returns n with the keys of the blocks on its pages of the
// noted process's code buffer, by l, that process's CodeLayout (Place
// then finds those blocks wherever another process has them); n as it
// is if l names no blocks or was not read of that buffer.
func (n Notes) WithCode(l CodeLayout) Notes {
	m := codeBuffer(n.layout)
	if l.Blocks() == 0 || m < 0 || n.layout[m].start != l.base {
		return n
	}
	var runs []noteRun
	for _, r := range n.runs {
		if r.m == m {
			runs = append(runs, r)
		}
	}
	if len(runs) == 0 {
		return n
	}
	n.code = l.keysOn(runs)
	return n
}

// placeNotes returns the spans notes name in the process whose maps text
// is maps, in address order, adjacent ones joined: a run whose mapping
// pairs with none there is left out, and one that goes past the end of
// the mapping it pairs with is cut short. If code (that process's layout
// of its code buffer) names blocks and n has their keys, n's runs in its
// code buffer give way to the pages of those blocks in code.
func placeNotes(maps []byte, n Notes, code CodeLayout) []Span {
	if len(n.runs) == 0 {
		return nil
	}
	to := privateLayout(maps)
	if i := codeBuffer(to); i < 0 || to[i].start != code.base || n.code == nil {
		code = CodeLayout{}
	}
	pair := pairLayouts(n.layout, to)
	var spans []Span
	for _, r := range n.runs {
		j := pair[r.m]
		if j < 0 || r.off >= to[j].size || code.Blocks() > 0 && n.layout[r.m].isCode() {
			continue
		}
		spans = append(spans, Span{to[j].start + r.off, min(r.len, to[j].size-r.off)})
	}
	if code.Blocks() > 0 {
		spans = append(spans, code.spans(n.code)...)
	}
	return joinSpans(spans)
}

// joinSpans sorts spans by address and joins those that touch or
// overlap, in place.
func joinSpans(spans []Span) []Span {
	slices.SortFunc(spans, func(a, b Span) int { return cmp.Compare(a.Start, b.Start) })
	out := spans[:0]
	for _, s := range spans {
		if k := len(out) - 1; k >= 0 && out[k].Start+out[k].Len >= s.Start {
			out[k].Len = max(out[k].Len, s.Start+s.Len-out[k].Start)
			continue
		}
		out = append(out, s)
	}
	return out
}

// Note names spans of the process named by id (ResidentAnon's, say) by
// its mappings, for Place to find in another process. It fails with a
// NotFound-class error once the process has exited.
func Note(id Identity, spans []Span) (Notes, error) {
	maps, err := readMaps(id)
	if err != nil {
		return Notes{}, err
	}
	return noteSpans(maps, spans), nil
}

// NoteResident notes the pages ResidentAnon returns (with its bounds: no
// notes past them), reading the process's maps once for both.
func NoteResident(id Identity, maxBytes uint64, maxRuns int) (Notes, error) {
	spans, maps, err := residentAnon(id, maxBytes, maxRuns)
	if err != nil || spans == nil {
		return Notes{}, err
	}
	return noteSpans(maps, spans), nil
}

// Place returns the spans of the process named by id that notes (taken
// of another process of the same program, by Note) name: what PageIn
// reads back. Runs in mappings it lacks are left out. With code, the
// layout of its code buffer (ReadCodeLayout, read while it still had the
// blocks it has now), and notes that know their blocks (WithCode), the
// blocks are found by what they translate instead of by offset. It
// fails with a NotFound-class error once the process has exited.
func Place(id Identity, n Notes, code CodeLayout) ([]Span, error) {
	maps, err := readMaps(id)
	if err != nil {
		return nil, err
	}
	return placeNotes(maps, n, code), nil
}

// readMaps reads /proc/PID/maps of the process named by id.
func readMaps(id Identity) ([]byte, error) {
	p, err := Open(id)
	if err != nil {
		return nil, err
	}
	defer p.Close()
	maps, err := os.ReadFile(filepath.Join(Root, strconv.Itoa(id.PID), "maps"))
	if err != nil {
		return nil, p.gone(err)
	}
	if exited(p.fd) {
		return nil, errExited(id.PID)
	}
	return maps, nil
}
