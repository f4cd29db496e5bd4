package trace

import (
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/prefix"
)

const (
	mtbenchPath = "../data/fastchat_mtbench_question.jsonl"
	sonnetPath  = "../data/vllm_sonnet.txt"
)

// byteEncoder encodes each byte as one token (1000 + byte): deterministic,
// and prefix-preserving, which a BPE is not in general.
type byteEncoder struct{}

func (byteEncoder) Encode(s string) []uint32 {
	out := make([]uint32, len(s))
	for i := range len(s) {
		out[i] = 1000 + uint32(s[i])
	}
	return out
}

func TestRecordTokensLiteral(t *testing.T) {
	lit := []uint32{7, 8, 9}
	r := Record{InputLength: 3, HashIDs: []int64{5}, TokenIDs: lit}
	if got := r.Tokens([]uint32{1}); !slices.Equal(got, []uint32{1, 7, 8, 9}) {
		t.Fatalf("Tokens = %v, want the literal ids appended", got)
	}
	r.TokenIDs = nil
	if got := r.Tokens(nil); len(got) != 3 || got[0] == 7 {
		t.Fatalf("Tokens without literal ids = %v, want 3 synthetic ids", got)
	}
}

func TestReadMTBenchErrors(t *testing.T) {
	ok := `{"question_id": 81, "category": "writing", "turns": ["a", "b"]}` + "\n"
	qs, err := ReadMTBench(strings.NewReader(ok + "\n" + ok))
	if err != nil || len(qs) != 2 || qs[1].ID != 81 || qs[0].Category != "writing" || !slices.Equal(qs[0].Turns, []string{"a", "b"}) {
		t.Fatalf("ReadMTBench = %+v, %v", qs, err)
	}
	for _, tc := range []struct{ name, in, want string }{
		{"json", ok + "{", "line 2"},
		{"no id", ok + `{"turns": ["a"]}`, `line 2: missing "question_id"`},
		{"no turns", `{"question_id": 1, "turns": []}`, `line 1: no "turns"`},
		{"empty turn", ok + ok + `{"question_id": 1, "turns": ["a", ""]}`, "line 3: turn 2 is empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadMTBench(strings.NewReader(tc.in))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

var testQuestions = []Question{
	{ID: 1, Turns: []string{"What is a sonnet?", "Write one."}},
	{ID: 2, Turns: []string{"Name three rivers.", "Which is longest?", "And shortest?"}},
	{ID: 3, Turns: []string{"Hello."}},
}

const testSonnet = "FROM fairest creatures we desire increase,\nThat thereby beauty's rose might never die,\n"

// checkSessions verifies the structure every ChatSessions output must have.
func checkSessions(t *testing.T, ss []Session, enc Encoder, sonnet string, o ChatOptions) {
	t.Helper()
	system := enc.Encode(sonnet)[:o.SystemPromptTokens]
	for s, sess := range ss {
		if sess.ThinkTime != o.ThinkTime {
			t.Fatalf("session %d think time %v", s, sess.ThinkTime)
		}
		if o.Rate == 0 && sess.Start != 0 {
			t.Fatalf("session %d starts at %v with rate 0", s, sess.Start)
		}
		if s > 0 && sess.Start < ss[s-1].Start {
			t.Fatalf("session %d starts before session %d", s, s-1)
		}
		for k, r := range sess.Turns {
			if r.InputLength != len(r.TokenIDs) || r.OutputLength != o.AnswerTokens || r.Timestamp != 0 {
				t.Fatalf("session %d turn %d: in %d (%d tokens), out %d, at %v", s, k, r.InputLength, len(r.TokenIDs), r.OutputLength, r.Timestamp)
			}
			if !slices.Equal(r.HashIDs, ContentHashIDs(r.TokenIDs)) {
				t.Fatalf("session %d turn %d: hash ids are not the content hashes", s, k)
			}
			if !slices.Equal(r.Tokens(nil), r.TokenIDs) {
				t.Fatalf("session %d turn %d: Tokens is not the literal prompt", s, k)
			}
			if !slices.Equal(r.TokenIDs[:len(system)], system) {
				t.Fatalf("session %d turn %d does not start with the system prompt", s, k)
			}
			if k == 0 {
				continue
			}
			prev := sess.Turns[k-1]
			if !slices.Equal(r.TokenIDs[:prev.InputLength], prev.TokenIDs) {
				t.Fatalf("session %d: turn %d's prompt is not a prefix of turn %d's", s, k-1, k)
			}
			full := prev.InputLength / MooncakeBlockTokens
			if got := commonBlocks(prev.HashIDs, r.HashIDs); got < full {
				t.Fatalf("session %d turns %d, %d share %d blocks, want at least %d", s, k-1, k, got, full)
			}
		}
	}
}

func TestChatSessions(t *testing.T) {
	base := ChatOptions{Sessions: 7, SystemPromptTokens: 40, AnswerTokens: 30, Rate: 2, ThinkTime: time.Second, Seed: 9}
	for _, tc := range []struct {
		name string
		edit func(*ChatOptions)
	}{
		{"base", func(*ChatOptions) {}},
		{"all at zero", func(o *ChatOptions) { o.Rate = 0 }},
		{"no system prompt", func(o *ChatOptions) { o.SystemPromptTokens = 0 }},
		{"no answers", func(o *ChatOptions) { o.AnswerTokens = 0 }},
		{"answers wrap the text", func(o *ChatOptions) { o.AnswerTokens = 3 * len(testSonnet) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := base
			tc.edit(&o)
			ss, err := ChatSessions(testQuestions, testSonnet, byteEncoder{}, o)
			if err != nil {
				t.Fatal(err)
			}
			if len(ss) != o.Sessions {
				t.Fatalf("%d sessions, want %d", len(ss), o.Sessions)
			}
			checkSessions(t, ss, byteEncoder{}, testSonnet, o)
			// Exact lengths: system + Σ user turns + one answer per earlier turn.
			user := func(q string) int { return len(chatUserPrefix + q + chatUserSuffix) }
			seen := map[int]int{}
			for s, sess := range ss {
				var q *Question
				for i := range testQuestions {
					n := o.SystemPromptTokens + user(testQuestions[i].Turns[0])
					if len(testQuestions[i].Turns) == len(sess.Turns) && sess.Turns[0].InputLength == n {
						q = &testQuestions[i]
					}
				}
				if q == nil {
					t.Fatalf("session %d matches no question", s)
				}
				seen[q.ID]++
				want := o.SystemPromptTokens
				for k, turn := range q.Turns {
					if k > 0 {
						want += o.AnswerTokens
					}
					want += user(turn)
					if sess.Turns[k].InputLength != want {
						t.Fatalf("session %d turn %d: %d tokens, want %d", s, k, sess.Turns[k].InputLength, want)
					}
				}
			}
			// 7 sessions over 3 questions: each asked 2 or 3 times.
			for id, n := range seen {
				if n < 2 || n > 3 {
					t.Errorf("question %d asked %d times, want 2 or 3", id, n)
				}
			}
		})
	}
}

func TestChatSessionsErrors(t *testing.T) {
	ok := ChatOptions{Sessions: 2, SystemPromptTokens: 10, AnswerTokens: 5}
	for _, tc := range []struct {
		name   string
		qs     []Question
		sonnet string
		enc    Encoder
		edit   func(*ChatOptions)
		want   string
	}{
		{"no encoder", testQuestions, testSonnet, nil, nil, "no encoder"},
		{"no questions", nil, testSonnet, byteEncoder{}, nil, "no questions"},
		{"empty question", []Question{{ID: 4}}, testSonnet, byteEncoder{}, nil, "question 0 (id 4) has no turns"},
		{"no sessions", testQuestions, testSonnet, byteEncoder{}, func(o *ChatOptions) { o.Sessions = 0 }, "sessions 0"},
		{"negative system", testQuestions, testSonnet, byteEncoder{}, func(o *ChatOptions) { o.SystemPromptTokens = -1 }, "system prompt tokens -1"},
		{"negative answer", testQuestions, testSonnet, byteEncoder{}, func(o *ChatOptions) { o.AnswerTokens = -1 }, "answer tokens -1"},
		{"negative think", testQuestions, testSonnet, byteEncoder{}, func(o *ChatOptions) { o.ThinkTime = -1 }, "think time"},
		{"negative rate", testQuestions, testSonnet, byteEncoder{}, func(o *ChatOptions) { o.Rate = -1 }, "rate -1"},
		{"short text", testQuestions, "abc", byteEncoder{}, nil, "fewer than the 10-token system prompt"},
		{"no answer text", testQuestions, "", byteEncoder{}, func(o *ChatOptions) { o.SystemPromptTokens = 0 }, "empty sonnet text"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := ok
			if tc.edit != nil {
				tc.edit(&o)
			}
			_, err := ChatSessions(tc.qs, tc.sonnet, tc.enc, o)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestChatSessionsDeterministic(t *testing.T) {
	o := ChatOptions{Sessions: 9, SystemPromptTokens: 20, AnswerTokens: 12, Rate: 1, Seed: 4}
	a, _ := ChatSessions(testQuestions, testSonnet, byteEncoder{}, o)
	b, _ := ChatSessions(testQuestions, testSonnet, byteEncoder{}, o)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("same options gave different sessions")
	}
	o.Seed++
	c, _ := ChatSessions(testQuestions, testSonnet, byteEncoder{}, o)
	if reflect.DeepEqual(a, c) {
		t.Fatal("another seed gave the same sessions")
	}
}

func TestFlatten(t *testing.T) {
	turn := func(id int64, out int) Record {
		return Record{InputLength: 1, OutputLength: out, HashIDs: []int64{id}}
	}
	ss := []Session{
		{Start: 0, ThinkTime: 5 * time.Second, Turns: []Record{turn(1, 10), turn(2, 20), turn(3, 0)}},
		{Start: 3 * time.Second, ThinkTime: time.Second, Turns: []Record{turn(4, 100)}},
		{Start: 7 * time.Second, Turns: []Record{turn(5, 1), turn(6, 1)}},
	}
	lat := LinearLatency(100*time.Millisecond, 10*time.Millisecond)
	got := Flatten(ss, lat)
	want := []struct {
		id int64
		at time.Duration
	}{
		{1, 0},
		{4, 3 * time.Second},
		{2, 5200 * time.Millisecond}, // 0 + 0.1 + 10×0.01 + 5
		{5, 7 * time.Second},
		{6, 7110 * time.Millisecond},  // 7 + 0.1 + 0.01
		{3, 10500 * time.Millisecond}, // 5.2 + 0.1 + 20×0.01 + 5
	}
	if len(got) != len(want) {
		t.Fatalf("%d records, want %d", len(got), len(want))
	}
	for i, w := range want {
		if got[i].HashIDs[0] != w.id || got[i].Timestamp != w.at {
			t.Errorf("record %d = id %d at %v, want id %d at %v", i, got[i].HashIDs[0], got[i].Timestamp, w.id, w.at)
		}
	}
	if ss[0].Turns[1].Timestamp != 0 {
		t.Error("Flatten modified the sessions")
	}
	// Without a latency estimate, ties keep session then turn order.
	tie := Flatten([]Session{
		{Turns: []Record{turn(1, 1), turn(2, 1)}},
		{Turns: []Record{turn(3, 1)}},
	}, nil)
	var ids []int64
	for _, r := range tie {
		ids = append(ids, r.HashIDs[0])
	}
	if !slices.Equal(ids, []int64{1, 2, 3}) {
		t.Errorf("tie order %v, want [1 2 3]", ids)
	}
}

func TestContentHashIDs(t *testing.T) {
	a := make([]uint32, 1300)
	for i := range a {
		a[i] = uint32(i)
	}
	b := slices.Clone(a)
	b[1100] = 7 // differs in block 2
	ia, ib := ContentHashIDs(a), ContentHashIDs(b)
	if len(ia) != 3 || commonBlocks(ia, ib) != 2 {
		t.Fatalf("ids %v vs %v: want 3 ids, 2 shared", ia, ib)
	}
	c := slices.Clone(a)
	c[0] = 9 // differs in block 0: chaining makes every id differ
	for i, id := range ContentHashIDs(c) {
		if id == ia[i] {
			t.Fatalf("block %d id equal after a change in block 0", i)
		}
	}
	if cut := ContentHashIDs(a[:1200]); commonBlocks(cut, ia) != 2 {
		t.Fatal("a partial last block matched a longer one")
	}
	for _, id := range append(ia, ib...) {
		if id < TextIDBase {
			t.Fatalf("id %d below TextIDBase", id)
		}
	}
	if ContentHashIDs(nil) == nil || len(ContentHashIDs(nil)) != 0 {
		t.Fatal("want an empty, non-nil slice for no tokens")
	}
}

func TestChatSessionsMTBench(t *testing.T) {
	qs, err := LoadMTBench(mtbenchPath)
	if err != nil {
		t.Fatal(err)
	}
	sonnet, err := os.ReadFile(sonnetPath)
	if err != nil {
		t.Fatal(err)
	}
	if len(qs) != 80 {
		t.Fatalf("%d questions, want 80", len(qs))
	}
	for _, q := range qs {
		if len(q.Turns) != 2 {
			t.Fatalf("question %d has %d turns, want 2", q.ID, len(q.Turns))
		}
	}
	tok, err := prefix.NewTokenizer()
	if err != nil {
		t.Fatal(err)
	}
	o := DefaultChatOptions()
	ss, err := ChatSessions(qs, string(sonnet), tok, o)
	if err != nil {
		t.Fatal(err)
	}
	if len(ss) != 80 {
		t.Fatalf("%d sessions, want 80", len(ss))
	}
	checkSessions(t, ss, tok, string(sonnet), o)
	ids := map[int]bool{} // each question once
	recs := Flatten(ss, LinearLatency(200*time.Millisecond, 20*time.Millisecond))
	if len(recs) != 160 {
		t.Fatalf("%d flattened records, want 160", len(recs))
	}
	for _, s := range ss {
		first := s.Turns[0].TokenIDs
		for _, q := range qs {
			u := tok.Encode(chatUserPrefix + q.Turns[0] + chatUserSuffix)
			if slices.Equal(first[o.SystemPromptTokens:], u) {
				ids[q.ID] = true
			}
		}
	}
	if len(ids) != 80 {
		t.Errorf("sessions ask %d distinct questions, want 80", len(ids))
	}
	// The shared system prompt is 4 whole blocks of every prompt; the rest
	// of a first turn is new, and a second turn repeats its first turn's
	// whole blocks.
	hit := InfiniteCacheBlockHitRate(recs)
	t.Logf("160 turns, %d..%d tokens; block hit ceiling %.3f", ss[0].Turns[0].InputLength, ss[0].Turns[1].InputLength, hit)
	if hit < 0.6 {
		t.Errorf("block hit ceiling %v, want > 0.6 (system prompt and history reuse)", hit)
	}
}
