package trace

import (
	"fmt"
	"slices"
)

// RAGOptions parameterizes RAG: retrieval-augmented requests over a few
// large shared documents, each request a short distinct question about the
// documents a retriever put in front of it (the "document QA" shape of
// RAGCache, Jin et al., arXiv:2404.12457, and of vLLM's prefix-caching
// benchmark, where a long shared prefix precedes a short distinct suffix).
type RAGOptions struct {
	// Requests is the number of requests (default 2,000).
	Requests int
	// Documents is the corpus size (default 64), each DocumentTokens long
	// (default 12,288): 786k tokens, more than one simulated 70B engine's
	// KV cache (460k) and less than eight's.
	Documents      int
	DocumentTokens int
	// DocsPerRequest documents precede each question (default 1), drawn
	// without repeats with probability ∝ 1/(rank)^ZipfS (default 0.8:
	// popular documents are asked about more), in the drawn order (so a
	// prefix is shared past the first document only by requests that drew
	// the same documents in the same order).
	DocsPerRequest int
	ZipfS          float64
	// SystemPromptTokens is the instructions every request starts with
	// (default 512).
	SystemPromptTokens int
	// QuestionTokens is the median of the question (log-normal sigma 0.5,
	// at most 4,096; default 96).
	QuestionTokens int
	// OutputTokens is the median of the answer (log-normal sigma 0.5, at
	// most 2,000; default 256).
	OutputTokens int
	// Rate is the Poisson arrival rate (requests/s; default 10; 0: all at
	// t=0).
	Rate float64
	// Seed fixes every draw and the id offset (default 1).
	Seed uint64
}

// DefaultRAGOptions returns the defaults noted on RAGOptions.
func DefaultRAGOptions() RAGOptions {
	return RAGOptions{Requests: 2000, Documents: 64, DocumentTokens: 12288, DocsPerRequest: 1, ZipfS: 0.8,
		SystemPromptTokens: 512, QuestionTokens: 96, OutputTokens: 256, Rate: 10, Seed: 1}
}

func (o RAGOptions) validate() error {
	switch {
	case o.Requests < 1 || o.Requests > maxSynthRequests:
		return fmt.Errorf("requests %d: must be in [1, %d]", o.Requests, maxSynthRequests)
	case o.Documents < 1 || o.Documents > 1<<20:
		return fmt.Errorf("documents %d: must be in [1, %d]", o.Documents, 1<<20)
	case o.DocsPerRequest < 0 || o.DocsPerRequest > min(o.Documents, 64):
		return fmt.Errorf("documents per request %d: must be in [0, min(documents %d, 64)]", o.DocsPerRequest, o.Documents)
	case !(o.ZipfS >= 0 && o.ZipfS <= 8):
		return fmt.Errorf("zipf exponent %v: must be in [0, 8]", o.ZipfS)
	case o.SystemPromptTokens+o.DocsPerRequest*o.DocumentTokens > maxSynthTokens:
		return fmt.Errorf("system prompt and %d documents of %d tokens: more than %d tokens", o.DocsPerRequest, o.DocumentTokens, maxSynthTokens)
	}
	for _, c := range []struct {
		name  string
		v, lo int
	}{
		{"document tokens", o.DocumentTokens, 1}, {"system prompt tokens", o.SystemPromptTokens, 0},
		{"question tokens", o.QuestionTokens, 1}, {"output tokens", o.OutputTokens, 1},
	} {
		if err := checkLen(c.name, c.v, c.lo); err != nil {
			return err
		}
	}
	return checkRate(o.Rate)
}

// RAG generates o.Requests records, arriving as o.Rate says, each prompt
//
//	system ++ doc_{d1} ++ … ++ doc_{dk} ++ question
//
// with k = DocsPerRequest documents drawn by popularity and a question of
// its own. Blocks are shared exactly as far as the prompts agree (see
// composer): the system prompt's whole blocks by all, a document's by the
// requests that drew the same documents before it. Ids come from
// RAGIDBase; the output depends on o alone.
func RAG(o RAGOptions) ([]Record, error) {
	if err := o.validate(); err != nil {
		return nil, fmt.Errorf("rag workload: %w", err)
	}
	r := newRNG(o.Seed, 0x5241) // "RA"
	ids := newComposer(RAGIDBase, o.Seed)
	system := r.next()
	docs := make([]uint64, o.Documents)
	for i := range docs {
		docs[i] = r.next()
	}
	cum := zipfWeights(o.Documents, o.ZipfS)
	times := arrivals(r, o.Requests, o.Rate)
	out := make([]Record, o.Requests)
	segs := make([]segment, 0, o.DocsPerRequest+2)
	picked := make([]int, 0, o.DocsPerRequest)
	for i := range out {
		segs = append(segs[:0], segment{system, o.SystemPromptTokens})
		picked = picked[:0]
		for tries := 0; len(picked) < o.DocsPerRequest; tries++ {
			d := r.zipf(cum)
			if tries >= 64 { // bounded work: the most popular not yet drawn
				for d = 0; slices.Contains(picked, d); d++ {
				}
			}
			if !slices.Contains(picked, d) {
				picked = append(picked, d)
				segs = append(segs, segment{docs[d], o.DocumentTokens})
			}
		}
		q := r.logNormal(float64(o.QuestionTokens), 0.5, 1, 4096)
		segs = append(segs, segment{r.next(), q})
		hids, err := ids.hashIDs(segs)
		if err != nil {
			return nil, fmt.Errorf("rag workload: %w", err)
		}
		in := o.SystemPromptTokens + o.DocsPerRequest*o.DocumentTokens + q
		out[i] = Record{Timestamp: times[i], InputLength: in, OutputLength: r.logNormal(float64(o.OutputTokens), 0.5, 1, 2000), HashIDs: hids}
	}
	return out, nil
}
