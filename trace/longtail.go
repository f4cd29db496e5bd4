package trace

import "fmt"

// LongTailOptions parameterizes LongTail: many independent prompts (most
// requests start a prefix of their own), a minority continuing an earlier
// one, lengths log-normal around a median of a few thousand tokens with a
// heavy tail of very long prompts. It is the structure issue 19 reports of a
// held-out production trace in the Mooncake format (1,639 distinct first
// blocks among 2,000 requests, median prompt 4.2k tokens, a few prompts of
// 60–130k tokens, pooled-cache reference 13%), built here from those
// published facts alone; the trace itself stays held out.
type LongTailOptions struct {
	// Requests is the number of requests (default 2,000).
	Requests int
	// PromptTokens is the median of a new prompt (log-normal, sigma
	// PromptSigma, at most 32,768; defaults 3,400 and 1.0).
	PromptTokens int
	PromptSigma  float64
	// TailProb is the probability that a new prompt is a long one, uniform
	// in [TailMinTokens, TailMaxTokens] (defaults 0.012, 60,000, 130,000).
	TailProb      float64
	TailMinTokens int
	TailMaxTokens int
	// ContinueProb is the probability that a request continues one of the
	// Window requests before it (uniformly; defaults 0.18 and 256): its
	// prompt is that one's plus the reply and a new part (log-normal median
	// AppendTokens, sigma 1.0, at most 16,384; default 700), unless that
	// would exceed TailMaxTokens (then it starts a new prompt).
	ContinueProb float64
	Window       int
	AppendTokens int
	// OutputTokens is the median of the output (log-normal sigma 0.7, at
	// most 2,000; default 250).
	OutputTokens int
	// Rate is the Poisson arrival rate (requests/s; default 5; 0: all at
	// t=0).
	Rate float64
	// Seed fixes every draw and the id offset (default 1).
	Seed uint64
}

// DefaultLongTailOptions returns the defaults noted on LongTailOptions.
func DefaultLongTailOptions() LongTailOptions {
	return LongTailOptions{Requests: 2000, PromptTokens: 3600, PromptSigma: 1.0, TailProb: 0.012,
		TailMinTokens: 60000, TailMaxTokens: 130000, ContinueProb: 0.18, Window: 256, AppendTokens: 700,
		OutputTokens: 250, Rate: 5, Seed: 1}
}

func (o LongTailOptions) validate() error {
	switch {
	case o.Requests < 1 || o.Requests > maxSynthRequests:
		return fmt.Errorf("requests %d: must be in [1, %d]", o.Requests, maxSynthRequests)
	case !(o.TailProb >= 0 && o.TailProb <= 1):
		return fmt.Errorf("tail probability %v: must be in [0, 1]", o.TailProb)
	case !(o.ContinueProb >= 0 && o.ContinueProb <= 1):
		return fmt.Errorf("continue probability %v: must be in [0, 1]", o.ContinueProb)
	case o.Window < 1:
		return fmt.Errorf("window %d: must be at least 1", o.Window)
	case o.TailMinTokens > o.TailMaxTokens:
		return fmt.Errorf("tail tokens [%d, %d]: min above max", o.TailMinTokens, o.TailMaxTokens)
	}
	for _, c := range []struct {
		name  string
		v, lo int
	}{
		{"prompt tokens", o.PromptTokens, 1}, {"tail min tokens", o.TailMinTokens, 1},
		{"tail max tokens", o.TailMaxTokens, 1}, {"append tokens", o.AppendTokens, 1},
		{"output tokens", o.OutputTokens, 1},
	} {
		if err := checkLen(c.name, c.v, c.lo); err != nil {
			return err
		}
	}
	if err := checkSigma("prompt sigma", o.PromptSigma); err != nil {
		return err
	}
	if o.Requests > maxSynthBlocks/((o.TailMaxTokens+MooncakeBlockTokens-1)/MooncakeBlockTokens) {
		return fmt.Errorf("%d requests of up to %d tokens: more than %d hash ids", o.Requests, o.TailMaxTokens, maxSynthBlocks)
	}
	return checkRate(o.Rate)
}

// LongTail generates o.Requests records, arriving as o.Rate says. Request i
// continues request j (drawn uniformly from the Window before it) with
// probability ContinueProb: its prompt is j's prompt, j's output and a new
// part, so it shares j's whole blocks. Otherwise it is a new prompt of its
// own content — its first block distinct from every other's — of a
// log-normal length or, with probability TailProb, a long one. Ids come
// from LongTailIDBase; the output depends on o alone.
func LongTail(o LongTailOptions) ([]Record, error) {
	if err := o.validate(); err != nil {
		return nil, fmt.Errorf("long-tail workload: %w", err)
	}
	r := newRNG(o.Seed, 0x4c54) // "LT"
	ids := newComposer(LongTailIDBase, o.Seed)
	times := arrivals(r, o.Requests, o.Rate)
	prompts := make([][]segment, o.Requests)
	out := make([]Record, o.Requests)
	for i := range out {
		var segs []segment
		outTok := r.logNormal(float64(o.OutputTokens), 0.7, 1, 2000)
		if i > 0 && r.float64() < o.ContinueProb {
			j := i - 1 - r.intn(min(i, o.Window))
			add := r.logNormal(float64(o.AppendTokens), 1.0, 1, 16384)
			n := out[j].InputLength + out[j].OutputLength + add
			if n <= o.TailMaxTokens {
				segs = append(append(make([]segment, 0, len(prompts[j])+2), prompts[j]...),
					segment{r.next(), out[j].OutputLength}, segment{r.next(), add})
			}
		}
		if segs == nil {
			n := r.logNormal(float64(o.PromptTokens), o.PromptSigma, 1, 32768)
			if r.float64() < o.TailProb {
				n = o.TailMinTokens + r.intn(o.TailMaxTokens-o.TailMinTokens+1)
			}
			segs = []segment{{r.next(), n}}
		}
		hids, err := ids.hashIDs(segs)
		if err != nil {
			return nil, fmt.Errorf("long-tail workload: %w", err)
		}
		in := 0
		for _, s := range segs {
			in += s.tokens
		}
		prompts[i] = segs
		out[i] = Record{Timestamp: times[i], InputLength: in, OutputLength: outTok, HashIDs: hids}
	}
	return out, nil
}
