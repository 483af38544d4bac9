package memimage

import "github.com/forkd/forkd/internal/errdefs"

// Run is Count consecutive pages starting at page index Start.
type Run struct {
	Start, Count uint64
}

// end returns the index just past r.
func (r Run) end() uint64 { return r.Start + r.Count }

// Pages is a set of pages of a memory image, as page indexes: page i is the
// image bytes [i*PageSize, (i+1)*PageSize).
//
// A valid Pages has its Runs sorted by Start, each non-empty and none
// overlapping another. Private and Union return them canonical as well:
// runs never touch (two adjacent runs are one). The zero Pages is the empty
// set of any page size.
type Pages struct {
	PageSize int
	Runs     []Run
}

// Len returns the number of pages in p.
func (p Pages) Len() uint64 {
	var n uint64
	for _, r := range p.Runs {
		n += r.Count
	}
	return n
}

// Bytes returns the number of bytes the pages of p hold.
func (p Pages) Bytes() int64 { return int64(p.Len()) * int64(p.PageSize) }

// Validate checks that p is valid (see Pages) and fits in an image of
// limit pages. It fails with an InvalidArgument-class error.
func (p Pages) Validate(limit uint64) error {
	if len(p.Runs) == 0 {
		return nil
	}
	if p.PageSize <= 0 {
		return errdefs.InvalidArgument("pages: page size %d", p.PageSize)
	}
	var next uint64
	for i, r := range p.Runs {
		switch {
		case r.Count == 0:
			return errdefs.InvalidArgument("pages: run %d is empty", i)
		case r.Start < next:
			return errdefs.InvalidArgument("pages: run %d (page %d) overlaps or precedes the run before it", i, r.Start)
		case r.end() < r.Start || r.end() > limit:
			return errdefs.InvalidArgument("pages: run %d (pages %d+%d) beyond the image's %d pages", i, r.Start, r.Count, limit)
		}
		next = r.end()
	}
	return nil
}

// Union returns the pages in a or in b, canonical. Both must be valid; an
// empty set goes with any page size, other sets must have the same one. It
// fails with an InvalidArgument-class error otherwise.
func Union(a, b Pages) (Pages, error) {
	size := a.PageSize
	switch {
	case len(a.Runs) == 0:
		size = b.PageSize
	case len(b.Runs) > 0 && a.PageSize != b.PageSize:
		return Pages{}, errdefs.InvalidArgument("union of pages of %d and %d bytes", a.PageSize, b.PageSize)
	}
	for _, p := range []Pages{a, b} {
		if err := p.Validate(^uint64(0)); err != nil {
			return Pages{}, err
		}
	}
	out := Pages{PageSize: size, Runs: make([]Run, 0, len(a.Runs)+len(b.Runs))}
	i, j := 0, 0
	for i < len(a.Runs) || j < len(b.Runs) {
		var r Run
		if j == len(b.Runs) || (i < len(a.Runs) && a.Runs[i].Start <= b.Runs[j].Start) {
			r, i = a.Runs[i], i+1
		} else {
			r, j = b.Runs[j], j+1
		}
		out.Runs = appendRun(out.Runs, r)
	}
	return out, nil
}

// appendRun appends r to runs, which are sorted by Start with none starting
// after r, merging r into the last run when they overlap or touch.
func appendRun(runs []Run, r Run) []Run {
	if n := len(runs); n > 0 && r.Start <= runs[n-1].end() {
		if e := r.end(); e > runs[n-1].end() {
			runs[n-1].Count = e - runs[n-1].Start
		}
		return runs
	}
	return append(runs, r)
}
