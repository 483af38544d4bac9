package e2b

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/state"
)

// proxy forwards a request for a guest port to the sandbox over its own
// network (HTTP and WebSocket alike), as E2B's proxy does. A sandbox made
// private (allowPublicTraffic false) needs its traffic token.
func (s *Server) proxy(w http.ResponseWriter, r *http.Request, rec *record, sb *state.Sandbox, port int) {
	if rec.Private && !tokenEqual(r.Header.Get("E2B-Traffic-Access-Token"), rec.TrafficToken) {
		writeJSON(w, http.StatusForbidden, map[string]any{"sandboxId": rec.ID, "message": "this sandbox's ports need its E2B-Traffic-Access-Token", "code": http.StatusForbidden})
		return
	}
	if sb.Net == nil || sb.Net.Address == "" {
		writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": rec.ID,
			"message": "The sandbox has no network: its snapshot " + sb.Snapshot + " was made without one (forkd snapshot as root)", "code": http.StatusBadGateway})
		return
	}
	target := &url.URL{Scheme: "http", Host: net.JoinHostPort(sb.Net.Address, strconv.Itoa(port))}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.Host = pr.In.Host // the guest sees the name it was called by
			pr.SetXForwarded()
			pr.Out.Header.Del("E2B-Traffic-Access-Token")
			pr.Out.Header.Del("E2b-Sandbox-Id")
			pr.Out.Header.Del("E2b-Sandbox-Port")
		},
		FlushInterval: -1,
		Transport:     s.transport(),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			msg := "The sandbox is running but port is not open"
			if r.Context().Err() != nil {
				return
			}
			if !strings.Contains(err.Error(), "connection refused") {
				msg += ": " + err.Error()
			}
			writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": rec.ID, "message": msg, "port": port, "code": http.StatusBadGateway})
		},
		ErrorLog: nil,
	}
	rp.ServeHTTP(w, r)
}

// transport is the proxy's HTTP transport, shared.
func (s *Server) transport() http.RoundTripper {
	s.trOnce.Do(func() {
		s.tr = &http.Transport{
			DialContext:           (&net.Dialer{Timeout: 10 * time.Second}).DialContext,
			MaxIdleConnsPerHost:   16,
			IdleConnTimeout:       90 * time.Second,
			ResponseHeaderTimeout: 0,
		}
	})
	return s.tr
}

// metrics answers one sample of the guest's CPU, memory and disk.
func (s *Server) metrics(w http.ResponseWriter, r *http.Request) error {
	rec, err := s.lookup(r.Context(), r.PathValue("id"))
	if err != nil {
		return err
	}
	out := []sandboxMetric{}
	if rec.State != stateRunning {
		writeJSON(w, http.StatusOK, out)
		return nil
	}
	sb, err := s.sandboxOf(r.Context(), rec)
	if err != nil {
		return err
	}
	c, release, err := s.e.Agent(r.Context(), sb.ID)
	if err != nil {
		return err
	}
	defer release() // the idle watch freezes it again once done
	m, err := sample(r.Context(), c)
	if err != nil {
		return err
	}
	m.CPUCount = rec.CPUCount
	out = append(out, *m)
	writeJSON(w, http.StatusOK, out)
	return nil
}

// sample measures a guest: CPU busy over 200 ms from /proc/stat, memory
// from /proc/meminfo, the root's size from df.
func sample(ctx context.Context, c *agent.Client) (*sandboxMetric, error) {
	read := func(p string) (string, error) {
		var b bytes.Buffer
		_, err := c.ReadFile(ctx, p, &limitWriter{w: &b, n: 1 << 20})
		return b.String(), err
	}
	cpu := func() (busy, total float64, err error) {
		st, err := read("/proc/stat")
		if err != nil {
			return 0, 0, err
		}
		line, _, _ := strings.Cut(st, "\n")
		f := strings.Fields(line)
		for i, v := range f[1:] {
			n, _ := strconv.ParseFloat(v, 64)
			total += n
			if i != 3 && i != 4 { // idle, iowait
				busy += n
			}
		}
		return busy, total, nil
	}
	b1, t1, err := cpu()
	if err != nil {
		return nil, err
	}
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(200 * time.Millisecond):
	}
	b2, t2, err := cpu()
	if err != nil {
		return nil, err
	}
	now := time.Now().UTC()
	m := &sandboxMetric{Timestamp: now, TimestampUnix: now.Unix()}
	if t2 > t1 {
		m.CPUUsedPct = 100 * (b2 - b1) / (t2 - t1)
	}
	mi, err := read("/proc/meminfo")
	if err != nil {
		return nil, err
	}
	kb := map[string]int64{}
	for _, l := range strings.Split(mi, "\n") {
		f := strings.Fields(l)
		if len(f) >= 2 {
			n, _ := strconv.ParseInt(f[1], 10, 64)
			kb[strings.TrimSuffix(f[0], ":")] = n << 10
		}
	}
	m.MemTotal, m.MemCache = kb["MemTotal"], kb["Cached"]
	m.MemUsed = kb["MemTotal"] - kb["MemAvailable"]
	var df bytes.Buffer
	if res, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"df", "-P", "-k", "/"}, Stdout: &df, Timeout: 5 * time.Second}); err == nil && res.ExitCode == 0 {
		lines := strings.Split(strings.TrimSpace(df.String()), "\n")
		if f := strings.Fields(lines[len(lines)-1]); len(f) >= 3 {
			total, _ := strconv.ParseInt(f[1], 10, 64)
			used, _ := strconv.ParseInt(f[2], 10, 64)
			m.DiskTotal, m.DiskUsed = total<<10, used<<10
		}
	}
	return m, nil
}
