package trace

import (
	"fmt"
	"math"
)

// Hash-id ranges of the workloads composed from segments (see
// AgenticIDBase): each its own 2^40-wide range, like AzureIDBase.
const (
	// AgenticIDBase is the first hash id of Agentic.
	AgenticIDBase int64 = 3 << 40
	// RAGIDBase is the first hash id of RAG.
	RAGIDBase int64 = 4 << 40
	// LongTailIDBase is the first hash id of LongTail.
	LongTailIDBase int64 = 5 << 40
)

// segment is a run of prompt tokens with its own content: two segments with
// the same key are the same tokens. A prompt is a list of segments.
type segment struct {
	key    uint64
	tokens int
}

// composer turns prompts made of segments into chained hash ids of
// MooncakeBlockTokens-token blocks: block b's id is interned from (the id
// of block b−1, the content of tokens [512b, 512(b+1)) — the pieces of the
// segments it covers, each as (segment key, offset, length)), so two
// prompts share block b's id exactly when they agree on every token up to
// the end of block b, the Mooncake traces' rule, whatever the segments'
// lengths (a block that a segment boundary crosses is shared only by
// prompts with the same segments on both sides). A last block shorter than
// 512 tokens has its own content. Ids are numbered consecutively from a
// seed-derived base (idBase).
type composer struct {
	next int64
	ids  map[[2]uint64]int64
	left int // hash ids still allowed (maxSynthBlocks)
}

func newComposer(base int64, seed uint64) *composer {
	return &composer{next: idBase(base, seed), ids: make(map[[2]uint64]int64), left: maxSynthBlocks}
}

// hashIDs returns the ids of the prompt made of segs (total tokens:
// their sum), or an error past the workload's id budget.
func (c *composer) hashIDs(segs []segment) ([]int64, error) {
	total := 0
	for _, s := range segs {
		total += s.tokens
	}
	n := (total + MooncakeBlockTokens - 1) / MooncakeBlockTokens
	if n > c.left {
		return nil, fmt.Errorf("more than %d hash ids", maxSynthBlocks)
	}
	c.left -= n
	out := make([]int64, 0, n)
	parent := uint64(0)
	si, off := 0, 0 // current segment and offset into it
	for b := range n {
		want := min(MooncakeBlockTokens, total-b*MooncakeBlockTokens)
		h := uint64(0x243f6a8885a308d3) ^ uint64(want)
		for want > 0 {
			for segs[si].tokens-off == 0 {
				si, off = si+1, 0
			}
			take := min(want, segs[si].tokens-off)
			h = splitmix(h ^ segs[si].key)
			h = splitmix(h ^ uint64(off)<<32 ^ uint64(take))
			off += take
			want -= take
		}
		k := [2]uint64{parent, h}
		id, ok := c.ids[k]
		if !ok {
			id = c.next
			c.next++
			c.ids[k] = id
		}
		out = append(out, id)
		parent = uint64(id)
	}
	return out, nil
}

// normal returns a standard normal draw (Box–Muller).
func (r *rng) normal() float64 {
	u := 1 - r.float64() // (0, 1]
	v := r.float64()
	return math.Sqrt(-2*math.Log(u)) * math.Cos(2*math.Pi*v)
}

// logNormal returns a length drawn from a log-normal distribution of the
// given median and sigma (of the log), rounded, within [lo, hi].
func (r *rng) logNormal(median, sigma float64, lo, hi int) int {
	x := math.Round(median * math.Exp(sigma*r.normal()))
	return int(min(max(x, float64(lo)), float64(hi)))
}

// zipf returns an index in [0, n) with probability ∝ 1/(i+1)^s (s ≥ 0; 0
// is uniform), by inverting the cumulative weights cum (of length n,
// built by zipfWeights).
func (r *rng) zipf(cum []float64) int {
	x := r.float64() * cum[len(cum)-1]
	lo, hi := 0, len(cum)-1
	for lo < hi {
		m := (lo + hi) / 2
		if cum[m] > x {
			hi = m
		} else {
			lo = m + 1
		}
	}
	return lo
}

// zipfWeights returns the cumulative weights 1/(i+1)^s of n items.
func zipfWeights(n int, s float64) []float64 {
	cum := make([]float64, n)
	t := 0.0
	for i := range cum {
		t += math.Pow(float64(i+1), -s)
		cum[i] = t
	}
	return cum
}

// checkLen reports a length option outside [lo, maxSynthTokens].
func checkLen(name string, v, lo int) error {
	if v < lo || v > maxSynthTokens {
		return fmt.Errorf("%s %d: must be in [%d, %d]", name, v, lo, maxSynthTokens)
	}
	return nil
}

// checkSigma reports a log-normal sigma outside [0, 4].
func checkSigma(name string, v float64) error {
	if !(v >= 0 && v <= 4) {
		return fmt.Errorf("%s %v: must be in [0, 4]", name, v)
	}
	return nil
}
