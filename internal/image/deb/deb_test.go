package deb

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
)

func TestParseControl(t *testing.T) {
	p := parseControl([]byte("Package: linux-image-cloud-amd64\nSource: linux-signed-amd64 (6.1.192+2)\n" +
		"Version: 6.1.192-2\nArchitecture: amd64\n" +
		"Depends: linux-image-6.1.0-56-cloud-amd64 (= 6.1.192-2), kmod | busybox, libc6:any (>= 2.3)\n" +
		"Description: meta\n more text: with a colon\n\nPackage: other\nVersion: 1\n"))
	if p.Name != "linux-image-cloud-amd64" || p.Version != "6.1.192-2" || p.Arch != "amd64" {
		t.Errorf("parsed %+v", p)
	}
	if want := []string{"linux-image-6.1.0-56-cloud-amd64", "kmod", "libc6"}; !slices.Equal(p.Depends, want) {
		t.Errorf("depends %v, want %v", p.Depends, want)
	}
}

func TestKey(t *testing.T) {
	for _, c := range []struct{ name, version, want string }{
		{"busybox-static", "1:1.35.0-4+deb12u1+b1", "busybox-static_1_1.35.0-4+deb12u1+b1"},
		{"linux-image-6.1.0-56-cloud-amd64", "6.1.192-2", "linux-image-6.1.0-56-cloud-amd64_6.1.192-2"},
		{"x", "1/../../2", "x_1_.._.._2"},
	} {
		t.Run(c.name, func(t *testing.T) {
			p, want := Package{Name: c.name, Version: c.version}, c.want
			if got := p.Key(); got != want {
				t.Errorf("%+v.Key() = %q, want %q", p, got, want)
			}
		})
	}
}

func TestValidName(t *testing.T) {
	for _, ok := range []string{"file", "python3-numpy", "g++", "libc6.1"} {
		t.Run(ok, func(t *testing.T) {
			if !ValidName(ok) {
				t.Errorf("%q refused", ok)
			}
		})
	}
	for _, bad := range []string{"", "-o", "--allow-unauthenticated", "a", "Upper", "x y", "x;rm", "../x"} {
		t.Run("bad "+bad, func(t *testing.T) {
			if ValidName(bad) {
				t.Errorf("%q accepted", bad)
			}
		})
	}
}

// fakeAptCache writes a stand-in apt-cache that answers for "known" and
// counts its calls in a file.
func fakeAptCache(t *testing.T) (Tools, string) {
	t.Helper()
	dir := t.TempDir()
	calls := filepath.Join(dir, "calls")
	script := `#!/bin/sh
echo x >> ` + calls + `
for last; do :; done
if [ "$last" = known ]; then
  printf 'Package: known\nVersion: 1.0-1\nArchitecture: amd64\n'
  exit 0
fi
echo "E: No packages found" >&2
exit 100
`
	p := filepath.Join(dir, "apt-cache")
	if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	lists := filepath.Join(dir, "lists")
	must(t, os.Mkdir(lists, 0o755))
	must(t, os.WriteFile(filepath.Join(lists, "mirror_dists_x_main_binary-amd64_Packages"), []byte("a"), 0o644))
	return Tools{AptCache: p, AptGet: "/bin/true", ListsDir: lists, Memo: filepath.Join(dir, "memo.json")}, calls
}

// must fails t when a setup step failed. (This package cannot use
// testutil's helpers: testutil imports it.)
func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func countCalls(t *testing.T, calls string) int {
	b, _ := os.ReadFile(calls)
	return strings.Count(string(b), "x")
}

func TestCandidateMemo(t *testing.T) {
	tools, calls := fakeAptCache(t)
	ctx := context.Background()
	for i := 0; i < 3; i++ {
		p, err := tools.Candidate(ctx, "known")
		if err != nil || p.Version != "1.0-1" {
			t.Fatalf("Candidate: %+v, %v", p, err)
		}
	}
	if n := countCalls(t, calls); n != 1 {
		t.Errorf("apt-cache ran %d times, want 1", n)
	}
	// New package lists invalidate the memo.
	later := time.Now().Add(time.Minute)
	must(t, os.Chtimes(filepath.Join(tools.ListsDir, "mirror_dists_x_main_binary-amd64_Packages"), later, later))
	if _, err := tools.Candidate(ctx, "known"); err != nil {
		t.Fatal(err)
	}
	if n := countCalls(t, calls); n != 2 {
		t.Errorf("apt-cache ran %d times, want 2", n)
	}
	// Unknown packages: NotFound, after one apt-get update (here /bin/true).
	if _, err := tools.Candidate(ctx, "unknown"); !errdefs.IsNotFound(err) {
		t.Errorf("unknown: %v", err)
	}
	if _, err := tools.Candidate(ctx, "-o=x"); !errdefs.IsInvalidArgument(err) {
		t.Errorf("bad name: %v", err)
	}
}

func TestMissingTool(t *testing.T) {
	tools := Tools{AptCache: "/nonexistent/apt-cache", ListsDir: t.TempDir(), AptGet: "/nonexistent/apt-get"}
	if _, err := tools.Candidate(context.Background(), "known"); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("missing apt: %v", err)
	}
	if err := tools.Extract(context.Background(), "/nonexistent.deb", t.TempDir()); err == nil {
		t.Error("extract of a missing file succeeded")
	}
	if _, err := tools.Fields(context.Background(), "/nonexistent.deb"); !errdefs.IsNotFound(err) {
		t.Errorf("fields of a missing file: %v", err)
	}
}
