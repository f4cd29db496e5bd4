// Package measure holds what a benchmark measures and how it is summarised,
// as pure types and functions with no network, no gateway and no engines:
// the per-request Record, its Summary (percentiles, hit rate, throughput,
// lag, goodput), warm-up selection (Warmup, Measured), the reference hit
// rates of a pooled and an infinite prefix cache (References) and the
// Provenance of a report, with the redaction of secrets it needs. Package
// bench produces Records (Replay against a target, Compare on simulated
// fleets, virtual.Replay in virtual time), package plan judges them against
// an SLO, and package report lays them out as tables and HTML.
//
// # Time domain
//
// Latencies are milliseconds and durations seconds of engine time: the wall
// time a client measured multiplied by the target's time scale (its simulated
// seconds per wall second; 1 for real engines), or the simulated time of a
// virtual run. See bench/README.md, "Time domain".
package measure

import (
	"encoding/json"
	"io"
)

// Record is the measurement of one replayed request. Times are milliseconds
// of engine time (wall time × TimeScale; see the package comment).
type Record struct {
	// Policy is the routing policy of the run (bench.Compare and virtual
	// runs; "" otherwise).
	Policy string `json:"policy,omitempty"`
	// Index is the request's position in the replayed records.
	Index int `json:"index"`
	// ArrivalMs is when the request was sent, from the start of the replay
	// (ms, engine time). The schedule is Timestamp − first Timestamp, so a
	// value above it shows the client falling behind.
	ArrivalMs float64 `json:"arrival_ms"`
	// TTFTMs is the time from sending the request to receiving the first
	// chunk that carries output (ms, engine time); 0 if none arrived.
	TTFTMs float64 `json:"ttft_ms"`
	// ITLMs holds the inter-token latencies (ms, engine time), measured per
	// read of the response body: the gap between a read that brought output
	// and the previous such read is split evenly over the output-carrying
	// chunks the read brought, one entry each (so they sum to the time from
	// the first read with output to the last). The chunks of the first such
	// read have no entry. See README "Inter-token latency".
	ITLMs []float64 `json:"itl_ms"`
	// SendLagMs is how late the request was sent against its schedule (ms,
	// engine time, >= 0): its trace time for an open-loop replay, its
	// session's start or the previous turn's end plus the think time for a
	// session replay. Absent (nil) for a closed loop, which has no schedule.
	SendLagMs *float64 `json:"send_lag_ms,omitempty"`
	// E2EMs is the time from sending the request to the end of the response
	// (ms, engine time), or to the failure for an errored request.
	E2EMs float64 `json:"e2e_ms"`
	// PromptTokens is usage.prompt_tokens as the engine reported it, or the
	// number of tokens sent when usage was missing (tokens).
	PromptTokens int `json:"prompt_tokens"`
	// CachedTokens is usage.prompt_tokens_details.cached_tokens, the prompt
	// tokens served from the engine's prefix cache (tokens; 0 if unreported).
	CachedTokens int `json:"cached_tokens"`
	// TierTokens splits CachedTokens by the tier each block came from:
	// GPU, host memory, disk, remote (a simulated engine with KV tiers
	// reports it; nil otherwise).
	TierTokens *[NumTiers]int `json:"tier_cached_tokens,omitempty"`
	// PredictedTierTokens is what the precise index predicted the engine
	// would take from each tier at routing time (tokens; nil when not
	// tracked).
	PredictedTierTokens *[NumTiers]int `json:"predicted_tier_tokens,omitempty"`
	// OutputTokens is usage.completion_tokens, or the number of
	// output-carrying chunks when usage was missing (tokens).
	OutputTokens int `json:"output_tokens"`
	// NoUsage is true when the stream carried no usage chunk.
	NoUsage bool `json:"no_usage,omitempty"`
	// Status is the HTTP status code (0 when no response arrived).
	Status int `json:"status"`
	// Error describes the failure; "" for a successful request.
	Error string `json:"error,omitempty"`
	// Warmup is true for a warm-up request (see Warmup): sent, but left out
	// of the Summary, the HTML report and goodput.
	Warmup bool `json:"warmup,omitempty"`
	// Target is the base URL the request was sent to when a replay deals
	// requests over several targets (bench.ReplayOptions.Targets); "" with
	// one target.
	Target string `json:"target,omitempty"`
	// Endpoint is the endpoint that answered, as the gateway names it in
	// its X-Infergate-Endpoint response header (the engine's normalized
	// base URL; the last one tried after retries); "" when the target does
	// not send the header (a gateway without response_headers.endpoint, an
	// engine, a request without an answer). bench.Compare's gateway sends
	// it.
	Endpoint string `json:"endpoint,omitempty"`
	// PD is the request's P/D hand-off in a fleet with prefill and decode
	// engines (nil outside one).
	PD *PDLeg `json:"pd,omitempty"`
}

// PDLeg is how a P/D fleet served one request.
type PDLeg struct {
	// Split is true when a prefill engine computed the prompt and a decode
	// engine read its KV; false when the decode engine served it whole.
	Split bool `json:"split"`
	// Reason says why it was not split (sched.PDDecision.Reason).
	Reason string `json:"reason,omitempty"`
	// PrefillMs is arrival to the prefill leg's answer (ms; split only).
	PrefillMs float64 `json:"prefill_ms,omitempty"`
	// TransferMs is the prefill leg's answer to the end of the decode
	// engine's read of the KV (ms; split only): the P→D transfer with its
	// queueing on D (admission and its interconnect link).
	TransferMs float64 `json:"transfer_ms,omitempty"`
}

// WriteRecords writes recs as JSON lines (the --records format).
func WriteRecords(w io.Writer, recs []Record) error {
	enc := json.NewEncoder(w)
	for i := range recs {
		if err := enc.Encode(&recs[i]); err != nil {
			return err
		}
	}
	return nil
}
