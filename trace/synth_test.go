package trace

import (
	"cmp"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// commonBlocks returns how many leading hash ids a and b share.
func commonBlocks(a, b []int64) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// commonTokens returns how many leading tokens a and b share.
func commonTokens(a, b []uint32) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

func TestSharedPrefix(t *testing.T) {
	small := func(s, q int) SharedPrefixOptions {
		return SharedPrefixOptions{Groups: 4, PromptsPerGroup: 5, SystemPromptTokens: s, QuestionTokens: q, OutputTokens: 7, Seed: 3}
	}
	for _, tc := range []struct {
		name       string
		o          SharedPrefixOptions
		blocks     int // blocks per request
		shared     int // leading blocks shared within a group
		sharedToks int // leading tokens equal within a group
	}{
		{"sglang defaults", DefaultSharedPrefixOptions(), 5, 4, 2048},
		{"aligned", small(1024, 100), 3, 2, 1024},
		{"straddling block is per request", small(1000, 100), 3, 1, 512},
		{"system prompt shorter than a block", small(300, 300), 2, 0, 0},
		{"no question", small(1024, 0), 2, 2, 1024},
		{"no question, partial last block", small(1100, 0), 3, 2, 1024},
		{"no system prompt", small(0, 600), 2, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := tc.o
			recs, err := SharedPrefix(o)
			if err != nil {
				t.Fatal(err)
			}
			if len(recs) != o.Groups*o.PromptsPerGroup {
				t.Fatalf("%d records, want %d", len(recs), o.Groups*o.PromptsPerGroup)
			}
			groups := map[int64][]int{} // first id (when shared) -> record indices
			for i, r := range recs {
				if r.InputLength != o.SystemPromptTokens+o.QuestionTokens || r.OutputLength != o.OutputTokens || len(r.HashIDs) != tc.blocks {
					t.Fatalf("record %d: in %d out %d, %d ids; want %d, %d, %d", i, r.InputLength, r.OutputLength, len(r.HashIDs),
						o.SystemPromptTokens+o.QuestionTokens, o.OutputTokens, tc.blocks)
				}
				if r.Timestamp != 0 {
					t.Fatalf("record %d at %v, want 0 (rate 0)", i, r.Timestamp)
				}
				for _, id := range r.HashIDs {
					if id < SharedPrefixIDBase || id >= SharedPrefixIDBase+1<<40 {
						t.Fatalf("record %d: id %d outside the shared-prefix range", i, id)
					}
				}
				if tc.shared > 0 {
					groups[r.HashIDs[0]] = append(groups[r.HashIDs[0]], i)
				}
			}
			if tc.shared > 0 {
				if len(groups) != o.Groups {
					t.Fatalf("%d groups by first block, want %d", len(groups), o.Groups)
				}
				for _, g := range groups {
					if len(g) != o.PromptsPerGroup {
						t.Fatalf("group of %d requests, want %d", len(g), o.PromptsPerGroup)
					}
				}
			}
			group := func(i int) int64 {
				if tc.shared == 0 {
					return int64(-1 - i) // every request alone
				}
				return recs[i].HashIDs[0]
			}
			toks := make([][]uint32, len(recs))
			for i := range recs {
				toks[i] = recs[i].Tokens(nil)
			}
			for i := range recs {
				for j := i + 1; j < len(recs); j++ {
					wantB, wantT := 0, 0
					if group(i) == group(j) {
						wantB, wantT = tc.shared, tc.sharedToks
					}
					if got := commonBlocks(recs[i].HashIDs, recs[j].HashIDs); got != wantB {
						t.Fatalf("records %d and %d share %d leading blocks, want %d", i, j, got, wantB)
					}
					if got := commonTokens(toks[i], toks[j]); got != wantT {
						t.Fatalf("records %d and %d share %d leading tokens, want %d", i, j, got, wantT)
					}
				}
			}
			n := o.Groups * o.PromptsPerGroup
			want := float64(o.Groups*(o.PromptsPerGroup-1)*tc.shared) / float64(n*tc.blocks)
			if got := InfiniteCacheBlockHitRate(recs); math.Abs(got-want) > 1e-12 {
				t.Errorf("block hit ceiling %v, want %v", got, want)
			}
		})
	}
}

func TestSharedPrefixArrivals(t *testing.T) {
	o := DefaultSharedPrefixOptions()
	o.Rate = 8
	recs, err := SharedPrefix(o)
	if err != nil {
		t.Fatal(err)
	}
	if recs[0].Timestamp != 0 {
		t.Errorf("first arrival %v, want 0", recs[0].Timestamp)
	}
	if !slices.IsSortedFunc(recs, func(a, b Record) int { return cmp.Compare(a.Timestamp, b.Timestamp) }) {
		t.Fatal("arrivals not sorted")
	}
	// 1023 exponential gaps of mean 125 ms: the mean is within 10% with
	// overwhelming probability (its standard error is 3%).
	mean := recs[len(recs)-1].Timestamp.Seconds() / float64(len(recs)-1)
	if math.Abs(mean-1/o.Rate) > 0.1/o.Rate {
		t.Errorf("mean gap %.4f s, want about %.4f", mean, 1/o.Rate)
	}
}

func TestSharedPrefixDeterministic(t *testing.T) {
	o := DefaultSharedPrefixOptions()
	o.Rate = 3
	a, _ := SharedPrefix(o)
	b, _ := SharedPrefix(o)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("same options gave different workloads")
	}
	o.Seed++
	c, _ := SharedPrefix(o)
	if reflect.DeepEqual(a, c) {
		t.Fatal("another seed gave the same workload")
	}
	ids := map[int64]bool{}
	for _, r := range a {
		for _, id := range r.HashIDs {
			ids[id] = true
		}
	}
	for _, r := range c {
		for _, id := range r.HashIDs {
			if ids[id] {
				t.Fatalf("seeds %d and %d share id %d", o.Seed-1, o.Seed, id)
			}
		}
	}
}

func TestSharedPrefixErrors(t *testing.T) {
	ok := DefaultSharedPrefixOptions()
	for _, tc := range []struct {
		name string
		edit func(*SharedPrefixOptions)
		want string
	}{
		{"no groups", func(o *SharedPrefixOptions) { o.Groups = 0 }, "groups 0"},
		{"no prompts", func(o *SharedPrefixOptions) { o.PromptsPerGroup = -1 }, "prompts per group -1"},
		{"too many", func(o *SharedPrefixOptions) { o.Groups, o.PromptsPerGroup = 1<<13, 1<<12 }, "more than"},
		{"negative system", func(o *SharedPrefixOptions) { o.SystemPromptTokens = -1 }, "system prompt tokens -1"},
		{"negative question", func(o *SharedPrefixOptions) { o.QuestionTokens = -1 }, "question tokens -1"},
		{"empty prompt", func(o *SharedPrefixOptions) { o.SystemPromptTokens, o.QuestionTokens = 0, 0 }, "both 0"},
		{"huge prompt", func(o *SharedPrefixOptions) { o.SystemPromptTokens = 1 << 30 }, "at most"},
		{"too many blocks", func(o *SharedPrefixOptions) { o.Groups, o.PromptsPerGroup, o.SystemPromptTokens = 1<<12, 1<<12, 1<<20 }, "hash ids"},
		{"negative output", func(o *SharedPrefixOptions) { o.OutputTokens = -1 }, "output tokens -1"},
		{"negative rate", func(o *SharedPrefixOptions) { o.Rate = -1 }, "rate -1"},
		{"nan rate", func(o *SharedPrefixOptions) { o.Rate = math.NaN() }, "rate NaN"},
		{"inf rate", func(o *SharedPrefixOptions) { o.Rate = math.Inf(1) }, "rate +Inf"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := ok
			tc.edit(&o)
			_, err := SharedPrefix(o)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestArrivalsZeroRate(t *testing.T) {
	for _, d := range arrivals(newRNG(1, 1), 5, 0) {
		if d != 0 {
			t.Fatalf("arrival %v at rate 0", d)
		}
	}
	if got := arrivals(newRNG(1, 1), 0, 2); len(got) != 0 {
		t.Fatalf("%d arrivals for n=0", len(got))
	}
}
