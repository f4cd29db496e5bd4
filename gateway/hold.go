package gateway

import (
	"fmt"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// DefaultMaxHeldResponseBytes bounds the bytes of non-streaming answers the
// gateway holds at once, all requests together (256 MiB): each answer is
// held until it ends (up to maxUsageScan, 4 MiB) so that one that breaks
// can be retried with nothing sent, and without a global bound 100 clients
// that do not read a large answer made the gateway hold 100 × 4 MiB and
// more (683 MB measured).
const DefaultMaxHeldResponseBytes = 256 << 20

// byteBudget counts bytes held gateway-wide against a limit, without
// waiting: g.hold the non-streaming answers held by relayBody (an answer
// that would take it over its limit is relayed from there on as it
// arrives, its held part first, so it is no longer retry-safe; a buffer
// grown for an answer counts with its capacity, holdMore), g.bodies the
// request bodies being read (bodybudget.go). overflows counts the times a
// reservation did not fit.
type byteBudget struct {
	limit     int64 // bytes; ≤ 0: nothing is held
	held      atomic.Int64
	overflows prometheus.Counter
}

// reserve takes n bytes from the budget; false, taking nothing, when they
// do not fit.
func (h *byteBudget) reserve(n int64) bool {
	for {
		cur := h.held.Load()
		if cur+n > h.limit {
			return false
		}
		if h.held.CompareAndSwap(cur, cur+n) {
			return true
		}
	}
}

// release gives back *n reserved bytes and zeroes *n.
func (h *byteBudget) release(n *int64) {
	if *n != 0 {
		h.held.Add(-*n)
		*n = 0
	}
}

// holdMore makes room in x.capture for n more bytes, reserving them in the
// hold budget (*held: the bytes the request has reserved); false when the
// budget cannot take them. Within the buffer's capacity the bytes are
// reserved as they come; beyond it the buffer grows (doubling, from 64 KiB
// to maxUsageScan) by what the budget grants, so the reservation is the
// memory allocated for the answer, growth included.
func (g *Gateway) holdMore(x *exchange, n int, held *int64) bool {
	need := len(x.capture) + n
	want, grow := int64(need), need > cap(x.capture)
	newCap := 0
	if grow {
		newCap = min(maxUsageScan, max(2*cap(x.capture), need, 64<<10))
		want = int64(newCap)
	}
	if want > *held {
		if !g.hold.reserve(want - *held) {
			return false
		}
		*held = want
	}
	if grow {
		x.capture = append(make([]byte, 0, newCap), x.capture...)
	}
	return true
}

// initHold sets up the hold budget and registers its metrics.
func (g *Gateway) initHold(reg prometheus.Registerer) (err error) {
	g.hold, err = newByteBudget(reg, g.cfg.MaxHeldResponseBytes,
		"response_hold_overflows_total", "Non-streaming answers relayed before their end because max_held_response_bytes was held (not retry-safe).",
		"response_held_bytes", "Bytes of non-streaming answers held until their end, all requests together (bounded by max_held_response_bytes).")
	return err
}

// newByteBudget returns a byteBudget of limit bytes with its metrics
// registered on reg: a counter of its overflows and a gauge of the bytes
// held (names without the infergate_ prefix).
func newByteBudget(reg prometheus.Registerer, limit int64, overflowsName, overflowsHelp, heldName, heldHelp string) (*byteBudget, error) {
	b := &byteBudget{limit: limit,
		overflows: prometheus.NewCounter(prometheus.CounterOpts{Namespace: "infergate", Name: overflowsName, Help: overflowsHelp})}
	held := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "infergate", Name: heldName, Help: heldHelp},
		func() float64 { return float64(b.held.Load()) })
	for _, c := range []prometheus.Collector{b.overflows, held} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("gateway: register metrics: %w", err)
		}
	}
	return b, nil
}
