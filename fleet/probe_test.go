package fleet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/openai"
)

// deepJSONProbe nests one level past openai.MaxDepth.
var deepJSONProbe = strings.Repeat("[", openai.MaxDepth+1) + strings.Repeat("]", openai.MaxDepth+1)

func TestParseCacheConfig(t *testing.T) {
	text := "# TYPE vllm:cache_config_info gauge\n" +
		`vllm:cache_config_info{block_size="16",cache_dtype="auto",note="a \"quoted\", value",num_gpu_blocks="27000"} 1.0` + "\n"
	cc, err := ParseCacheConfig(strings.NewReader(text))
	if err != nil || cc.NumGPUBlocks != 27000 || cc.BlockSize != 16 {
		t.Errorf("got %+v, %v", cc, err)
	}
	if _, err := ParseCacheConfig(strings.NewReader("vllm:num_requests_running 1\n")); err == nil {
		t.Error("no error without cache_config_info")
	}
}

// FuzzParseMaxModelLen: an engine's model list never panics the parser,
// and what it reads is a context length within bounds.
func FuzzParseMaxModelLen(f *testing.F) {
	for _, s := range []string{`{"object":"list","data":[{"id":"m","max_model_len":131072},{"id":"a","parent":"m"}]}`,
		`{"data":[{"max_model_len":1e30}]}`, `{"data":[{"max_model_len":-5}]}`, `{"data":null}`, `[]`,
		`{"data":[{"max_model_len":` + deepJSONProbe + `}]}`, `{"data":` + strings.Repeat("[", 1<<14) + `}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		n, err := ParseMaxModelLen(b)
		if (err == nil) != (n > 0) || n > MaxModelLenLimit {
			t.Fatalf("%q: %d, %v", b, n, err)
		}
	})
}

// FuzzParseModelList: an engine's model list never panics the parser, and
// what it keeps is within bounds: at most MaxListedModels ids of 1 to
// MaxModelIDBytes bytes, adapters among them with another, bounded parent.
func FuzzParseModelList(f *testing.F) {
	for _, s := range []string{
		`{"object":"list","data":[{"id":"m","max_model_len":131072,"parent":null},{"id":"a","parent":"m","root":"/adapters/a"}]}`,
		`{"data":[{"id":"a","parent":"a"},{"id":"","parent":"m"},{"id":"b","parent":""}]}`,
		`{"data":[{"id":5}]}`, `{"data":null}`, `[]`, `{"data":[{"id":"x","parent":{"a":1}}]}`,
		`{"data":` + strings.Repeat("[", 1<<14) + `}`, `{"data":[{"id":"` + strings.Repeat("x", 300) + `"}]}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		l, err := ParseModelList(b)
		if err != nil {
			if len(l.IDs) != 0 || len(l.Adapters) != 0 {
				t.Fatalf("%q: an error with a list %+v", b, l)
			}
			return
		}
		if len(l.IDs) > MaxListedModels || len(l.Adapters) > len(l.IDs) {
			t.Fatalf("%q: %d ids, %d adapters", b, len(l.IDs), len(l.Adapters))
		}
		for _, id := range l.IDs {
			if id == "" || len(id) > MaxModelIDBytes {
				t.Fatalf("%q: id %q kept", b, id)
			}
		}
		for _, a := range l.Adapters {
			if !l.Lists(a.Name) || a.Parent == "" || a.Parent == a.Name || len(a.Parent) > MaxModelIDBytes {
				t.Fatalf("%q: adapter %+v kept", b, a)
			}
		}
	})
}

// TestParseModelList reads vLLM's model list: the base model and each
// adapter with its parent, bounded.
func TestParseModelList(t *testing.T) {
	body := `{"object":"list","data":[{"id":"meta-llama/Llama-3.1-8B-Instruct","object":"model","root":"/models/llama","parent":null,"max_model_len":131072},` +
		`{"id":"sql-lora","object":"model","root":"/adapters/sql","parent":"meta-llama/Llama-3.1-8B-Instruct"}]}`
	l, err := ParseModelList([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"meta-llama/Llama-3.1-8B-Instruct", "sql-lora"}; !slices.Equal(l.IDs, want) {
		t.Errorf("ids %v, want %v", l.IDs, want)
	}
	if want := []ListedAdapter{{Name: "sql-lora", Parent: "meta-llama/Llama-3.1-8B-Instruct"}}; !slices.Equal(l.Adapters, want) {
		t.Errorf("adapters %v, want %v", l.Adapters, want)
	}
	var many strings.Builder
	many.WriteString(`{"data":[`)
	for i := range MaxListedModels + 10 {
		if i > 0 {
			many.WriteByte(',')
		}
		fmt.Fprintf(&many, `{"id":"a%d","parent":"m"}`, i)
	}
	many.WriteString(`]}`)
	if l, err := ParseModelList([]byte(many.String())); err != nil || len(l.IDs) != MaxListedModels {
		t.Errorf("%d entries kept, %v; want %d", len(l.IDs), err, MaxListedModels)
	}
	if _, err := ParseModelList(make([]byte, maxModelsBody+1)); err == nil {
		t.Error("a list over the bound parsed")
	}
}

// TestProber: the reads carry the endpoint's header, tell a refusal of its
// credentials from other failures, and read what the engine reports.
func TestProber(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer k" {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		switch r.URL.Path {
		case "/health":
			w.WriteHeader(http.StatusOK)
		case "/metrics":
			io.WriteString(w, `vllm:cache_config_info{block_size="32",num_gpu_blocks="900"} 1`+"\n")
		case ModelsPath:
			io.WriteString(w, `{"data":[{"id":"m","max_model_len":8192}]}`)
		default:
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	p := Prober{Transport: http.DefaultTransport, Timeout: 10 * time.Second}
	ok := http.Header{"Authorization": {"Bearer k"}}
	ctx := context.Background()
	if err := p.Health(ctx, "e", srv.URL+"/health", ok); err != nil {
		t.Errorf("health: %v", err)
	}
	err := p.Health(ctx, "e", srv.URL+"/health", nil)
	var ar AuthRefused
	if !errors.As(err, &ar) || int(ar) != http.StatusUnauthorized || !errors.Is(err, ErrAuthRefused) ||
		!strings.HasPrefix(err.Error(), "health check e: status 401: ") {
		t.Errorf("health without the key: %v", err)
	}
	if err := p.Health(ctx, "e", srv.URL+"/down", ok); err == nil || errors.As(err, &ar) || err.Error() != "health check e: status 503" {
		t.Errorf("health of a 503: %v", err)
	}
	if cc, err := p.CacheConfig(ctx, srv.URL, ok); err != nil || cc != (CacheConfig{NumGPUBlocks: 900, BlockSize: 32}) {
		t.Errorf("cache config: %+v, %v", cc, err)
	}
	if n, err := p.MaxModelLen(ctx, srv.URL, ok); err != nil || n != 8192 {
		t.Errorf("max_model_len: %d, %v", n, err)
	}
	if _, err := p.MaxModelLen(ctx, srv.URL, nil); !errors.As(err, &ar) {
		t.Errorf("max_model_len without the key: %v", err)
	}
}

// TestUnanswered: a read that got no HTTP answer — the connection refused,
// no headers within Timeout — is Unanswered; one answered with a status
// (503, 401) or a page that does not parse is not.
func TestUnanswered(t *testing.T) {
	hole := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	defer hole.Close()
	status := func(code int) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(code) }))
	}
	down, locked, garbage := status(http.StatusServiceUnavailable), status(http.StatusUnauthorized), status(http.StatusOK)
	defer down.Close()
	defer locked.Close()
	defer garbage.Close()
	refused := httptest.NewServer(http.NotFoundHandler())
	refusedURL := refused.URL
	refused.Close() // nothing listens there now
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	p := Prober{Transport: tr, Timeout: 100 * time.Millisecond}
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"refused", p.Health(context.Background(), "e", refusedURL+"/health", nil), true},
		{"no answer within the timeout", p.Health(context.Background(), "e", hole.URL+"/health", nil), true},
		{"503", p.Health(context.Background(), "e", down.URL+"/health", nil), false},
		{"401", p.Health(context.Background(), "e", locked.URL+"/health", nil), false},
		{"no cache config on the page", func() error { _, err := p.CacheConfig(context.Background(), garbage.URL, nil); return err }(), false},
		{"no error", nil, false},
	} {
		if c.want && c.err == nil {
			t.Fatalf("%s: no error", c.name)
		}
		if got := Unanswered(c.err); got != c.want {
			t.Errorf("%s (%v): Unanswered %v, want %v", c.name, c.err, got, c.want)
		}
	}
}
