package sim

import (
	"math"
	"testing"
	"time"
)

// A calibration point is one published vLLM measurement and how the
// simulator's latency model predicts it. Sources are cited per row; how each
// number was read or derived is in sim/CALIBRATION.md.
type calibPoint struct {
	id      string
	source  string // URL or repo:path@commit
	profile string // key in Profiles()
	tp      int    // tensor parallelism of the measured setup, when it differs from the profile's
	what    string // "ttft" or "tpot"
	// measured is the published (or derived, see CALIBRATION.md) latency.
	measured time.Duration
	// predict computes the model's value for this point from a profile.
	predict func(p GPUProfile) time.Duration
	// excluded, when set, says why the point is kept in the table but not held
	// to the bound.
	excluded string
}

// chunkedPrefill is the TTFT of a lone prompt of n tokens prefilled in chunks
// of at most chunk tokens (vLLM chunked prefill, --max-num-batched-tokens).
func chunkedPrefill(p GPUProfile, n, chunk int) time.Duration {
	var d time.Duration
	for done := 0; done < n; done += chunk {
		d += p.PrefillTime(min(chunk, n-done), done)
	}
	return d
}

// batchPrefill is one step prefilling several prompts together.
func batchPrefill(p GPUProfile, lens ...int) time.Duration {
	var c StepCost
	for _, n := range lens {
		c.Add(n, 0)
	}
	return p.StepTime(c)
}

// loadedTPOT is the mean time per output token of batch requests decoding at
// context tokens while rps new prompts of promptLen tokens per second are
// prefilled in steps of their own (vLLM v0.6 with multi-step scheduling does
// not mix prefills into decode steps), which stall the decodes:
// TPOT = DecodeTime / (1 − rps × PrefillTime(promptLen)).
func loadedTPOT(p GPUProfile, batch, context int, rps float64, promptLen int) time.Duration {
	busy := rps * p.PrefillTime(promptLen, 0).Seconds()
	return time.Duration(float64(p.DecodeTime(batch, context)) / (1 - busy))
}

const (
	srcQwenH100 = "gpustack/gpustack:docs/performance-lab/qwen3-32b/h100.md@10e9444a07c73556f2ef0d10d2b2766bbf54c9c0"
	srcSGL060   = "sgl-project/sglang:benchmark/benchmark_vllm_060/README.md@120affb9613cc3f5bcd055ec09c7621d3ced0ebc"
	srcLambda8B = "LambdaLabsML/vllm-benchmark:results/prompt_10/1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json@a4f9f4371a1ccac781293837fce2bce0cc6d25cc"
)

// lambda10Prompts are the prompt lengths of the Lambda run (input_lens).
var lambda10Prompts = []int{13, 25, 27, 10, 329, 29, 399, 328, 4, 205}

var calibPoints = []calibPoint{
	// Llama-3(.1)-8B on 1×H100, vLLM v0.6.0 with --num-scheduler-steps 10
	// (tokens stream in groups of 10; ITL / 10 is the step time).
	{id: "L8-prefill-10x", source: srcLambda8B, profile: "llama-3.1-8b-h100", what: "ttft",
		measured: 62426 * time.Microsecond, // mean_ttft_ms 62.43: 10 prompts, 1369 tokens, one step
		predict:  func(p GPUProfile) time.Duration { return batchPrefill(p, lambda10Prompts...) }},
	{id: "L8-decode-b1", source: srcLambda8B, profile: "llama-3.1-8b-h100", what: "tpot",
		measured: 7058 * time.Microsecond, // ITL groups 43–73 of the 741-token request: 70.58 ms / 10
		predict:  func(p GPUProfile) time.Duration { return p.DecodeTime(1, 614) }},
	{id: "L8-decode-b2", source: srcLambda8B, profile: "llama-3.1-8b-h100", what: "tpot",
		measured: 7167 * time.Microsecond, // ITL groups 24–42: 71.67 ms / 10
		predict:  func(p GPUProfile) time.Duration { return p.DecodeTime(2, 362) }},
	{id: "L8-decode-b6", source: srcLambda8B, profile: "llama-3.1-8b-h100", what: "tpot",
		measured: 7391 * time.Microsecond, // ITL groups 3–9: 73.91 ms / 10
		predict:  func(p GPUProfile) time.Duration { return p.DecodeTime(6, 137) }},

	// Llama-3.1-70B on 4×H100 TP4, vLLM v0.6.0 --num-scheduler-steps 10,
	// ShareGPT (mean 224 prompt / 189 output tokens) at a fixed request rate.
	// Batch = RPS × median E2E latency (Little's law), context = 224 + 189/2.
	{id: "L70-sharegpt-rps4", source: srcSGL060, profile: DefaultProfileName, what: "tpot",
		measured: 23580 * time.Microsecond, // median TPOT, RPS 4, median E2E 2915.6 ms
		predict:  func(p GPUProfile) time.Duration { return loadedTPOT(p, 12, 319, 4, 224) }},
	{id: "L70-sharegpt-rps8", source: srcSGL060, profile: DefaultProfileName, what: "tpot",
		measured: 29150 * time.Microsecond, // median TPOT, RPS 8, median E2E 3752.4 ms
		predict:  func(p GPUProfile) time.Duration { return loadedTPOT(p, 30, 319, 8, 224) }},

	// Qwen3-32B on 1×H100 (vllm serve defaults, TP 1), vLLM v0.11.0, random
	// 32000-token prompts: one request fits in KV at a time, so requests run
	// back to back.
	{id: "Q32-decode-b1-32k", source: srcQwenH100, profile: "qwen3-32b-2xh100", tp: 1, what: "tpot",
		measured: 43420 * time.Microsecond, // mean TPOT (p99 44.34): batch 1 at ~32k context
		predict:  func(p GPUProfile) time.Duration { return p.DecodeTime(1, 32038) }},
	{id: "Q32-prefill-32k", source: srcQwenH100, profile: "qwen3-32b-2xh100", tp: 1, what: "ttft",
		measured: 8281 * time.Millisecond, // 1157.25 s / 100 requests − 75.81 decode steps × 43.42 ms
		predict:  func(p GPUProfile) time.Duration { return chunkedPrefill(p, 32000, 8192) }},
}

// calibTolerance is the largest relative error the model may make on a
// non-excluded calibration point: the issue asked for 15%; the fit reaches
// 3.1% (CALIBRATION.md), so the test holds it to 5%.
const calibTolerance = 0.05

func (pt calibPoint) profileFor(t testing.TB, ps map[string]GPUProfile) GPUProfile {
	p, ok := ps[pt.profile]
	if !ok {
		t.Fatalf("%s: no profile %q", pt.id, pt.profile)
	}
	if pt.tp > 0 {
		p.TensorParallel = pt.tp
	}
	return p
}

func relErr(model, measured time.Duration) float64 {
	return float64(model-measured) / float64(measured)
}

func TestCalibrationPoints(t *testing.T) {
	ps := Profiles()
	var worst float64
	for _, pt := range calibPoints {
		p := pt.profileFor(t, ps)
		got := pt.predict(p)
		e := relErr(got, pt.measured)
		t.Logf("%-20s %-5s measured %10v model %10v error %+6.1f%%", pt.id, pt.what, pt.measured.Round(10*time.Microsecond), got.Round(10*time.Microsecond), 100*e)
		if pt.excluded != "" {
			continue
		}
		worst = max(worst, math.Abs(e))
		if math.Abs(e) > calibTolerance {
			t.Errorf("%s (%s): model %v vs measured %v, error %+.1f%% over ±%.0f%%", pt.id, pt.source, got, pt.measured, 100*e, 100*calibTolerance)
		}
	}
	t.Logf("worst |error| %.1f%%", 100*worst)
}

// calibGroup is a set of points that share efficiency factors, and the factors
// fitted on them. The step overhead is fixed, not fitted: in every group the
// decode points move nearly the same bytes, so overhead and bandwidth
// efficiency are not separately identifiable (CALIBRATION.md).
type calibGroup struct {
	profile  string
	fitMFU   bool // false when no point constrains it (no isolated prefill)
	fitBWEff bool
}

var calibGroups = []calibGroup{
	{profile: "llama-3.1-8b-h100", fitMFU: true, fitBWEff: true},
	{profile: DefaultProfileName, fitMFU: false, fitBWEff: true},
	{profile: "qwen3-32b-2xh100", fitMFU: true, fitBWEff: true},
}

// sse is Σ relative error² of a group's points under profile p.
func sse(t testing.TB, p GPUProfile, pts []calibPoint) float64 {
	var s float64
	for _, pt := range pts {
		q := p
		if pt.tp > 0 {
			q.TensorParallel = pt.tp
		}
		e := relErr(pt.predict(q), pt.measured)
		s += e * e
	}
	return s
}

// fitGroup minimises sse over PrefillMFU and DecodeBandwidthEfficiency on a
// grid of 0.005, then refines to 0.001.
func fitGroup(t testing.TB, p GPUProfile, pts []calibPoint, g calibGroup) (mfu, eff, best float64) {
	mfu, eff, best = p.PrefillMFU, p.DecodeBandwidthEfficiency, math.Inf(1)
	search := func(mlo, mhi, elo, ehi, step float64) {
		ms, es := []float64{p.PrefillMFU}, []float64{p.DecodeBandwidthEfficiency}
		if g.fitMFU {
			ms = nil
			for m := mlo; m <= mhi+1e-9; m += step {
				ms = append(ms, m)
			}
		}
		if g.fitBWEff {
			es = nil
			for e := elo; e <= ehi+1e-9; e += step {
				es = append(es, e)
			}
		}
		for _, m := range ms {
			for _, e := range es {
				q := p
				q.PrefillMFU, q.DecodeBandwidthEfficiency = m, e
				if s := sse(t, q, pts); s < best {
					best, mfu, eff = s, m, e
				}
			}
		}
	}
	search(0.1, 0.8, 0.3, 0.98, 0.005)
	search(max(0.1, mfu-0.005), min(1, mfu+0.005), max(0.3, eff-0.005), min(1, eff+0.005), 0.001)
	return mfu, eff, best
}

// TestCalibrationFit re-runs the least-squares fit and checks that the
// constants in sim/profiles are its result (to the 0.01 they are written with).
// Run with -v to print the fitted values.
func TestCalibrationFit(t *testing.T) {
	ps := Profiles()
	for _, g := range calibGroups {
		p := ps[g.profile]
		var pts []calibPoint
		for _, pt := range calibPoints {
			if pt.profile == g.profile && pt.excluded == "" {
				pts = append(pts, pt)
			}
		}
		mfu, eff, best := fitGroup(t, p, pts, g)
		t.Logf("%s: %d points, fitted prefill_mfu %.3f decode_bandwidth_efficiency %.3f (overhead %v fixed), rms error %.1f%%; profile has %.3f %.3f, rms %.1f%%",
			g.profile, len(pts), mfu, eff, p.StepOverhead, 100*math.Sqrt(best/float64(len(pts))),
			p.PrefillMFU, p.DecodeBandwidthEfficiency, 100*math.Sqrt(sse(t, p, pts)/float64(len(pts))))
		if g.fitMFU && math.Abs(mfu-p.PrefillMFU) > 0.01 {
			t.Errorf("%s: prefill_mfu %.3f, the fit gives %.3f", g.profile, p.PrefillMFU, mfu)
		}
		if g.fitBWEff && math.Abs(eff-p.DecodeBandwidthEfficiency) > 0.01 {
			t.Errorf("%s: decode_bandwidth_efficiency %.3f, the fit gives %.3f", g.profile, p.DecodeBandwidthEfficiency, eff)
		}
	}
}
