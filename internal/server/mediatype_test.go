package server

import (
	"net/http"
	"strings"
	"testing"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/sandbox"
)

// TestJSONBodiesNeedJSONContentType: every route whose body is JSON
// refuses any other Content-Type (or none) with 415, before reading it.
func TestJSONBodiesNeedJSONContentType(t *testing.T) {
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, nil)
	n := 0
	for _, rt := range routes {
		if rt.h.req == nil {
			continue
		}
		n++
		path := strings.NewReplacer("{id}", "sb-aaaaaaaaaa", "{tag}", "base").Replace(rt.Path)
		for _, ct := range []string{"", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
			"application/json; charset=latin1", "application/jsonx", "json", ";;"} {
			code, b := d.callCT(t, rt.Method, path, ct, strings.NewReader(`{}`))
			e := apiError(t, b)
			if code != http.StatusUnsupportedMediaType || e.Code != apiv1.CodeInvalidArgument || !strings.Contains(e.Message, "application/json") {
				t.Errorf("%s %s with Content-Type %q: %d %s, want 415 naming application/json", rt.Method, path, ct, code, b)
			}
		}
		for _, ct := range []string{"application/json", "application/json; charset=utf-8", "Application/JSON; charset=\"UTF-8\""} {
			if code, b := d.callCT(t, rt.Method, path, ct, strings.NewReader(`{}`)); code == http.StatusUnsupportedMediaType {
				t.Errorf("%s %s with Content-Type %q: %d %s", rt.Method, path, ct, code, b)
			}
		}
	}
	if n < 10 {
		t.Fatalf("only %d routes take JSON", n)
	}
	// exec/stream also takes a streamed stdin body.
	code, b := d.callCT(t, "POST", "/v1/sandboxes/sb-aaaaaaaaaa/exec/stream", apiv1.ExecStdinStream, strings.NewReader(`{"args":["cat"],"stdin_stream":true}`+"\n"))
	if code != http.StatusNotFound {
		t.Errorf("exec/stream with %s: %d %s, want 404 (no such sandbox)", apiv1.ExecStdinStream, code, b)
	}
	// A raw body of any type still goes to PUT files.
	code, b = d.callCT(t, "PUT", "/v1/sandboxes/sb-aaaaaaaaaa/files?path=/a", "text/plain", strings.NewReader("data"))
	if code != http.StatusNotFound {
		t.Errorf("PUT files as text/plain: %d %s, want 404 (no such sandbox)", code, b)
	}
}
