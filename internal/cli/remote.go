package cli

import (
	"context"
	"encoding/json"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/loopback"
)

// remote returns a client of the daemon serving this command's data dir,
// or nil when none does (the command then works on the data dir itself).
//
// FORKD_URL names the daemon explicitly (unix:///path, http(s)://host:port);
// it must answer. Its token is FORKD_TOKEN, else, for a loopback address
// only, the data dir's token file when readable (daemonToken). Without
// FORKD_URL the socket recorded in the data dir by a
// running daemon and the default socket are tried; one is used when it
// answers /healthz and serves this same data dir.
func (g *globals) remote(ctx context.Context) (*client.Client, error) {
	dir, err := g.resolveDataDir()
	if err != nil {
		return nil, err
	}
	if u := os.Getenv("FORKD_URL"); u != "" {
		tok, err := daemonToken(u, dir)
		if err != nil {
			return nil, err
		}
		c, err := client.New(u, tok)
		if err != nil {
			return nil, err
		}
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if err := c.Health(pctx); err != nil {
			return nil, errdefs.Unavailable("FORKD_URL=%s does not answer: %w", u, err)
		}
		return c, nil
	}
	var socks []string
	if b, err := os.ReadFile(filepath.Join(dir, apiv1.ControllerFile)); err == nil {
		var info apiv1.ControllerInfo
		if json.Unmarshal(b, &info) == nil && info.Socket != "" {
			socks = append(socks, info.Socket)
		}
	}
	if s := client.DefaultSocket(); s != "" {
		socks = append(socks, s)
	}
	for _, s := range socks {
		if _, err := os.Stat(s); err != nil {
			continue
		}
		c, err := client.New("unix://"+s, "")
		if err != nil {
			continue
		}
		if servesDir(ctx, c, dir) {
			return c, nil
		}
		c.Close()
	}
	return nil, nil
}

// daemonToken is the token sent to the daemon at FORKD_URL rawURL:
// FORKD_TOKEN when set; else the data dir's token file, but only to a
// loopback address (unix sockets need none), so that the secret of this
// machine's daemon never goes wherever FORKD_URL points. Plain http to a
// host that is not loopback is refused unless FORKD_INSECURE=1: it would
// carry the token in clear.
func daemonToken(rawURL, dir string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", errdefs.InvalidArgument("FORKD_URL %q: %w", rawURL, err)
	}
	tok := os.Getenv("FORKD_TOKEN")
	if u.Scheme == "unix" {
		return tok, nil
	}
	if !loopback.Host(u.Hostname()) {
		if u.Scheme == "http" && os.Getenv("FORKD_INSECURE") != "1" {
			return "", errdefs.InvalidArgument("FORKD_URL=%s: plain http to a host that is not loopback would send the token in clear; use https:// (or set FORKD_INSECURE=1)", rawURL)
		}
		return tok, nil
	}
	if tok == "" {
		if b, err := os.ReadFile(filepath.Join(dir, "token")); err == nil {
			tok = strings.TrimSpace(string(b))
		}
	}
	return tok, nil
}

// servesDir reports whether the daemon behind c answers and serves dir.
func servesDir(ctx context.Context, c *client.Client, dir string) bool {
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if c.Health(pctx) != nil {
		return false
	}
	v, err := c.Version(pctx)
	if err != nil {
		return false
	}
	return samePath(v.DataDir, dir)
}

func samePath(a, b string) bool {
	ra, err1 := filepath.EvalSymlinks(a)
	rb, err2 := filepath.EvalSymlinks(b)
	if err1 != nil || err2 != nil {
		return filepath.Clean(a) == filepath.Clean(b)
	}
	return ra == rb
}

// api returns the client every command speaks through, and done, which
// the command calls when it has finished: the daemon serving this data
// dir when one runs (see remote), else a server in this process over the
// data dir's engine (localAPI), shut down by done. Either way the command
// has one code path.
func (g *globals) api(ctx context.Context) (c *client.Client, done func(), err error) {
	return g.apiFor(ctx, false)
}

// apiFor is api; with longLived, an in-process server also kills
// sandboxes at their deadline while the command runs, as a daemon does
// (a command that serves others for long: forkd mcp).
func (g *globals) apiFor(ctx context.Context, longLived bool) (c *client.Client, done func(), err error) {
	if c, err := g.remote(ctx); err != nil {
		return nil, nil, err
	} else if c != nil {
		return c, c.Close, nil
	}
	return g.localAPI(longLived)
}

// needRemote is remote for commands that only exist through a daemon.
func (g *globals) needRemote(ctx context.Context, cmd string) (*client.Client, error) {
	c, err := g.remote(ctx)
	if err != nil {
		return nil, err
	}
	if c == nil {
		return nil, errdefs.FailedPrecondition("%s needs a running daemon (forkd serve), and none serves this data dir; set FORKD_URL to reach one elsewhere", cmd)
	}
	return c, nil
}
