package server

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/loopback"
)

// MinTokenBytes is the shortest bearer token the daemon accepts.
const MinTokenBytes = 16

// placeholders are tokens people copy from examples; refused in any case.
var placeholders = []string{
	"changeme", "change-me", "change_me", "placeholder", "token", "secret", "password",
	"your-token", "your_token", "yourtoken", "your-token-here", "<token>", "todo",
	"example", "default", "forkd", "admin", "test", "dummy", "insecure",
}

// CheckToken refuses a token that is empty, shorter than MinTokenBytes, a
// known placeholder, made of too few distinct characters, or not a single
// word of printable ASCII (it travels in an HTTP header).
func CheckToken(tok []byte) error {
	if len(tok) == 0 {
		return errdefs.InvalidArgument("token is empty")
	}
	for _, b := range tok {
		if b <= ' ' || b > '~' {
			return errdefs.InvalidArgument("token holds a space or a non-printable character")
		}
	}
	// What is left without placeholder words and punctuation must still
	// be a token ("changeme-changeme-changeme" is not).
	rest := strings.ToLower(string(tok))
	var found string
	for _, p := range placeholders {
		if strings.Contains(rest, p) {
			found = p
			rest = strings.ReplaceAll(rest, p, "")
		}
	}
	rest = strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			return r
		}
		return -1
	}, rest)
	if found != "" && len(rest) < MinTokenBytes {
		return errdefs.InvalidArgument("token looks like a placeholder (%q); put a random secret in it (e.g. openssl rand -hex 32)", found)
	}
	if len(tok) < MinTokenBytes {
		return errdefs.InvalidArgument("token is %d bytes; want at least %d", len(tok), MinTokenBytes)
	}
	distinct := map[byte]bool{}
	for _, b := range tok {
		distinct[b] = true
	}
	if len(distinct) < 8 {
		return errdefs.InvalidArgument("token uses only %d distinct characters; put a random secret in it", len(distinct))
	}
	return nil
}

// LoadToken reads the bearer token in path (surrounding white space is
// ignored). When the file does not exist and create is set, it is created
// with mode 0600 holding 32 random bytes in hex. The token is refused when
// CheckToken refuses it, and the file when group or others may read it.
func LoadToken(path string, create bool) (tok []byte, created bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) && create {
		if err := createToken(path); err != nil {
			return nil, false, err
		}
		created = true
		b, err = os.ReadFile(path)
	}
	if err != nil {
		return nil, false, fmt.Errorf("token file: %w", err)
	}
	st, err := os.Stat(path)
	if err != nil {
		return nil, false, err
	}
	if st.Mode().Perm()&0o077 != 0 {
		return nil, false, errdefs.InvalidArgument("token file %s has mode %04o: others may read it (chmod 600 %s)", path, st.Mode().Perm(), path)
	}
	tok = bytes.TrimSpace(b)
	if err := CheckToken(tok); err != nil {
		return nil, false, fmt.Errorf("token file %s: %w", path, err)
	}
	return tok, created, nil
}

// createToken writes a fresh token to path atomically, never replacing a
// file that appeared meanwhile: it is written complete under a temporary
// name, then hard-linked into place.
func createToken(path string) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	var raw [32]byte
	rand.Read(raw[:])
	tmp := fmt.Sprintf("%s.new-%d", path, os.Getpid())
	if err := fsutil.WriteFile(tmp, []byte(hex.EncodeToString(raw[:])+"\n"), 0o600); err != nil {
		return err
	}
	defer os.Remove(tmp)
	if err := os.Link(tmp, path); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	return fsutil.SyncDir(dir)
}

// peer is who is at the other end of a connection.
type peer struct {
	unix bool
	uid  int // unix sockets only
	addr string
}

type peerKey struct{}

// connContext records each connection's peer; for a unix socket, its uid
// from SO_PEERCRED.
func connContext(ctx context.Context, c net.Conn) context.Context {
	p := &peer{uid: -1, addr: c.RemoteAddr().String()}
	if uc, ok := c.(*net.UnixConn); ok {
		p.unix = true
		if raw, err := uc.SyscallConn(); err == nil {
			// On failure uid stays -1, which authenticate refuses.
			_ = raw.Control(func(fd uintptr) {
				if cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
					p.uid = int(cred.Uid)
				}
			})
		}
	}
	return context.WithValue(ctx, peerKey{}, p)
}

// authenticate says who the caller is, or fails with class
// Unauthenticated. On the unix socket (mode 0600) the kernel vouches for
// the caller: root or the daemon's own user. Elsewhere the caller must
// present the bearer token.
func (s *Server) authenticate(r *http.Request) (caller string, err error) {
	p, _ := r.Context().Value(peerKey{}).(*peer)
	if p != nil && p.unix {
		if p.uid == 0 || p.uid == os.Geteuid() {
			return "uid:" + strconv.Itoa(p.uid), nil
		}
		return "uid:" + strconv.Itoa(p.uid), errdefs.Unauthenticated("uid %d may not use this socket", p.uid)
	}
	host := r.RemoteAddr
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	if s.tokenSum == nil {
		// Without a token (--no-auth, loopback only) a web page in the
		// user's browser is the threat: it can send simple cross-origin
		// requests, and read answers after DNS rebinding. Browsers name
		// their page in Origin and the site in Host; an API client does
		// neither, and names a loopback host.
		if o := r.Header.Get("Origin"); o != "" {
			return "anonymous@" + host, errdefs.Unauthenticated("requests from web pages (Origin %s) are refused by a daemon without a token", errdefs.Quote(o))
		}
		if !loopback.Host(r.Host) {
			return "anonymous@" + host, errdefs.Unauthenticated("Host %s: a daemon without a token answers only requests for localhost or a loopback address", errdefs.Quote(r.Host))
		}
		return "anonymous@" + host, nil
	}
	scheme, tok, ok := strings.Cut(r.Header.Get("Authorization"), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") || tok == "" {
		return "anonymous@" + host, errdefs.Unauthenticated("missing bearer token (Authorization: Bearer <token>; the token is in the daemon's token file)")
	}
	sum := sha256.Sum256([]byte(strings.TrimSpace(tok)))
	if subtle.ConstantTimeCompare(sum[:], s.tokenSum) != 1 {
		return "bad-token@" + host, errdefs.Unauthenticated("invalid bearer token")
	}
	return "token@" + host, nil
}
