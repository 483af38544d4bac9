// Package errdefs defines the few classes of error forkd distinguishes.
//
// Every error that crosses a package boundary carries one class, attached by
// one of the constructors below (errdefs.NotFound("snapshot %q", tag)) or by
// wrapping a sentinel (fmt.Errorf("snapshot %q: %w", tag, errdefs.ErrNotFound)).
// A constructor given a cause with %w keeps it: the result unwraps to both
// the class and the cause, so errors.Is(err, errdefs.ErrNotFound) and
// errors.Is(err, fs.ErrNotExist) (or context.Canceled) both hold.
//
// An error has one class: the one attached nearest the top of its chain
// (Class). The Is* helpers test that class, never one buried in a cause; the
// HTTP layer maps classes to status codes in one place and the Go client
// maps them back.
package errdefs

import (
	"errors"
	"fmt"
	"strconv"
	"unicode/utf8"
)

// The classes. Wrap them; never compare with ==.
var (
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrInvalidArgument    = errors.New("invalid argument")
	ErrFailedPrecondition = errors.New("failed precondition")
	ErrResourceExhausted  = errors.New("resource exhausted")
	ErrUnavailable        = errors.New("unavailable")
	ErrNotImplemented     = errors.New("not implemented")
	ErrUnauthenticated    = errors.New("unauthenticated")
	ErrDeadlineExceeded   = errors.New("deadline exceeded")
)

// classed is an error with a message of its own, a class, and the causes
// its message wrapped with %w (none when it had no cause). The class name
// does not appear in the message.
type classed struct {
	msg    string
	class  error
	causes []error
}

func (e *classed) Error() string { return e.msg }

// Unwrap returns the class first, then the causes.
func (e *classed) Unwrap() []error { return append([]error{e.class}, e.causes...) }

// newf formats like fmt.Errorf, so that %w keeps the cause.
func newf(class error, format string, args ...any) error {
	err := fmt.Errorf(format, args...)
	c := &classed{msg: err.Error(), class: class}
	switch u := err.(type) { //nolint:errorlint // fmt.Errorf's own result: its direct causes, not a search of the tree
	case interface{ Unwrap() error }:
		if cause := u.Unwrap(); cause != nil {
			c.causes = []error{cause}
		}
	case interface{ Unwrap() []error }:
		c.causes = u.Unwrap()
	}
	return c
}

// NotFound returns an error of class ErrNotFound with the given message
// (fmt.Errorf's format: %w keeps a cause).
func NotFound(format string, args ...any) error { return newf(ErrNotFound, format, args...) }

// AlreadyExists returns an error of class ErrAlreadyExists.
func AlreadyExists(format string, args ...any) error {
	return newf(ErrAlreadyExists, format, args...)
}

// InvalidArgument returns an error of class ErrInvalidArgument.
func InvalidArgument(format string, args ...any) error {
	return newf(ErrInvalidArgument, format, args...)
}

// FailedPrecondition returns an error of class ErrFailedPrecondition.
func FailedPrecondition(format string, args ...any) error {
	return newf(ErrFailedPrecondition, format, args...)
}

// ResourceExhausted returns an error of class ErrResourceExhausted.
func ResourceExhausted(format string, args ...any) error {
	return newf(ErrResourceExhausted, format, args...)
}

// Unavailable returns an error of class ErrUnavailable.
func Unavailable(format string, args ...any) error {
	return newf(ErrUnavailable, format, args...)
}

// NotImplemented returns an error of class ErrNotImplemented.
func NotImplemented(format string, args ...any) error {
	return newf(ErrNotImplemented, format, args...)
}

// Unauthenticated returns an error of class ErrUnauthenticated.
func Unauthenticated(format string, args ...any) error {
	return newf(ErrUnauthenticated, format, args...)
}

// DeadlineExceeded returns an error of class ErrDeadlineExceeded.
func DeadlineExceeded(format string, args ...any) error {
	return newf(ErrDeadlineExceeded, format, args...)
}

// Class returns err's class: the class sentinel met first when err's chain
// is walked from the top (a classed error's own class before its causes'),
// or nil when err carries none.
func Class(err error) error {
	for _, c := range codes {
		if err == c.class { //nolint:errorlint // this node only: errors.Is would find a class buried in a cause
			return c.class
		}
	}
	switch e := err.(type) { //nolint:errorlint // walks the tree node by node, nearest the top first
	case *classed:
		return e.class
	case interface{ Unwrap() error }:
		return Class(e.Unwrap())
	case interface{ Unwrap() []error }:
		for _, u := range e.Unwrap() {
			if c := Class(u); c != nil {
				return c
			}
		}
	}
	return nil
}

// Classed reports whether err carries a class. An error without one is an
// internal error: a bug or a failure forkd did not foresee.
func Classed(err error) bool { return Class(err) != nil }

// IsNotFound reports whether err is of class ErrNotFound.
func IsNotFound(err error) bool { return errors.Is(Class(err), ErrNotFound) }

// IsAlreadyExists reports whether err is of class ErrAlreadyExists.
func IsAlreadyExists(err error) bool { return errors.Is(Class(err), ErrAlreadyExists) }

// IsInvalidArgument reports whether err is of class ErrInvalidArgument.
func IsInvalidArgument(err error) bool { return errors.Is(Class(err), ErrInvalidArgument) }

// IsFailedPrecondition reports whether err is of class ErrFailedPrecondition.
func IsFailedPrecondition(err error) bool { return errors.Is(Class(err), ErrFailedPrecondition) }

// IsResourceExhausted reports whether err is of class ErrResourceExhausted.
func IsResourceExhausted(err error) bool { return errors.Is(Class(err), ErrResourceExhausted) }

// IsUnavailable reports whether err is of class ErrUnavailable.
func IsUnavailable(err error) bool { return errors.Is(Class(err), ErrUnavailable) }

// IsUnauthenticated reports whether err is of class ErrUnauthenticated.
func IsUnauthenticated(err error) bool { return errors.Is(Class(err), ErrUnauthenticated) }

// IsNotImplemented reports whether err is of class ErrNotImplemented.
func IsNotImplemented(err error) bool { return errors.Is(Class(err), ErrNotImplemented) }

// IsDeadlineExceeded reports whether err is of class ErrDeadlineExceeded.
func IsDeadlineExceeded(err error) bool { return errors.Is(Class(err), ErrDeadlineExceeded) }

// CodeInternal is the wire name of an error without a class.
const CodeInternal = "internal"

// Code returns the stable wire name of err's class ("not_found", ...), or
// CodeInternal when err carries no class.
func Code(err error) string {
	c := Class(err)
	for _, k := range codes {
		if errors.Is(c, k.class) {
			return k.code
		}
	}
	return CodeInternal
}

// FromCode returns an error of the class named by code with the given
// message; an unknown code gives a plain error.
func FromCode(code, msg string) error {
	for _, c := range codes {
		if c.code == code {
			return &classed{msg: msg, class: c.class}
		}
	}
	return errors.New(msg)
}

var codes = []struct {
	code  string
	class error
}{
	{"not_found", ErrNotFound},
	{"already_exists", ErrAlreadyExists},
	{"invalid_argument", ErrInvalidArgument},
	{"failed_precondition", ErrFailedPrecondition},
	{"resource_exhausted", ErrResourceExhausted},
	{"unavailable", ErrUnavailable},
	{"not_implemented", ErrNotImplemented},
	{"unauthenticated", ErrUnauthenticated},
	{"deadline_exceeded", ErrDeadlineExceeded},
}

// QuoteMax is the most bytes of a string Quote shows.
const QuoteMax = 64

// Quote is s as %q writes it when s is at most QuoteMax bytes long;
// otherwise its first QuoteMax bytes (cut at a character boundary), quoted,
// then "…" and s's length. Messages quote user input with it, so an error
// about a huge field stays short.
func Quote(s string) string {
	if len(s) <= QuoteMax {
		return strconv.Quote(s)
	}
	cut := QuoteMax
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return fmt.Sprintf("%q… (%d bytes)", s[:cut], len(s))
}
