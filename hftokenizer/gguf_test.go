package hftokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/text/unicode/norm"

	"github.com/infergate/infergate/gguf"
	"github.com/infergate/infergate/internal/realpart"
)

// ggufFromTokenizerJSON writes a vocabulary-only GGUF holding the
// tokenizer.json and tokenizer_config.json of dir as convert_hf_to_gguf.py
// (llama.cpp) writes a gpt2-type vocabulary: tokens by id (added tokens as
// their content), token types (added special → control, other added →
// user-defined, the rest normal), merges as "left right", pre, BOS/EOS and
// add_bos_token, the chat template.
func ggufFromTokenizerJSON(t testing.TB, dir, pre string, bos, eos uint32, addBOS bool) string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		AddedTokens []AddedToken `json:"added_tokens"`
		Model       struct {
			Vocab  map[string]uint32 `json:"vocab"`
			Merges []json.RawMessage `json:"merges"`
		} `json:"model"`
	}
	if err := json.Unmarshal(raw, &f); err != nil {
		t.Fatal(err)
	}
	n := uint32(0)
	for _, id := range f.Model.Vocab {
		n = max(n, id+1)
	}
	for _, a := range f.AddedTokens {
		n = max(n, a.ID+1)
	}
	tokens, types := make([]string, n), make([]int32, n)
	for tok, id := range f.Model.Vocab {
		tokens[id], types[id] = tok, TokenNormal
	}
	for _, a := range f.AddedTokens {
		tokens[a.ID], types[a.ID] = a.Content, TokenUserDefined
		if a.Special {
			types[a.ID] = TokenControl
		}
	}
	for id := range tokens {
		if tokens[id] == "" {
			tokens[id], types[id] = "[PAD"+string(rune('0'+id%10))+"]", TokenUnused
		}
	}
	merges := make([]string, len(f.Model.Merges))
	for i, m := range f.Model.Merges {
		l, r, err := parseMerge(m)
		if err != nil {
			t.Fatal(err)
		}
		merges[i] = l + " " + r
	}
	kvs := []gguf.KV{
		{Key: "general.architecture", Value: "llama"},
		{Key: "tokenizer.ggml.model", Value: "gpt2"},
		{Key: "tokenizer.ggml.pre", Value: pre},
		{Key: "tokenizer.ggml.tokens", Value: tokens},
		{Key: "tokenizer.ggml.token_type", Value: types},
		{Key: "tokenizer.ggml.merges", Value: merges},
		{Key: "tokenizer.ggml.bos_token_id", Value: bos},
		{Key: "tokenizer.ggml.eos_token_id", Value: eos},
		{Key: "tokenizer.ggml.add_bos_token", Value: addBOS},
	}
	if cfg, err := os.ReadFile(filepath.Join(dir, "tokenizer_config.json")); err == nil {
		var c struct {
			ChatTemplate json.RawMessage `json:"chat_template"`
		}
		if json.Unmarshal(cfg, &c) == nil {
			if src, err := templateSource(c.ChatTemplate); err == nil {
				kvs = append(kvs, gguf.KV{Key: "tokenizer.chat_template", Value: src})
			}
		}
	}
	path := filepath.Join(t.TempDir(), "vocab.gguf")
	w, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := gguf.WriteMetadata(w, kvs); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestReferenceGGUF: a GGUF holding Meta-Llama-3's vocabulary (as llama.cpp's
// converter writes it, pre "llama-bpe") tokenizes the whole reference corpus
// into the reference ids, with and without BOS, decodes it, and renders and
// tokenizes every reference chat with its embedded template; Qwen3's
// ("qwen2") too, except texts that are not in NFC, which llama.cpp does not
// normalize and tokenizer.json does (its NFC normalizer): those are
// counted, and must differ only there.
func TestReferenceGGUF(t *testing.T) {
	for _, tc := range []struct {
		m, pre   string
		bos, eos uint32
		addBOS   bool
		nfc      bool // tokenizer.json's normalizer is NFC
	}{{"llama3", "llama-bpe", 128000, 128009, true, false}, {"qwen3", "qwen2", 151643, 151645, false, true}} {
		t.Run(tc.m, func(t *testing.T) {
			_, v := reference(t, tc.m)
			dir := filepath.Join(realpart.CacheDir("tokref", tokrefVersion), tc.m)
			path := ggufFromTokenizerJSON(t, dir, tc.pre, tc.bos, tc.eos, tc.addBOS)
			tok, err := Load(path) // a GGUF file: its embedded vocabulary
			if err != nil {
				t.Fatal(err)
			}
			texts, notNFC, ids := 0, 0, 0
			for _, c := range v.Texts {
				got, err := tok.Encode(c.Text, false)
				if err != nil {
					t.Fatal(err)
				}
				gotS, _ := tok.Encode(c.Text, true)
				if tc.nfc && !norm.NFC.IsNormalString(c.Text) {
					notNFC++
					t.Logf("%s/%s: not NFC: ids equal %v", c.Part, c.Name, slices.Equal(got, c.IDs))
					continue
				}
				if !slices.Equal(got, c.IDs) || !slices.Equal(gotS, c.IDsSpecial) {
					i := firstDiff(c.IDs, got)
					t.Errorf("%s/%s: ids differ at %d: want %v got %v", c.Part, c.Name, i, c.IDs[i:min(len(c.IDs), i+6)], got[i:min(len(got), i+6)])
					continue
				}
				if d := tok.Decode(got, false); d != c.Decoded {
					t.Errorf("%s/%s: decode differs", c.Part, c.Name)
				}
				texts++
				ids += len(got)
			}
			tpl := tok.Template()
			if tpl == nil {
				t.Fatal("no chat template from tokenizer.chat_template")
			}
			chats, chatIDs := 0, 0
			for _, c := range v.Chats {
				got, err := tpl.Render(Chat{Messages: c.Messages, Tools: c.Tools, AddGenerationPrompt: c.AddGenerationPrompt, Extra: c.Extra})
				if err != nil || got != c.Rendered {
					t.Errorf("%s/%s: rendering differs (%v)", c.Part, c.Name, err)
					continue
				}
				gi, _ := tok.Encode(got, false)
				if tc.nfc && !norm.NFC.IsNormalString(got) {
					notNFC++
					continue
				}
				if !slices.Equal(gi, c.IDs) {
					t.Errorf("%s/%s: chat ids differ at %d", c.Part, c.Name, firstDiff(c.IDs, gi))
					continue
				}
				chats++
				chatIDs += len(gi)
			}
			t.Logf("%s from GGUF (pre %s): texts %d/%d equal (%d ids), chats %d/%d equal (%d ids); %d not NFC, left out",
				tc.m, tc.pre, texts, len(v.Texts), ids, chats, len(v.Chats), chatIDs, notNFC)
			if texts+chats+notNFC != len(v.Texts)+len(v.Chats) || !tc.nfc && notNFC > 0 {
				t.Errorf("not every case compared")
			}
		})
	}
}

func TestGGUFVocab(t *testing.T) {
	// The generator's tiny vocabulary: its own encoder (GPT-2's pattern,
	// what Ollama's Go engine runs for pre "default") agrees with the
	// Ollama engine dialect; llama.cpp's "default" is four patterns in
	// turn, and Ollama serves a llama architecture with llama.cpp.
	dir := t.TempDir()
	path := filepath.Join(dir, "tiny.gguf")
	m, err := gguf.WriteFile(path, gguf.Options{EmbeddingLength: 64, BlockCount: 1, FeedForwardLength: 64, HeadCount: 2, ContextLength: 256})
	if err != nil {
		t.Fatal(err)
	}
	meta, err := gguf.ReadMetadataFile(path, gguf.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	ollama, err := FromGGUF(meta, DialectOllamaEngine)
	if err != nil {
		t.Fatal(err)
	}
	cpp, err := FromGGUF(meta, DialectLlamaCpp)
	if err != nil {
		t.Fatal(err)
	}
	viaOllama, err := FromGGUF(meta, DialectOllama)
	if err != nil {
		t.Fatal(err)
	}
	const digits = "Call 1234567 now!!! ok"
	a, _ := cpp.Encode(digits, true)
	b, _ := viaOllama.Encode(digits, true)
	c, _ := ollama.Encode(digits, true)
	if !slices.Equal(a, b) || slices.Equal(a, c) {
		t.Fatalf("llama.cpp %v, Ollama (llama.cpp runner) %v, Ollama engine %v: want the first two equal, the third not", a, b, c)
	}
	text := "The quick brown fox's 12345 jumps -- over <|eot_id|> the lazy dog!\n\n  Done."
	want := m.Vocab.Tokenize(text, true)
	got, _ := ollama.Encode(text, true)
	if len(got) != len(want) {
		t.Fatalf("ollama dialect: %v, generator %v", got, want)
	}
	for i := range want {
		if uint32(want[i]) != got[i] {
			t.Fatalf("ollama dialect: %v, generator %v", got, want)
		}
	}
	if got[0] != uint32(m.Vocab.ID(gguf.BeginOfText)) || !slices.Contains(got, uint32(m.Vocab.ID(gguf.EndOfTurn))) {
		t.Fatalf("BOS or the control token missing: %v", got)
	}
	withArch := func(arch string) *gguf.Metadata {
		kvs := slices.Clone(meta.KVs)
		for i := range kvs {
			if kvs[i].Key == "general.architecture" {
				kvs[i].Value = arch
			}
		}
		return &gguf.Metadata{KVs: kvs}
	}
	qwen := withArch("qwen3")
	if q, err := FromGGUF(qwen, DialectOllama); err != nil || q.steps[0].split.maxDigits != 1 {
		t.Fatalf("qwen3 under Ollama: %v", err)
	}
	gemma := withArch("gemma3")
	if _, err := FromGGUF(gemma, DialectOllama); err == nil {
		t.Fatal("gemma3 under Ollama's engine: no error")
	}
	if _, err := Load(path); err != nil { // llama.cpp's "default"
		t.Fatal(err)
	}

	for _, tc := range []struct {
		kvs  []gguf.KV
		want string
	}{
		{[]gguf.KV{{Key: "tokenizer.ggml.model", Value: "llama"}}, `"llama" is not supported`},
		{[]gguf.KV{{Key: "tokenizer.ggml.model", Value: "gpt2"}, {Key: "tokenizer.ggml.pre", Value: "tekken"}, {Key: "tokenizer.ggml.tokens", Value: []string{"a"}}}, `"tekken" is not supported`},
		{[]gguf.KV{{Key: "tokenizer.ggml.model", Value: "gpt2"}, {Key: "tokenizer.ggml.pre", Value: "default"}}, "tokens missing"},
		{[]gguf.KV{{Key: "tokenizer.ggml.model", Value: "gpt2"}, {Key: "tokenizer.ggml.pre", Value: "default"}, {Key: "tokenizer.ggml.tokens", Value: []string{"a", "b"}},
			{Key: "tokenizer.ggml.merges", Value: []string{"a c"}}}, "out of vocabulary"},
		{[]gguf.KV{{Key: "tokenizer.ggml.model", Value: "gpt2"}, {Key: "tokenizer.ggml.pre", Value: "default"}, {Key: "tokenizer.ggml.tokens", Value: []string{"a", "b c"}}}, "not in the byte-level alphabet"},
		{[]gguf.KV{{Key: "tokenizer.ggml.model", Value: "gpt2"}, {Key: "tokenizer.ggml.pre", Value: "default"}, {Key: "tokenizer.ggml.tokens", Value: []string{"a"}},
			{Key: "tokenizer.ggml.token_type", Value: []int32{1, 1}}}, "2 token types for 1 tokens"},
	} {
		_, err := FromGGUF(&gguf.Metadata{KVs: tc.kvs}, "")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.kvs, err, tc.want)
		}
	}
}
