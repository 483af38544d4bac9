package server

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
)

// httpStatus maps an error to its HTTP status: the one place where errdefs
// classes meet HTTP. The Go client maps the code back (errdefs.FromCode).
func httpStatus(err error) int {
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		return http.StatusRequestEntityTooLarge
	case errdefs.IsNotFound(err):
		return http.StatusNotFound
	case errdefs.IsAlreadyExists(err), errdefs.IsFailedPrecondition(err):
		return http.StatusConflict
	case errdefs.IsInvalidArgument(err):
		return http.StatusBadRequest
	case errdefs.IsResourceExhausted(err):
		return http.StatusTooManyRequests
	case errdefs.IsUnavailable(err):
		return http.StatusServiceUnavailable
	case errdefs.IsNotImplemented(err):
		return http.StatusNotImplemented
	case errors.Is(err, errdefs.ErrUnauthenticated):
		return http.StatusUnauthorized
	case errors.Is(err, errdefs.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

// wireError is err as the API shows it.
func wireError(err error) apiv1.Error {
	code := errdefs.Code(err)
	if code == "internal" && errors.Is(err, context.DeadlineExceeded) {
		code = apiv1.CodeDeadlineExceeded
	}
	return apiv1.Error{Code: code, Message: err.Error()}
}

// writeError writes err as an ErrorResponse with its status.
func writeError(w http.ResponseWriter, err error) {
	writeJSON(w, httpStatus(err), apiv1.ErrorResponse{Error: wireError(err)})
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
	enc.Encode(v) // a failed write means the caller left
}
