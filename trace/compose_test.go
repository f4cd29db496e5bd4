package trace

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

// The composer shares exactly the whole blocks two prompts agree on.
func TestComposerSharesWholeEqualBlocks(t *testing.T) {
	c := newComposer(RAGIDBase, 7)
	a, b, x := uint64(1), uint64(2), uint64(3)
	ids := func(segs ...segment) []int64 {
		h, err := c.hashIDs(segs)
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	base := ids(segment{a, 1000}, segment{b, 300})       // 1,300 tokens: 3 blocks
	same := ids(segment{a, 1000}, segment{b, 300})       // identical prompt
	longer := ids(segment{a, 1000}, segment{b, 600})     // extends it
	split := ids(segment{a, 512}, segment{a + 100, 488}) // other content after 512
	other := ids(segment{x, 1000}, segment{b, 300})
	if !reflect.DeepEqual(base, same) || len(base) != 3 {
		t.Fatalf("equal prompts: %v %v", base, same)
	}
	if n := commonBlocks(base, longer); n != 2 { // the partial third block differs
		t.Fatalf("extension shares %d blocks, want 2", n)
	}
	if n := commonBlocks(base, split); n != 1 {
		t.Fatalf("prompts equal on 512 tokens share %d blocks, want 1", n)
	}
	if commonBlocks(base, other) != 0 {
		t.Fatal("different first segments share a block")
	}
	for _, id := range append(base, other...) {
		if id < RAGIDBase || id >= RAGIDBase+1<<40 {
			t.Fatalf("id %d outside RAG's range", id)
		}
	}
}

func TestAgenticSessions(t *testing.T) {
	o := DefaultAgenticOptions()
	o.Sessions, o.MaxContextTokens = 60, 40000
	ss, err := Agentic(o)
	if err != nil {
		t.Fatal(err)
	}
	again, _ := Agentic(o)
	if !reflect.DeepEqual(ss, again) {
		t.Fatal("same options, different sessions")
	}
	turns := 0
	for i, s := range ss {
		if s.ThinkTime != o.ToolTime || len(s.Turns) == 0 {
			t.Fatalf("session %d: %+v", i, s)
		}
		for k, r := range s.Turns {
			turns++
			if r.InputLength > o.MaxContextTokens || len(r.HashIDs) != (r.InputLength+511)/512 {
				t.Fatalf("session %d turn %d: %d tokens, %d ids", i, k, r.InputLength, len(r.HashIDs))
			}
			if k > 0 {
				prev := s.Turns[k-1]
				if r.InputLength <= prev.InputLength+prev.OutputLength {
					t.Fatalf("session %d turn %d does not append a tool output", i, k)
				}
				if n := commonBlocks(prev.HashIDs, r.HashIDs); n != prev.InputLength/512 {
					t.Fatalf("session %d turn %d shares %d blocks with the last, want %d", i, k, n, prev.InputLength/512)
				}
			}
		}
		// Sessions of one agent share its system prompt's whole blocks.
		if j := i + o.Agents; j < len(ss) {
			if n := commonBlocks(s.Turns[0].HashIDs, ss[j].Turns[0].HashIDs); n != o.SystemPromptTokens/512 {
				t.Fatalf("sessions %d and %d share %d blocks, want the system prompt's %d", i, j, n, o.SystemPromptTokens/512)
			}
		}
	}
	if turns < 2*len(ss) {
		t.Fatalf("%d turns in %d sessions: want a mean above 2", turns, len(ss))
	}
	recs := Flatten(ss, LinearLatency(time.Second, 0))
	if c := InfiniteCacheHitRate(recs); c < 0.4 || c > 0.95 {
		t.Fatalf("ceiling %.3f", c)
	}
}

func TestRAG(t *testing.T) {
	o := DefaultRAGOptions()
	o.Requests, o.Documents = 300, 6
	recs, err := RAG(o)
	if err != nil {
		t.Fatal(err)
	}
	docBlocks := (o.SystemPromptTokens + o.DocumentTokens) / 512
	byDoc := map[int64][]int{}
	for i, r := range recs {
		if i > 0 && r.Timestamp < recs[i-1].Timestamp {
			t.Fatal("arrivals out of order")
		}
		byDoc[r.HashIDs[docBlocks-1]] = append(byDoc[r.HashIDs[docBlocks-1]], i)
	}
	if len(byDoc) != o.Documents {
		t.Fatalf("%d distinct document prefixes, want %d", len(byDoc), o.Documents)
	}
	sizes := []int{}
	for _, idx := range byDoc {
		sizes = append(sizes, len(idx))
		a, b := recs[idx[0]], recs[idx[len(idx)-1]]
		if len(idx) > 1 && commonBlocks(a.HashIDs, b.HashIDs) != docBlocks {
			t.Fatalf("two questions on one document share %d blocks, want %d", commonBlocks(a.HashIDs, b.HashIDs), docBlocks)
		}
	}
	// Zipf 0.8 over 6: the most popular document draws about 3× the least.
	lo, hi := sizes[0], sizes[0]
	for _, n := range sizes {
		lo, hi = min(lo, n), max(hi, n)
	}
	if hi < 2*lo {
		t.Fatalf("document popularity %v: not skewed", sizes)
	}
	two := o
	two.DocsPerRequest = 2
	recs2, err := RAG(two)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range recs2 {
		if q := r.InputLength - o.SystemPromptTokens - 2*o.DocumentTokens; q < 1 || q > 4096 {
			t.Fatalf("two documents, record %d: question of %d tokens", i, q)
		}
	}
}

func TestLongTail(t *testing.T) {
	o := DefaultLongTailOptions()
	recs, err := LongTail(o)
	if err != nil {
		t.Fatal(err)
	}
	first := map[int64]int{}
	tail, cont := 0, 0
	for i, r := range recs {
		first[r.HashIDs[0]]++
		if r.InputLength > o.TailMaxTokens || len(r.HashIDs) != (r.InputLength+511)/512 {
			t.Fatalf("record %d: %d tokens, %d ids", i, r.InputLength, len(r.HashIDs))
		}
		if r.InputLength >= o.TailMinTokens {
			tail++
		}
		// A continuation shares all whole blocks of some earlier prompt.
		for j := max(0, i-o.Window); j < i; j++ {
			p := recs[j]
			if p.InputLength >= 512 && commonBlocks(p.HashIDs, r.HashIDs) == p.InputLength/512 && r.InputLength > p.InputLength {
				cont++
				break
			}
		}
	}
	// 2,000 requests, 18% continuing: most first blocks distinct.
	if d := len(first); d < 1500 || d > 1800 {
		t.Fatalf("%d distinct first blocks of %d", d, len(recs))
	}
	if tail < 10 || tail > 60 {
		t.Fatalf("%d prompts of %d+ tokens", tail, o.TailMinTokens)
	}
	if cont < 250 {
		t.Fatalf("%d continuations", cont)
	}
	other := o
	other.Seed = 2
	recs2, _ := LongTail(other)
	if recs2[0].HashIDs[0] == recs[0].HashIDs[0] {
		t.Fatal("seeds 1 and 2 share an id")
	}
}

func TestWorkloadOptionsRefused(t *testing.T) {
	a := DefaultAgenticOptions()
	a.MeanTurns = 0
	r := DefaultRAGOptions()
	r.DocsPerRequest = r.Documents + 1
	l := DefaultLongTailOptions()
	l.TailMinTokens = l.TailMaxTokens + 1
	l2 := DefaultLongTailOptions()
	l2.PromptSigma = -1
	_, e1 := Agentic(a)
	_, e2 := RAG(r)
	_, e3 := LongTail(l)
	_, e4 := LongTail(l2)
	for i, tc := range []struct {
		err  error
		want string
	}{{e1, "mean turns"}, {e2, "documents per request"}, {e3, "min above max"}, {e4, "prompt sigma"}} {
		if tc.err == nil || !strings.Contains(tc.err.Error(), tc.want) {
			t.Errorf("case %d: %v, want %q", i, tc.err, tc.want)
		}
	}
}
