package server

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// auditLog writes one JSON line per request. Safe for concurrent use.
type auditLog struct {
	mu sync.Mutex // guards w
	w  io.Writer
}

func newAuditLog(w io.Writer) *auditLog { return &auditLog{w: w} }

// auditEntry is one line of the audit log.
type auditEntry struct {
	Time      time.Time `json:"time"`
	Method    string    `json:"method"`
	Path      string    `json:"path"`
	Route     string    `json:"route,omitempty"`
	Status    int       `json:"status"`
	LatencyMS float64   `json:"latency_ms"`
	Bytes     int64     `json:"bytes"`
	Caller    string    `json:"caller"`
}

func (a *auditLog) write(e auditEntry) error {
	if a.w == nil {
		return nil
	}
	b, _ := json.Marshal(e)
	b = append(b, '\n')
	a.mu.Lock()
	defer a.mu.Unlock()
	_, err := a.w.Write(b)
	return err
}

// statusWriter records what a handler wrote.
type statusWriter struct {
	http.ResponseWriter
	status int
	bytes  int64
	wrote  bool // headers sent
}

func (w *statusWriter) WriteHeader(code int) {
	if !w.wrote {
		w.status, w.wrote = code, true
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if !w.wrote {
		w.status, w.wrote = http.StatusOK, true
	}
	n, err := w.ResponseWriter.Write(b)
	w.bytes += int64(n)
	return n, err
}

// Flush sends buffered data to the caller (streams).
func (w *statusWriter) Flush() {
	if !w.wrote {
		w.status, w.wrote = http.StatusOK, true
	}
	http.NewResponseController(w.ResponseWriter).Flush()
}

// Unwrap lets http.ResponseController reach the real writer.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// middleware wraps every request: audit line, metrics, and a panic turned
// into a 500 (or a cut response when it already started).
func (s *Server) middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		ri := &reqInfo{}
		r = r.WithContext(context.WithValue(r.Context(), reqInfoKey{}, ri))
		sw := &statusWriter{ResponseWriter: w}
		s.metrics.inFlight.Inc()
		defer func() {
			s.metrics.inFlight.Dec()
			p := recover()
			abort := p == http.ErrAbortHandler //nolint:errorlint // a recover() value, compared as net/http does
			cut := abort
			if p != nil && !cut {
				s.log.Error("handler panic", "route", ri.route, "panic", p)
				if sw.wrote {
					cut = true // headers gone: the response is cut short
				} else {
					writeJSON(sw, http.StatusInternalServerError, map[string]any{"error": map[string]string{"code": "internal", "message": "internal error"}})
				}
			}
			status := sw.status
			if status == 0 {
				status = http.StatusOK
			}
			if cut {
				status = 0 // cut short
			}
			lat := time.Since(start)
			route := ri.route
			if route == "" {
				route = "unmatched"
			}
			s.metrics.requests.WithLabelValues(route, strconv.Itoa(status)).Inc()
			s.metrics.latency.WithLabelValues(route).Observe(lat.Seconds())
			err := s.audit.write(auditEntry{
				Time: start.UTC(), Method: r.Method, Path: r.URL.Path, Route: ri.route, Status: status,
				LatencyMS: float64(lat.Microseconds()) / 1000, Bytes: sw.bytes, Caller: ri.caller,
			})
			if err != nil {
				s.log.Warn("write audit log", "route", route, "err", err)
			}
			if abort {
				panic(p)
			}
		}()
		next.ServeHTTP(sw, r)
	})
}
