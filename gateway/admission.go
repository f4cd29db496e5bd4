package gateway

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/openai"
)

// codeOverloaded is the OpenAI error code of a 429 from admission control
// (the admission queue is full, or the request waited in it too long): the
// code OpenAI sends with its own 429s.
const codeOverloaded = "rate_limit_exceeded"

// admissionRetryAfter is the Retry-After of an admission 429 (seconds):
// queues drain in seconds, and clients add their own back-off.
const admissionRetryAfter = "1"

// Admission outcomes besides admitted.
var (
	errQueueFull    = errors.New("admission queue full")
	errQueueTimeout = errors.New("admission queue timeout")
	// errQueueDisplaced: a queued request made room for one of higher
	// priority that found the queue full.
	errQueueDisplaced = errors.New("admission queue: displaced by a higher priority")
	errNoEndpoint     = errors.New("no endpoint ready")
)

// admission is one pool's admission control: at most maxInFlight requests
// admitted at once, and only while some ready endpoint has a free
// circuit-breaker slot; the others wait in a bounded priority queue (higher
// priority first, FIFO within a priority) for at most timeout. A request
// that finds the queue full takes the place of the lowest-priority waiter
// (the latest to arrive among equals) if its own priority is higher; that
// waiter is answered 429 at once. A waiter is woken by a channel send when
// admitted; it starts no goroutine. Once drained (shutdown), it admits
// nothing more: the waiters and every later request get errShuttingDown.
type admission struct {
	mu sync.Mutex
	// The pool's endpoints and limits, under mu (a reload changes them:
	// update).
	endpoints   []*endpoint
	limit       int // circuit-breaker slots per endpoint
	maxInFlight int
	maxQueue    int // < 0: no queue
	timeout     time.Duration

	inFlight int // admitted, not released
	queue    waitQueue
	seq      uint64
	draining bool // drain was called

	// pending counts admitted requests that have not taken their first
	// endpoint slot yet (they are owed one).
	pending atomic.Int64
	// waiting mirrors len(queue), active mirrors inFlight (read without mu).
	waiting atomic.Int64
	active  atomic.Int64
	// arrivals counts the requests that asked for admission (the
	// autoscaling arrival rate, autoscale.go).
	arrivals atomic.Uint64

	wait                                  prometheus.Observer
	rejectFull, rejectTO, rejectDisplaced prometheus.Counter
	rejectShutdown                        prometheus.Counter

	// Scale from zero (coldstart.go), under mu: the pool's settings
	// (hold.HoldTTL 0: off), the held requests (queued while no endpoint
	// was ready) and their body bytes, whether this cold episode's
	// wake-up was called, whether a call is still in flight (one at a
	// time: an episode that starts while the last one's call is pending
	// counts as woken by it, so clients that come and go cannot pile up
	// calls to a stalled hook). wakeCall makes the call on a goroutine of
	// wakes (the gateway's loops). heldNow mirrors held and probe the
	// probe interval (read without mu by the health loops).
	hold      ScaleFromZeroConfig
	held      int
	heldBytes int64
	woken     bool
	waking    bool
	wakeCall  func(hold ScaleFromZeroConfig, eps []*endpoint, held int)
	wakes     *sync.WaitGroup
	heldNow   atomic.Int64
	probe     atomic.Int64 // nanoseconds
	beating   atomic.Bool  // hold on with heartbeats

	heldC, heldExpired, heldRejected prometheus.Counter
	heldTime                         prometheus.Observer
}

// waiter is one queued request.
type waiter struct {
	priority int
	seq      uint64
	index    int           // in the heap; -1 once popped
	ready    chan struct{} // capacity 1: admitted or failed
	granted  bool          // admitted (under mu)
	err      error         // failed while queued (under mu)
	// cold: held while the pool had no ready endpoint (scale from zero),
	// counted in held until unheld; bytes its body's size.
	cold, unheld bool
	bytes        int64
}

// waitQueue is a max-heap on (priority, -seq).
type waitQueue []*waiter

func (q waitQueue) Len() int { return len(q) }
func (q waitQueue) Less(i, j int) bool {
	if q[i].priority != q[j].priority {
		return q[i].priority > q[j].priority
	}
	return q[i].seq < q[j].seq
}
func (q waitQueue) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].index, q[j].index = i, j
}
func (q *waitQueue) Push(v any) {
	w := v.(*waiter)
	w.index = len(*q)
	*q = append(*q, w)
}
func (q *waitQueue) Pop() any {
	old := *q
	n := len(old) - 1
	w := old[n]
	old[n] = nil
	w.index = -1
	*q = old[:n]
	return w
}

// capacityLocked reports whether one more request can be admitted now, and
// whether any endpoint is ready at all.
func (a *admission) capacityLocked() (ok, anyReady bool) {
	room := int64(0)
	for _, ep := range a.endpoints {
		if ep.ready.Load() {
			anyReady = true
			room += max(0, int64(a.limit)-ep.ledger.InFlight())
		}
	}
	return a.inFlight < a.maxInFlight && room > a.pending.Load(), anyReady
}

func (a *admission) admitLocked() {
	a.inFlight++
	a.active.Store(int64(a.inFlight))
	a.pending.Add(1)
}

// dispatchLocked admits queued requests while there is capacity, and fails
// them all when no endpoint is ready — unless the pool holds requests
// while it has none (scale from zero): they wait for one, or their TTL.
func (a *admission) dispatchLocked() {
	for len(a.queue) > 0 {
		ok, anyReady := a.capacityLocked()
		if !anyReady {
			if a.hold.HoldTTL > 0 {
				break
			}
			for len(a.queue) > 0 {
				w := heap.Pop(&a.queue).(*waiter)
				a.unholdLocked(w)
				w.err = errNoEndpoint
				w.ready <- struct{}{}
			}
			break
		}
		if !ok {
			break
		}
		w := heap.Pop(&a.queue).(*waiter)
		a.unholdLocked(w)
		w.granted = true
		a.admitLocked()
		w.ready <- struct{}{}
	}
	a.waiting.Store(int64(len(a.queue)))
	a.endEpisodeLocked()
}

// unholdLocked takes w out of the held count, once.
func (a *admission) unholdLocked(w *waiter) {
	if w.cold && !w.unheld {
		w.unheld = true
		a.held--
		a.heldBytes -= w.bytes
		a.heldNow.Store(int64(a.held))
	}
}

// endEpisodeLocked ends the cold episode (the next held request calls the
// wake-up hook again) once an endpoint is ready or nothing is held.
func (a *admission) endEpisodeLocked() {
	if !a.woken {
		return
	}
	if _, anyReady := a.capacityLocked(); anyReady || a.held == 0 {
		a.woken = false
	}
}

// acquire admits the request, waiting in the queue if need be. It returns
// nil once admitted (release must follow), errNoEndpoint, errQueueFull,
// errQueueTimeout, errQueueDisplaced, errShuttingDown, errHoldFull,
// errHoldExpired or ctx's error. bytes is the request body's size (the
// scale-from-zero hold's bound); beat, when not nil, is called every
// hold.Heartbeat while the request is held and ends the wait (as a client
// gone) when it returns false.
func (a *admission) acquire(ctx context.Context, priority int, bytes int64, beat func() bool) error {
	a.mu.Lock()
	if a.draining {
		a.mu.Unlock()
		a.rejectShutdown.Inc()
		return errShuttingDown
	}
	a.dispatchLocked()
	ok, anyReady := a.capacityLocked()
	cold := false
	switch {
	case !anyReady && a.hold.HoldTTL <= 0:
		a.mu.Unlock()
		return errNoEndpoint
	case !anyReady:
		if a.held >= a.hold.MaxHeld || a.heldBytes+bytes > a.hold.MaxHeldBytes {
			a.mu.Unlock()
			a.heldRejected.Inc()
			return errHoldFull
		}
		cold = true
	case ok && len(a.queue) == 0:
		a.admitLocked()
		a.mu.Unlock()
		return nil
	case a.maxQueue < 0 || (len(a.queue) >= a.maxQueue && !a.displaceLocked(priority)):
		a.mu.Unlock()
		a.rejectFull.Inc()
		return errQueueFull
	}
	a.seq++
	w := &waiter{priority: priority, seq: a.seq, ready: make(chan struct{}, 1), cold: cold, bytes: bytes}
	heap.Push(&a.queue, w)
	a.waiting.Store(int64(len(a.queue)))
	timeout, heartbeat := a.timeout, time.Duration(0)
	var probe []*endpoint
	if cold {
		a.held++
		a.heldBytes += bytes
		a.heldNow.Store(int64(a.held))
		a.heldC.Inc()
		a.startWakeLocked()
		timeout, probe = a.hold.HoldTTL, a.endpoints
		if beat != nil {
			heartbeat = a.hold.Heartbeat
		}
	}
	// Capacity freed between the check above and waiting's update would
	// have found waiting 0 and not woken anyone: check again.
	a.dispatchLocked()
	a.mu.Unlock()
	for _, ep := range probe {
		ep.probeSoon() // the health loops switch to the hold's probe interval at once
	}

	queued := time.Now()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var beats <-chan time.Time
	if heartbeat > 0 {
		t := time.NewTicker(heartbeat)
		defer t.Stop()
		beats = t.C
	}
	var err error
wait:
	for {
		select {
		case <-w.ready:
		case <-ctx.Done():
			err = ctx.Err()
		case <-timer.C:
			err = errQueueTimeout
		case <-beats:
			if beat() {
				continue
			}
			err = context.Canceled // the client is gone
		}
		break wait
	}
	a.mu.Lock()
	switch {
	case w.granted && err == nil:
	case w.granted && err == errQueueTimeout:
		err = nil // admitted as the timer fired: take it
	case w.granted: // admitted, but the client is gone
		a.releaseLocked()
	case w.err != nil:
		err = w.err
	default:
		heap.Remove(&a.queue, w.index)
		a.waiting.Store(int64(len(a.queue)))
		a.unholdLocked(w)
		if _, anyReady := a.capacityLocked(); err == errQueueTimeout && cold && !anyReady {
			err = errHoldExpired // still no endpoint: 503, not 429
		}
		a.endEpisodeLocked()
	}
	a.mu.Unlock()
	waited := time.Since(queued).Seconds()
	a.wait.Observe(waited)
	if cold {
		a.heldTime.Observe(waited)
	}
	switch err {
	case errQueueTimeout:
		a.rejectTO.Inc()
	case errHoldExpired:
		a.heldExpired.Inc()
	case errShuttingDown:
		a.rejectShutdown.Inc()
	}
	return err
}

// drain refuses every request from now on and fails the waiters with
// errShuttingDown at once; admitted requests are not affected.
func (a *admission) drain() {
	a.mu.Lock()
	a.draining = true
	for len(a.queue) > 0 {
		w := heap.Pop(&a.queue).(*waiter)
		a.unholdLocked(w)
		w.err = errShuttingDown
		w.ready <- struct{}{}
	}
	a.waiting.Store(0)
	a.mu.Unlock()
}

// displaceLocked makes room in a full queue for a request of priority:
// the lowest-priority waiter, the latest among equals, is failed with
// errQueueDisplaced if its priority is lower. It reports whether it made
// room. O(queue length), on a full queue only.
func (a *admission) displaceLocked(priority int) bool {
	if len(a.queue) == 0 {
		return false
	}
	low := a.queue[0]
	for _, w := range a.queue[1:] {
		if w.priority < low.priority || (w.priority == low.priority && w.seq > low.seq) {
			low = w
		}
	}
	if low.priority >= priority {
		return false
	}
	heap.Remove(&a.queue, low.index)
	a.unholdLocked(low)
	low.err = errQueueDisplaced
	low.ready <- struct{}{}
	a.waiting.Store(int64(len(a.queue)))
	a.rejectDisplaced.Inc()
	return true
}

// picked records that an admitted request took its first endpoint slot (or
// found none).
func (a *admission) picked() {
	a.pending.Add(-1)
	a.wake()
}

// release ends an admitted request.
func (a *admission) release() {
	a.mu.Lock()
	a.releaseLocked()
	a.mu.Unlock()
}

func (a *admission) releaseLocked() {
	a.inFlight--
	a.active.Store(int64(a.inFlight))
	a.dispatchLocked()
}

// wake admits waiters if capacity allows (after an endpoint slot was freed
// or an endpoint changed readiness). Free when nobody waits.
func (a *admission) wake() {
	if a.waiting.Load() == 0 {
		return
	}
	a.mu.Lock()
	a.dispatchLocked()
	a.mu.Unlock()
}

// admitQueued runs admission control for request x of pool p; false when it
// was answered (503 no endpoint, 503 shutting down, 429 queue full or timed
// out, or the client left while queued). A request refused here was never
// admitted: its charge on the key's rate limits is given back. A streaming
// request held while the pool has no ready endpoint gets heartbeats when
// the pool's scale_from_zero says so (x.hb, coldstart.go): the answer is
// then a committed event stream, and the caller writes the rest through
// x.hb.stream.
func (g *Gateway) admitQueued(w http.ResponseWriter, r *http.Request, p *pool, x *exchange) bool {
	var beat func() bool
	if _, picker := w.(*eppRecorder); x.stream && !picker && p.gate.beating.Load() { // the endpoint picker has no client stream to write to
		x.hb = heartbeat{g: g, w: w, x: x}
		beat = x.hb.beat
	}
	p.gate.arrivals.Add(1)
	err := p.gate.acquire(r.Context(), x.sreq.Priority, int64(len(x.body)), beat)
	if err == nil {
		return true
	}
	w, end := x.hb.stream(w)
	defer end()
	if x.pass.fallback { // the alias's next target may take it (alias.go)
		switch {
		case errors.Is(err, errNoEndpoint), errors.Is(err, errHoldFull), errors.Is(err, errHoldExpired):
			x.pass.fell = fallbackNoEndpoint
			return false
		case errors.Is(err, errQueueFull), errors.Is(err, errQueueDisplaced), errors.Is(err, errQueueTimeout):
			x.pass.fell = fallbackOverloaded
			return false
		}
	}
	x.refundKey(w.Header())
	switch {
	case errors.Is(err, errNoEndpoint):
		g.failNoEndpoint(w, p, nil)
	case errors.Is(err, errHoldExpired):
		ttl := p.gate.holdTTL()
		w.Header().Set("Retry-After", g.retryAfter)
		g.fail(w, p.none, openai.NewError(http.StatusServiceUnavailable,
			fmt.Sprintf("No endpoint serving model `%s` became ready within %s; retry later.", p.model, ttl), "", openai.CodeNoEndpoint))
	case errors.Is(err, errHoldFull):
		w.Header().Set("Retry-After", g.retryAfter)
		g.fail(w, p.none, openai.NewError(http.StatusServiceUnavailable,
			fmt.Sprintf("No endpoint serving model `%s` is available and too many requests are waiting for one; retry later.", p.model), "", openai.CodeNoEndpoint))
	case errors.Is(err, errShuttingDown):
		g.failShuttingDown(w, p.none)
	case errors.Is(err, errQueueFull):
		w.Header().Set("Retry-After", admissionRetryAfter)
		g.fail(w, p.none, openai.NewError(http.StatusTooManyRequests,
			fmt.Sprintf("Model `%s` is overloaded: too many requests are waiting; retry later.", p.model), "", codeOverloaded))
	case errors.Is(err, errQueueDisplaced):
		w.Header().Set("Retry-After", admissionRetryAfter)
		g.fail(w, p.none, openai.NewError(http.StatusTooManyRequests,
			fmt.Sprintf("Model `%s` is overloaded: a request of higher priority took this one's place in the full queue; retry later.",
				p.model), "", codeOverloaded))
	case errors.Is(err, errQueueTimeout):
		w.Header().Set("Retry-After", admissionRetryAfter)
		_, _, timeout := p.gate.settings()
		g.fail(w, p.none, openai.NewError(http.StatusTooManyRequests,
			fmt.Sprintf("Model `%s` is overloaded: the request waited %s without being admitted; retry later.",
				p.model, timeout), "", codeOverloaded))
	default: // the client went away while queued (or Abort ended the wait)
		g.canceled(w, r, p.none)
	}
	return false
}

// failNoEndpoint answers 503 no_endpoint_available for p's model, with
// Retry-After (the health-check interval); x, when not nil, may be pinned
// to the endpoint that stored a response (responses.go).
func (g *Gateway) failNoEndpoint(w http.ResponseWriter, p *pool, x *exchange) {
	w.Header().Set("Retry-After", g.retryAfter)
	msg := fmt.Sprintf("No endpoint serving model `%s` is available; retry later.", p.model)
	if x != nil && x.pass.pinEP != nil {
		msg = fmt.Sprintf("The endpoint that stored response `%s` is not available; retry later.", x.pass.pinID)
	}
	g.fail(w, p.none, openai.NewError(http.StatusServiceUnavailable, msg, "", openai.CodeNoEndpoint))
}

// newGate returns model's admission control, configured by update.
func (g *Gateway) newGate(model string) *admission {
	m := g.res
	return &admission{
		wakeCall:        g.wakeCall(model),
		wakes:           &g.wg,
		heldC:           g.cold.held.WithLabelValues(model),
		heldExpired:     g.cold.expired.WithLabelValues(model),
		heldRejected:    g.cold.rejected.WithLabelValues(model),
		heldTime:        g.cold.heldTime.WithLabelValues(model),
		wait:            m.queueWait.WithLabelValues(model),
		rejectFull:      m.rejections.WithLabelValues(model, "queue_full"),
		rejectTO:        m.rejections.WithLabelValues(model, "queue_timeout"),
		rejectDisplaced: m.rejections.WithLabelValues(model, "displaced"),
		rejectShutdown:  m.rejections.WithLabelValues(model, "shutdown"),
	}
}

// update sets the gate's endpoints and limits (at New, and at each reload:
// the queue and the admitted requests are kept) and admits the waiters the
// new capacity allows. maxInFlight 0 is the sum of the endpoints'
// circuit-breaker slots.
func (a *admission) update(eps []*endpoint, limit int, c AdmissionConfig, hold ScaleFromZeroConfig) {
	maxInFlight := c.MaxInFlight
	if maxInFlight == 0 {
		maxInFlight = limit * len(eps)
	}
	a.mu.Lock()
	a.endpoints, a.limit, a.maxInFlight = eps, limit, maxInFlight
	a.maxQueue, a.timeout = c.MaxQueue, c.QueueTimeout
	a.hold = hold
	a.probe.Store(int64(hold.ProbeInterval))
	a.beating.Store(hold.HoldTTL > 0 && hold.Heartbeat > 0)
	a.dispatchLocked()
	a.mu.Unlock()
}

// retire ends the scale-from-zero hold of the gate of a model a reload
// removed: nothing probes or wakes its endpoints any more, so its held
// requests are answered 503 no_endpoint_available at once (they waited out
// hold_ttl, then were told no endpoint became ready), as is any request
// that still reaches it.
func (a *admission) retire() {
	a.mu.Lock()
	a.hold = ScaleFromZeroConfig{}
	a.beating.Store(false)
	a.dispatchLocked()
	a.mu.Unlock()
}

// settings returns the gate's current limits.
func (a *admission) settings() (maxInFlight, maxQueue int, timeout time.Duration) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.maxInFlight, a.maxQueue, a.timeout
}

// holdTTL returns the gate's scale-from-zero hold TTL (0: off).
func (a *admission) holdTTL() time.Duration {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.hold.HoldTTL
}
