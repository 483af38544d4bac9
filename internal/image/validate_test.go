package image

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

func TestValidateOCIOptions(t *testing.T) {
	imports := t.TempDir()
	inside := filepath.Join(imports, "img.tar")
	outside := filepath.Join(t.TempDir(), "img.tar")
	for _, p := range []string{inside, outside} {
		testutil.WriteFile(t, p, []byte("x"), 0o644)
	}
	many := make([]string, MaxExtraPackages+1)
	for i := range many {
		many[i] = "pkg"
	}
	for _, c := range []struct {
		ref  string
		o    OCIOptions
		is   func(error) bool
		want string
	}{
		{outside, OCIOptions{Tag: "t", ImportDir: imports}, errdefs.IsInvalidArgument, "outside the import directory"},
		{"/nonexistent.tar", OCIOptions{Tag: "t"}, errdefs.IsNotFound, "no such file"},
		{inside, OCIOptions{Tag: "../t"}, errdefs.IsInvalidArgument, "image name"},
		{inside, OCIOptions{Tag: "minimal"}, errdefs.IsAlreadyExists, "built-in"},
		{inside, OCIOptions{Tag: "t", Extra: []string{"-oAPT::x"}}, errdefs.IsInvalidArgument, "extra package name"},
		{inside, OCIOptions{Tag: "t", Extra: many}, errdefs.IsInvalidArgument, "at most"},
		{inside, OCIOptions{Tag: "t", Preload: []string{"__import__('os')"}}, errdefs.IsInvalidArgument, "preload module"},
		{strings.Repeat("a", MaxRefLen+1), OCIOptions{Tag: "t"}, errdefs.IsInvalidArgument, "limit"},
	} {
		t.Run(c.want, func(t *testing.T) {
			if err := ValidateOCIOptions(c.ref, c.o); !c.is(err) || !strings.Contains(err.Error(), c.want) {
				t.Errorf("%.40s %+v: %v, want %q", c.ref, c.o, err, c.want)
			}
		})
	}
	for _, c := range []struct{ name, ref string }{
		{"absolute", inside},
		{"relative", "img.tar"},
		{"docker-archive", "docker-archive:img.tar"},
		{"registry", "busybox:1.36"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if err := ValidateOCIOptions(c.ref, OCIOptions{Tag: "t", Extra: []string{"python3"}, Preload: []string{"numpy"}, ImportDir: imports}); err != nil {
				t.Errorf("%s: %v", c.ref, err)
			}
		})
	}
	// Without an import dir (the local CLI) any path goes.
	if err := ValidateOCIOptions(outside, OCIOptions{Tag: "t"}); err != nil {
		t.Errorf("local %s: %v", outside, err)
	}
}
