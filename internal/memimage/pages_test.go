package memimage

import (
	"reflect"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
)

func TestPagesLenBytes(t *testing.T) {
	p := Pages{PageSize: 4096, Runs: []Run{{0, 2}, {5, 3}}}
	if p.Len() != 5 || p.Bytes() != 5*4096 {
		t.Fatalf("Len %d Bytes %d", p.Len(), p.Bytes())
	}
	if (Pages{}).Len() != 0 || (Pages{}).Bytes() != 0 {
		t.Fatal("zero Pages not empty")
	}
}

func TestPagesValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    Pages
		ok   bool
	}{
		{"empty", Pages{}, true},
		{"ok", Pages{4096, []Run{{0, 1}, {1, 2}, {9, 1}}}, true},
		{"fills the image", Pages{4096, []Run{{0, 10}}}, true},
		{"no page size", Pages{0, []Run{{0, 1}}}, false},
		{"empty run", Pages{4096, []Run{{0, 0}}}, false},
		{"overlap", Pages{4096, []Run{{0, 3}, {2, 1}}}, false},
		{"unsorted", Pages{4096, []Run{{5, 1}, {2, 1}}}, false},
		{"beyond", Pages{4096, []Run{{9, 2}}}, false},
		{"wraps", Pages{4096, []Run{{1, ^uint64(0)}}}, false},
	} {
		err := tc.p.Validate(10)
		if (err == nil) != tc.ok || (err != nil && !errdefs.IsInvalidArgument(err)) {
			t.Errorf("%s: Validate = %v", tc.name, err)
		}
	}
}

func TestUnion(t *testing.T) {
	a := Pages{PageSize: 4096, Runs: []Run{{0, 2}, {10, 5}, {30, 1}}}
	b := Pages{PageSize: 4096, Runs: []Run{{2, 1}, {4, 1}, {12, 10}, {29, 1}, {40, 2}}}
	got, err := Union(a, b)
	if err != nil {
		t.Fatal(err)
	}
	want := Pages{PageSize: 4096, Runs: []Run{{0, 3}, {4, 1}, {10, 12}, {29, 2}, {40, 2}}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Union = %v, want %v", got, want)
	}
	if got, _ := Union(b, a); !reflect.DeepEqual(got, want) {
		t.Fatalf("Union not symmetric: %v", got)
	}
	// The inputs are untouched.
	if a.Runs[0] != (Run{0, 2}) || b.Runs[0] != (Run{2, 1}) {
		t.Fatal("Union changed its inputs")
	}
	if got, err := Union(Pages{}, b); err != nil || got.PageSize != 4096 || len(got.Runs) != len(b.Runs) {
		t.Fatalf("Union(empty, b) = %v, %v", got, err)
	}
	if _, err := Union(a, Pages{PageSize: 65536, Runs: []Run{{0, 1}}}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("page sizes differ: %v", err)
	}
	if _, err := Union(a, Pages{PageSize: 4096, Runs: []Run{{3, 1}, {1, 1}}}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("unsorted input: %v", err)
	}
}
