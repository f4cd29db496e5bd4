package bench

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/infergate/infergate/trace"
)

// Retime returns copies of recs (token slices shared), in the same order and
// with the same content, whose Timestamps are re-drawn as a Poisson process
// of rate requests per second: the first at 0, then exponential gaps of mean
// 1/rate drawn from a PCG generator seeded with seed, so equal arguments give
// equal arrivals. rate must be positive and finite.
func Retime(recs []trace.Record, rate float64, seed uint64) ([]trace.Record, error) {
	if !(rate > 0) || math.IsInf(rate, 0) {
		return nil, fmt.Errorf("bench: rate %v req/s: must be positive and finite", rate)
	}
	r := rand.New(rand.NewPCG(seed, 0x52415445)) // "RATE"
	out := make([]trace.Record, len(recs))
	var t float64 // seconds
	for i, rec := range recs {
		if i > 0 {
			t += r.ExpFloat64() / rate
		}
		rec.Timestamp = time.Duration(t * float64(time.Second))
		out[i] = rec
	}
	return out, nil
}

// Spread returns recs with each arrival moved to a uniformly random
// instant within res after its timestamp (fixed seed), in arrival order:
// a trace whose timestamps have a resolution of res (the Mooncake traces'
// are whole seconds) says only that a request arrived somewhere in
// [t, t+res); replayed as given, every request of a second arrives at one
// instant, which no real client does and which no exchange between
// gateway replicas can make known to the others in time (gateway/README.md
// "Replicas"). The records are otherwise unchanged; recs is not modified.
func Spread(recs []trace.Record, res time.Duration, seed uint64) ([]trace.Record, error) {
	if res <= 0 {
		return nil, fmt.Errorf("bench: spread %v: must be positive", res)
	}
	r := rand.New(rand.NewPCG(seed, 0x53505244)) // "SPRD"
	out := slices.Clone(recs)
	for i := range out {
		out[i].Timestamp += time.Duration(r.Int64N(int64(res)))
	}
	slices.SortStableFunc(out, func(a, b trace.Record) int { return cmp.Compare(a.Timestamp, b.Timestamp) })
	return out, nil
}

// closedLoop sends recs closed-loop: conc users, each sending the next
// unsent record as soon as its previous request finished, until every
// record is sent.
func closedLoop(ctx context.Context, conc int, recs []trace.Record, do sendFunc) {
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(conc, len(recs)) {
		wg.Go(func() {
			for ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				if i >= len(recs) {
					return
				}
				do(i, recs[i], time.Time{}) // no schedule
			}
		})
	}
	wg.Wait()
}

// sessionLoop drives sessions closed-loop: session s starts at
// Start/speedup of wall time after start, or later when conc sessions (0:
// no bound) are already active; each next turn is sent when the previous
// turn's response has ended plus ThinkTime/speedup. Turns are numbered
// session-major from 0 (base[s] is session s's first index); at most limit
// (0: all) are sent. A turn is due when its wait ends: the session's start
// (or when a slot frees for a session held back by conc), or the previous
// turn's end plus the think time; do is called sendLead ahead of a
// session's start and right after the previous turn for a later turn, and
// sends at the due time itself.
func sessionLoop(ctx context.Context, conc int, sessions []trace.Session, limit int, speedup float64, start time.Time, do sendFunc) {
	total := 0
	base := make([]int, len(sessions))
	for s, ss := range sessions {
		base[s] = total
		total += len(ss.Turns)
	}
	if limit > 0 && limit < total {
		total = limit
	}
	var sem chan struct{}
	if conc > 0 {
		sem = make(chan struct{}, conc)
	}
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	var wg sync.WaitGroup
	order := make([]int, len(sessions))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(sessions[a].Start, sessions[b].Start) })
	for _, s := range order {
		if base[s] >= total {
			continue
		}
		due := start.Add(time.Duration(float64(sessions[s].Start) / speedup))
		if wait := time.Until(due) - sendLead; wait > 0 {
			timer.Reset(wait)
			select {
			case <-ctx.Done():
				timer.Stop()
			case <-timer.C:
			}
		}
		if ctx.Err() != nil {
			break
		}
		if sem != nil {
			select {
			case sem <- struct{}{}:
			default: // held back by conc: due when a slot frees
				select {
				case sem <- struct{}{}:
					if now := time.Now(); now.After(due) {
						due = now
					}
				case <-ctx.Done():
				}
			}
			if ctx.Err() != nil {
				break
			}
		}
		ss := sessions[s]
		wg.Go(func() {
			if sem != nil {
				defer func() { <-sem }()
			}
			for k, rec := range ss.Turns {
				i := base[s] + k
				if i >= total || ctx.Err() != nil {
					return
				}
				if k > 0 {
					due = time.Now().Add(time.Duration(float64(ss.ThinkTime) / speedup))
				}
				do(i, rec, due)
			}
		})
	}
	wg.Wait()
}
