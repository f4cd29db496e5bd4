package hftokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// tinyJSON builds a byte-level BPE tokenizer.json: the 256 byte tokens
// (ids 0..255 in byte order), then one token per merge in order, then the
// added tokens; merges are written in the "a b" form or, with pairs, as
// ["a", "b"].
func tinyJSON(t testing.TB, merges [][2]string, pairs bool, added []AddedToken, extra map[string]any) []byte {
	t.Helper()
	vocab := map[string]uint32{}
	for b := 0; b < 256; b++ {
		vocab[string(byteToRune[b])] = uint32(b)
	}
	var ms []any
	for _, m := range merges {
		l, r := toByteLevel(m[0]), toByteLevel(m[1])
		if _, ok := vocab[l+r]; !ok {
			vocab[l+r] = uint32(len(vocab))
		}
		if pairs {
			ms = append(ms, []string{l, r})
		} else {
			ms = append(ms, l+" "+r)
		}
	}
	f := map[string]any{
		"added_tokens": added,
		"normalizer":   nil,
		"pre_tokenizer": map[string]any{"type": "Sequence", "pretokenizers": []any{
			map[string]any{"type": "Split", "pattern": map[string]any{"Regex": llama3Pattern}, "behavior": "Isolated", "invert": false},
			map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
		}},
		"post_processor": nil,
		"decoder":        map[string]any{"type": "ByteLevel"},
		"model":          map[string]any{"type": "BPE", "vocab": vocab, "merges": ms, "ignore_merges": false},
	}
	for k, v := range extra {
		f[k] = v
	}
	raw, err := json.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

func toByteLevel(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		b.WriteRune(byteToRune[s[i]])
	}
	return b.String()
}

func mustParse(t testing.TB, raw []byte) *Tokenizer {
	t.Helper()
	tok, err := Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

var tinyMerges = [][2]string{{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {" ", "w"}, {" w", "o"}, {"r", "l"}, {" wo", "rl"}, {" worl", "d"}}

func TestMergesBothFormats(t *testing.T) {
	a := mustParse(t, tinyJSON(t, tinyMerges, false, nil, nil))
	b := mustParse(t, tinyJSON(t, tinyMerges, true, nil, nil))
	for _, s := range []string{"hello world", "hellohello", "world", "xhello", ""} {
		ia, _ := a.Encode(s, false)
		ib, _ := b.Encode(s, false)
		if !slices.Equal(ia, ib) {
			t.Errorf("%q: \"a b\" merges give %v, [a, b] merges %v", s, ia, ib)
		}
		if got := a.Decode(ia, false); got != s {
			t.Errorf("%q round-trips to %q", s, got)
		}
	}
	ids, _ := a.Encode("hello world", false)
	if len(ids) != 2 { // "hello", " world"
		t.Errorf("hello world = %v, want 2 tokens", ids)
	}
}

func TestMergeOrderLowestRankLeftmost(t *testing.T) {
	// "aaa" with the single merge a+a: the leftmost pair merges first.
	tok := mustParse(t, tinyJSON(t, [][2]string{{"a", "a"}}, false, nil, nil))
	ids, _ := tok.Encode("aaa", false)
	aa, _ := tok.TokenID("aa")
	if want := []uint32{aa, 'a'}; !slices.Equal(ids, want) {
		t.Errorf("aaa = %v, want %v", ids, want)
	}
	// Rank decides before position: b+c (rank 0) before a+b (rank 1).
	tok = mustParse(t, tinyJSON(t, [][2]string{{"b", "c"}, {"a", "b"}}, false, nil, nil))
	ids, _ = tok.Encode("abc", false)
	bc, _ := tok.TokenID("bc")
	if want := []uint32{'a', bc}; !slices.Equal(ids, want) {
		t.Errorf("abc = %v, want %v", ids, want)
	}
}

func TestIgnoreMerges(t *testing.T) {
	// "abc" is in the vocabulary but no merge sequence reaches it from the
	// ranks given (a+b then ab+c is missing): only ignore_merges finds it.
	raw := tinyJSON(t, [][2]string{{"a", "b"}, {"b", "c"}, {"a", "bc"}}, false, nil, nil)
	var f map[string]any
	_ = json.Unmarshal(raw, &f)
	model := f["model"].(map[string]any)
	raw, _ = json.Marshal(f)
	plain := mustParse(t, raw)
	model["ignore_merges"] = true
	raw, _ = json.Marshal(f)
	ignoring := mustParse(t, raw)
	abc, _ := plain.TokenID("abc")
	ab, _ := plain.TokenID("ab")
	if ids, _ := plain.Encode("abc", false); !slices.Equal(ids, []uint32{ab, 'c'}) {
		t.Errorf("merges: abc = %v, want [ab c]", ids)
	}
	if ids, _ := ignoring.Encode("abc", false); !slices.Equal(ids, []uint32{abc}) {
		t.Errorf("ignore_merges: abc = %v, want [abc]=%d", ids, abc)
	}
}

func TestAddedTokens(t *testing.T) {
	added := []AddedToken{
		{ID: 1000, Content: "<|bos|>", Special: true},
		{ID: 1001, Content: "<|eot|>", Special: true},
		{ID: 1002, Content: "<sep>", LStrip: true, RStrip: true},
		{ID: 1003, Content: "cat", SingleWord: true},
		{ID: 1004, Content: "<|eot|>x"}, // longer, same start: leftmost-longest wins
	}
	tok := mustParse(t, tinyJSON(t, nil, false, added, map[string]any{
		"post_processor": map[string]any{"type": "TemplateProcessing",
			"single":         []any{map[string]any{"SpecialToken": map[string]any{"id": "<|bos|>", "type_id": 0}}, map[string]any{"Sequence": map[string]any{"id": "A", "type_id": 0}}, map[string]any{"SpecialToken": map[string]any{"id": "<|eot|>", "type_id": 0}}},
			"special_tokens": map[string]any{"<|bos|>": map[string]any{"id": "<|bos|>", "ids": []uint32{1000}, "tokens": []string{"<|bos|>"}}, "<|eot|>": map[string]any{"id": "<|eot|>", "ids": []uint32{1001}, "tokens": []string{"<|eot|>"}}}},
	}))
	for _, c := range []struct {
		in   string
		want []uint32
	}{
		{"a<|eot|>b", []uint32{'a', 1001, 'b'}},
		{"<|eot|>x", []uint32{1004}},
		{"a  <sep>  b", []uint32{'a', 1002, 'b'}},
		{"cat", []uint32{1003}},
		{"a cat.", []uint32{'a', ' ', 1003, '.'}},
		{"concat", []uint32{'c', 'o', 'n', 'c', 'a', 't'}},
		{"<|bos", []uint32{'<', '|', 'b', 'o', 's'}},
	} {
		got, err := tok.Encode(c.in, false)
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("%q = %v, %v; want %v", c.in, got, err, c.want)
		}
	}
	got, _ := tok.Encode("a", true)
	if want := []uint32{1000, 'a', 1001}; !slices.Equal(got, want) {
		t.Errorf("with special tokens: %v, want %v", got, want)
	}
	if d := tok.Decode(got, true); d != "a" {
		t.Errorf("decode skipping special = %q", d)
	}
	if d := tok.Decode(got, false); d != "<|bos|>a<|eot|>" {
		t.Errorf("decode = %q", d)
	}
}

func TestSplitBehaviors(t *testing.T) {
	split := func(behavior string, invert bool) *Tokenizer {
		return mustParse(t, tinyJSON(t, nil, false, nil, map[string]any{
			"pre_tokenizer": map[string]any{"type": "Split", "pattern": map[string]any{"Regex": `\d+`}, "behavior": behavior, "invert": invert},
		}))
	}
	for _, c := range []struct {
		behavior string
		invert   bool
		want     []uint32
	}{
		{"Isolated", false, []uint32{'a', 'b', '1', '2', 'c'}},
		{"Removed", true, []uint32{'1', '2'}},       // only the matches
		{"Removed", false, []uint32{'a', 'b', 'c'}}, // only the text between
	} {
		got, err := split(c.behavior, c.invert).Encode("ab12c", false)
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("%s invert %v: %v %v, want %v", c.behavior, c.invert, got, err, c.want)
		}
	}
}

func TestNFC(t *testing.T) {
	tok := mustParse(t, tinyJSON(t, nil, false, nil, map[string]any{"normalizer": map[string]any{"type": "NFC"}}))
	a, _ := tok.Encode("Cafe\u0301", false)
	b, _ := tok.Encode("Caf\u00e9", false)
	if !slices.Equal(a, b) {
		t.Errorf("NFD %v != NFC %v", a, b)
	}
}

func TestUnsupportedComponents(t *testing.T) {
	for name, extra := range map[string]map[string]any{
		"normalizer":     {"normalizer": map[string]any{"type": "Lowercase"}},
		"pre_tokenizer":  {"pre_tokenizer": map[string]any{"type": "Metaspace"}},
		"split behavior": {"pre_tokenizer": map[string]any{"type": "Split", "pattern": map[string]any{"Regex": "a"}, "behavior": "MergedWithNext"}},
		"bad regex":      {"pre_tokenizer": map[string]any{"type": "Split", "pattern": map[string]any{"Regex": "(a"}, "behavior": "Isolated"}},
		"post":           {"post_processor": map[string]any{"type": "BertProcessing"}},
		"decoder":        {"decoder": map[string]any{"type": "WordPiece"}},
		"model":          {"model": map[string]any{"type": "WordPiece", "vocab": map[string]int{"a": 0}}},
		"merge":          {"model": map[string]any{"type": "BPE", "vocab": map[string]int{"a": 0}, "merges": []string{"a b"}}},
	} {
		if _, err := Parse(tinyJSON(t, nil, false, nil, extra)); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	if _, err := Parse([]byte(`{"model": [}`)); err == nil {
		t.Error("bad JSON: no error")
	}
	// An id far past the token count: refused, not a 32 GB table.
	if _, err := Parse(tinyJSON(t, nil, false, []AddedToken{{ID: 4_000_000_000, Content: "<x>"}}, nil)); err == nil {
		t.Error("huge id: no error")
	}
}

func TestRegexTimeoutIsAnError(t *testing.T) {
	// A catastrophically backtracking pattern the scanner does not cover.
	tok := mustParse(t, tinyJSON(t, nil, false, nil, map[string]any{
		"pre_tokenizer": map[string]any{"type": "Split", "pattern": map[string]any{"Regex": `(a+)+$`}, "behavior": "Isolated"},
	}))
	tok.steps[0].split.re.MatchTimeout = 10 * time.Millisecond
	_, err := tok.Encode(strings.Repeat("a", 5000)+"b", false)
	if !errors.Is(err, ErrRegexTimeout) {
		t.Fatalf("err = %v, want ErrRegexTimeout", err)
	}
}

func TestGenericRegexPathMatchesScanner(t *testing.T) {
	fast := mustParse(t, tinyJSON(t, tinyMerges, false, nil, nil))
	slow := mustParse(t, tinyJSON(t, tinyMerges, false, nil, nil))
	slow.steps[0].split.fast = false
	for _, s := range splitSeeds {
		a, err1 := fast.Encode(s, false)
		b, err2 := slow.Encode(s, false)
		if err1 != nil || err2 != nil || !slices.Equal(a, b) {
			t.Errorf("%q: scanner %v, regexp2 %v (%v %v)", s, a, b, err1, err2)
		}
	}
}

var splitSeeds = []string{
	"", "a", "hello world", "I'm OK, you're fine; 'S 'LL 'Ve", "  leading", "trailing  ", "a\n\nb", "a \n b",
	"x\r\n\r\ny", "1234567 89", "١٢٣٤", "€100", " !!! ??", "emoji 🍕🍕 x", "\t\t\tx", "  \u00a0\u2003x", "a\u0085b",
	"\xff\xfeab", "a\xe4\xb8b", "'", "'x", "ab'", "'re're", "\n", " ", "a  ", "a \t\nb", "\u3000\u3000字",
	"naïve café", "x\u0301y", "ǅungla", "‿_x", "a_b c-d",
}

func TestLossyUTF8(t *testing.T) {
	for in, want := range map[string]string{
		"ok":               "ok",
		"a\xffb":           "a\uFFFDb",
		"\xe4\xb8":         "\uFFFD",             // truncated 3-byte sequence: one
		"\xe4\xb8x":        "\uFFFDx",            //
		"\xed\xa0\x80":     "\uFFFD\uFFFD\uFFFD", // surrogate: ED's second byte out of range
		"\xf0\x9f\x8d":     "\uFFFD",
		"\xc0\xaf":         "\uFFFD\uFFFD",
		"\xf4\x90\x80\x80": "\uFFFD\uFFFD\uFFFD\uFFFD",
	} {
		if got := lossyUTF8([]byte(in)); got != want {
			t.Errorf("%q → %q, want %q", in, got, want)
		}
	}
}

func TestLoadFolderAndFile(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), tinyJSON(t, tinyMerges, false, nil, nil), 0o644); err != nil {
		t.Fatal(err)
	}
	tok, err := Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil || tok.Template() != nil {
		t.Fatalf("file: %v, template %v", err, tok.Template())
	}
	cfg := `{"bos_token": {"content": "<s>"}, "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"}`
	if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	tok, err = Load(dir)
	if err != nil || tok.Template() == nil {
		t.Fatalf("folder: %v", err)
	}
	out, err := tok.Template().Render(Chat{Messages: []byte(`[{"role":"user","content":"hi"}]`)})
	if err != nil || out != "<s>[user]hi" {
		t.Fatalf("render = %q, %v", out, err)
	}
	if _, err := Load(filepath.Join(dir, "missing")); err == nil {
		t.Fatal("missing path: no error")
	}
}

// FuzzEncode: no input panics; valid UTF-8 round-trips through Decode
// (this tokenizer has no normalizer); every id is in the vocabulary.
func FuzzEncode(f *testing.F) {
	for _, s := range splitSeeds {
		f.Add(s)
	}
	f.Add("<|eot|><|eot|>x<sep> cat cat")
	tok := mustParse(f, tinyJSON(f, tinyMerges, false, []AddedToken{{ID: 1001, Content: "<|eot|>"}, {ID: 1002, Content: "<sep>", LStrip: true, RStrip: true}, {ID: 1003, Content: "cat", SingleWord: true}}, nil))
	f.Fuzz(func(t *testing.T, s string) {
		ids, err := tok.Encode(s, true)
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range ids {
			if int(id) >= tok.VocabSize() {
				t.Fatalf("id %d outside the vocabulary", id)
			}
		}
		if utf8.ValidString(s) && !strings.Contains(s, "<sep>") {
			if got := tok.Decode(ids, false); got != s {
				t.Fatalf("%q decodes to %q", s, got)
			}
		}
	})
}

// FuzzScannerMatchesRegexp: the hand-written scanner cuts text exactly as
// regexp2 does with the pattern it stands for.
func FuzzScannerMatchesRegexp(f *testing.F) {
	for _, s := range splitSeeds {
		f.Add(s)
	}
	type pat struct {
		src       string
		maxDigits int
	}
	var res []*splitter
	var pats = []pat{{llama3Pattern, 3}, {qwen2Pattern, 1}}
	for _, p := range pats {
		s, err := newSplitter(p.src, false)
		if err != nil {
			f.Fatal(err)
		}
		res = append(res, s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for k, p := range pats {
			var want, got [][2]int
			if err := res[k].split(s, func(a, b int) { want = append(want, [2]int{a, b}) }); err != nil {
				t.Skip(err)
			}
			scanFamily(s, p.maxDigits, func(a, b int) { got = append(got, [2]int{a, b}) })
			if !slices.Equal(want, got) {
				t.Fatalf("pattern %d on %q:\nregexp2 %v\nscanner %v", k, s, pieces(s, want), pieces(s, got))
			}
		}
	})
}

func pieces(s string, spans [][2]int) []string {
	out := make([]string, len(spans))
	for i, sp := range spans {
		out[i] = fmt.Sprintf("%q", s[sp[0]:sp[1]])
	}
	return out
}

// naiveMerge is the textbook BPE loop (scan for the lowest-ranked,
// leftmost pair, merge, repeat), O(n²): the reference for the heap.
func naiveMerge(m *bpe, word string) []uint32 {
	var ids []uint32
	for i := 0; i < len(word); i++ {
		if m.hasByte[word[i]] {
			ids = append(ids, m.byteID[word[i]])
		}
	}
	for {
		best, bestRank, bestID := -1, uint64(1<<63), uint32(0)
		for i := 0; i+1 < len(ids); i++ {
			if rm, ok := m.merges[uint64(ids[i])<<32|uint64(ids[i+1])]; ok && rm>>32 < bestRank {
				best, bestRank, bestID = i, rm>>32, uint32(rm)
			}
		}
		if best < 0 {
			return ids
		}
		ids = append(ids[:best], append([]uint32{bestID}, ids[best+2:]...)...)
	}
}

// FuzzMergeMatchesNaive: the heap-ordered merge equals the textbook loop.
func FuzzMergeMatchesNaive(f *testing.F) {
	for _, s := range []string{"hello", "aaaaaaa", "hellhellohe", "abcabc", " world world"} {
		f.Add(s)
	}
	merges := append([][2]string{{"a", "a"}, {"aa", "a"}, {"a", "b"}, {"b", "c"}, {"ab", "c"}, {"aa", "aa"}}, tinyMerges...)
	tok := mustParse(f, tinyJSON(f, merges, true, nil, nil))
	f.Fuzz(func(t *testing.T, s string) {
		if len(s) > 4096 {
			return
		}
		got := tok.model.merge(nil, s, new(mergeScratch))
		if want := naiveMerge(&tok.model, s); !slices.Equal(got, want) {
			t.Fatalf("%q: heap %v, naive %v", s, got, want)
		}
	})
}

// FuzzEncodeReference runs FuzzEncode's checks on the real Llama-3 and
// Qwen3 files (scripts/tokref.sh; skipped without them): their added
// tokens, NFC (Qwen3: round trip compared after NFC) and the scanner on
// the real vocabularies.
func FuzzEncodeReference(f *testing.F) {
	for _, s := range splitSeeds {
		f.Add(s)
	}
	f.Add("<|im_start|>user\nhi<|im_end|><|begin_of_text|><think>x</think>")
	var toks []*Tokenizer
	for _, m := range []string{"llama3", "qwen3"} {
		tok, _ := reference(f, m)
		toks = append(toks, tok)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, tok := range toks {
			ids, err := tok.Encode(s, true)
			if err != nil {
				t.Fatal(err)
			}
			for _, id := range ids {
				if int(id) >= tok.VocabSize() {
					t.Fatalf("id %d outside the vocabulary", id)
				}
			}
			if !utf8.ValidString(s) {
				continue
			}
			plain, _ := tok.Encode(s, false)
			want := s
			if tok.nfc {
				want = norm.NFC.String(s)
			}
			if got := tok.Decode(plain, false); got != want {
				t.Fatalf("%q decodes to %q", s, got)
			}
		}
	})
}
