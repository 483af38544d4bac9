package errdefs

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"testing"
)

func TestClassKeepsCause(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, statErr := os.Stat("/nonexistent/forkd-errdefs")
	for _, tc := range []struct {
		name  string
		err   error
		class error
		cause error
	}{
		{"canceled", Unavailable("agent: %w", ctx.Err()), ErrUnavailable, context.Canceled},
		{"not exist", NotFound("state file: %w", statErr), ErrNotFound, fs.ErrNotExist},
		{"two causes", FailedPrecondition("a: %w, b: %w", context.DeadlineExceeded, fs.ErrPermission), ErrFailedPrecondition, fs.ErrPermission},
		{"wrapped again", fmt.Errorf("fork: %w", InvalidArgument("n: %w", errStrconv)), ErrInvalidArgument, errStrconv},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !errors.Is(tc.err, tc.class) {
				t.Errorf("errors.Is(%v, class %v) = false", tc.err, tc.class)
			}
			if !errors.Is(tc.err, tc.cause) {
				t.Errorf("errors.Is(%v, cause %v) = false", tc.err, tc.cause)
			}
			if got := Class(tc.err); !errors.Is(got, tc.class) {
				t.Errorf("Class = %v, want %v", got, tc.class)
			}
		})
	}
}

var errStrconv = errors.New("strconv: bad digit")

func TestMessageNamesNoClass(t *testing.T) {
	err := NotFound("snapshot %q not found", "py")
	if got, want := err.Error(), `snapshot "py" not found`; got != want {
		t.Fatalf("message %q, want %q", got, want)
	}
	if got, want := Unavailable("dial: %w", context.Canceled).Error(), "dial: context canceled"; got != want {
		t.Fatalf("message %q, want %q", got, want)
	}
}

func TestOuterClassWins(t *testing.T) {
	inner := NotFound("memory file missing")
	outer := FailedPrecondition("snapshot py unusable: %w", inner)
	if !IsFailedPrecondition(outer) || IsNotFound(outer) {
		t.Fatalf("outer class not first: precondition=%v notfound=%v", IsFailedPrecondition(outer), IsNotFound(outer))
	}
	if !errors.Is(outer, ErrNotFound) {
		t.Fatal("the cause's class is no longer reachable with errors.Is")
	}
	if got := Code(outer); got != "failed_precondition" {
		t.Fatalf("Code = %q", got)
	}
	// A class joined with other errors is still found.
	if got := Code(errors.Join(errors.New("x"), ResourceExhausted("full"))); got != "resource_exhausted" {
		t.Fatalf("Code of a join = %q", got)
	}
}

func TestUnclassedIsInternal(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
	}{
		{"plain", errors.New("boom")},
		{"canceled", fmt.Errorf("ctx: %w", context.Canceled)},
		{"nil", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			if Classed(c.err) {
				t.Errorf("Classed(%v) = true", c.err)
			}
			if got := Code(c.err); got != CodeInternal {
				t.Errorf("Code(%v) = %q, want %q", c.err, got, CodeInternal)
			}
		})
	}
}

func TestCodeRoundTrip(t *testing.T) {
	for _, c := range codes {
		t.Run(c.code, func(t *testing.T) {
			err := FromCode(c.code, "msg")
			if !errors.Is(Class(err), c.class) || Code(err) != c.code || err.Error() != "msg" {
				t.Fatalf("FromCode(%q) = %v (class %v, code %q)", c.code, err, Class(err), Code(err))
			}
		})
	}
	if err := FromCode("no_such_code", "m"); Classed(err) || err.Error() != "m" {
		t.Fatalf("unknown code gave %v (classed %v)", err, Classed(err))
	}
}

func TestQuote(t *testing.T) {
	for in, want := range map[string]string{
		"":                            `""`,
		"py":                          `"py"`,
		"a\x00b":                      `"a\x00b"`,
		strings.Repeat("x", 64):       `"` + strings.Repeat("x", 64) + `"`,
		strings.Repeat("x", 65):       `"` + strings.Repeat("x", 64) + `"… (65 bytes)`,
		strings.Repeat("x", 1<<20):    `"` + strings.Repeat("x", 64) + `"… (1048576 bytes)`,
		strings.Repeat("é", 40):       `"` + strings.Repeat("é", 32) + `"… (80 bytes)`,
		"x" + strings.Repeat("é", 40): `"x` + strings.Repeat("é", 31) + `"… (81 bytes)`,
	} {
		if got := Quote(in); got != want {
			t.Errorf("Quote(%.20q…) = %s, want %s", in, got, want)
		}
	}
}
