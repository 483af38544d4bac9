package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/sandbox"
)

// TrafficPort is the guest port of the traffic phase's HTTP servers.
const TrafficPort = 8000

// scaleTraffic starts an HTTP server in each of ids, serving a page that
// names the child, and GETs it once from the host at the child's address
// (addrs, as ids); waits until the idle watch froze them all, and times a
// GET of each child's page, then a second one; then, all frozen again, a
// GET of every child's page at once.
func scaleTraffic(ctx context.Context, e *sandbox.Engine, ids, addrs []string, r *ScaleResult, say func(string, ...any)) {
	say("an HTTP server in each child")
	var up []int
	urls := make([]string, len(ids))
	for i, id := range ids {
		if addrs[i] == "" {
			r.TrafficFailed++
			say("%s has no address", id)
			continue
		}
		urls[i] = fmt.Sprintf("http://%s/", net.JoinHostPort(addrs[i], strconv.Itoa(TrafficPort)))
		if err := startServer(ctx, e, id); err != nil {
			r.TrafficFailed++
			say("HTTP server in %s: %v", id, err)
			continue
		}
		up = append(up, i)
	}
	// A first GET in each, awake: the server answers, and the guest has
	// run (and QEMU translated) its network path and the server's once,
	// as a server's guest has by the time it idles.
	hc := &http.Client{Timeout: time.Minute, Transport: &http.Transport{DisableKeepAlives: true}}
	served := up[:0]
	for _, i := range up {
		var err error
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			if err = getPage(ctx, hc, urls[i], ids[i]); err == nil || ctx.Err() != nil || time.Now().After(deadline) {
				break
			}
		}
		if err != nil {
			r.TrafficFailed++
			say("first GET in %s: %v", ids[i], err)
			continue
		}
		served = append(served, i)
	}
	up = served
	waitFrozen(ctx, e, len(ids)-r.ChildrenLost, say)
	say("GET from each child's server, woken from frozen by the request's packets")
	before := e.FreezeStats().TrafficWakes
	defer func() { r.TrafficWakes = e.FreezeStats().TrafficWakes - before }()
	var woken, again []float64
	for _, i := range up {
		if ctx.Err() != nil {
			break
		}
		start := time.Now()
		if err := getPage(ctx, hc, urls[i], ids[i]); err != nil {
			r.TrafficFailed++
			say("GET in %s: %v", ids[i], err)
			continue
		}
		woken = append(woken, msSince(start))
		start = time.Now()
		if err := getPage(ctx, hc, urls[i], ids[i]); err != nil {
			r.TrafficFailed++
			say("second GET in %s: %v", ids[i], err)
			continue
		}
		again = append(again, msSince(start))
	}
	r.TrafficWoken, r.TrafficAwake = Summarize(woken), Summarize(again)
	if ctx.Err() != nil || len(up) == 0 {
		return
	}
	// All at once, as a caller fanning one request out to every child.
	waitFrozen(ctx, e, len(ids)-r.ChildrenLost, say)
	say("GET from every child's server at once, each woken from frozen by its packets")
	burst := make([]float64, len(up))
	ended := make([]float64, len(up)) // since start
	errs := make([]error, len(up))
	var wg sync.WaitGroup
	start := time.Now()
	for k, i := range up {
		wg.Go(func() {
			t := time.Now()
			errs[k] = getPage(ctx, hc, urls[i], ids[i])
			burst[k], ended[k] = msSince(t), msSince(start)
		})
	}
	wg.Wait()
	var ok []float64
	for k, err := range errs {
		if err != nil {
			r.TrafficBurstFailed++
			say("GET at once in %s: %v", ids[up[k]], err)
			continue
		}
		ok = append(ok, burst[k])
		r.TrafficBurstWallMS = max(r.TrafficBurstWallMS, ended[k])
	}
	r.TrafficBurst = Summarize(ok)
}

// startServer starts busybox's HTTP server on TrafficPort in sandbox id,
// in the background, serving a page that holds id.
func startServer(ctx context.Context, e *sandbox.Engine, id string) error {
	return withAgent(ctx, e, id, func(ctx context.Context, c *agent.Client) error {
		var stderr bytes.Buffer
		res, err := c.Exec(ctx, agent.ExecRequest{Shell: "mkdir -p /tmp/www && echo " + id + " > /tmp/www/index.html", Stderr: &stderr})
		if err == nil && res.ExitCode != 0 {
			err = fmt.Errorf("write the page: exit %d: %s", res.ExitCode, bytes.TrimSpace(stderr.Bytes()))
		}
		if err != nil {
			return err
		}
		_, err = c.Exec(ctx, agent.ExecRequest{Args: []string{"busybox", "httpd", "-f", "-p", strconv.Itoa(TrafficPort), "-h", "/tmp/www"},
			Background: true, Tag: "bench-httpd"})
		return err
	})
}

// getPage GETs url and checks that the page holds id.
func getPage(ctx context.Context, hc *http.Client, url, id string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if err == nil && (resp.StatusCode != http.StatusOK || strings.TrimSpace(string(body)) != id) {
		err = fmt.Errorf("%s: %s %q", url, resp.Status, body)
	}
	return err
}
