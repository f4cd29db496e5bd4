package measure

import (
	"math"
	"slices"
)

// Latency summarizes a latency distribution (ms, engine time). Every field is
// 0 when there are no samples.
type Latency struct {
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
	Mean float64 `json:"mean"`
}

// Summary aggregates one run's Records. Latencies are milliseconds and
// durations seconds of engine time (see the package comment). Token sums,
// hit rate and latencies count successful requests only.
type Summary struct {
	// Policy is the routing policy (or run label).
	Policy string `json:"policy"`
	// RateRPS is the Poisson arrival rate the run's requests were re-timed
	// to (requests/s; a --rate sweep); 0 (absent) when the trace's own
	// timestamps (or a closed loop) were used.
	RateRPS float64 `json:"rate_rps,omitempty"`
	// Requests is the number of requests measured: sent and not warm-up.
	Requests int `json:"requests"`
	// WarmupRequests is the number of warm-up requests sent before the
	// measured ones and left out of every other field (absent when 0).
	WarmupRequests int `json:"warmup_requests,omitempty"`
	// Errors is the number of requests that failed.
	Errors int `json:"errors"`
	// HitRate is CachedTokens / PromptTokens: the fraction of prompt tokens
	// the engines reported as prefix-cache hits (0 with no prompt tokens).
	HitRate float64 `json:"hit_rate"`
	// TTFT is the time to first token over requests (ms).
	TTFT Latency `json:"ttft_ms"`
	// ITL is the inter-token latency over all gaps between output chunks of
	// all requests, as vLLM's benchmark_serving pools them (ms).
	ITL Latency `json:"itl_ms"`
	// E2E is the end-to-end request latency (ms).
	E2E Latency `json:"e2e_ms"`
	// OutputTokPerS is OutputTokens / DurationS (tokens per engine second).
	OutputTokPerS float64 `json:"output_tok_per_s"`
	// PromptTokens is Σ prompt tokens as the engines reported them (tokens).
	PromptTokens int64 `json:"prompt_tokens"`
	// CachedTokens is Σ cached prompt tokens as reported (tokens).
	CachedTokens int64 `json:"cached_tokens"`
	// PrefillTokensComputed is PromptTokens − CachedTokens: the prompt tokens
	// the fleet had to compute (tokens).
	PrefillTokensComputed int64 `json:"prefill_tokens_computed"`
	// OutputTokens is Σ generated tokens (tokens).
	OutputTokens int64 `json:"output_tokens"`
	// DurationS is the replay's length, from its start to the end of its last
	// request (s). With warm-up requests it is the measured window instead:
	// from the first measured request's arrival to the end of the last one.
	DurationS float64 `json:"duration_s"`
	// MeanEngineUtilization is the mean fraction of engine time the fleet's
	// engines spent stepping, in [0, 1]; nil when unknown (a --target run).
	MeanEngineUtilization *float64 `json:"mean_engine_utilization,omitempty"`
	// EnginePrefillTokens is the prefill tokens the simulated engines
	// computed, including recomputation after preemption (tokens); nil when
	// unknown (a --target run).
	EnginePrefillTokens *int64 `json:"engine_prefill_tokens,omitempty"`
	// Preemptions counts the simulated engines' preemptions; nil when unknown.
	Preemptions *int64 `json:"preemptions,omitempty"`
	// EndpointShareMax and EndpointShareMin are the largest and smallest
	// fractions of the run's requests one engine served (prompts the engine
	// started, warm-up included), in [0, 1]; nil when unknown (a --target
	// run). A perfectly even split gives 1/engines for both.
	EndpointShareMax *float64 `json:"endpoint_share_max,omitempty"`
	EndpointShareMin *float64 `json:"endpoint_share_min,omitempty"`
	// PredictedHitRate is the prompt tokens the policy predicted cached
	// (its prefix index's matched blocks × block size) over the prompt
	// tokens, and PredictionMAE the mean absolute error between predicted
	// and reported cached tokens per request (tokens); nil when unknown.
	PredictedHitRate *float64 `json:"predicted_hit_rate,omitempty"`
	PredictionMAE    *float64 `json:"prediction_mae_tokens,omitempty"`
	// PrecisePredictedHitRate and PrecisePredictionMAE are the same for the
	// precise index fed by the engines' KV events, queried for the chosen
	// engine at routing time whatever the policy (virtual runs only).
	PrecisePredictedHitRate *float64 `json:"precise_predicted_hit_rate,omitempty"`
	PrecisePredictionMAE    *float64 `json:"precise_prediction_mae_tokens,omitempty"`
	// PooledHitRate and InfiniteHitRate are the run's reference hit rates
	// (References.Apply), over the same requests as HitRate: what one cache
	// with the fleet's whole KV capacity (PooledCacheHitRate) and an
	// infinite cache (trace.InfiniteCacheHitRate) would serve them, warm-up
	// requests filling both; nil when not computed (no fleet capacity to
	// pool for a --target run; no hash ids for the infinite one).
	PooledHitRate   *float64 `json:"pooled_hit_rate,omitempty"`
	InfiniteHitRate *float64 `json:"infinite_hit_rate,omitempty"`
	// PooledTieredHitRate is the pooled reference's tiered twin: one cache
	// with the fleet's KV capacity in every tier (GPU, host, disk, remote)
	// pooled; nil when the fleet has no tiers.
	PooledTieredHitRate *float64 `json:"pooled_tiered_hit_rate,omitempty"`
	// TierHitRate splits HitRate by the tier the engines took each cached
	// block from (Record.TierTokens); nil when no record reports tiers.
	TierHitRate *Tiers `json:"tier_hit_rate,omitempty"`
	// TierPredictedHitRate and TierPredictionMAE compare, per tier, the
	// precise index's prediction at routing time (Record.PredictedTierTokens)
	// with what the engine reported: predicted hit rate, and the mean
	// absolute error per request (tokens); nil when not tracked.
	TierPredictedHitRate *Tiers `json:"tier_predicted_hit_rate,omitempty"`
	TierPredictionMAE    *Tiers `json:"tier_prediction_mae_tokens,omitempty"`
	// PD summarizes the P/D hand-offs of a fleet with prefill and decode
	// engines (Record.PD); nil outside one.
	PD *PDSummary `json:"pd,omitempty"`
	// FleetLag is the simulated fleet's step lag (simserver.Fleet.Lag): how late
	// its engines delivered their steps against their time scale (ms of
	// engine time); nil when unknown (a --target run) or not applicable (a
	// virtual run, which has no wall clock).
	FleetLag *Lag `json:"fleet_lag,omitempty"`
	// SendLag is how late the client sent the requests against their
	// schedule (Record.SendLagMs, ms of engine time); nil for a closed loop
	// and a virtual run.
	SendLag *Lag `json:"send_lag,omitempty"`
	// MaxLagMs is the lag margin the run was judged against (CheckLag; ms
	// of engine time); 0 (absent) when it was not judged.
	MaxLagMs float64 `json:"max_lag_ms,omitempty"`
	// Behind is true when FleetLag's or SendLag's p99 exceeds MaxLagMs: the
	// run fell behind its time scale and its latencies measure the host,
	// not the modelled hardware.
	Behind bool `json:"behind,omitempty"`
	// TTFTByPromptLength splits TTFT by the prompt's length
	// (Record.PromptTokens) into PromptBuckets, all four always present
	// (Requests 0, zero latencies for an empty one): whether long prompts
	// wait longer than their own prefill takes, which the pooled
	// percentiles hide (issue 19, item 4). Successful requests only; nil
	// when the summary was not built by Summarize.
	TTFTByPromptLength []BucketLatency `json:"ttft_by_prompt_length,omitempty"`
	// FirstError is the error of the first failed request ("" if none).
	FirstError string `json:"first_error,omitempty"`
	// Goodput counts the requests that met a per-request SLO; nil when the
	// run was not judged against one (plan sets it; Summarize does not).
	Goodput *Goodput `json:"goodput,omitempty"`
}

// PromptBucket is a range of prompt lengths: MinTokens ≤ prompt tokens <
// MaxTokens (MaxTokens 0: no upper bound).
type PromptBucket struct {
	Name      string `json:"name"`
	MinTokens int    `json:"min_tokens"`
	MaxTokens int    `json:"max_tokens,omitempty"`
}

// PromptBuckets are the prompt-length buckets of TTFTByPromptLength,
// issue 19's: < 8k, 8–32k, 32–64k and ≥ 64k tokens (k = 1,024 tokens, as
// context windows are counted).
var PromptBuckets = []PromptBucket{
	{Name: "<8k", MinTokens: 0, MaxTokens: 8 << 10},
	{Name: "8-32k", MinTokens: 8 << 10, MaxTokens: 32 << 10},
	{Name: "32-64k", MinTokens: 32 << 10, MaxTokens: 64 << 10},
	{Name: ">=64k", MinTokens: 64 << 10},
}

// bucketOf returns the index in PromptBuckets of a prompt of n tokens.
func bucketOf(n int) int {
	for i, b := range PromptBuckets {
		if b.MaxTokens == 0 || n < b.MaxTokens {
			return i
		}
	}
	return len(PromptBuckets) - 1
}

// BucketLatency is the TTFT of one PromptBucket's requests.
type BucketLatency struct {
	PromptBucket
	// Requests is the number of successful requests in the bucket.
	Requests int `json:"requests"`
	// TTFT is their time to first token (ms).
	TTFT Latency `json:"ttft_ms"`
}

// ttftByPromptLength buckets the successful requests of recs by prompt
// length (PromptBuckets) and summarizes each bucket's TTFT.
func ttftByPromptLength(recs []Record) []BucketLatency {
	xs := make([][]float64, len(PromptBuckets))
	for i := range recs {
		r := &recs[i]
		if r.Error != "" {
			continue
		}
		b := bucketOf(r.PromptTokens)
		xs[b] = append(xs[b], r.TTFTMs)
	}
	out := make([]BucketLatency, len(PromptBuckets))
	for i, b := range PromptBuckets {
		out[i] = BucketLatency{PromptBucket: b, Requests: len(xs[i]), TTFT: NewLatency(xs[i])}
	}
	return out
}

// PDSummary is the P/D part of a Summary.
type PDSummary struct {
	// Split and Whole count the successful requests split across a prefill
	// and a decode engine, and those a decode engine served whole.
	Split int `json:"split"`
	Whole int `json:"whole"`
	// Reasons counts the whole ones by reason (sched.PDDecision.Reason).
	Reasons map[string]int `json:"reasons,omitempty"`
	// Prefill and Transfer are the split requests' PDLeg.PrefillMs and
	// TransferMs (ms).
	Prefill  Latency `json:"prefill_ms"`
	Transfer Latency `json:"transfer_ms"`
}

func (s *Summary) pd(recs []Record) {
	var p PDSummary
	var prefill, transfer []float64
	for i := range recs {
		r := &recs[i]
		if r.PD == nil || r.Error != "" {
			continue
		}
		if !r.PD.Split {
			p.Whole++
			if p.Reasons == nil {
				p.Reasons = map[string]int{}
			}
			p.Reasons[r.PD.Reason]++
			continue
		}
		p.Split++
		prefill = append(prefill, r.PD.PrefillMs)
		transfer = append(transfer, r.PD.TransferMs)
	}
	if p.Split+p.Whole == 0 {
		return
	}
	p.Prefill, p.Transfer = NewLatency(prefill), NewLatency(transfer)
	s.PD = &p
}

// NumTiers is the number of KV tiers a record splits its hits by: GPU, host
// memory, disk, remote (sim.NumTiers).
const NumTiers = 4

// TierNames are the tiers of Tiers and Record.TierTokens, in order.
var TierNames = [NumTiers]string{"gpu", "host", "disk", "remote"}

// Tiers is one value per KV tier.
type Tiers struct {
	GPU    float64 `json:"gpu"`
	Host   float64 `json:"host"`
	Disk   float64 `json:"disk"`
	Remote float64 `json:"remote"`
}

// TiersOf returns v as Tiers.
func TiersOf(v [NumTiers]float64) *Tiers {
	return &Tiers{GPU: v[0], Host: v[1], Disk: v[2], Remote: v[3]}
}

// Array returns t in tier order.
func (t *Tiers) Array() [NumTiers]float64 { return [NumTiers]float64{t.GPU, t.Host, t.Disk, t.Remote} }

// Goodput is the part of a run's requests that met every per-request target
// of a service-level objective (see package plan for how an SLO applies to a
// single request). A failed request never meets it.
type Goodput struct {
	// SLO is the objective the requests were judged against, as written
	// (e.g. "ttft_p90=2s,itl_p99=100ms").
	SLO string `json:"slo"`
	// Requests is the number of requests that met every target.
	Requests int `json:"requests"`
	// Share is Requests / Summary.Requests, in [0, 1] (0 with no requests).
	Share float64 `json:"share"`
	// PerS is Requests / Summary.DurationS (requests per engine second):
	// vLLM benchmark_serving's request_goodput (0 when DurationS is 0).
	PerS float64 `json:"req_per_s"`
}

// Summarize aggregates recs into a Summary labelled policy, leaving out
// warm-up records (Record.Warmup) except to count them.
func Summarize(policy string, recs []Record) Summary {
	s := Summary{Policy: policy}
	var ttft, e2e, itl []float64
	all := len(recs)
	recs = Measured(recs)
	s.WarmupRequests = all - len(recs)
	startMs := 0.0 // the measured window's start
	if s.WarmupRequests > 0 && len(recs) > 0 {
		startMs = recs[0].ArrivalMs
		for i := range recs {
			startMs = min(startMs, recs[i].ArrivalMs)
		}
	}
	s.Requests = len(recs)
	for i := range recs {
		r := &recs[i]
		s.DurationS = max(s.DurationS, (r.ArrivalMs+r.E2EMs-startMs)/1000)
		if r.Error != "" {
			if s.Errors == 0 {
				s.FirstError = r.Error
			}
			s.Errors++
			continue
		}
		s.PromptTokens += int64(r.PromptTokens)
		s.CachedTokens += int64(r.CachedTokens)
		s.OutputTokens += int64(r.OutputTokens)
		ttft = append(ttft, r.TTFTMs)
		e2e = append(e2e, r.E2EMs)
		itl = append(itl, r.ITLMs...)
	}
	s.PrefillTokensComputed = s.PromptTokens - s.CachedTokens
	if s.PromptTokens > 0 {
		s.HitRate = float64(s.CachedTokens) / float64(s.PromptTokens)
	}
	if s.DurationS > 0 {
		s.OutputTokPerS = float64(s.OutputTokens) / s.DurationS
	}
	s.TTFT, s.ITL, s.E2E = NewLatency(ttft), NewLatency(itl), NewLatency(e2e)
	s.TTFTByPromptLength = ttftByPromptLength(recs)
	s.SendLag = sendLag(recs)
	s.tiers(recs)
	s.pd(recs)
	return s
}

// tiers sets the per-tier hit rates and prediction errors of recs.
func (s *Summary) tiers(recs []Record) {
	var hit, pred, mae [NumTiers]float64
	var prompt float64
	var reported, predicted bool
	n := 0
	for i := range recs {
		r := &recs[i]
		if r.Error != "" || r.TierTokens == nil {
			continue
		}
		reported = true
		prompt += float64(r.PromptTokens)
		n++
		for t, k := range r.TierTokens {
			hit[t] += float64(k)
		}
		if p := r.PredictedTierTokens; p != nil {
			predicted = true
			for t, k := range p {
				pred[t] += float64(k)
				mae[t] += math.Abs(float64(k - r.TierTokens[t]))
			}
		}
	}
	if !reported || prompt == 0 {
		return
	}
	for t := range hit {
		hit[t] /= prompt
		pred[t] /= prompt
		mae[t] /= float64(n)
	}
	s.TierHitRate = TiersOf(hit)
	if predicted {
		s.TierPredictedHitRate, s.TierPredictionMAE = TiersOf(pred), TiersOf(mae)
	}
}

// SetShares sets EndpointShareMax/Min from per-engine request counts.
func (s *Summary) SetShares(counts []int64) {
	var total int64
	for _, c := range counts {
		total += c
	}
	if total == 0 || len(counts) == 0 {
		return
	}
	lo, hi := counts[0], counts[0]
	for _, c := range counts {
		lo, hi = min(lo, c), max(hi, c)
	}
	mx, mn := float64(hi)/float64(total), float64(lo)/float64(total)
	s.EndpointShareMax, s.EndpointShareMin = &mx, &mn
}

// NewLatency sorts xs (ms) in place and returns its p50, p90, p99
// (Percentile) and mean; the zero Latency for no samples.
func NewLatency(xs []float64) Latency {
	if len(xs) == 0 {
		return Latency{}
	}
	slices.Sort(xs)
	var sum float64
	for _, x := range xs {
		sum += x
	}
	return Latency{
		P50:  Percentile(xs, 50),
		P90:  Percentile(xs, 90),
		P99:  Percentile(xs, 99),
		Mean: sum / float64(len(xs)),
	}
}

// Percentile returns the p-th percentile (p in [0, 100]) of sorted, an
// ascending slice, by linear interpolation between closest ranks: with
// h = (n−1)·p/100, it is sorted[⌊h⌋] + (h−⌊h⌋)·(sorted[⌊h⌋+1] − sorted[⌊h⌋]).
// This is NumPy's default ("linear") method, the one vLLM's benchmark_serving
// uses via np.percentile. It returns 0 for an empty slice; p outside [0, 100]
// is clamped.
func Percentile(sorted []float64, p float64) float64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	p = min(max(p, 0), 100)
	h := float64(n-1) * p / 100
	lo := int(math.Floor(h))
	if lo >= n-1 {
		return sorted[n-1]
	}
	return sorted[lo] + (h-float64(lo))*(sorted[lo+1]-sorted[lo])
}
