package trace

import (
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

const mooncakePath = "../data/mooncake_conversation_trace.jsonl"

func TestReadMooncake(t *testing.T) {
	in := `{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}

{"timestamp": 1.5, "input_length": 512, "output_length": 0, "hash_ids": [0], "extra": true}
{"timestamp": 3000, "input_length": 1025, "output_length": 7, "hash_ids": [0, 1, 2]}
`
	recs, err := ReadMooncake(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	want := []Record{
		{Timestamp: 0, InputLength: 1000, OutputLength: 5, HashIDs: []int64{0, 1}},
		{Timestamp: 1500 * time.Microsecond, InputLength: 512, OutputLength: 0, HashIDs: []int64{0}},
		{Timestamp: 3 * time.Second, InputLength: 1025, OutputLength: 7, HashIDs: []int64{0, 1, 2}},
	}
	if len(recs) != len(want) {
		t.Fatalf("got %d records, want %d", len(recs), len(want))
	}
	for i := range want {
		g, w := recs[i], want[i]
		if g.Timestamp != w.Timestamp || g.InputLength != w.InputLength || g.OutputLength != w.OutputLength || !slices.Equal(g.HashIDs, w.HashIDs) {
			t.Errorf("record %d = %+v, want %+v", i, g, w)
		}
	}
}

func TestReadMooncakeErrors(t *testing.T) {
	ok := `{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [0]}` + "\n"
	for _, tc := range []struct {
		name, in, want string
	}{
		{"bad json", ok + `{"timestamp": 5,` + "\n", "line 2"},
		{"hash count", ok + `{"timestamp": 6, "input_length": 513, "output_length": 1, "hash_ids": [0]}`, "line 2: 1 hash_ids for input_length 513: want ceil(513/512) = 2"},
		{"too many ids", `{"timestamp": 6, "input_length": 512, "output_length": 1, "hash_ids": [0, 1]}`, "line 1: 2 hash_ids"},
		{"unsorted", ok + ok + `{"timestamp": 4, "input_length": 10, "output_length": 1, "hash_ids": [0]}`, "line 3: timestamp"},
		{"missing ts", `{"input_length": 10, "output_length": 1, "hash_ids": [0]}`, `line 1: missing "timestamp"`},
		{"missing in", `{"timestamp": 1, "output_length": 1, "hash_ids": [0]}`, `missing "input_length"`},
		{"missing out", `{"timestamp": 1, "input_length": 1, "hash_ids": [0]}`, `missing "output_length"`},
		{"missing ids", `{"timestamp": 1, "input_length": 1, "output_length": 1}`, `missing "hash_ids"`},
		{"negative ts", `{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [0]}`, "timestamp -1 ms out of range"},
		{"zero input", `{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}`, "input_length 0"},
		{"negative output", `{"timestamp": 1, "input_length": 1, "output_length": -2, "hash_ids": [0]}`, "output_length -2"},
		{"negative id", `{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [-3]}`, "hash_ids[0] = -3"},
		{"too long", ok + `{"timestamp": 1, "pad": "` + strings.Repeat("x", MaxLineBytes) + `"}`, "line 2: longer than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadMooncake(strings.NewReader(tc.in))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestTokens(t *testing.T) {
	a := Record{InputLength: 1000, HashIDs: []int64{0, 7}}
	b := Record{InputLength: 1300, HashIDs: []int64{0, 7, 9}}
	c := Record{InputLength: 600, HashIDs: []int64{0, 8}}
	ta, tb, tc := a.Tokens(nil), b.Tokens(nil), c.Tokens(nil)
	if len(ta) != 1000 || len(tb) != 1300 || len(tc) != 600 {
		t.Fatalf("lengths %d %d %d, want 1000 1300 600", len(ta), len(tb), len(tc))
	}
	// Equal ids at equal positions give equal prefixes; the cut block is a
	// prefix of the full one.
	if !slices.Equal(ta, tb[:1000]) {
		t.Error("records sharing ids [0 7] do not share their first 1000 tokens")
	}
	if !slices.Equal(ta[:512], tc[:512]) {
		t.Error("records sharing id 0 do not share block 0")
	}
	same := 0
	for i := 512; i < 600; i++ {
		if ta[i] == tc[i] {
			same++
		}
	}
	if same > 2 {
		t.Errorf("blocks of different ids agree in %d of 88 positions", same)
	}
	for _, tok := range tb {
		if tok < MinTokenID || tok >= MaxTokenID {
			t.Fatalf("token %d outside [%d, %d)", tok, MinTokenID, MaxTokenID)
		}
	}
	// Deterministic, appends to dst, and pinned: a change here changes every
	// prompt a benchmark sends (and so its cache behaviour across versions).
	dst := []uint32{42}
	got := a.Tokens(dst)
	if got[0] != 42 || !slices.Equal(got[1:], ta) {
		t.Error("Tokens does not append to dst deterministically")
	}
	// 0xe220a8397b1dcdaf, SplitMix64's first output for seed 0, gives 29535.
	if want := []uint32{29535, 29700, 17679, 5444}; !slices.Equal(ta[:4], want) {
		t.Errorf("first tokens of id 0 = %v, want %v", ta[:4], want)
	}
}

func TestInfiniteCacheHitRate(t *testing.T) {
	recs := []Record{
		{InputLength: 1024, HashIDs: []int64{0, 1}},    // all miss
		{InputLength: 1100, HashIDs: []int64{0, 1, 2}}, // 1024 hit, 76 miss
		{InputLength: 600, HashIDs: []int64{0, 3}},     // 512 hit, 88 miss
		{InputLength: 700, HashIDs: []int64{4, 2}},     // first block misses: no prefix hit after it
	}
	const tokens = 1024 + 1100 + 600 + 700
	if got, want := InfiniteCacheHitRate(recs), float64(1024+512)/tokens; math.Abs(got-want) > 1e-12 {
		t.Errorf("InfiniteCacheHitRate = %v, want %v", got, want)
	}
	if got, want := InfiniteCacheBlockHitRate(recs), 3.0/9; math.Abs(got-want) > 1e-12 {
		t.Errorf("InfiniteCacheBlockHitRate = %v, want %v", got, want)
	}
	if InfiniteCacheHitRate(nil) != 0 || InfiniteCacheBlockHitRate(nil) != 0 {
		t.Error("empty trace should give 0")
	}
	if got := InfiniteCacheHits(recs); !slices.Equal(got, []int{0, 1024, 512, 0}) {
		t.Errorf("InfiniteCacheHits = %v, want [0 1024 512 0]", got)
	}
}

func loadRealTrace(t *testing.T) []Record {
	t.Helper()
	recs, err := LoadMooncake(mooncakePath)
	if err != nil {
		t.Fatal(err)
	}
	return recs
}

// TestMooncakeFacts checks the facts PROVENANCE.md states for the full trace.
func TestMooncakeFacts(t *testing.T) {
	recs := loadRealTrace(t)
	if len(recs) != 12031 {
		t.Errorf("%d records, want 12031", len(recs))
	}
	blocks, distinct := 0, map[int64]bool{}
	maxIn := 0
	for _, r := range recs {
		blocks += len(r.HashIDs)
		for _, id := range r.HashIDs {
			distinct[id] = true
		}
		maxIn = max(maxIn, r.InputLength)
		if r.HashIDs[0] != 0 {
			t.Fatalf("record at %v does not start with the shared id 0", r.Timestamp)
		}
	}
	if blocks != 288500 || len(distinct) != 182790 || maxIn != 126195 {
		t.Errorf("blocks %d distinct %d max input %d, want 288500 182790 126195", blocks, len(distinct), maxIn)
	}
	if last := recs[len(recs)-1].Timestamp; last.Round(time.Second) != 3537*time.Second {
		t.Errorf("trace spans %v, want about 3537s", last)
	}
	if got := InfiniteCacheHitRate(recs); math.Abs(got-0.374) > 0.0005 {
		t.Errorf("token hit-rate ceiling %.4f, want 0.374", got)
	}
	if got := InfiniteCacheBlockHitRate(recs); math.Abs(got-0.366) > 0.0005 {
		t.Errorf("block hit-rate ceiling %.4f, want 0.366", got)
	}
}

// TestMooncakeTokensShareRealPrefixes checks, on real records, that two
// requests share exactly as many leading tokens as their common leading ids
// promise.
func TestMooncakeTokensShareRealPrefixes(t *testing.T) {
	recs := loadRealTrace(t)
	recs = recs[:min(len(recs), 2000)]
	last := map[int64]int{} // second block's id → latest record holding it
	checked := 0
	for i, r := range recs {
		if len(r.HashIDs) < 2 {
			continue
		}
		j, ok := last[r.HashIDs[1]]
		last[r.HashIDs[1]] = i
		if !ok {
			continue
		}
		p := recs[j]
		common := 0
		for common < min(len(p.HashIDs), len(r.HashIDs)) && p.HashIDs[common] == r.HashIDs[common] {
			common++
		}
		a, b := p.Tokens(nil), r.Tokens(nil)
		shared := 0
		for shared < min(len(a), len(b)) && a[shared] == b[shared] {
			shared++
		}
		// Common blocks are shared (a cut last block up to the shorter
		// prompt); the first differing block differs from its first token.
		if want := min(common*MooncakeBlockTokens, len(a), len(b)); shared != want {
			t.Fatalf("records %d and %d: %d common ids but %d shared tokens", j, i, common, shared)
		}
		checked++
	}
	if checked < 100 {
		t.Fatalf("only %d continuation pairs checked", checked)
	}
}

func BenchmarkTokens(b *testing.B) {
	r := Record{InputLength: 12035, HashIDs: make([]int64, 24)}
	for i := range r.HashIDs {
		r.HashIDs[i] = int64(i)
	}
	var buf []uint32
	b.SetBytes(int64(r.InputLength) * 4)
	for b.Loop() {
		buf = r.Tokens(buf[:0])
	}
}
