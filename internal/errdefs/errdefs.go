// Package errdefs defines the few classes of error forkd distinguishes.
//
// Every error that crosses a package boundary carries one class, attached by
// wrapping one of the sentinels below (fmt.Errorf("snapshot %q: %w", tag,
// errdefs.ErrNotFound) or errdefs.NotFound("...")). Callers test the class with
// the Is* helpers; the HTTP layer maps classes to status codes in one place
// and the Go client maps them back.
package errdefs

import (
	"errors"
	"fmt"
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

// classed is an error with a message of its own and a class it unwraps to,
// so that the class name does not appear twice in the message.
type classed struct {
	msg   string
	class error
}

func (e *classed) Error() string { return e.msg }
func (e *classed) Unwrap() error { return e.class }

func newf(class error, format string, args ...any) error {
	return &classed{msg: fmt.Sprintf(format, args...), class: class}
}

// NotFound returns an error of class ErrNotFound with the given message.
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

// IsNotFound reports whether err is of class ErrNotFound.
func IsNotFound(err error) bool { return errors.Is(err, ErrNotFound) }

// IsAlreadyExists reports whether err is of class ErrAlreadyExists.
func IsAlreadyExists(err error) bool { return errors.Is(err, ErrAlreadyExists) }

// IsInvalidArgument reports whether err is of class ErrInvalidArgument.
func IsInvalidArgument(err error) bool { return errors.Is(err, ErrInvalidArgument) }

// IsFailedPrecondition reports whether err is of class ErrFailedPrecondition.
func IsFailedPrecondition(err error) bool { return errors.Is(err, ErrFailedPrecondition) }

// IsResourceExhausted reports whether err is of class ErrResourceExhausted.
func IsResourceExhausted(err error) bool { return errors.Is(err, ErrResourceExhausted) }

// IsUnavailable reports whether err is of class ErrUnavailable.
func IsUnavailable(err error) bool { return errors.Is(err, ErrUnavailable) }

// IsUnauthenticated reports whether err is of class ErrUnauthenticated.
func IsUnauthenticated(err error) bool { return errors.Is(err, ErrUnauthenticated) }

// IsNotImplemented reports whether err is of class ErrNotImplemented.
func IsNotImplemented(err error) bool { return errors.Is(err, ErrNotImplemented) }

// Code returns the stable wire name of err's class ("not_found", ...), or
// "internal" when err carries no class.
func Code(err error) string {
	for _, c := range codes {
		if errors.Is(err, c.class) {
			return c.code
		}
	}
	return "internal"
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
