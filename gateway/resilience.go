package gateway

import (
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of the resilience settings (README.md "Failures and overload").
const (
	// DefaultRetryMaxAttempts is the attempts per request, the first one
	// included: two retries, Envoy's and most SDKs' default retry count.
	DefaultRetryMaxAttempts = 3
	// DefaultRetryBudgetPercent and DefaultMinRetryConcurrency are Envoy's
	// retry budget defaults: retries in flight ≤ max(3, 20% of the requests
	// in flight), so a fleet-wide failure cannot multiply the load.
	DefaultRetryBudgetPercent  = 20.0
	DefaultMinRetryConcurrency = 3
	// DefaultOutlierConsecutiveErrors is Envoy's consecutive_5xx default.
	DefaultOutlierConsecutiveErrors = 5
	// DefaultMaxEjectionTime caps the doubling ejection back-off (Envoy's
	// max_ejection_time default).
	DefaultMaxEjectionTime = 5 * time.Minute
	// DefaultCircuitBreakerMaxRequests bounds the requests in flight to one
	// endpoint: far above what one engine batches (vLLM's max_num_seqs is
	// 256–1024), so it only stops a runaway pile-up on one engine.
	DefaultCircuitBreakerMaxRequests = 1024
	// DefaultAdmissionMaxQueue bounds the requests waiting per model.
	DefaultAdmissionMaxQueue = 1024
	// DefaultAdmissionQueueTimeout is the longest wait in the admission
	// queue before a 429 (seconds of queueing are already a poor TTFT).
	DefaultAdmissionQueueTimeout = 30 * time.Second
)

// RetryConfig configures retries of requests that failed before any byte of
// the answer reached the client.
type RetryConfig struct {
	// MaxAttempts is the most attempts per request, the first included
	// (default 3: two retries); 1 disables retries.
	MaxAttempts int `yaml:"max_attempts"`
	// BudgetPercent and MinRetryConcurrency bound the retries in flight per
	// model to max(MinRetryConcurrency, BudgetPercent% of the model's
	// requests in flight) (defaults 20 and 3, Envoy's retry budget).
	BudgetPercent       float64 `yaml:"budget_percent"`
	MinRetryConcurrency int     `yaml:"min_retry_concurrency"`
}

func (c RetryConfig) withDefaults() RetryConfig {
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultRetryMaxAttempts
	}
	if c.BudgetPercent == 0 {
		c.BudgetPercent = DefaultRetryBudgetPercent
	}
	if c.MinRetryConcurrency == 0 {
		c.MinRetryConcurrency = DefaultMinRetryConcurrency
	}
	return c
}

// OutlierConfig configures passive outlier detection. A connection refused
// ejects an endpoint at once (the engine is gone), and so does a 401/403
// (the engine refuses the gateway's credentials); ConsecutiveErrors other
// failures in a row (5xx, connection lost, response timeout, a stream that
// failed) eject it too. An ejection lasts eject_duration × 2^(n−1) for the
// n-th ejection in a row, at most MaxEjectionTime; n starts again once the
// endpoint has stayed in rotation for MaxEjectionTime.
type OutlierConfig struct {
	// ConsecutiveErrors is the failures in a row that eject (default 5). A
	// response that is not a 5xx resets the count.
	ConsecutiveErrors int `yaml:"consecutive_errors"`
	// MaxEjectionTime caps the back-off (default 5m).
	MaxEjectionTime time.Duration `yaml:"max_ejection_time"`
}

func (c OutlierConfig) withDefaults() OutlierConfig {
	if c.ConsecutiveErrors == 0 {
		c.ConsecutiveErrors = DefaultOutlierConsecutiveErrors
	}
	if c.MaxEjectionTime == 0 {
		c.MaxEjectionTime = DefaultMaxEjectionTime
	}
	return c
}

// CircuitBreakerConfig bounds the load on one endpoint.
type CircuitBreakerConfig struct {
	// MaxRequests is the most requests in flight to one endpoint (all the
	// models it serves together; default 1024). An endpoint at its limit is
	// not picked; when every endpoint of a model is, requests queue.
	MaxRequests int `yaml:"max_requests"`
}

func (c CircuitBreakerConfig) withDefaults() CircuitBreakerConfig {
	if c.MaxRequests == 0 {
		c.MaxRequests = DefaultCircuitBreakerMaxRequests
	}
	return c
}

// AdmissionConfig configures per-model admission control.
type AdmissionConfig struct {
	// MaxInFlight is the most requests of one model admitted at once
	// (0, the default: the sum of its endpoints' circuit_breaker.max_requests).
	MaxInFlight int `yaml:"max_in_flight"`
	// MaxQueue is the most requests of one model waiting for admission
	// (default 1024; negative: none wait, the excess is refused at once).
	// Beyond it: 429 with Retry-After.
	MaxQueue int `yaml:"max_queue"`
	// QueueTimeout is the longest wait in the queue (default 30s); then 429.
	QueueTimeout time.Duration `yaml:"queue_timeout"`
}

func (c AdmissionConfig) withDefaults() AdmissionConfig {
	if c.MaxQueue == 0 {
		c.MaxQueue = DefaultAdmissionMaxQueue
	}
	if c.QueueTimeout == 0 {
		c.QueueTimeout = DefaultAdmissionQueueTimeout
	}
	return c
}

// validateResilience checks the retry, outlier, circuit_breaker and
// admission settings of a defaulted configuration.
func (c Config) validateResilience() []error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.Retry.MaxAttempts < 1 {
		bad("retry.max_attempts %d: must be at least 1 (1 disables retries)", c.Retry.MaxAttempts)
	}
	if !(c.Retry.BudgetPercent > 0 && c.Retry.BudgetPercent <= 100) {
		bad("retry.budget_percent %v: must be in (0, 100]", c.Retry.BudgetPercent)
	}
	if c.Retry.MinRetryConcurrency < 0 {
		bad("retry.min_retry_concurrency %d: must be >= 0", c.Retry.MinRetryConcurrency)
	}
	if c.Outlier.ConsecutiveErrors < 1 {
		bad("outlier.consecutive_errors %d: must be at least 1", c.Outlier.ConsecutiveErrors)
	}
	if c.Outlier.MaxEjectionTime < c.EjectDuration {
		bad("outlier.max_ejection_time %v: must be at least eject_duration %v", c.Outlier.MaxEjectionTime, c.EjectDuration)
	}
	if c.CircuitBreaker.MaxRequests < 1 {
		bad("circuit_breaker.max_requests %d: must be at least 1", c.CircuitBreaker.MaxRequests)
	}
	if c.Admission.MaxInFlight < 0 {
		bad("admission.max_in_flight %d: must be >= 0 (0: the sum of the endpoints' circuit_breaker.max_requests)", c.Admission.MaxInFlight)
	}
	if c.Admission.QueueTimeout <= 0 {
		bad("admission.queue_timeout %v: must be positive", c.Admission.QueueTimeout)
	}
	return errs
}

// outlierState is an endpoint's passive outlier detection state.
type outlierState struct {
	// consecutive counts failures since the last non-5xx response.
	consecutive atomic.Int64

	mu sync.Mutex
	// ejections is the ejections in a row (the back-off exponent).
	ejections int
	// until is the end of the latest ejection, reason its cause.
	until  time.Time
	reason string
}

// Failure kinds of one attempt, for outlier detection and the retries
// metric's reason label.
const (
	reasonConnect = "connect_failure" // connection refused / dial failed
	reasonReset   = "connection_lost" // connection reset or closed before the answer
	reason5xx     = "5xx"             // the engine answered 5xx
	reasonTimeout = "timeout"         // no response headers, first output or next read in time
	reasonStream  = "stream_failed"   // a stream failed after output was relayed (not retried)
	// reasonErrorEvent: a stream's error event before its first output.
	reasonErrorEvent = "error_event"
	// reasonBadResponse: a 2xx that is not the answer asked for (a stream
	// that is not SSE, or ends with no completion chunk).
	reasonBadResponse = "bad_response"
	// reasonEndpointDown: the endpoint failed health_check_abort_after
	// probes in a row while the attempt waited for its response headers
	// (upstream/wait.go).
	reasonEndpointDown = "endpoint_down"
)

// outlierSuccess records an answer that is not a failure of the endpoint.
func (ep *endpoint) outlierSuccess() {
	if ep.outlier.consecutive.Load() != 0 {
		ep.outlier.consecutive.Store(0)
	}
	if ep.authFailing.Load() {
		ep.authFailing.Store(false)
	}
}

// outlierFailure records a failure of kind reason at now and ejects the
// endpoint when it is a refused connection or credentials (reasonAuth:
// every request would fail alike) or the consecutive-error threshold is
// reached. It reports whether this call ejected it.
func (g *Gateway) outlierFailure(ep *endpoint, reason string, now time.Time) bool {
	n := ep.outlier.consecutive.Add(1)
	if reason != reasonConnect && reason != reasonAuth && n < int64(g.cfg.Outlier.ConsecutiveErrors) {
		return false
	}
	return g.ejectOutlier(ep, reason, now)
}

// ejectOutlier takes ep out of rotation for the back-off of its next
// ejection, unless an ejection is already running.
func (g *Gateway) ejectOutlier(ep *endpoint, reason string, now time.Time) bool {
	o := &ep.outlier
	o.mu.Lock()
	if now.Before(o.until) {
		o.mu.Unlock()
		return false // already ejected: in-flight failures of the same outage
	}
	maxEject := g.cfg.Outlier.MaxEjectionTime
	if o.ejections > 0 && now.Sub(o.until) >= maxEject {
		o.ejections = 0 // back in rotation long enough: the back-off starts over
	}
	o.ejections++
	d := g.cfg.EjectDuration
	for i := 1; i < o.ejections && d < maxEject; i++ {
		d *= 2
	}
	d = min(d, maxEject)
	o.until, o.reason = now.Add(d), reason
	n := o.ejections
	o.mu.Unlock()
	o.consecutive.Store(0)
	ep.eject(now, d)
	g.res.ejections.WithLabelValues(ep.name, reason).Inc()
	slog.Warn("gateway: endpoint ejected", "endpoint", ep.name, "reason", reason,
		"ejection", n, "eject_for", d)
	return true
}

// endAuthEjection ends a running ejection that a refusal of the gateway's
// credentials caused (they have since changed, and the engine accepts the
// new ones: applyCredentials), the back-off starting over, and puts the
// endpoint back in rotation. It reports whether there was one.
func (ep *endpoint) endAuthEjection(now time.Time) bool {
	o := &ep.outlier
	o.mu.Lock()
	if !now.Before(o.until) || o.reason != reasonAuth {
		o.mu.Unlock()
		return false
	}
	o.until, o.ejections, o.reason = now, 0, ""
	o.mu.Unlock()
	o.consecutive.Store(0)
	ep.ejectedUntil.Store(0)
	ep.wentDown.Store(false)
	ep.setReady(true)
	return true
}
