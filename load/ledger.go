// Package load is the gateway's accounting of what it has sent each
// endpoint: requests in flight, their prompt tokens, the prefill backlog not
// yet answered and the prefill rate learnt from observed TTFTs. It is the
// load half of what the scheduler sees of an endpoint (sched.Endpoint's
// InFlight, InFlightTokens and PendingPrefillTokens; the learnt rate is
// kept for the dashboard, not routed on: Fill).
//
// It is one pure core driven from two worlds: the live gateway
// (gateway/attempt.go) calls it with the wall clock, the virtual-time fleet
// (package virtual) with simulated time, so that `infergate plan` and
// `bench --virtual` route on exactly the numbers the live gateway routes on.
// Time is passed in (a time.Duration since any fixed origin, as sim.Engine
// takes it); nothing here reads a clock or does I/O.
//
// A Ledger is safe for concurrent use (atomics; the live gateway updates it
// from every request's goroutine), allocation-free, and its zero value is an
// idle endpoint with no learnt rate.
package load

import (
	"math"
	"sync/atomic"
	"time"

	"github.com/infergate/infergate/sched"
)

// Ledger is one endpoint's load as the gateway accounts it. An endpoint
// serving several pools (several models or LoRA adapters) has one Ledger:
// its counts are the engine's whole load as the gateway sees it.
type Ledger struct {
	// inFlight counts requests sent and not finished (requests). It is
	// also the circuit breaker's slot count (TryAcquire).
	inFlight atomic.Int64
	// inFlightTokens sums the prompt tokens of those requests (tokens;
	// only known for requests routed with their tokens, Send).
	inFlightTokens atomic.Int64
	// pendingPrefill sums, over requests sent that have not produced their
	// first token, the prompt tokens not predicted cached (tokens).
	pendingPrefill atomic.Int64
	// prefillRate is the effective prefill throughput learnt from observed
	// TTFTs (float64 bits of tokens/s; 0 until observed).
	prefillRate atomic.Uint64
}

// Share is one request's part of a Ledger, from Send to Finish: what it
// added, so that exactly that is taken back. The zero value holds nothing
// (Finish and FirstToken on it do nothing). A Share is owned by its
// request: not safe for concurrent use.
type Share struct {
	ledger *Ledger
	// prompt is the request's prompt tokens (added to inFlightTokens).
	prompt int64
	// pending is its prompt tokens not predicted cached (added to
	// pendingPrefill until its first token); 0 once released.
	pending int64
	// ahead is the backlog it joined, its own pending included (tokens):
	// what the engine prefilled before its first token.
	ahead int64
	// sent is when it was sent (the caller's clock).
	sent time.Duration
}

// PrefillRateAlpha is the weight of a new observation in the learnt
// prefill rate's exponentially weighted moving average.
const PrefillRateAlpha = 0.05

// MinObservedTokens is the smallest backlog (tokens) whose TTFT teaches
// the prefill rate: vLLM's default per-step token budget
// (--max-num-batched-tokens 8192, vllm/config/scheduler.py). A smaller
// backlog is prefilled within one step, whose time is set by the decodes
// batched with it, not by the backlog: tokens/TTFT then grows with the
// backlog, so an endpoint given more work would look faster and be given
// more (measured in virtual time on the Azure trace: one engine of 8 took
// 25.8% of the requests, one 2.8%).
const MinObservedTokens = 8192

// TryAcquire takes one in-flight slot if fewer than limit are taken and
// reports whether it did (the circuit breaker's max_requests per endpoint).
func (l *Ledger) TryAcquire(limit int) bool {
	for {
		n := l.inFlight.Load()
		if n >= int64(limit) {
			return false
		}
		if l.inFlight.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// Acquire takes one in-flight slot unconditionally.
func (l *Ledger) Acquire() { l.inFlight.Add(1) }

// Release gives back a slot taken by TryAcquire or Acquire.
func (l *Ledger) Release() { l.inFlight.Add(-1) }

// Send records a request of promptTokens tokens sent at now, of which the
// scheduler predicted matchedTokens cached on the endpoint, in s. The
// request adds its prompt to the in-flight tokens until Finish and its
// uncached part, max(1, prompt − matched) tokens, to the prefill backlog
// until FirstToken (or Finish). A promptTokens ≤ 0 (a request routed
// without tokenizing) records nothing.
func (l *Ledger) Send(s *Share, promptTokens, matchedTokens int, now time.Duration) {
	*s = Share{}
	if promptTokens <= 0 {
		return
	}
	n := int64(promptTokens)
	s.ledger, s.prompt = l, n
	s.pending = max(1, n-int64(matchedTokens))
	l.inFlightTokens.Add(n)
	s.ahead, s.sent = l.pendingPrefill.Add(s.pending), now
}

// FirstToken records s's first output token at now: the backlog it joined
// was prefilled in now − sent, which folds into the learnt rate (Observe),
// and its share of the backlog is released. Only the first call counts.
func (s *Share) FirstToken(now time.Duration) {
	if s.pending == 0 {
		return
	}
	if s.ahead >= MinObservedTokens {
		s.ledger.Observe(s.ahead, now-s.sent)
	}
	s.Prefilled()
}

// Prefilled releases s's share of the prefill backlog without observing a
// rate (a request whose first token was not timed, or that ended without
// one). Idempotent.
func (s *Share) Prefilled() {
	if s.pending != 0 {
		s.ledger.pendingPrefill.Add(-s.pending)
		s.pending = 0
	}
}

// Finish releases everything s still holds (its prefill backlog if no first
// token came, its in-flight tokens). Idempotent. The in-flight slot is
// released separately (Release): a request holds it from before it is
// routed.
func (s *Share) Finish() {
	if s.ledger == nil {
		return
	}
	s.Prefilled()
	s.ledger.inFlightTokens.Add(-s.prompt)
	*s = Share{}
}

// Pending is s's share of the prefill backlog still held (tokens; 0 once
// released).
func (s *Share) Pending() int64 { return s.pending }

// Observe folds one prefill observation into the learnt rate: tokens (the
// backlog a request waited behind plus its own uncached prompt) prefilled in
// ttft. The effective rate includes queueing behind decodes and the network,
// which is what a TTFT estimate needs (sched's cost scorer). Observations
// with no tokens or no time are ignored.
func (l *Ledger) Observe(tokens int64, ttft time.Duration) {
	if tokens <= 0 || ttft <= 0 {
		return
	}
	obs := float64(tokens) / ttft.Seconds()
	for {
		old := l.prefillRate.Load()
		cur := math.Float64frombits(old)
		next := obs
		if cur > 0 {
			next = cur + PrefillRateAlpha*(obs-cur)
		}
		if l.prefillRate.CompareAndSwap(old, math.Float64bits(next)) {
			return
		}
	}
}

// InFlight is the number of requests in flight.
func (l *Ledger) InFlight() int64 { return l.inFlight.Load() }

// InFlightTokens is the prompt tokens of the requests in flight.
func (l *Ledger) InFlightTokens() int64 { return l.inFlightTokens.Load() }

// PendingPrefill is the prefill backlog: the uncached prompt tokens of the
// requests in flight that have not produced their first token.
func (l *Ledger) PendingPrefill() int64 { return l.pendingPrefill.Load() }

// PrefillRate is the learnt prefill rate (tokens/s), 0 until observed.
func (l *Ledger) PrefillRate() float64 { return math.Float64frombits(l.prefillRate.Load()) }

// Fill sets e's load fields (InFlight, InFlightTokens,
// PendingPrefillTokens) from the ledger, leaving the others.
//
// The learnt prefill rate is not passed on (PrefillTokensPerSecond is left
// as it is): measured, it made routing worse. In a homogeneous fleet the
// per-endpoint estimates drift apart under load (more than 2× within a
// 2,000-request Mooncake run), and the cost scorer turned that noise into
// starvation: an endpoint that learnt a low rate got fewer requests and so
// fewer observations to correct it. Virtual time, 8 engines, cache-aware,
// routing seeds 0-5: with the rates, hit rate 14.7-16.2%, TTFT p99
// 23.9-39.0 s, smallest share 3.8-10.8%; without, 15.2-16.0%, 22.4-25.0 s,
// 10.0-11.3%. Real time showed the same skew (sched/README.md: share 18.5/8.4%
// for cache-aware with learnt rates). A heterogeneous fleet needs a rate
// that load does not bias (a configured one, or a fitted
// TTFT = fixed + tokens/rate): left for later.
func (l *Ledger) Fill(e *sched.Endpoint) {
	e.InFlight = int(l.inFlight.Load())
	e.InFlightTokens = int(l.inFlightTokens.Load())
	e.PendingPrefillTokens = int(l.pendingPrefill.Load())
}
