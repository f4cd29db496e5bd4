package trace

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// Hash-id ranges of the synthetic workloads. Mooncake's ids are small
// (below 2^20 in the public traces); each generator here draws its ids from its
// own 2^40-wide range so that records of different workloads never share an
// id by accident. Within a range a generator places its ids at a seed-derived
// offset below 2^39 and numbers them consecutively from there, so a workload
// never repeats an id it did not mean to share, and two seeds give disjoint
// ids (hence different prompts) unless their offsets fall within the
// workload's id count of each other (probability about count/2^39).
const (
	// AzureIDBase is the first hash id of PrefixModel (the Azure trace).
	AzureIDBase int64 = 1 << 40
	// SharedPrefixIDBase is the first hash id of SharedPrefix.
	SharedPrefixIDBase int64 = 2 << 40
	// TextIDBase is the first id ContentHashIDs produces; its ids fill
	// [2^62, 2^63).
	TextIDBase int64 = 1 << 62
)

// idSpan is the number of ids a generator may allocate from its offset.
const idSpan = 1 << 39

// Limits that keep generated workloads within memory and the id spans.
const (
	maxSynthRequests = 1 << 24 // requests of one generated workload
	maxSynthTokens   = 1 << 24 // tokens of one generated prompt
	maxSynthBlocks   = 1 << 28 // hash ids of one workload (2 GiB)
)

// idBase returns the first id a generator with the given range and seed
// allocates: base + (a seed-derived offset below 2^39).
func idBase(base int64, seed uint64) int64 {
	return base + int64(splitmix(seed^0x5851f42d4c957f2d)%idSpan)
}

// rng is a SplitMix64 generator. The workloads use it rather than math/rand
// so that their output depends on the seed alone, not on the Go release.
type rng struct{ state uint64 }

func newRNG(seed, stream uint64) *rng {
	return &rng{state: splitmix(seed) ^ splitmix(stream+0x632be59bd9b4e019)}
}

func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

func (r *rng) next() uint64 {
	r.state += 0x9e3779b97f4a7c15
	z := r.state
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// float64 returns a uniform number in [0, 1).
func (r *rng) float64() float64 { return float64(r.next()>>11) / (1 << 53) }

// intn returns a number in [0, n), n > 0 (modulo bias below n/2^64).
func (r *rng) intn(n int) int { return int(r.next() % uint64(n)) }

// shuffle permutes s in place (Fisher–Yates).
func shuffle[T any](r *rng, s []T) {
	for i := len(s) - 1; i > 0; i-- {
		j := r.intn(i + 1)
		s[i], s[j] = s[j], s[i]
	}
}

// arrivals returns n arrival times: all 0 when rate is 0, else a Poisson
// process of rate per second starting at 0 (the first arrival is at 0, each
// later gap exponential with mean 1/rate s, as in SGLang's and vLLM's
// bench_serving).
func arrivals(r *rng, n int, rate float64) []time.Duration {
	out := make([]time.Duration, n)
	if rate == 0 {
		return out
	}
	t := 0.0
	for i := 1; i < n; i++ {
		t += -math.Log(1-r.float64()) / rate
		out[i] = time.Duration(math.Round(t * float64(time.Second)))
	}
	return out
}

func checkRate(rate float64) error {
	if !(rate >= 0) || math.IsInf(rate, 0) {
		return fmt.Errorf("rate %v: must be >= 0 and finite (0 sends everything at t=0)", rate)
	}
	return nil
}

// SharedPrefixOptions parameterizes SharedPrefix, a hash-id version of
// SGLang's bench_serving "generated-shared-prefix" dataset (flags gsp_*):
// Groups system prompts, each followed by PromptsPerGroup distinct
// questions.
type SharedPrefixOptions struct {
	// Groups is the number of distinct system prompts (SGLang
	// --gsp-num-groups, default 64).
	Groups int
	// PromptsPerGroup is the number of requests per system prompt (SGLang
	// --gsp-prompts-per-group, default 16).
	PromptsPerGroup int
	// SystemPromptTokens is the length of each group's system prompt
	// (tokens; --gsp-system-prompt-len, default 2048).
	SystemPromptTokens int
	// QuestionTokens is the length of each request's own question (tokens;
	// --gsp-question-len, default 128).
	QuestionTokens int
	// OutputTokens is every request's output length (tokens;
	// --gsp-output-len, default 256).
	OutputTokens int
	// Rate is the Poisson arrival rate (requests/s); 0, the default, sends
	// every request at t=0 (SGLang's default --request-rate inf).
	Rate float64
	// Seed fixes the request order, the arrivals and the hash-id offset
	// (default 1).
	Seed uint64
}

// DefaultSharedPrefixOptions returns SGLang's defaults: 64 groups × 16
// prompts, 2048-token system prompts, 128-token questions, 256 output tokens,
// all requests at t=0, seed 1.
func DefaultSharedPrefixOptions() SharedPrefixOptions {
	return SharedPrefixOptions{
		Groups:             64,
		PromptsPerGroup:    16,
		SystemPromptTokens: 2048,
		QuestionTokens:     128,
		OutputTokens:       256,
		Seed:               1,
	}
}

func (o SharedPrefixOptions) validate() error {
	switch {
	case o.Groups < 1:
		return fmt.Errorf("groups %d: must be at least 1", o.Groups)
	case o.PromptsPerGroup < 1:
		return fmt.Errorf("prompts per group %d: must be at least 1", o.PromptsPerGroup)
	case o.Groups > maxSynthRequests/o.PromptsPerGroup:
		return fmt.Errorf("%d groups × %d prompts: more than %d requests", o.Groups, o.PromptsPerGroup, maxSynthRequests)
	case o.SystemPromptTokens < 0:
		return fmt.Errorf("system prompt tokens %d: must not be negative", o.SystemPromptTokens)
	case o.QuestionTokens < 0:
		return fmt.Errorf("question tokens %d: must not be negative", o.QuestionTokens)
	case o.SystemPromptTokens+o.QuestionTokens < 1:
		return errors.New("system prompt and question tokens are both 0: a prompt needs at least 1 token")
	case o.SystemPromptTokens > maxSynthTokens || o.QuestionTokens > maxSynthTokens:
		return fmt.Errorf("system prompt %d + question %d tokens: each must be at most %d", o.SystemPromptTokens, o.QuestionTokens, maxSynthTokens)
	case o.OutputTokens < 0:
		return fmt.Errorf("output tokens %d: must not be negative", o.OutputTokens)
	}
	blocks := (o.SystemPromptTokens + o.QuestionTokens + MooncakeBlockTokens - 1) / MooncakeBlockTokens
	if o.Groups*o.PromptsPerGroup > maxSynthBlocks/blocks {
		return fmt.Errorf("%d requests × %d blocks: more than %d hash ids", o.Groups*o.PromptsPerGroup, blocks, maxSynthBlocks)
	}
	return checkRate(o.Rate)
}

// SharedPrefix generates the shared-prefix workload described by o:
// Groups×PromptsPerGroup records of SystemPromptTokens+QuestionTokens input
// and OutputTokens output tokens, in an order shuffled by the seed (SGLang
// shuffles too), arriving as o.Rate says.
//
// Blocks are MooncakeBlockTokens (512) tokens with chained hash ids, so
// Record.Tokens and every replay path work unchanged. Block b of a request
// carries its group's id when the block lies wholly inside the system prompt
// ((b+1)·512 ≤ SystemPromptTokens); every other block, including one that
// straddles the end of the system prompt and the start of the question, gets
// an id of its own. So requests of one group share exactly
// ⌊SystemPromptTokens/512⌋ leading blocks (their token prompts agree on those
// ⌊SystemPromptTokens/512⌋·512 tokens) and requests of different groups share
// none. When SystemPromptTokens is not a multiple of 512, its last
// SystemPromptTokens mod 512 tokens are therefore per request: hash ids
// cannot describe a prefix that ends inside a block, so the workload shares
// slightly less than SGLang's (which shares them at the engine's block
// granularity). The defaults (2048) are a multiple of 512.
//
// Ids come from SharedPrefixIDBase (see there); the output depends on o
// alone.
func SharedPrefix(o SharedPrefixOptions) ([]Record, error) {
	if err := o.validate(); err != nil {
		return nil, fmt.Errorf("shared-prefix workload: %w", err)
	}
	const B = MooncakeBlockTokens
	in := o.SystemPromptTokens + o.QuestionTokens
	nBlocks := (in + B - 1) / B
	shared := min(o.SystemPromptTokens/B, nBlocks)
	n := o.Groups * o.PromptsPerGroup

	next := idBase(SharedPrefixIDBase, o.Seed)
	groupIDs := make([]int64, o.Groups*shared)
	for i := range groupIDs {
		groupIDs[i] = next
		next++
	}
	ids := make([]int64, n*nBlocks) // one backing array for all records
	recs := make([]Record, n)
	for g := range o.Groups {
		for p := range o.PromptsPerGroup {
			i := g*o.PromptsPerGroup + p
			h := ids[i*nBlocks : (i+1)*nBlocks : (i+1)*nBlocks]
			copy(h, groupIDs[g*shared:(g+1)*shared])
			for b := shared; b < nBlocks; b++ {
				h[b] = next
				next++
			}
			recs[i] = Record{InputLength: in, OutputLength: o.OutputTokens, HashIDs: h}
		}
	}
	r := newRNG(o.Seed, 0x5347) // "SG"
	shuffle(r, recs)
	for i, t := range arrivals(r, n, o.Rate) {
		recs[i].Timestamp = t
	}
	return recs, nil
}
