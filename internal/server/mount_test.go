package server

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/sandbox"
)

func TestMount(t *testing.T) {
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, func(_ *sandbox.Config, c *Config) { c.MaxBodyBytes = 4 << 10 })
	calls := 0
	d.srv.Mount("/mcp", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		b, _ := io.ReadAll(r.Body)
		_, _ = w.Write([]byte(r.Method + " " + string(b)))
	}))

	// TCP: the bearer token, as on every route.
	for _, tok := range []string{"", "wrong-token-0123456789abcdef"} {
		code, b := d.call(t, "POST", "/mcp", tok, strings.NewReader(`{}`))
		if code != http.StatusUnauthorized || apiError(t, b).Code != apiv1.CodeUnauthenticated {
			t.Errorf("POST /mcp with token %q: %d %s", tok, code, b)
		}
	}
	if calls != 0 {
		t.Fatalf("the mounted handler ran %d times for unauthenticated callers", calls)
	}
	if code, b := d.call(t, "POST", "/mcp", testToken, strings.NewReader(`{"a":1}`)); code != 200 || string(b) != `POST {"a":1}` {
		t.Errorf("POST /mcp with the token: %d %s", code, b)
	}
	if code, b := d.call(t, "GET", "/mcp", testToken, nil); code != 200 || string(b) != "GET " {
		t.Errorf("GET /mcp with the token: %d %s", code, b)
	}
	// A body over --max-body-bytes never reaches the handler.
	if code, b := d.call(t, "POST", "/mcp", testToken, strings.NewReader(strings.Repeat("x", 5<<10))); code != http.StatusRequestEntityTooLarge || apiError(t, b).Code != apiv1.CodeInvalidArgument {
		t.Errorf("a body over the limit: %d %s", code, b)
	}
	if calls != 2 {
		t.Errorf("the mounted handler ran %d times, want 2", calls)
	}
	// Only the exact path is mounted.
	if code, _ := d.call(t, "POST", "/mcp/x", testToken, strings.NewReader(`{}`)); code != http.StatusNotFound {
		t.Errorf("POST /mcp/x: %d, want 404", code)
	}

	// The unix socket: the kernel vouches for the caller.
	resp, err := unixHTTP(d.sock).Post("http://forkd/mcp", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(b) != "POST {}" {
		t.Errorf("POST /mcp over the socket: %d %s", resp.StatusCode, b)
	}

	d.stop(t)
	var audited []string
	for _, line := range strings.Split(strings.TrimSpace(d.audit.String()), "\n") {
		var e auditEntry
		if err := json.Unmarshal([]byte(line), &e); err == nil && e.Route == "MOUNT /mcp" {
			audited = append(audited, e.Caller)
		}
	}
	if len(audited) != 6 || audited[0] != "anonymous@127.0.0.1" || audited[2] != "token@127.0.0.1" || !strings.HasPrefix(audited[5], "uid:") {
		t.Errorf("audit callers of /mcp: %q", audited)
	}

	for _, path := range []string{"/v1/sandboxes", "/v1", "mcp", "/x/{id}"} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Mount(%q) did not panic", path)
				}
			}()
			d.srv.Mount(path, http.NotFoundHandler())
		}()
	}
}

// unixHTTP is an HTTP client of the unix socket at path.
func unixHTTP(path string) *http.Client {
	return &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}}}
}
