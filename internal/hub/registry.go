package hub

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/forkd/forkd/internal/errdefs"
)

// Remote says how to reach and authenticate to a registry.
type Remote struct {
	// Username and Password, when Username is set, authenticate with
	// basic credentials (or the registry's token service); otherwise the
	// Keychain does.
	Username, Password string
	// Keychain resolves credentials by registry (nil: the Docker config
	// file and its credential helpers, authn.DefaultKeychain).
	Keychain authn.Keychain
	// CAPEM holds extra root certificates (PEM) trusted besides the
	// system's.
	CAPEM []byte
	// Insecure allows plain HTTP, and only to a loopback registry. TLS is
	// always verified.
	Insecure bool
}

// netStats counts the bytes a registry connection moves.
type netStats struct {
	sent, received atomic.Int64
}

// registry is one repository of a registry, authenticated.
type registry struct {
	repo   name.Repository
	ref    name.Reference
	user   string // the --username given ("": the keychain's)
	hc     *http.Client
	pusher *remote.Pusher
	stats  *netStats
}

// isLoopback reports whether host (no port) is a loopback name or address.
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

// parseRef parses a registry reference ("host/repo:tag", "host/repo@sha256:...").
func parseRef(ref string) (name.Reference, error) {
	r, err := name.ParseReference(ref)
	if err != nil {
		return nil, errdefs.InvalidArgument("reference %s: %v", errdefs.Quote(ref), err)
	}
	return r, nil
}

// dial authenticates to the repository of ref, for pushing or pulling.
func dial(ctx context.Context, ref string, rm Remote, push bool) (*registry, error) {
	r, err := parseRef(ref)
	if err != nil {
		return nil, err
	}
	reg := r.Context().Registry
	if err := checkInsecure(r, rm.Insecure); err != nil {
		return nil, err
	}
	tlsCfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if len(rm.CAPEM) > 0 {
		pool, err := x509.SystemCertPool()
		if err != nil || pool == nil {
			pool = x509.NewCertPool()
		}
		if !pool.AppendCertsFromPEM(rm.CAPEM) {
			return nil, errdefs.InvalidArgument("CA file: no PEM certificate in it")
		}
		tlsCfg.RootCAs = pool
	}
	base := http.DefaultTransport.(*http.Transport).Clone()
	base.TLSClientConfig = tlsCfg
	base.ResponseHeaderTimeout = 2 * time.Minute
	stats := &netStats{}
	inner := &guard{inner: base, allowHTTP: rm.Insecure, stats: stats}
	var auth authn.Authenticator
	switch {
	case rm.Username != "":
		auth = &authn.Basic{Username: rm.Username, Password: rm.Password}
	default:
		kc := rm.Keychain
		if kc == nil {
			kc = authn.DefaultKeychain
		}
		if auth, err = kc.Resolve(r.Context()); err != nil {
			return nil, errdefs.Unauthenticated("credentials for %s: %v", reg.RegistryStr(), err)
		}
	}
	scope := transport.PullScope
	if push {
		scope = transport.PushScope
	}
	rt, err := transport.NewWithContext(ctx, reg, auth, inner, []string{r.Context().Scope(scope)})
	if err != nil {
		return nil, classify(ref, rm.Username, err)
	}
	g := &registry{repo: r.Context(), ref: r, user: rm.Username, hc: &http.Client{Transport: rt}, stats: stats}
	if push {
		if g.pusher, err = remote.NewPusher(remote.WithTransport(rt), remote.WithContext(ctx), remote.WithJobs(2)); err != nil {
			return nil, err
		}
	}
	return g, nil
}

// guard refuses plain HTTP unless allowed, and to anything but a loopback
// host even then, and counts the bytes that pass.
type guard struct {
	inner     http.RoundTripper
	allowHTTP bool
	stats     *netStats
}

func (g *guard) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.Scheme == "http" {
		if !g.allowHTTP || !isLoopback(r.URL.Hostname()) {
			return nil, errdefs.FailedPrecondition("plain HTTP to %s refused: forkd speaks HTTPS to registries (--insecure allows plain HTTP to a loopback registry)", r.URL.Host)
		}
	}
	if r.Body != nil && r.Body != http.NoBody {
		r.Body = &countingReader{ReadCloser: r.Body, n: &g.stats.sent}
	}
	resp, err := g.inner.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	resp.Body = &countingReader{ReadCloser: resp.Body, n: &g.stats.received}
	return resp, nil
}

type countingReader struct {
	io.ReadCloser
	n *atomic.Int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	k, err := c.ReadCloser.Read(p)
	c.n.Add(int64(k))
	return k, err
}

// url is the URL of path in the repository's API.
func (g *registry) url(kind, ref string) string {
	return fmt.Sprintf("%s://%s/v2/%s/%s/%s", g.repo.Scheme(), g.repo.RegistryStr(), g.repo.RepositoryStr(), kind, ref)
}

// do sends a request and returns the response of a 2xx status; a 404 is
// NotFound, other statuses classed errors.
func (g *registry) do(ctx context.Context, method, u string, accept string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, u, nil)
	if err != nil {
		return nil, err
	}
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	resp, err := g.hc.Do(req)
	if err != nil {
		return nil, classify(g.ref.String(), g.user, err)
	}
	if resp.StatusCode/100 == 2 {
		return resp, nil
	}
	defer resp.Body.Close()
	if err := transport.CheckError(resp, http.StatusOK); err != nil {
		return nil, classify(g.ref.String(), g.user, err)
	}
	return nil, errdefs.Unavailable("%s %s: %s", method, u, resp.Status)
}

// manifest fetches the manifest ref names (a tag or a digest) in the
// repository, reading at most limit bytes. A manifest fetched by digest
// must hash to it.
func (g *registry) manifest(ctx context.Context, ref string, limit int64) ([]byte, string, error) {
	resp, err := g.do(ctx, http.MethodGet, g.url("manifests", ref), string(types.OCIManifestSchema1))
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	if resp.ContentLength > limit {
		return nil, "", errdefs.InvalidArgument("manifest %s is %d bytes; the limit is %d", ref, resp.ContentLength, limit)
	}
	raw, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, "", classify(g.ref.String(), g.user, err)
	}
	if int64(len(raw)) > limit {
		return nil, "", errdefs.InvalidArgument("manifest %s is over %d bytes (the limit)", ref, limit)
	}
	sum := sha256.Sum256(raw)
	digest := fmt.Sprintf("sha256:%x", sum)
	if strings.HasPrefix(ref, "sha256:") && ref != digest {
		return nil, "", errdefs.InvalidArgument("manifest %s does not match its digest (it hashes to %s): refused", ref, digest)
	}
	return raw, digest, nil
}

// blob streams blob digest of size bytes to w; more bytes than size are
// refused. The caller verifies the digest.
func (g *registry) blob(ctx context.Context, digest string, size int64, w io.Writer) error {
	resp, err := g.do(ctx, http.MethodGet, g.url("blobs", digest), "")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.ContentLength > size {
		return errdefs.InvalidArgument("blob %s is %d bytes; its manifest says %d", digest, resp.ContentLength, size)
	}
	n, err := io.Copy(w, io.LimitReader(resp.Body, size+1))
	switch {
	case err != nil:
		return classify(g.ref.String(), g.user, err)
	case n > size:
		return errdefs.InvalidArgument("blob %s is over the %d bytes its manifest says", digest, size)
	case n < size:
		return errdefs.Unavailable("blob %s: %d of %d bytes, then the registry stopped", digest, n, size)
	}
	return nil
}

// has reports whether the repository holds blob digest (HEAD).
func (g *registry) has(ctx context.Context, digest string) (bool, error) {
	return g.exists(ctx, g.url("blobs", digest))
}

func (g *registry) exists(ctx context.Context, u string) (bool, error) {
	resp, err := g.do(ctx, http.MethodHead, u, string(types.OCIManifestSchema1))
	if errdefs.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	resp.Body.Close()
	return true, nil
}

// put uploads a blob (skipped by go-containerregistry when the registry
// has it).
func (g *registry) put(ctx context.Context, b blob) error {
	h, err := v1.NewHash(b.digest)
	if err != nil {
		return err
	}
	if err := g.pusher.Upload(ctx, g.repo, &staticLayer{b: b, h: h}); err != nil {
		return classify(g.ref.String(), g.user, err)
	}
	return nil
}

// putManifest uploads a manifest, under tag (or by its digest when tag
// is "").
func (g *registry) putManifest(ctx context.Context, raw []byte, digest, tag string) error {
	var ref name.Reference = g.repo.Digest(digest)
	if tag != "" {
		ref = g.repo.Tag(tag)
	}
	if err := g.pusher.Put(ctx, ref, rawManifest(raw)); err != nil {
		return classify(g.ref.String(), g.user, err)
	}
	return nil
}

// rawManifest is a manifest as remote.Put takes it.
type rawManifest []byte

func (m rawManifest) RawManifest() ([]byte, error)        { return m, nil }
func (m rawManifest) MediaType() (types.MediaType, error) { return types.OCIManifestSchema1, nil }

// blob is a blob to store: its bytes in memory, or open reads them.
type blob struct {
	digest    string
	size      int64
	mediaType string
	data      []byte
	open      func() (io.ReadCloser, error)
}

func (b blob) reader() (io.ReadCloser, error) {
	if b.open != nil {
		return b.open()
	}
	return io.NopCloser(bytes.NewReader(b.data)), nil
}

// staticLayer is a blob as a v1.Layer whose digest is known.
type staticLayer struct {
	b blob
	h v1.Hash
}

func (l *staticLayer) Digest() (v1.Hash, error)             { return l.h, nil }
func (l *staticLayer) DiffID() (v1.Hash, error)             { return l.h, nil }
func (l *staticLayer) Compressed() (io.ReadCloser, error)   { return l.b.reader() }
func (l *staticLayer) Uncompressed() (io.ReadCloser, error) { return l.b.reader() }
func (l *staticLayer) Size() (int64, error)                 { return l.b.size, nil }
func (l *staticLayer) MediaType() (types.MediaType, error) {
	return types.MediaType(l.b.mediaType), nil
}

// classify gives an error of a registry call a class; user is the
// account given for it ("": the keychain's, or none).
func classify(ref, user string, err error) error {
	if err == nil || errdefs.Classed(err) {
		return err
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	var terr *transport.Error
	if errors.As(err, &terr) {
		for _, d := range terr.Errors {
			switch d.Code {
			case transport.ManifestUnknownErrorCode, transport.NameUnknownErrorCode, transport.BlobUnknownErrorCode:
				return errdefs.NotFound("%s: %w", ref, err)
			case transport.UnauthorizedErrorCode, transport.DeniedErrorCode:
				return errdefs.Unauthenticated("%s: %s: %w", ref, refused(user), err)
			}
		}
		switch terr.StatusCode {
		case http.StatusNotFound:
			return errdefs.NotFound("%s: %w", ref, err)
		case http.StatusUnauthorized, http.StatusForbidden:
			return errdefs.Unauthenticated("%s: %s: %w", ref, refused(user), err)
		}
		return errdefs.Unavailable("%s: %w", ref, err)
	}
	var uerr *url.Error
	if errors.As(err, &uerr) {
		var cerr *tls.CertificateVerificationError
		if errors.As(err, &cerr) {
			return errdefs.FailedPrecondition("%s: %w (trust its CA with --ca-file)", ref, err)
		}
		if inner := errdefs.Class(uerr.Err); inner != nil {
			return uerr.Err
		}
	}
	return errdefs.Unavailable("%s: %w", ref, err)
}

// CheckRef checks a registry reference as Push (tagged: it must name a
// tag) or Pull takes it, and that plain HTTP (insecure) goes only to a
// loopback registry, without reaching the registry.
func CheckRef(ref string, tagged, insecure bool) error {
	r, err := parseRef(ref)
	if err != nil {
		return err
	}
	if _, ok := r.(name.Tag); tagged && !ok {
		return errdefs.InvalidArgument("reference %s: push to a tag (registry/repo:tag), not a digest", errdefs.Quote(ref))
	}
	return checkInsecure(r, insecure)
}

// checkInsecure refuses plain HTTP to a registry not on loopback.
func checkInsecure(r name.Reference, insecure bool) error {
	reg := r.Context().Registry
	host := reg.RegistryStr()
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	if insecure && !isLoopback(host) {
		return errdefs.InvalidArgument("--insecure (plain HTTP) is allowed only for a loopback registry, not %s", errdefs.Quote(reg.RegistryStr()))
	}
	return nil
}

// refused says why a registry answered 401 or 403, and what to do.
func refused(user string) string {
	if user != "" {
		return fmt.Sprintf("the registry refused user %s (check the password or token given with --password-stdin, and the user's rights to the repository)", errdefs.Quote(user))
	}
	return "the registry wants credentials this host has not given (docker login, or --username with --password-stdin)"
}
