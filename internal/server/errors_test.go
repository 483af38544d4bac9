package server

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
)

// TestErrorRoundTrip: every class goes to its HTTP status and wire code,
// and the code read back (as the Go client does) gives the same class.
func TestErrorRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		err    error
		status int
		code   string
	}{
		{errdefs.NotFound("x"), http.StatusNotFound, "not_found"},
		{errdefs.AlreadyExists("x"), http.StatusConflict, "already_exists"},
		{errdefs.FailedPrecondition("x"), http.StatusConflict, "failed_precondition"},
		{errdefs.InvalidArgument("x"), http.StatusBadRequest, "invalid_argument"},
		{errdefs.ResourceExhausted("x"), http.StatusTooManyRequests, "resource_exhausted"},
		{errdefs.Unavailable("x"), http.StatusServiceUnavailable, "unavailable"},
		{errdefs.NotImplemented("x"), http.StatusNotImplemented, "not_implemented"},
		{errdefs.Unauthenticated("x"), http.StatusUnauthorized, "unauthenticated"},
		{errdefs.DeadlineExceeded("x"), http.StatusGatewayTimeout, "deadline_exceeded"},
		{fmt.Errorf("exec: %w", context.DeadlineExceeded), http.StatusGatewayTimeout, "deadline_exceeded"},
		{&http.MaxBytesError{Limit: 10}, http.StatusRequestEntityTooLarge, "internal"},
		{&tooLarge{&http.MaxBytesError{Limit: 10}}, http.StatusRequestEntityTooLarge, "invalid_argument"},
		{&unsupportedType{got: "text/plain", want: []string{jsonType}}, http.StatusUnsupportedMediaType, "invalid_argument"},
		{fmt.Errorf("boom"), http.StatusInternalServerError, "internal"},
	} {
		t.Run(tc.code+"/"+tc.err.Error(), func(t *testing.T) {
			if got := httpStatus(tc.err); got != tc.status {
				t.Errorf("status %d, want %d", got, tc.status)
			}
			w := wireError(tc.err)
			if w.Code != tc.code {
				t.Errorf("code %q, want %q", w.Code, tc.code)
			}
			back := errdefs.FromCode(w.Code, w.Message)
			if want := errdefs.Class(tc.err); want != nil && !errors.Is(errdefs.Class(back), want) {
				t.Errorf("read back as class %v, want %v", errdefs.Class(back), want)
			}
			if back.Error() != tc.err.Error() {
				t.Errorf("message %q, want %q", back.Error(), tc.err.Error())
			}
		})
	}
}

// TestTooLargeIs413: a body over its limit is an invalid argument, but
// answers 413, not 400.
func TestTooLargeIs413(t *testing.T) {
	err := &tooLarge{mbe: &http.MaxBytesError{Limit: 10}}
	if !errdefs.IsInvalidArgument(err) {
		t.Fatalf("class %v", errdefs.Class(err))
	}
	if got := httpStatus(err); got != http.StatusRequestEntityTooLarge {
		t.Fatalf("status %d, want 413", got)
	}
}
