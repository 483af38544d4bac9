package server

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
)

// statuses maps each errdefs class to its HTTP status: the one place where
// classes meet HTTP. The Go client maps the wire code back
// (errdefs.FromCode).
var statuses = map[error]int{
	errdefs.ErrNotFound:           http.StatusNotFound,
	errdefs.ErrAlreadyExists:      http.StatusConflict,
	errdefs.ErrFailedPrecondition: http.StatusConflict,
	errdefs.ErrInvalidArgument:    http.StatusBadRequest,
	errdefs.ErrResourceExhausted:  http.StatusTooManyRequests,
	errdefs.ErrUnavailable:        http.StatusServiceUnavailable,
	errdefs.ErrNotImplemented:     http.StatusNotImplemented,
	errdefs.ErrUnauthenticated:    http.StatusUnauthorized,
	errdefs.ErrDeadlineExceeded:   http.StatusGatewayTimeout,
}

// httpStatus maps an error to its HTTP status: 413 for a body over its
// limit and 415 for one of a media type the route does not take (both of
// class InvalidArgument), 408 for a body that came too slowly (class
// DeadlineExceeded), else by its class, else 504 for a deadline and 500
// for the rest.
func httpStatus(err error) int {
	var (
		tooBig  *http.MaxBytesError
		badType *unsupportedType
		slow    *slowBody
	)
	switch {
	case errors.As(err, &tooBig):
		return http.StatusRequestEntityTooLarge
	case errors.As(err, &badType):
		return http.StatusUnsupportedMediaType
	case errors.As(err, &slow):
		return http.StatusRequestTimeout
	}
	if st, ok := statuses[errdefs.Class(err)]; ok {
		return st
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

// wireError is err as the API shows it.
func wireError(err error) apiv1.Error {
	code := errdefs.Code(err)
	if !errdefs.Classed(err) && errors.Is(err, context.DeadlineExceeded) {
		code = apiv1.CodeDeadlineExceeded
	}
	return apiv1.Error{Code: code, Message: err.Error()}
}

// writeError writes err as an ErrorResponse with its status.
func writeError(w http.ResponseWriter, err error) {
	status := httpStatus(err)
	if status == http.StatusTooManyRequests && w.Header().Get("Retry-After") == "" {
		// A limit that frees up as work ends (admission, branches,
		// operations): worth a retry soon.
		w.Header().Set("Retry-After", "1")
	}
	writeJSON(w, status, apiv1.ErrorResponse{Error: wireError(err)})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	if status == http.StatusNoContent {
		return
	}
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v) // a failed write means the caller left
}
