package server

import (
	"net/http"

	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/state"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metrics are the daemon's Prometheus series.
type metrics struct {
	requests  *prometheus.CounterVec   // route, code
	latency   *prometheus.HistogramVec // route
	inFlight  prometheus.Gauge
	created   prometheus.Counter
	failed    prometheus.Counter
	rejected  prometheus.Counter
	expired   prometheus.Counter
	events    *prometheus.CounterVec // kind
	readyTime prometheus.Histogram
	handler   http.Handler
}

func newMetrics(s *Server, reg *prometheus.Registry) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "forkd_http_requests_total", Help: "HTTP requests by route and status.",
		}, []string{"route", "code"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "forkd_http_request_duration_seconds", Help: "HTTP request latency by route.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, []string{"route"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "forkd_http_requests_in_flight", Help: "HTTP requests being served.",
		}),
		created: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "forkd_sandboxes_created_total", Help: "Sandboxes that became ready.",
		}),
		failed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "forkd_sandbox_restore_failures_total", Help: "Children that failed to come up.",
		}),
		rejected: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "forkd_sandbox_admission_rejected_total", Help: "Create requests refused by a limit.",
		}),
		expired: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "forkd_sandboxes_expired_total", Help: "Sandboxes killed at their deadline.",
		}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "forkd_sandbox_events_total", Help: "Events outside requests, by kind: unresponsive, responsive, killed (by the unresponsive policy).",
		}, []string{"kind"}),
		readyTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "forkd_sandbox_ready_seconds", Help: "Time from restore start until a child's agent answered.",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 12),
		}),
	}
	live := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "forkd_sandboxes_live", Help: "Sandboxes starting or running.",
	}, func() float64 {
		n, _ := s.cfg.Admitter.Live()
		return float64(n)
	})
	snaps := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "forkd_snapshots", Help: "Snapshots in the store.",
	}, func() float64 {
		l, _ := s.e.Snapshots().List()
		return float64(len(l))
	})
	bodies := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "forkd_http_body_bytes_in_flight", Help: "Bytes of JSON request bodies held (at most --max-body-bytes-in-flight).",
	}, func() float64 { return float64(s.bodies.held()) })
	unresponsive := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "forkd_sandboxes_unresponsive", Help: "Sandboxes whose agent stopped answering.",
	}, func() float64 {
		l, _ := s.e.State().List()
		n := 0
		for _, sb := range l {
			if sb.Status == state.StatusUnresponsive {
				n++
			}
		}
		return float64(n)
	})
	// The idle watch's counters (serve --idle-freeze, --idle-reclaim);
	// gauges are counts now, the rest counters.
	idle := []struct {
		name, help string
		gauge      bool
		v          func(sandbox.FreezeStats) float64
	}{
		{"forkd_sandboxes_frozen", "Sandboxes frozen while idle (serve --idle-freeze).", true, func(st sandbox.FreezeStats) float64 { return float64(st.Frozen) }},
		{"forkd_sandboxes_frozen_watched", "Of those, the ones whose inbound traffic a packet socket watches (the others' counters are read every 100 ms).", true, func(st sandbox.FreezeStats) float64 { return float64(st.Watched) }},
		{"forkd_sandbox_freezes_total", "Idle sandboxes frozen.", false, func(st sandbox.FreezeStats) float64 { return float64(st.Freezes) }},
		{"forkd_sandbox_wakes_total", "Frozen sandboxes woken by a request or inbound traffic.", false, func(st sandbox.FreezeStats) float64 { return float64(st.Wakes) }},
		{"forkd_sandbox_traffic_wakes_total", "Wakes that inbound traffic asked for.", false, func(st sandbox.FreezeStats) float64 { return float64(st.TrafficWakes) }},
		{"forkd_sandbox_clock_sets_total", "Wakes after which the guest was told the time (its clock does not follow the host's).", false, func(st sandbox.FreezeStats) float64 { return float64(st.ClockSets) }},
		{"forkd_sandbox_wake_seconds_total", "Time wakes took, from the request to the guest's clock set (mean: divide by forkd_sandbox_wakes_total).", false, func(st sandbox.FreezeStats) float64 { return st.WakeSeconds }},
		{"forkd_sandboxes_reclaimed", "Frozen sandboxes whose VMM memory was paged out (serve --idle-reclaim).", true, func(st sandbox.FreezeStats) float64 { return float64(st.Reclaimed) }},
		{"forkd_sandbox_reclaims_total", "Page-outs of frozen sandboxes' VMMs that moved memory to swap.", false, func(st sandbox.FreezeStats) float64 { return float64(st.Reclaims) }},
		{"forkd_sandbox_reclaimed_bytes_total", "VMM memory the page-outs moved to swap.", false, func(st sandbox.FreezeStats) float64 { return float64(st.SwappedBytes) }},
		{"forkd_zram_compactions_total", "Compactions of the pools of zram swap devices, after paged-out sandboxes woke or went.", false, func(st sandbox.FreezeStats) float64 { return float64(st.ZramCompactions) }},
		{"forkd_zram_compacted_bytes_total", "RAM those compactions freed.", false, func(st sandbox.FreezeStats) float64 { return float64(st.ZramCompactedBytes) }},
		{"forkd_sandbox_page_ins_total", "Wakes that read a paged-out sandbox's recently used pages back, beside its guest.", false, func(st sandbox.FreezeStats) float64 { return float64(st.PageIns) }},
		{"forkd_sandbox_page_in_bytes_total", "What those wakes read back.", false, func(st sandbox.FreezeStats) float64 { return float64(st.PageInBytes) }},
		{"forkd_sandbox_page_in_seconds_total", "Time those wakes spent reading back, beside their guests (not in forkd_sandbox_wake_seconds_total).", false, func(st sandbox.FreezeStats) float64 { return st.PageInSeconds }},
		{"forkd_sandbox_sibling_page_ins_total", "Of those wakes, the ones from a first page-out, which read back the pages a sibling of the same snapshot used.", false, func(st sandbox.FreezeStats) float64 { return float64(st.SiblingPageIns) }},
		{"forkd_sandbox_sibling_code_page_ins_total", "Of those, the ones that found the sibling's translated code by block in their own VMM's code buffer (TCG).", false, func(st sandbox.FreezeStats) float64 { return float64(st.SiblingCodePageIns) }},
	}
	for _, c := range idle {
		f := func() float64 { return c.v(s.e.FreezeStats()) }
		if c.gauge {
			reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: c.name, Help: c.help}, f))
		} else {
			reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: c.name, Help: c.help}, f))
		}
	}
	reg.MustRegister(m.requests, m.latency, m.inFlight, m.created, m.failed, m.rejected, m.expired, m.events, m.readyTime, live, snaps, unresponsive, bodies,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.handler = promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	return m
}

func (s *Server) serveMetrics(w http.ResponseWriter, r *http.Request) error {
	s.metrics.handler.ServeHTTP(w, r)
	return nil
}

// Event counts an engine event (sandbox.Config.OnEvent).
func (s *Server) Event(ev sandbox.Event) { s.metrics.events.WithLabelValues(ev.Kind).Inc() }
