package client

import "github.com/forkd/forkd/internal/errdefs"

// The error classes of the daemon's answers, for errors.Is: an error code
// in a response comes back as an error wrapping one of these.
var (
	ErrNotFound           = errdefs.ErrNotFound
	ErrAlreadyExists      = errdefs.ErrAlreadyExists
	ErrInvalidArgument    = errdefs.ErrInvalidArgument
	ErrFailedPrecondition = errdefs.ErrFailedPrecondition
	ErrResourceExhausted  = errdefs.ErrResourceExhausted
	ErrUnavailable        = errdefs.ErrUnavailable
	ErrNotImplemented     = errdefs.ErrNotImplemented
	ErrUnauthenticated    = errdefs.ErrUnauthenticated
	ErrDeadlineExceeded   = errdefs.ErrDeadlineExceeded
)
