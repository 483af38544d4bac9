package server

import (
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/sandbox"
)

func TestQueryParametersChecked(t *testing.T) {
	d := startDaemon(t, noVMs{}, sandbox.Limits{}, nil)
	for _, c := range []struct{ path, want string }{
		{"/v1/sandboxes?status=runing", `status "runing": want one of starting, running`},
		{"/v1/sandboxes?stauts=running", `unknown query parameter "stauts": want one of snapshot, metadata, status`},
		{"/v1/snapshots?all=1", `unknown query parameter "all"`},
		{"/v1/sandboxes/sb-aaaaaaaaaa/files/stat?path=/x&recursive=1", `want one of path`},
	} {
		code, b := d.call(t, "GET", c.path, testToken, nil)
		if e := apiError(t, b); code != 400 || !strings.Contains(e.Message, c.want) {
			t.Errorf("GET %s: %d %s, want 400 and %q", c.path, code, b, c.want)
		}
	}
	for _, path := range []string{"/v1/sandboxes?status=running", "/v1/sandboxes?snapshot=base&metadata=a=b", "/v1/sandboxes"} {
		if code, b := d.call(t, "GET", path, testToken, nil); code != 200 {
			t.Errorf("GET %s: %d %s", path, code, b)
		}
	}
}
