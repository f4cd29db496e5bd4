package gateway

import (
	"path/filepath"
	"slices"
	"testing"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/gguf"
	"github.com/infergate/infergate/hftokenizer"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

// A pool can name a GGUF model file as its tokenizer: routing tokenizes
// with its embedded vocabulary, read as the pool's engines read it.
func TestPoolTokenizerGGUF(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tiny.gguf")
	if _, err := gguf.WriteFile(path, gguf.Options{EmbeddingLength: 64, BlockCount: 1, FeedForwardLength: 64, HeadCount: 2, ContextLength: 256}); err != nil {
		t.Fatal(err)
	}
	e := newFakeEngine(t, "a")
	cfg := testConfig(sched.CacheAware, e)
	cfg.Tokenizers = map[string]string{"m": path}
	g, url := startGateway(t, cfg)
	p := g.state.Load().pools["m"]
	if p.hf == nil {
		t.Fatal("pool m has no tokenizer of its own")
	}
	meta, err := gguf.ReadMetadataFile(path, gguf.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	want, err := hftokenizer.FromGGUF(meta, hftokenizer.DialectLlamaCpp)
	if err != nil {
		t.Fatal(err)
	}
	const text = "Hello, world! 12345 <|eot_id|> done"
	x := &exchange{body: []byte(`{"model":"m","prompt":"` + text + `"}`)}
	if err := openai.Decode(x.body, &x.comp); err != nil {
		t.Fatal(err)
	}
	ids, _ := want.Encode(text, true)
	if got := x.promptTokens(kindCompletion, p, true); !slices.Equal(got, ids) {
		t.Fatalf("completion tokens %v, want the GGUF vocabulary's %v", got, ids)
	}
	if m := scrape(t, testClient(t), url); m.value("infergate_pool_tokenizer", `model="m",tokenizer="`+path+`"`) != 1 {
		t.Error("infergate_pool_tokenizer does not name the GGUF file")
	}
	ollama := &endpointSpec{kind: fleet.Ollama}
	vllm := &endpointSpec{kind: fleet.VLLM}
	eps := []*endpoint{{}, {}}
	for _, tc := range []struct {
		specs []*endpointSpec
		want  string
	}{{[]*endpointSpec{ollama, ollama}, hftokenizer.DialectOllama}, {[]*endpointSpec{ollama, vllm}, hftokenizer.DialectLlamaCpp}} {
		specOf := func(ep *endpoint) *endpointSpec { return tc.specs[slices.Index(eps, ep)] }
		if got := ggufDialect(eps, specOf); got != tc.want {
			t.Errorf("dialect %q, want %q", got, tc.want)
		}
	}
	if ggufDialect(nil, nil) != hftokenizer.DialectLlamaCpp {
		t.Error("no endpoint: not llama.cpp's")
	}
}
