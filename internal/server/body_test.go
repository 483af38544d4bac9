package server

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/sandbox"
)

// liveHeap is the heap in use after a collection.
func liveHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse
}

// TestSlowBodiesAreBounded: many authenticated callers each send most of
// a large declared JSON body, then stall. The daemon must neither hold
// their bytes without bound nor wait for them forever: the heap stays near
// its baseline during and after the load, and every stalled request is
// answered (or cut) within the body deadline.
func TestSlowBodiesAreBounded(t *testing.T) {
	const (
		conns    = 200
		limit    = 1 << 20
		timeout  = 3 * time.Second
		stall    = time.Second
		inFlight = 16 << 20
		// grace is what an answer may take past the deadline: the test
		// shows stalls are bounded, not how fast a loaded host answers
		// (200 connections on 2 cores under -race took 5–9 s at load 25).
		grace = 10 * time.Second
	)
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, func(_ *sandbox.Config, c *Config) {
		c.BodyTimeout, c.BodyStallTimeout = timeout, stall
		c.MaxBodyBytesInFlight, c.BodyWait = inFlight, 200*time.Millisecond
	})
	addr := strings.TrimPrefix(d.url, "http://")
	prefix := `{"snapshot_tag":"base","metadata":{"k":"`
	payload := append([]byte(prefix), bytes.Repeat([]byte("x"), limit-4096-len(prefix))...)
	head := fmt.Sprintf("POST /v1/sandboxes HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"+
		"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n", addr, testToken, limit)

	base := liveHeap()
	start := time.Now()
	type answer struct {
		status     int
		retryAfter string
		after      time.Duration
		err        error
	}
	answers := make(chan answer, conns)
	var open []net.Conn
	var wg sync.WaitGroup
	for range conns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		open = append(open, c)
		wg.Add(1)
		go func() { // send, then stall (the connection stays open)
			defer wg.Done()
			c.SetWriteDeadline(time.Now().Add(timeout + 5*time.Second))
			c.Write([]byte(head))
			c.Write(payload)
		}()
		go func() {
			c.SetReadDeadline(time.Now().Add(timeout + 3*time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			a := answer{after: time.Since(start), err: err}
			if err == nil {
				a.status, a.retryAfter = resp.StatusCode, resp.Header.Get("Retry-After")
				resp.Body.Close()
			}
			answers <- a
		}()
	}
	defer func() {
		for _, c := range open {
			c.Close()
		}
		wg.Wait()
	}()

	// While the callers stall, the bytes they sent are not all held.
	peak := base
	for time.Since(start) < timeout {
		peak = max(peak, liveHeap())
		time.Sleep(100 * time.Millisecond)
	}
	statuses := map[int]int{}
	cut := 0
	for range conns {
		a := <-answers
		switch {
		case a.err != nil && a.after > timeout+grace:
			t.Errorf("a stalled request was neither answered nor cut after %v: %v", a.after.Round(time.Millisecond), a.err)
		case a.err != nil:
			cut++
		default:
			statuses[a.status]++
			if a.status == http.StatusTooManyRequests && a.retryAfter == "" {
				t.Errorf("a 429 without Retry-After")
			}
			if a.after > timeout+grace {
				t.Errorf("a stalled request was answered %d after %v, want within %v", a.status, a.after.Round(time.Millisecond), timeout+grace)
			}
		}
	}
	for _, c := range open {
		c.Close()
	}
	wg.Wait()
	// The server's handlers see the closes, and give their share of the
	// budget back, in their own time: a slow host may still be reading.
	for deadline := time.Now().Add(20 * time.Second); d.srv.bodies.held() != 0 && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
	after := liveHeap()
	const mb = 1 << 20
	t.Logf("heap in use: baseline %d MiB, peak under load %d MiB, after %d MiB; answers %v, %d cut",
		base/mb, peak/mb, after/mb, statuses, cut)
	if peak > base+50*mb {
		t.Errorf("heap grew from %d MiB to %d MiB under stalled bodies (budget %d MiB)", base/mb, peak/mb, inFlight/mb)
	}
	if after > base+8*mb {
		t.Errorf("heap is %d MiB after the load, baseline %d MiB", after/mb, base/mb)
	}
	for st := range statuses {
		if st != http.StatusRequestTimeout && st != http.StatusTooManyRequests {
			t.Errorf("stalled requests answered %d, want 408 or 429", st)
		}
	}
	// The budget is whole again: an ordinary request goes through.
	if held := d.srv.bodies.held(); held != 0 {
		t.Errorf("%d bytes of the body budget still held after the load", held)
	}
	if code, b := d.call(t, "POST", "/v1/sandboxes", testToken, strings.NewReader(`{"snapshot_tag":"base"}`)); code != http.StatusNotFound {
		t.Errorf("a request after the load: %d %s, want 404 (no snapshot)", code, b)
	}
}

// slowReader yields chunks of data with a pause before each but the
// first.
type slowReader struct {
	chunks  [][]byte
	pause   time.Duration
	started bool
}

func (s *slowReader) Read(p []byte) (int, error) {
	if len(s.chunks) == 0 {
		return 0, io.EOF
	}
	if s.started {
		time.Sleep(s.pause)
	}
	s.started = true
	n := copy(p, s.chunks[0])
	s.chunks[0] = s.chunks[0][n:]
	if len(s.chunks[0]) == 0 {
		s.chunks = s.chunks[1:]
	}
	return n, nil
}

func chunks(s string, n int) [][]byte {
	var out [][]byte
	for len(s) > 0 {
		k := min(n, len(s))
		out = append(out, []byte(s[:k]))
		s = s[k:]
	}
	return out
}

// TestBodyDeadlines: a JSON body that keeps trickling is cut at
// BodyTimeout, one that stalls at BodyStallTimeout; an upload that keeps
// moving may take longer than either, and a streamed exec's stdin is not
// timed at all once its head has arrived.
func TestBodyDeadlines(t *testing.T) {
	// Bounds well apart from the pauses below: on a loaded host a 200 ms
	// sleep has taken over 300 ms.
	const timeout, stall = 2 * time.Second, time.Second
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, func(_ *sandbox.Config, c *Config) {
		c.BodyTimeout, c.BodyStallTimeout = timeout, stall
	})
	body := `{"snapshot_tag":"base","metadata":{"k":"` + strings.Repeat("v", 100) + `"}}`

	// Trickling: a chunk every 100 ms, 3 s in all.
	start := time.Now()
	code, b := d.callCT(t, "POST", "/v1/sandboxes", "application/json", &slowReader{chunks: chunks(body, len(body)/30+1), pause: 100 * time.Millisecond})
	if e := apiError(t, b); code != http.StatusRequestTimeout || e.Code != "deadline_exceeded" || !strings.Contains(e.Message, "did not arrive within "+timeout.String()) {
		t.Errorf("trickled body: %d %s, want 408", code, b)
	}
	if el := time.Since(start); el > timeout+time.Second {
		t.Errorf("trickled body cut after %v, want about %v", el, timeout)
	}
	// Stalled: half the body, then nothing for twice the stall bound.
	code, b = d.callCT(t, "POST", "/v1/sandboxes", "application/json", &slowReader{chunks: chunks(body, len(body)/2+1), pause: 2 * stall})
	if e := apiError(t, b); code != http.StatusRequestTimeout || !strings.Contains(e.Message, "stalled: no data for "+stall.String()) {
		t.Errorf("stalled body: %d %s, want 408", code, b)
	}
	// The same body in time goes through (404: no such snapshot).
	code, b = d.callCT(t, "POST", "/v1/sandboxes", "application/json", &slowReader{chunks: chunks(body, len(body)/3+1), pause: stall / 4})
	if code != http.StatusNotFound {
		t.Errorf("body in time: %d %s, want 404", code, b)
	}

	// An upload (no VM here, so the bounded reader is served directly)
	// taking 2× the body timeout but never stalling is read whole; one
	// that stalls is cut.
	upload := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		dl := d.srv.bodyDeadline(w, r, 0)
		defer dl.done()
		n, err := io.Copy(io.Discard, dl)
		if err != nil {
			writeError(w, err)
			return
		}
		fmt.Fprint(w, n)
	}))
	defer upload.Close()
	// A Local server (the CLI's own, no daemon) times nothing: its one
	// caller is its own process (forkd cp - from a slow pipe).
	local := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, func(_ *sandbox.Config, c *Config) {
		c.BodyTimeout, c.BodyStallTimeout, c.Local = timeout, stall, true
	})
	localUpload := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		dl := local.srv.bodyDeadline(w, r, timeout)
		defer dl.done()
		n, err := io.Copy(io.Discard, dl)
		if err != nil {
			writeError(w, err)
			return
		}
		fmt.Fprint(w, n)
	}))
	defer localUpload.Close()
	for _, c := range []struct {
		url   string
		n     int // chunks of 100 bytes
		pause time.Duration
		want  int
	}{
		{upload.URL, 20, stall / 5, http.StatusOK}, // 3.8 s in all
		{upload.URL, 2, 2 * stall, http.StatusRequestTimeout},
		{localUpload.URL, 2, 2 * stall, http.StatusOK}, // stalls 2 s, past the stall bound and the timeout
	} {
		req, _ := http.NewRequest("PUT", c.url, &slowReader{chunks: chunks(strings.Repeat("x", 100*c.n), 100), pause: c.pause})
		req.ContentLength = int64(100 * c.n)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.want || c.want == http.StatusOK && string(got) != fmt.Sprint(100*c.n) {
			t.Errorf("upload pausing %v per chunk: %d %s, want %d", c.pause, resp.StatusCode, got, c.want)
		}
	}

	// Once a JSON body is in, its request may run longer than both bounds
	// (a long exec) without its context being cancelled.
	long := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct{ A int }
		if err := d.srv.decodeBody(w, r, &req); err != nil {
			writeError(w, err)
			return
		}
		select {
		case <-r.Context().Done():
			fmt.Fprint(w, r.Context().Err())
		case <-time.After(timeout + stall):
			fmt.Fprint(w, "ok")
		}
	}))
	defer long.Close()
	if resp, err := http.Post(long.URL, "application/json", strings.NewReader(`{"A":1}`)); err != nil {
		t.Error(err)
	} else {
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(got) != "ok" {
			t.Errorf("a request running past the body bounds: %d %s", resp.StatusCode, got)
		}
	}

	// A streamed exec: the head stalls → 408; once the head is in, stdin
	// may wait longer than both bounds.
	code, b = d.callCT(t, "POST", "/v1/sandboxes/sb-aaaaaaaaaa/exec/stream", "application/vnd.forkd.exec-stdin",
		&slowReader{chunks: [][]byte{[]byte(`{"args":["cat"],`), []byte(`"stdin_stream":true}`)}, pause: 2 * stall})
	if code != http.StatusRequestTimeout {
		t.Errorf("stalled exec head: %d %s, want 408", code, b)
	}
	stdin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Args        []string `json:"args"`
			StdinStream bool     `json:"stdin_stream"`
		}
		rest, err := d.srv.decodeHead(w, r, &req)
		if err != nil {
			writeError(w, err)
			return
		}
		got, err := io.ReadAll(rest)
		if err != nil {
			writeError(w, err)
			return
		}
		fmt.Fprintf(w, "%v %q", req.Args, got)
	}))
	defer stdin.Close()
	req, _ := http.NewRequest("POST", stdin.URL, &slowReader{
		chunks: [][]byte{[]byte(`{"args":["cat"],"stdin_stream":true}` + "\nab"), []byte("cd")}, pause: timeout + stall})
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(got) != `[cat] "abcd"` {
		t.Errorf("stdin after a long pause: %d %s", resp.StatusCode, got)
	}
}

// TestReadBodyEdges: empty, exact, chunked and over-limit bodies, with a
// budget no larger than one body.
func TestReadBodyEdges(t *testing.T) {
	const limit = 4096
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, func(_ *sandbox.Config, c *Config) {
		c.MaxBodyBytes, c.MaxBodyBytesInFlight = limit, limit
	})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, release, err := d.srv.readBody(w, r, limit)
		if err != nil {
			writeError(w, err)
			return
		}
		defer release()
		fmt.Fprint(w, len(b))
	}))
	defer srv.Close()
	for _, c := range []struct {
		n       int
		chunked bool
		want    string
	}{
		{0, false, "0"}, {0, true, "0"}, {1, false, "1"}, {limit, false, "4096"}, {limit, true, "4096"},
		{limit + 1, false, "413"}, {limit + 1, true, "413"}, {3 * limit, true, "413"},
	} {
		var body io.Reader = strings.NewReader(strings.Repeat("x", c.n))
		if c.chunked {
			body = io.MultiReader(body) // length unknown: sent chunked
		}
		resp, err := http.Post(srv.URL, "application/json", body)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if s := string(got); s != c.want && !(c.want == "413" && resp.StatusCode == 413) {
			t.Errorf("%d bytes (chunked %v): %d %s, want %s", c.n, c.chunked, resp.StatusCode, got, c.want)
		}
	}
	if held := d.srv.bodies.held(); held != 0 {
		t.Errorf("%d bytes still held", held)
	}
}
