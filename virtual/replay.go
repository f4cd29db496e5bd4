package virtual

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
)

// DefaultEngines is the fleet size Replay uses when ReplayOptions.Engines
// is 0 (bench.DefaultEngines, for a real-time comparison, is the same).
const DefaultEngines = 4

// ReplayOptions configures Replay. Its fields mean what the fields
// of the same names in bench.CompareOptions mean, for one policy.
type ReplayOptions struct {
	// Policy is the routing policy name (default sched.DefaultPolicy).
	Policy string
	// TrackPrecise keeps the precise prefix index (fed by the engines' KV
	// events) under any policy, to report its prediction error
	// (Summary.PrecisePredictedHitRate, PrecisePredictionMAE); it costs
	// about a Match per request and the events' application.
	TrackPrecise bool
	// KVEventDelay delays the precise index's KV events (Config.KVEventDelay).
	KVEventDelay time.Duration
	// Engines is the number of simulated engines (default 4).
	Engines int
	// Engine is the engine model of every engine (zero: sim's defaults).
	Engine sim.Config
	// Records are the requests to replay, in arrival order.
	Records []trace.Record
	// Requests limits the run to the first Requests records (0: all).
	Requests int
	// OutputTokens, if > 0, replaces every record's output length (tokens).
	OutputTokens int
	// Model is the served model name (default: the engine profile's model,
	// else sim.DefaultModel); it seeds routing hashes as in the gateway.
	Model string
	// Seed seeds the engines' outputs (unless Engine.Seed is set) and the
	// policy's tie-breaking (unless Routing.Seed is set), as in bench.Compare.
	Seed int64
	// Routing tunes the policy (its Policy field is replaced by Policy; a
	// zero Prefix.BlockSize means the engines' block size).
	Routing sched.Config
	// Warmup marks the warm-up records (Record.Warmup), which Summary
	// leaves out.
	Warmup measure.Warmup
	// RateRPS, if > 0, is recorded in Summary.RateRPS (see Retime).
	RateRPS float64
	// SkipITL leaves Record.ITLMs empty (Summary.ITL is then zero), saving
	// memory on very large traces.
	SkipITL bool
	// Remote is the shared remote KV tier's size (Config.Remote); the
	// engines' host and disk tiers are Engine.Tiers.
	Remote sim.TierSize
	// Prefill is the number of the Engines that are prefill engines, the
	// others decode engines (Config.Prefill); 0: aggregated.
	Prefill int
	// Replicas, ReplicaSync, ReplicaDelay and LoadInterval run several
	// gateway replicas behind a round-robin front (Config.Replicas,
	// replicas.go); KillAtRequest > 0 kills replica KillReplica when
	// record KillAtRequest arrives (before it is routed).
	Replicas      int
	ReplicaSync   bool
	ReplicaDelay  time.Duration
	LoadInterval  time.Duration
	KillAtRequest int
	KillReplica   int

	// ReplicaNoStagger is Config.ReplicaNoStagger.
	ReplicaNoStagger bool

	// Autoscale scales the fleet (Config.Autoscale); Engines is then its
	// most engines (default: the policy's Max).
	Autoscale *Autoscale
}

// ReplayResult is the outcome of Replay.
type ReplayResult struct {
	// Records are the per-request measurements, in record order, in the
	// units and time domain of Replay's (ms of engine time; ArrivalMs is the
	// trace schedule, which a virtual client always keeps).
	Records []measure.Record
	// Engine is the index of the engine each record was routed to (-1: none).
	Engine []int
	// Replica is the gateway replica that routed each record.
	Replica []int
	// Stagger is each replica's staggered decisions (ReplicaSync; nil
	// otherwise): released by the learns of the replicas ranked before it
	// or by their deadline, and their wait.
	Stagger []StaggerStats
	// KilledAt is the arrival (ms) of the first record after a replica
	// kill (ReplayOptions.KillAtRequest); 0 without one.
	KilledAt float64
	// Summary aggregates Records, with the fleet's utilisation, prefill
	// tokens and preemptions, like a bench.Compare run.
	Summary measure.Summary
	// Stats are the engines' final Stats, in engine order.
	Stats []sim.Stats
	// Wall is the wall time the simulation took.
	Wall time.Duration
	// Scale is the autoscaling figures (nil without ReplayOptions.Autoscale).
	Scale *ScaleStats
}

// Replay replays records through a Fleet: the same engine
// model and routing policy as bench.Compare, in virtual time, with no network and
// no sleeping. Arrivals follow the trace exactly (Timestamp − first
// Timestamp); prompts are the records' synthetic tokens (trace.Record.Tokens,
// built at arrival) and max_tokens the output length (at least 1), as bench.Replay
// sends them. ctx is checked before the run only: a run is not interruptible.
//
// Closed-loop replay (bench.ReplayOptions.Concurrency, Sessions) is not available
// in virtual time: Fleet.Run takes every arrival up front and runs
// until the fleet is idle, so an arrival cannot depend on an earlier finish.
func Replay(ctx context.Context, opts ReplayOptions) (ReplayResult, error) {
	if err := ctx.Err(); err != nil {
		return ReplayResult{}, err
	}
	if err := opts.Warmup.Validate(); err != nil {
		return ReplayResult{}, err
	}
	if opts.Engines == 0 {
		opts.Engines = DefaultEngines
		if opts.Autoscale != nil {
			opts.Engines = max(opts.Autoscale.Policy.Max, 1)
		}
	}
	if opts.Policy == "" {
		opts.Policy = sched.DefaultPolicy
	}
	eng := opts.Engine
	if eng.Seed == 0 {
		eng.Seed = uint64(opts.Seed)
	}
	routing := opts.Routing
	routing.Policy = opts.Policy
	if routing.Seed == 0 {
		routing.Seed = uint64(opts.Seed)
	}
	recs := opts.Records
	if opts.Requests > 0 && opts.Requests < len(recs) {
		recs = recs[:opts.Requests]
	}
	var killAt time.Duration
	if k := opts.KillAtRequest; k > 0 {
		if k >= len(recs) {
			return ReplayResult{}, fmt.Errorf("virtual: kill at request %d of %d", k, len(recs))
		}
		// At least 1 ns: KillAt 0 means no kill.
		killAt = max(recs[k].Timestamp-recs[0].Timestamp, 1)
	}
	fleet, err := NewFleet(Config{
		Engines:      opts.Engines,
		Engine:       eng,
		Model:        opts.Model,
		Routing:      routing,
		SkipITL:      opts.SkipITL,
		TrackPrecise: opts.TrackPrecise,
		KVEventDelay: opts.KVEventDelay,
		Remote:       opts.Remote,
		Prefill:      opts.Prefill,
		Replicas:     opts.Replicas,
		ReplicaSync:  opts.ReplicaSync,
		ReplicaDelay: opts.ReplicaDelay,
		LoadInterval: opts.LoadInterval,
		KillAt:       killAt,
		KillReplica:  opts.KillReplica,
		Autoscale:    opts.Autoscale,

		ReplicaNoStagger: opts.ReplicaNoStagger,
	})
	if err != nil {
		return ReplayResult{}, fmt.Errorf("virtual: %w", err)
	}
	reqs := make([]Request, len(recs))
	for i := range recs {
		rec := &recs[i]
		out := rec.OutputLength
		if opts.OutputTokens > 0 {
			out = opts.OutputTokens
		}
		reqs[i] = Request{
			Arrival:   rec.Timestamp - recs[0].Timestamp,
			Prompt:    rec.Tokens,
			MaxTokens: max(out, 1), // as bench.Replay sends it
		}
	}
	start := time.Now()
	res, err := fleet.Run(reqs)
	wall := time.Since(start)
	if err != nil {
		return ReplayResult{}, fmt.Errorf("virtual: %w", err)
	}
	run := ReplayResult{
		Records: make([]measure.Record, len(res)),
		Engine:  make([]int, len(res)),
		Replica: make([]int, len(res)),
		Stats:   fleet.Stats(),
		Wall:    wall,
	}
	if opts.ReplicaSync && opts.Replicas > 1 {
		for r := range opts.Replicas {
			run.Stagger = append(run.Stagger, fleet.ReplicaStagger(r))
		}
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	if killAt > 0 {
		run.KilledAt = ms(killAt)
	}
	tiered := eng.Tiers.Enabled() || !opts.Remote.IsZero()
	for i := range res {
		r := &res[i]
		out := &run.Records[i]
		*out = measure.Record{Policy: opts.Policy, Index: i, ArrivalMs: ms(r.Arrival), Status: 200}
		run.Engine[i], run.Replica[i] = r.Engine, r.Replica
		if r.Err != nil {
			out.Status, out.Error = 400, r.Err.Error()
			switch {
			case errors.Is(r.Err, ErrReplicaKilled):
				out.Status = 502 // the connection the L4 front held was reset
			case r.Engine < 0:
				out.Status = 503
			}
			continue
		}
		out.TTFTMs, out.E2EMs = ms(r.TTFT()), ms(r.E2E())
		out.PromptTokens, out.CachedTokens, out.OutputTokens = r.PromptTokens, r.CachedTokens, r.OutputTokens
		if tiered {
			tt := r.TierTokens
			out.TierTokens = &tt
			if fleet.precise != nil {
				var p [measure.NumTiers]int
				for t, b := range r.PredictedTierBlocks {
					p[t] = b * fleet.BlockSize()
				}
				out.PredictedTierTokens = &p
			}
		}
		if opts.Prefill > 0 {
			out.PD = &measure.PDLeg{Split: r.Prefill >= 0, Reason: r.PDReason}
			if r.Prefill >= 0 {
				out.PD.PrefillMs, out.PD.TransferMs = ms(r.HandOff-r.Arrival), ms(r.Transferred-r.HandOff)
			}
		}
		if len(r.ITL) > 0 {
			out.ITLMs = make([]float64, len(r.ITL))
			for j, g := range r.ITL {
				out.ITLMs[j] = ms(g)
			}
		}
		r.ITL = nil
	}
	opts.Warmup.Mark(run.Records)
	run.Summary = measure.Summarize(opts.Policy, run.Records)
	run.Summary.RateRPS = opts.RateRPS
	util := fleet.Utilization()
	var prefill, preempt int64
	served := make([]int64, len(run.Stats))
	for i, st := range run.Stats {
		prefill += st.PrefillTokens
		preempt += st.Preemptions
		served[i] = st.Prompts
	}
	run.Summary.SetShares(served)
	blockSize := fleet.BlockSize()
	var predicted, mae, ppredicted, pmae float64
	var prompt, n int
	for i := range res {
		r := &res[i]
		if r.Err != nil || run.Records[i].Warmup {
			continue
		}
		// An engine recomputes at least the last prompt token.
		p := float64(min(r.MatchedBlocks*blockSize, r.PromptTokens-1))
		predicted += p
		mae += math.Abs(p - float64(r.CachedTokens))
		pp := float64(min(max(r.PreciseMatchedBlocks, 0)*blockSize, r.PromptTokens-1))
		ppredicted += pp
		pmae += math.Abs(pp - float64(r.CachedTokens))
		prompt += r.PromptTokens
		n++
	}
	if n > 0 && (opts.TrackPrecise || sched.UsesPrecise(routing)) {
		ph, m := ppredicted/float64(max(prompt, 1)), pmae/float64(n)
		run.Summary.PrecisePredictedHitRate, run.Summary.PrecisePredictionMAE = &ph, &m
		if fleet.Policy().NeedsHashes() {
			ph, m := predicted/float64(max(prompt, 1)), mae/float64(n)
			run.Summary.PredictedHitRate, run.Summary.PredictionMAE = &ph, &m
		}
	}
	run.Summary.MeanEngineUtilization = &util
	if opts.Autoscale != nil {
		st := fleet.ScaleStats()
		run.Scale = &st
	}
	run.Summary.EnginePrefillTokens, run.Summary.Preemptions = &prefill, &preempt
	return run, nil
}
