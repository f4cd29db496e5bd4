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
