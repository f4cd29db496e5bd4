package sched

import (
	"slices"
	"testing"
)

// TestQueueScorerMixedFleet: in a fleet where some engines export queue
// metrics and others do not, the queue scorer compares one quantity across
// all candidates (the gateway's in-flight count), not an engine's waiting
// queue (0 while it runs everything it was sent) against another endpoint's
// in-flight requests.
func TestQueueScorerMixedFleet(t *testing.T) {
	eps := []Endpoint{
		{Ready: true, InFlight: 40, Metrics: true, Waiting: 0, Running: 40}, // busy, nothing queued yet
		{Ready: true, InFlight: 2}, // exports no metrics
		{Ready: true, InFlight: 10, Metrics: true, Waiting: 1, Running: 9},
	}
	c := &Cycle{Req: &Request{}, Eps: eps}
	sc := make([]float64, 3)
	queueScorer{}.Score(c, []int{0, 1, 2}, sc)
	if want := []float64{0, 1, 30.0 / 38}; !slices.Equal(sc, want) {
		t.Fatalf("mixed fleet scores %v, want %v (in flight 40, 2, 10)", sc, want)
	}
	// Every candidate with fresh metrics: the engines' own queues.
	queueScorer{}.Score(c, []int{0, 2}, sc[:2])
	if want := []float64{1, 0}; !slices.Equal(sc[:2], want) {
		t.Fatalf("metrics fleet scores %v, want %v (waiting 0, 1)", sc[:2], want)
	}
}

// TestKVUtilScorerUnknown: an endpoint that reports no KV utilisation (no
// fresh metrics, or metrics without the gauge) is left unscored (0, no
// preference from this scorer) instead of scored as an empty cache, which
// made the endpoint nothing is known about the most attractive one; llm-d
// fixed the same in its kv-cache-utilization scorer.
func TestKVUtilScorerUnknown(t *testing.T) {
	eps := []Endpoint{
		{Ready: true, Metrics: true, KVUtil: 0.9},
		{Ready: true},                              // exports no metrics
		{Ready: true, Metrics: true, KVUtil: -1},   // queue metrics, no KV gauge
		{Ready: true, Metrics: true, KVUtil: 0.25}, // known
	}
	c := &Cycle{Req: &Request{}, Eps: eps}
	sc := make([]float64, 4)
	kvUtilScorer{}.Score(c, []int{0, 1, 2, 3}, sc)
	if want := []float64{1 - eps[0].KVUtil, 0, 0, 0.75}; !slices.Equal(sc, want) {
		t.Fatalf("scores %v, want %v", sc, want)
	}
	p := newProfileT(t, only("kv", ScorerConfig{Type: ScorerKVUtilization, Weight: 1}), Pool{Capacity: caps(3, 10)})
	if d := p.Pick(&Request{}, eps[:3]); d.Endpoint != 0 {
		t.Fatalf("picked %d, want 0, the one endpoint whose KV use is known", d.Endpoint)
	}
}

// TestDecisionRandomness: a decision's random draws (tie-breaking, random
// pickers) depend on the seed and the decision's ordinal only, not on how
// many draws the decisions before it made: two policies of one seed whose
// first decisions differ (four-way tie, three draws; one candidate, none)
// break every later tie alike.
func TestDecisionRandomness(t *testing.T) {
	for _, name := range []string{LeastRequest, Random, CacheAware, PowerOfTwo} {
		a := mustNew(t, Config{Policy: name, Seed: 11}, 4)
		b := mustNew(t, Config{Policy: name, Seed: 11}, 4)
		eps := ready(4)
		one := ready(4)
		one[1].Ready, one[2].Ready, one[3].Ready = false, false, false
		a.Pick(&Request{}, eps)
		b.Pick(&Request{}, one)
		var pa, pb []int
		for range 32 {
			pa = append(pa, a.Pick(&Request{}, eps).Endpoint)
			pb = append(pb, b.Pick(&Request{}, eps).Endpoint)
		}
		if !slices.Equal(pa, pb) {
			t.Errorf("%s: later picks depend on the first decision's draws:\n%v\n%v", name, pa, pb)
		}
	}
}
