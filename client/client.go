// Package client is the typed Go client of forkd's REST API v1 (the
// daemon, `forkd serve`). Errors the daemon returns keep their class:
// errdefs.IsNotFound(err) and friends work on them, as do the
// errors.Is checks against the errdefs sentinels.
//
//	c, err := client.New("unix:///run/forkd/forkd.sock", "")
//	res, err := c.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: "base", N: 5})
//	out, err := c.Exec(ctx, res.Sandboxes[0].ID, apiv1.ExecRequest{Args: []string{"uname", "-a"}})
package client

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
)

// Client talks to one daemon. Safe for concurrent use.
type Client struct {
	base  string // scheme://host, no trailing slash
	token string
	hc    *http.Client
	url   string // as given, for messages
}

// Options tune a Client.
type Options struct {
	// TLS configures https:// URLs (default: system roots).
	TLS *tls.Config
	// HTTPClient replaces the client's HTTP client entirely.
	HTTPClient *http.Client
}

// New returns a client of the daemon at rawURL: "unix:///path/to/sock",
// "http://host:port" or "https://host:port". token is the bearer token
// ("" for the unix socket, where the kernel vouches for the caller).
func New(rawURL, token string, opts ...Options) (*Client, error) {
	var o Options
	if len(opts) > 0 {
		o = opts[0]
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, errdefs.InvalidArgument("daemon url %q: %v", rawURL, err)
	}
	tr := &http.Transport{
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
		TLSClientConfig:     o.TLS,
		ForceAttemptHTTP2:   false,
	}
	c := &Client{token: token, url: rawURL}
	switch u.Scheme {
	case "unix":
		path := u.Path
		if path == "" {
			path = u.Opaque
		}
		if path == "" {
			return nil, errdefs.InvalidArgument("daemon url %q: want unix:///path/to/socket", rawURL)
		}
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}
		c.base = "http://forkd"
	case "http", "https":
		if u.Host == "" {
			return nil, errdefs.InvalidArgument("daemon url %q: no host", rawURL)
		}
		c.base = u.Scheme + "://" + u.Host
	default:
		return nil, errdefs.InvalidArgument("daemon url %q: want unix://, http:// or https://", rawURL)
	}
	c.hc = &http.Client{Transport: tr}
	if o.HTTPClient != nil {
		c.hc = o.HTTPClient
	}
	return c, nil
}

// NewDialer returns a client of a daemon reached through dial, one
// connection per call (the CLI's in-process server); name stands for its
// URL in messages.
func NewDialer(name string, dial func(ctx context.Context) (net.Conn, error)) *Client {
	tr := &http.Transport{
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
		DialContext:         func(ctx context.Context, _, _ string) (net.Conn, error) { return dial(ctx) },
	}
	return &Client{base: "http://forkd", url: name, hc: &http.Client{Transport: tr}}
}

// URL is the daemon's URL as given to New.
func (c *Client) URL() string { return c.url }

// Close releases idle connections.
func (c *Client) Close() { c.hc.CloseIdleConnections() }

// request sends a request and returns the response when its status is
// 2xx; otherwise it decodes the error body into a classed error.
func (c *Client) request(ctx context.Context, method, path string, q url.Values, body io.Reader, contentType string) (*http.Response, error) {
	u := c.base + path
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return nil, errdefs.InvalidArgument("%s %s: %v", method, path, err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, errdefs.Unavailable("forkd daemon at %s: %v", c.url, err)
	}
	if resp.StatusCode/100 == 2 {
		return resp, nil
	}
	defer resp.Body.Close()
	return nil, decodeError(resp)
}

// decodeError turns an error response into an error of its class.
func decodeError(resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	var er apiv1.ErrorResponse
	if err := json.Unmarshal(b, &er); err == nil && er.Error.Code != "" {
		return errdefs.FromCode(er.Error.Code, er.Error.Message)
	}
	msg := strings.TrimSpace(string(b))
	if msg == "" {
		msg = resp.Status
	}
	return fmt.Errorf("forkd daemon: %s: %s", resp.Status, msg)
}

// do sends in (nil: no body) as JSON and decodes the answer into out (nil:
// discard).
func (c *Client) do(ctx context.Context, method, path string, q url.Values, in, out any) error {
	var body io.Reader
	ct := ""
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return errdefs.InvalidArgument("%s %s: %v", method, path, err)
		}
		body, ct = bytes.NewReader(b), "application/json"
	}
	resp, err := c.request(ctx, method, path, q, body, ct)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		// Drained so that the connection is reused; the call succeeded
		// whatever the rest of the body does.
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("%s %s: bad response: %w", method, path, err)
	}
	return nil
}

func sandboxPath(id, rest string) string { return "/v1/sandboxes/" + url.PathEscape(id) + rest }

// Health checks the daemon is up (no authentication needed).
func (c *Client) Health(ctx context.Context) error {
	return c.do(ctx, "GET", "/healthz", nil, nil, &apiv1.Health{})
}

// Version returns the daemon's versions and data dir.
func (c *Client) Version(ctx context.Context) (*apiv1.VersionInfo, error) {
	var v apiv1.VersionInfo
	return &v, c.do(ctx, "GET", "/version", nil, nil, &v)
}

// CreateSandboxes forks req.N sandboxes and returns once they are ready.
func (c *Client) CreateSandboxes(ctx context.Context, req apiv1.CreateSandboxesRequest) (*apiv1.CreateSandboxesResponse, error) {
	var res apiv1.CreateSandboxesResponse
	return &res, c.do(ctx, "POST", "/v1/sandboxes", nil, req, &res)
}

// ListOptions filter ListSandboxes.
type ListOptions struct {
	Snapshot string
	Status   string
	Metadata map[string]string // all must match
}

// ListSandboxes lists sandboxes.
func (c *Client) ListSandboxes(ctx context.Context, opts ListOptions) ([]apiv1.Sandbox, error) {
	q := url.Values{}
	if opts.Snapshot != "" {
		q.Set("snapshot", opts.Snapshot)
	}
	if opts.Status != "" {
		q.Set("status", opts.Status)
	}
	for k, v := range opts.Metadata {
		q.Add("metadata", k+"="+v)
	}
	var l apiv1.SandboxList
	return l.Sandboxes, c.do(ctx, "GET", "/v1/sandboxes", q, nil, &l)
}

// GetSandbox returns one sandbox.
func (c *Client) GetSandbox(ctx context.Context, id string) (*apiv1.Sandbox, error) {
	var s apiv1.Sandbox
	return &s, c.do(ctx, "GET", sandboxPath(id, ""), nil, nil, &s)
}

// DeleteSandbox kills a sandbox.
func (c *Client) DeleteSandbox(ctx context.Context, id string) error {
	return c.do(ctx, "DELETE", sandboxPath(id, ""), nil, nil, nil)
}

// SetTimeout makes the daemon kill sandbox id d from now (0: never).
func (c *Client) SetTimeout(ctx context.Context, id string, d time.Duration) (*apiv1.Sandbox, error) {
	var s apiv1.Sandbox
	return &s, c.do(ctx, "POST", sandboxPath(id, "/timeout"), nil, apiv1.SetTimeoutRequest{TimeoutSecs: int(d / time.Second)}, &s)
}

// Ping round-trips to the sandbox's agent.
func (c *Client) Ping(ctx context.Context, id string) (*apiv1.PingResult, error) {
	var p apiv1.PingResult
	return &p, c.do(ctx, "POST", sandboxPath(id, "/ping"), nil, nil, &p)
}

// Exec runs a process and returns its buffered output and exit.
func (c *Client) Exec(ctx context.Context, id string, req apiv1.ExecRequest) (*apiv1.ExecResult, error) {
	var r apiv1.ExecResult
	return &r, c.do(ctx, "POST", sandboxPath(id, "/exec"), nil, req, &r)
}

// ExecStream runs a process, writing its output to stdout and stderr as
// it is produced, and returns how it ended. With stdin set (and
// req.Stdin not), the process reads stdin as it is produced, while its
// output streams; stdin's end closes the process's stdin.
func (c *Client) ExecStream(ctx context.Context, id string, req apiv1.ExecRequest, stdin io.Reader, stdout, stderr io.Writer) (*apiv1.ExecResult, error) {
	path := sandboxPath(id, "/exec/stream")
	var body io.Reader
	ct := "application/json"
	b, err := json.Marshal(req)
	if err != nil {
		return nil, errdefs.InvalidArgument("%s: %w", path, err)
	}
	body = bytes.NewReader(b)
	if stdin != nil {
		req.StdinStream = true
		if b, err = json.Marshal(req); err != nil {
			return nil, errdefs.InvalidArgument("%s: %w", path, err)
		}
		body, ct = io.MultiReader(bytes.NewReader(append(b, '\n')), stdin), apiv1.ExecStdinStream
	}
	ev, err := c.stream(ctx, path, body, ct, stdout, stderr)
	if err != nil {
		return nil, err
	}
	if ev.Type != apiv1.EventExit || ev.Exec == nil {
		return nil, fmt.Errorf("exec stream ended with a %q event", ev.Type)
	}
	return ev.Exec, nil
}

// Eval runs Python in the sandbox's warm interpreter.
func (c *Client) Eval(ctx context.Context, id string, req apiv1.EvalRequest) (*apiv1.EvalResult, error) {
	var r apiv1.EvalResult
	return &r, c.do(ctx, "POST", sandboxPath(id, "/eval"), nil, req, &r)
}

// EvalStream is Eval that also writes the code's output as it comes.
func (c *Client) EvalStream(ctx context.Context, id string, req apiv1.EvalRequest, stdout, stderr io.Writer) (*apiv1.EvalResult, error) {
	b, err := json.Marshal(req)
	if err != nil {
		return nil, errdefs.InvalidArgument("eval: %w", err)
	}
	ev, err := c.stream(ctx, sandboxPath(id, "/eval/stream"), bytes.NewReader(b), "application/json", stdout, stderr)
	if err != nil {
		return nil, err
	}
	if ev.Type != apiv1.EventResult || ev.Eval == nil {
		return nil, fmt.Errorf("eval stream ended with a %q event", ev.Type)
	}
	return ev.Eval, nil
}

// stream posts body and reads NDJSON events, writing output events to
// stdout and stderr, until the last event, which it returns.
func (c *Client) stream(ctx context.Context, path string, body io.Reader, contentType string, stdout, stderr io.Writer) (*apiv1.StreamEvent, error) {
	return c.streamFrom(ctx, "POST", path, body, contentType, stdout, stderr)
}

// streamFrom is stream with any method.
func (c *Client) streamFrom(ctx context.Context, method, path string, body io.Reader, contentType string, stdout, stderr io.Writer) (*apiv1.StreamEvent, error) {
	resp, err := c.request(ctx, method, path, nil, body, contentType)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 64<<20)
	for sc.Scan() {
		var ev apiv1.StreamEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return nil, fmt.Errorf("%s: bad event: %w", path, err)
		}
		var w io.Writer
		switch ev.Type {
		case apiv1.EventStdout:
			w = stdout
		case apiv1.EventStderr:
			w = stderr
		case apiv1.EventError:
			if ev.Error == nil {
				return nil, fmt.Errorf("%s: error event without error", path)
			}
			return nil, errdefs.FromCode(ev.Error.Code, ev.Error.Message)
		default:
			return &ev, nil
		}
		if w != nil {
			data := ev.DataB64
			if data == nil {
				data = []byte(ev.Data)
			}
			if _, err := w.Write(data); err != nil {
				return nil, err
			}
		}
	}
	if err := sc.Err(); err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, errdefs.Unavailable("%s: stream cut: %v", path, err)
	}
	return nil, errdefs.Unavailable("%s: stream ended without a result", path)
}

// ReadFile streams the guest file at path into w.
func (c *Client) ReadFile(ctx context.Context, id, path string, w io.Writer) (int64, error) {
	resp, err := c.request(ctx, "GET", sandboxPath(id, "/files"), url.Values{"path": {path}}, nil, "")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	n, err := io.Copy(w, resp.Body)
	if err != nil {
		return n, errdefs.Unavailable("read %s: %v", path, err)
	}
	return n, nil
}

// WriteFile replaces the guest file at path with r's content; mode 0
// keeps an existing file's mode (or gives 0644).
func (c *Client) WriteFile(ctx context.Context, id, path string, r io.Reader, mode uint32) (*apiv1.WriteFileResult, error) {
	q := url.Values{"path": {path}}
	if mode != 0 {
		q.Set("mode", "0"+strconv.FormatUint(uint64(mode), 8))
	}
	resp, err := c.request(ctx, "PUT", sandboxPath(id, "/files"), q, r, "application/octet-stream")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var res apiv1.WriteFileResult
	if err := json.NewDecoder(resp.Body).Decode(&res); err != nil {
		return nil, fmt.Errorf("write %s: bad response: %w", path, err)
	}
	return &res, nil
}

// ListDir lists a guest directory to depth levels (1 when not positive).
func (c *Client) ListDir(ctx context.Context, id, path string, depth int) ([]apiv1.FileInfo, error) {
	q := url.Values{"path": {path}}
	if depth > 0 {
		q.Set("depth", strconv.Itoa(depth))
	}
	var l apiv1.FileList
	return l.Entries, c.do(ctx, "GET", sandboxPath(id, "/files/list"), q, nil, &l)
}

// Stat describes a guest path.
func (c *Client) Stat(ctx context.Context, id, path string) (*apiv1.FileInfo, error) {
	var fi apiv1.FileInfo
	return &fi, c.do(ctx, "GET", sandboxPath(id, "/files/stat"), url.Values{"path": {path}}, nil, &fi)
}

// Remove removes a guest path; a non-empty directory needs recursive.
func (c *Client) Remove(ctx context.Context, id, path string, recursive bool) error {
	q := url.Values{"path": {path}}
	if recursive {
		q.Set("recursive", "true")
	}
	return c.do(ctx, "DELETE", sandboxPath(id, "/files"), q, nil, nil)
}

// MakeDir makes a guest directory and its parents.
func (c *Client) MakeDir(ctx context.Context, id, path string) (bool, error) {
	var r apiv1.MakeDirResult
	err := c.do(ctx, "POST", sandboxPath(id, "/files/mkdir"), nil, apiv1.MakeDirRequest{Path: path}, &r)
	return r.Created, err
}

// Rename renames a guest path.
func (c *Client) Rename(ctx context.Context, id, from, to string) error {
	return c.do(ctx, "POST", sandboxPath(id, "/files/rename"), nil, apiv1.RenameRequest{From: from, To: to}, nil)
}

// SetNetwork replaces a sandbox's egress policy.
func (c *Client) SetNetwork(ctx context.Context, id string, spec apiv1.NetworkSpec) (*apiv1.Sandbox, error) {
	var s apiv1.Sandbox
	return &s, c.do(ctx, "PUT", sandboxPath(id, "/network"), nil, spec, &s)
}

// Publish publishes a guest TCP port of a sandbox on a host port.
func (c *Client) Publish(ctx context.Context, id string, guestPort int) (*apiv1.PublishedPort, error) {
	var p apiv1.PublishedPort
	return &p, c.do(ctx, "POST", sandboxPath(id, "/ports"), nil, apiv1.PublishRequest{GuestPort: guestPort}, &p)
}

// Branch snapshots the running sandbox id into a new snapshot; with
// req.Wait false it returns at once with the snapshot in status
// "writing" (poll GetSnapshot).
func (c *Client) Branch(ctx context.Context, id string, req apiv1.BranchRequest) (*apiv1.Snapshot, error) {
	var s apiv1.Snapshot
	return &s, c.do(ctx, "POST", sandboxPath(id, "/branch"), nil, req, &s)
}

// ForkFrom forks req.Count sandboxes from the current state of the
// running sandbox id.
func (c *Client) ForkFrom(ctx context.Context, id string, req apiv1.ForkRequest) (*apiv1.CreateSandboxesResponse, error) {
	var res apiv1.CreateSandboxesResponse
	return &res, c.do(ctx, "POST", sandboxPath(id, "/fork"), nil, req, &res)
}

// CreateWorkspace makes a workspace.
func (c *Client) CreateWorkspace(ctx context.Context, req apiv1.CreateWorkspaceRequest) (*apiv1.Workspace, error) {
	var w apiv1.Workspace
	return &w, c.do(ctx, "POST", "/v1/workspaces", nil, req, &w)
}

// ListWorkspaces lists the workspaces.
func (c *Client) ListWorkspaces(ctx context.Context) ([]apiv1.Workspace, error) {
	var l apiv1.WorkspaceList
	return l.Workspaces, c.do(ctx, "GET", "/v1/workspaces", nil, nil, &l)
}

// GetWorkspace returns one workspace.
func (c *Client) GetWorkspace(ctx context.Context, name string) (*apiv1.Workspace, error) {
	var w apiv1.Workspace
	return &w, c.do(ctx, "GET", "/v1/workspaces/"+url.PathEscape(name), nil, nil, &w)
}

// SuspendWorkspace saves a workspace's state and stops its sandbox.
func (c *Client) SuspendWorkspace(ctx context.Context, name string) (*apiv1.Workspace, error) {
	var w apiv1.Workspace
	return &w, c.do(ctx, "POST", "/v1/workspaces/"+url.PathEscape(name)+"/suspend", nil, nil, &w)
}

// ResumeWorkspace starts a workspace's sandbox again from its latest state.
func (c *Client) ResumeWorkspace(ctx context.Context, name string) (*apiv1.Workspace, error) {
	var w apiv1.Workspace
	return &w, c.do(ctx, "POST", "/v1/workspaces/"+url.PathEscape(name)+"/resume", nil, nil, &w)
}

// DeleteWorkspace removes a workspace and its state snapshots.
func (c *Client) DeleteWorkspace(ctx context.Context, name string) error {
	return c.do(ctx, "DELETE", "/v1/workspaces/"+url.PathEscape(name), nil, nil, nil)
}

// CreateE2BKey issues an E2B-format API key; the answer is the only place
// the key itself appears.
func (c *Client) CreateE2BKey(ctx context.Context, name string) (*apiv1.E2BKey, error) {
	var k apiv1.E2BKey
	return &k, c.do(ctx, "POST", "/v1/e2b/keys", nil, apiv1.CreateE2BKeyRequest{Name: name}, &k)
}

// ListE2BKeys lists the E2B API keys, without the keys.
func (c *Client) ListE2BKeys(ctx context.Context) ([]apiv1.E2BKey, error) {
	var l apiv1.E2BKeyList
	return l.Keys, c.do(ctx, "GET", "/v1/e2b/keys", nil, nil, &l)
}

// RevokeE2BKey revokes an E2B API key by id.
func (c *Client) RevokeE2BKey(ctx context.Context, id string) error {
	return c.do(ctx, "DELETE", "/v1/e2b/keys/"+url.PathEscape(id), nil, nil, nil)
}
