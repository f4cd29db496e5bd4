package measure

import (
	"cmp"
	"fmt"
	"slices"
	"time"
)

// Warmup selects the requests of a run that are sent (they warm caches and
// load the fleet) but excluded from its Summary, HTML report and goodput.
// Records keep them, with Record.Warmup set. A request is warm-up if it is
// among the first Requests requests sent (by ArrivalMs, ties in record order)
// or if it was sent before Duration of engine time from the start of the run.
// The zero Warmup excludes nothing.
type Warmup struct {
	// Requests is the number of earliest-sent requests to exclude.
	Requests int
	// Duration excludes the requests sent before it (engine time).
	Duration time.Duration
}

// Validate reports a negative field.
func (w Warmup) Validate() error {
	if w.Requests < 0 || w.Duration < 0 {
		return fmt.Errorf("bench: warm-up %d requests / %v: must not be negative", w.Requests, w.Duration)
	}
	return nil
}

// Mark sets Record.Warmup on the warm-up requests of recs (see Warmup) and
// clears it on the others.
func (w Warmup) Mark(recs []Record) {
	order := make([]int, len(recs))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(recs[a].ArrivalMs, recs[b].ArrivalMs) })
	limit := float64(w.Duration) / float64(time.Millisecond)
	for rank, i := range order {
		recs[i].Warmup = rank < w.Requests || recs[i].ArrivalMs < limit
	}
}

// Measured returns the records of recs that are not warm-up, in order. It
// returns recs itself when none is warm-up.
func Measured(recs []Record) []Record {
	if !slices.ContainsFunc(recs, func(r Record) bool { return r.Warmup }) {
		return recs
	}
	out := make([]Record, 0, len(recs))
	for _, r := range recs {
		if !r.Warmup {
			out = append(out, r)
		}
	}
	return out
}
