package server

import (
	"bytes"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/errdefs"
)

func TestCheckToken(t *testing.T) {
	for _, tok := range []string{
		"", "short", "0123456789abcde", // empty, short
		"changeme", "changemechangeme", "changeme-changeme-changeme", "your-token-here",
		"<token>", "PLACEHOLDER_PLACEHOLDER", "test-token-test-token",
		"aaaaaaaaaaaaaaaaaaaaaaaa", "abababababababababab", // too few distinct characters
		"has a space in it 0123456789", "tab\there0123456789abcdef", "nul\x00xx0123456789abcdef",
	} {
		if err := CheckToken([]byte(tok)); !errdefs.IsInvalidArgument(err) {
			t.Errorf("CheckToken(%q) = %v, want refusal", tok, err)
		}
	}
	for _, tok := range []string{
		testToken, "correct-horse-battery-staple-42", "Zq8vN3xLw1Pk7Rt5",
	} {
		if err := CheckToken([]byte(tok)); err != nil {
			t.Errorf("CheckToken(%q) = %v", tok, err)
		}
	}
}

func TestLoadToken(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "sub", "token")
	if _, _, err := LoadToken(path, false); err == nil {
		t.Fatal("missing token file accepted without create")
	}
	tok, created, err := LoadToken(path, true)
	if err != nil || !created || len(tok) != 64 {
		t.Fatalf("created token %q, %v, %v", tok, created, err)
	}
	st, _ := os.Stat(path)
	if st.Mode().Perm() != 0o600 {
		t.Errorf("token file mode %v", st.Mode())
	}
	again, created, err := LoadToken(path, true)
	if err != nil || created || !bytes.Equal(again, tok) {
		t.Errorf("second load: %q %v %v", again, created, err)
	}
	// Refusals: readable by others, weak content.
	os.Chmod(path, 0o644)
	if _, _, err := LoadToken(path, true); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Errorf("0644 token file: %v", err)
	}
	for _, content := range []string{"", "\n", "changeme\n", "tooshort\n", "your-token-here\n"} {
		p := filepath.Join(dir, "weak")
		os.WriteFile(p, []byte(content), 0o600)
		if _, _, err := LoadToken(p, true); !errdefs.IsInvalidArgument(err) {
			t.Errorf("token file holding %q: %v", content, err)
		}
	}
	// Surrounding white space is not part of the token.
	p := filepath.Join(dir, "spaced")
	os.WriteFile(p, []byte("  "+testToken+"\n\n"), 0o600)
	if got, _, err := LoadToken(p, false); err != nil || string(got) != testToken {
		t.Errorf("spaced token: %q %v", got, err)
	}
}

// A daemon without a token answers API clients on loopback, never a web
// page (Origin) or a rebound DNS name (Host).
func TestNoTokenRefusesBrowsers(t *testing.T) {
	s := &Server{}
	for _, c := range []struct {
		host, origin string
		ok           bool
	}{
		{"127.0.0.1:8889", "", true},
		{"localhost:8889", "", true},
		{"[::1]:8889", "", true},
		{"127.0.0.1:8889", "http://evil.example", false},
		{"127.0.0.1:8889", "null", false},
		{"evil.example:8889", "", false},
		{"10.0.0.5:8889", "", false},
	} {
		r := httptest.NewRequest("POST", "/v1/sandboxes", nil)
		r.Host = c.host
		if c.origin != "" {
			r.Header.Set("Origin", c.origin)
		}
		_, err := s.authenticate(r)
		if (err == nil) != c.ok || (err != nil && !errdefs.IsUnauthenticated(err)) {
			t.Errorf("Host %q Origin %q: %v, want ok=%v", c.host, c.origin, err, c.ok)
		}
	}
}
