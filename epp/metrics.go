package epp

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Registerer is where the picker's metrics are registered.
type Registerer = prometheus.Registerer

// metrics are the picker's own collectors; the requests' metrics are the
// gateway's (infergate_requests_total, TTFT, ITL, tokens …).
type metrics struct {
	streams        prometheus.Gauge
	refused        prometheus.Counter
	decisions      *prometheus.CounterVec
	decide         prometheus.Observer
	panics         prometheus.Counter
	protocolErrors prometheus.Counter
	timeouts       *prometheus.CounterVec
}

// decideBuckets are the decision's durations (seconds): 10 µs to 10 s (a
// decision includes its wait in the admission queue).
var decideBuckets = []float64{1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2, 0.1, 1, 10}

func newMetrics(reg Registerer) (*metrics, error) {
	m := &metrics{
		streams: prometheus.NewGauge(prometheus.GaugeOpts{Name: "infergate_epp_streams",
			Help: "ext_proc streams open (one per request through the proxy)."}),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "infergate_epp_decisions_total",
			Help: "Endpoint picker decisions by result: picked, or the status of the immediate response (400, 404, 408: the body not received within body_read_timeout, 413, 415: an encoded body, 429, 431: headers over max_header_bytes, 503, 499: the stream went away while queued), too_large, buffer_full, timeout (no request headers within body_read_timeout)."},
			[]string{"result"}),
		refused: prometheus.NewCounter(prometheus.CounterOpts{Name: "infergate_epp_streams_refused_total",
			Help: "ext_proc streams refused with RESOURCE_EXHAUSTED: --max-streams were open already."}),
		panics: prometheus.NewCounter(prometheus.CounterOpts{Name: "infergate_epp_stream_panics_total",
			Help: "ext_proc streams ended by a recovered panic."}),
		protocolErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "infergate_epp_protocol_errors_total",
			Help: "ext_proc streams ended for a message out of order or unknown."}),
	}
	m.timeouts = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "infergate_epp_stream_timeouts_total",
		Help: "ext_proc streams ended for a wait: send (the proxy read no response within write_timeout), answer (no message of the answer within response_header_timeout, first_event_timeout or stream_idle_timeout, as serve bounds the engine; counted 504), end (the stream not ended within stream_idle_timeout of the answer's end)."},
		[]string{"wait"})
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "infergate_epp_decision_seconds",
		Help: "Time from the request's end of body to its pick (admission queueing included).", Buckets: decideBuckets})
	m.decide = h
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.streams, m.refused, m.decisions, h, m.panics, m.protocolErrors, m.timeouts} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("epp: register metrics: %w", err)
		}
	}
	return m, nil
}
