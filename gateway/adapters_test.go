package gateway

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/simserver"
)

// loraFleet starts n simulated engines serving model "m" with LoRA
// adapters (infergate sim --lora-modules a,b --max-loras 1) and KV events,
// and a gateway in front of them configured with the base model only: the
// adapters are discovered from the engines' GET /v1/models.
//
// The scrape interval is long so that a scrape stays fresh (three
// intervals) however loaded the host: the residency tests wait for the
// scrape that shows what they set up, then decide on it.
func loraFleet(t *testing.T, n int, timeScale float64, policy string) (*Gateway, string, *simserver.Fleet) {
	t.Helper()
	eng := sim.Config{LoRA: sim.LoRAConfig{Adapters: []string{"a", "b"}, MaxLoras: 1}}
	f, err := simserver.StartFleet(n, simserver.ServerConfig{Model: "m", TimeScale: timeScale, Engine: eng,
		KVEvents: kvevents.PublisherConfig{Enable: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	pub, replay := f.KVEventEndpoints()
	cfg := Config{HealthCheckInterval: time.Second, ScrapeInterval: 5 * time.Second, HealthCheckTimeout: 10 * time.Second}
	cfg.ResponseHeaders.Endpoint = true
	cfg.Routing.Policy = policy
	for i, u := range f.URLs {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: u, Model: "m", Kind: fleet.Sim,
			KVEvents: &KVEventsConfig{Endpoint: pub[i], ReplayEndpoint: replay[i]}})
	}
	g, url := startGateway(t, cfg)
	return g, url, f
}

// chatBody is a chat request for model with the system prompt sys.
func loraChat(model, sys, q string, maxTokens int, stream bool) string {
	b, _ := json.Marshal(map[string]any{"model": model, "max_tokens": maxTokens, "stream": stream,
		"messages": []map[string]string{{"role": "system", "content": sys}, {"role": "user", "content": q}}})
	return string(b)
}

// cachedTokens reads usage.prompt_tokens_details.cached_tokens of an answer.
func cachedTokens(t *testing.T, b []byte) int {
	t.Helper()
	var out struct {
		Model string `json:"model"`
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("%v: %s", err, b)
	}
	return out.Usage.Details.Cached
}

// TestLoRAAdaptersDiscovered: adapters an engine lists with a parent are
// served through the base model's pool, the body keeps the adapter's name
// (the engine answers as the adapter), GET /v1/models lists them with
// their parent, and an adapter nobody serves is 404 model_not_found.
func TestLoRAAdaptersDiscovered(t *testing.T) {
	g, url, _ := loraFleet(t, 2, 100, sched.CacheAware)
	c := testClient(t)
	resp, err := c.Get(url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var list openai.ModelList
	if err := json.Unmarshal(b, &list); err != nil {
		t.Fatal(err)
	}
	parents := map[string]string{}
	for _, m := range list.Data {
		parents[m.ID] = ""
		if m.Parent != nil {
			parents[m.ID] = *m.Parent
		}
	}
	if want := map[string]string{"m": "", "a": "m", "b": "m"}; !mapsEqual(parents, want) {
		t.Fatalf("GET /v1/models: %v, want %v (%s)", parents, want, b)
	}
	resp, b = post(t, c, url+pathChat, loraChat("a", "sys", "hi", 2, false))
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"model":"a"`) {
		t.Fatalf("adapter request: %d %s", resp.StatusCode, b)
	}
	resp, b = post(t, c, url+pathChat, loraChat("zzz", "sys", "hi", 2, false))
	if resp.StatusCode != http.StatusNotFound || !strings.Contains(string(b), openai.CodeModelNotFound) {
		t.Fatalf("unknown adapter: %d %s", resp.StatusCode, b)
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_lora_adapters", `model="m"`); v != 2 {
		t.Errorf("infergate_lora_adapters{model=m} = %v, want 2", v)
	}
	if v := m.value("infergate_lora_picks_total", `model="m"`); v != 1 {
		t.Errorf("infergate_lora_picks_total = %v, want 1", v)
	}
	if v := m.value("infergate_requests_total", `model="m"`); v != 1 {
		t.Errorf("the adapter's request is not counted under its base model: %v", v)
	}
	if st := g.state.Load(); st.adapters["a"] != "m" || st.adapters["b"] != "m" {
		t.Errorf("adapters %v", st.adapters)
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// TestLoRAResidency: with one adapter slot per engine (max_loras 1), an
// engine busy with adapter b is full for adapter a (the adapter-capacity
// filter keeps a off it) and the best place for b (the lora scorer), as
// its scraped vllm:lora_requests_info says; both with the default policy.
func TestLoRAResidency(t *testing.T) {
	g, url, _ := loraFleet(t, 3, 1, sched.CacheAware)
	c := testClient(t)

	// A long stream under b holds b on one engine.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+pathChat,
		strings.NewReader(loraChat("b", "sys", "write a long story", 100000, true)))
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("stream: %d", resp.StatusCode)
	}
	busy := resp.Header.Get(EndpointHeader)
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	p := g.state.Load().pools["m"]
	slot := slices.IndexFunc(p.endpoints, func(ep *endpoint) bool { return ep.name == busy })
	if slot < 0 {
		t.Fatalf("stream served by %q, not an endpoint of m", busy)
	}
	waitFor(t, "the scrape to show b running on "+busy+" and every engine's adapters", func() bool {
		for i, f := range p.scrapes {
			l, _, ok := f.latest(time.Now())
			want := []string(nil)
			if i == slot {
				want = []string{"b"}
			}
			if !ok || !l.LoRA.Known || !slices.Equal(l.LoRA.Running, want) || l.LoRA.Max != 1 {
				return false
			}
		}
		return true
	})

	for i := range 6 {
		resp, b := post(t, c, url+pathChat, loraChat("a", "sys", fmt.Sprintf("question %d", i), 2, false))
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("a: %d %s", resp.StatusCode, b)
		}
		if got := resp.Header.Get(EndpointHeader); got == busy {
			t.Fatalf("request %d for a went to %s, whose one adapter slot b holds", i, busy)
		}
	}
	for i := range 4 {
		resp, b := post(t, c, url+pathChat, loraChat("b", "sys", fmt.Sprintf("question %d", i), 2, false))
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("b: %d %s", resp.StatusCode, b)
		}
		if got := resp.Header.Get(EndpointHeader); got != busy {
			t.Fatalf("request %d for b went to %s, not %s where b is resident", i, got, busy)
		}
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_lora_picks_total", `placement="resident"`); v < 4 {
		t.Errorf("resident picks %v, want ≥ 4: %q", v, m.lines("infergate_lora_picks_total"))
	}
}

// TestLoRAPrefixIdentity: blocks an engine computed under an adapter are
// keyed apart from the base model's and from another adapter's, in the
// precise index (from the engines' KV events, lora_name) and in routing:
// the same prompt under the adapter again is routed to its holder and
// served from cache, while the base model and the other adapter are
// predicted no hit there and the engine serves them none.
func TestLoRAPrefixIdentity(t *testing.T) {
	g, url, _ := loraFleet(t, 3, 100, sched.PrecisePrefix)
	c := testClient(t)
	sys := strings.Repeat("You are a careful assistant who answers in full sentences. ", 40)
	chat := func(model, q string) (cached int, ep string) {
		t.Helper()
		resp, b := post(t, c, url+pathChat, loraChat(model, sys, q, 2, false))
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", model, resp.StatusCode, b)
		}
		return cachedTokens(t, b), resp.Header.Get(EndpointHeader)
	}
	_, home := chat("a", "first question")
	ix := g.PreciseIndex("m")
	waitFor(t, "the adapter's KV events in the precise index", func() bool {
		n := 0
		for e := range ix.Endpoints() {
			n += ix.Len(e, prefix.MediumGPU)
		}
		return n >= 30
	})
	predicted := func() float64 {
		return scrape(t, c, url).value("infergate_prefix_predicted_matched_tokens_total", `model="m"`)
	}
	before := predicted()
	for _, q := range []string{"second question", "third question"} {
		cached, ep := chat("a", q)
		if ep != home || cached < 400 {
			t.Fatalf("adapter follow-up: %d cached tokens on %s, want the ~480-token system prompt on %s", cached, ep, home)
		}
	}
	if got := predicted() - before; got < 800 {
		t.Fatalf("adapter follow-ups predicted %v matched tokens, want ≥ 800", got)
	}
	for _, model := range []string{"m", "b"} {
		before := predicted()
		cached, ep := chat(model, "first question")
		if got := predicted() - before; got != 0 {
			t.Errorf("%s: predicted %v matched tokens of the adapter a's blocks", model, got)
		}
		if cached != 0 {
			t.Errorf("%s: %d cached tokens on %s: the engine shared a's blocks", model, cached, ep)
		}
	}
}

// TestLoRAAdaptersConfigured: adapters listed in the configuration route
// to their base model's pool without any model list (a fake engine that
// has none), and the configuration refuses an adapter under an unknown
// model or with a configured model's name.
func TestLoRAAdaptersConfigured(t *testing.T) {
	e := newFakeEngine(t, "e")
	cfg := testConfig(sched.CacheAware, e)
	cfg.Adapters = map[string][]string{"m": {"sql-lora"}}
	_, url := startGateway(t, cfg)
	c := testClient(t)
	resp, b := post(t, c, url+pathChat, `{"model":"sql-lora","messages":[{"role":"user","content":"hi"}],"max_tokens":1}`)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	_, sent := e.last()
	if got := modelOf(sent); got != "sql-lora" {
		t.Errorf("the engine was asked for %q, want the adapter's name", got)
	}
	for _, bad := range []map[string][]string{{"x": {"a"}}, {"m": {"m"}}, {"m": {""}}, {"m": {}}} {
		cfg := testConfig(sched.CacheAware, e).WithDefaults()
		cfg.Adapters = bad
		if err := cfg.Validate(); err == nil {
			t.Errorf("adapters %v accepted", bad)
		}
	}
}

// TestLoRAAdapterLoadedAtRunTime: an adapter an engine starts listing
// after the gateway started (vLLM's /v1/load_lora_adapter) is routed once
// the endpoint's model list is read again, only to that endpoint.
func TestLoRAAdapterLoadedAtRunTime(t *testing.T) {
	e1, e2 := newFakeEngine(t, "e1"), newFakeEngine(t, "e2")
	setModels(e1, `{"object":"list","data":[{"id":"m"}]}`)
	setModels(e2, `{"object":"list","data":[{"id":"m"}]}`)
	cfg := testConfig(sched.CacheAware, e1, e2)
	cfg.ModelsRefreshInterval = 20 * time.Millisecond
	cfg.ResponseHeaders.Endpoint = true
	g, url := startGateway(t, cfg)
	c := testClient(t)
	body := `{"model":"late","messages":[{"role":"user","content":"hi"}],"max_tokens":1}`
	if resp, b := post(t, c, url+pathChat, body); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("before the adapter is loaded: %d %s", resp.StatusCode, b)
	}
	setModels(e2, `{"object":"list","data":[{"id":"m"},{"id":"late","parent":"m"}]}`)
	waitFor(t, "the adapter to be discovered", func() bool { return g.state.Load().adapters["late"] == "m" })
	for range 4 {
		resp, b := post(t, c, url+pathChat, body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		if got := resp.Header.Get(EndpointHeader); got != e2.URL() {
			t.Fatalf("adapter request went to %s, which does not list it", got)
		}
	}
	setModels(e2, `{"object":"list","data":[{"id":"m"}]}`)
	waitFor(t, "the adapter to be forgotten", func() bool { return g.state.Load().adapters["late"] == "" })
	if resp, b := post(t, c, url+pathChat, body); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("after the adapter was unloaded: %d %s", resp.StatusCode, b)
	}
}

func setModels(e *fakeEngine, list string) { e.models.Store(&list) }

func modelOf(body []byte) string {
	var r struct {
		Model string `json:"model"`
	}
	_ = json.Unmarshal(body, &r)
	return r.Model
}

// lines are the samples of name.
func (s scraped) lines(name string) []string {
	var out []string
	for _, l := range s {
		if strings.HasPrefix(l, name+"{") {
			out = append(out, l)
		}
	}
	return out
}

// TestLoRAAdapterConfiguredAsModel: an adapter whose engines are listed
// under its own name (a pool of its own, as configurations had it before
// adapters were known) is still routed as that adapter: its requests name
// it to the scheduler (the lora scorer and the placement counter see it)
// and are sent unchanged.
func TestLoRAAdapterConfiguredAsModel(t *testing.T) {
	e := newFakeEngine(t, "e")
	setModels(e, `{"object":"list","data":[{"id":"m","max_model_len":4096},{"id":"a","parent":"m"}]}`)
	cfg := testConfig(sched.CacheAware, e)
	// max_model_len 0: GET /v1/models is read when the endpoint is added.
	cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: e.URL(), Model: "a", KVBlocks: 1000})
	cfg.ResponseHeaders.Endpoint = true
	g, url := startGateway(t, cfg)
	if p := g.state.Load().pools["a"]; p == nil || p.adapter != "a" {
		t.Fatalf("pool a: %+v", p)
	}
	c := testClient(t)
	resp, b := post(t, c, url+pathChat, `{"model":"a","messages":[{"role":"user","content":"hi"}],"max_tokens":1}`)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if _, sent := e.last(); modelOf(sent) != "a" {
		t.Errorf("the engine was asked for %q", modelOf(sent))
	}
	if v := scrape(t, c, url).value("infergate_lora_picks_total", `model="a"`); v != 1 {
		t.Errorf("adapter picks of pool a: %v, want 1", v)
	}
}

// TestModelListReorderIsNoChange: an engine (or a proxy in front of it)
// that lists the same models and adapters in another order at each read
// does not count as a change, so it cannot make the gateway rebuild its
// state every models_refresh_interval (before: every reordered read was a
// change and a full rebuild); an added, removed or re-parented adapter
// still is.
func TestModelListReorderIsNoChange(t *testing.T) {
	parse := func(body string) *fleet.ModelList {
		l, err := fleet.ParseModelList([]byte(body))
		if err != nil {
			t.Fatal(err)
		}
		return &l
	}
	ep := &endpoint{}
	if _, changed := ep.setModels(parse(`{"data":[{"id":"m"},{"id":"a","parent":"m"},{"id":"b","parent":"m"}]}`)); !changed {
		t.Fatal("the first list is a change")
	}
	for _, c := range []struct {
		body    string
		changed bool
	}{
		{`{"data":[{"id":"b","parent":"m"},{"id":"m"},{"id":"a","parent":"m"}]}`, false},
		{`{"data":[{"id":"a","parent":"m"},{"id":"b","parent":"m"},{"id":"m"}]}`, false},
		{`{"data":[{"id":"a","parent":"m"},{"id":"b","parent":"x"},{"id":"m"}]}`, true},
		{`{"data":[{"id":"a","parent":"m"},{"id":"m"}]}`, true},
		{`{"data":[{"id":"a","parent":"m"},{"id":"m"},{"id":"c","parent":"m"}]}`, true},
		{`{"data":[{"id":"c","parent":"m"},{"id":"a","parent":"m"},{"id":"m"}]}`, false},
	} {
		if _, changed := ep.setModels(parse(c.body)); changed != c.changed {
			t.Errorf("%s: changed %v, want %v", c.body, changed, c.changed)
		}
	}
}

// TestLoRAServedSortedForSearch: an endpoint's served names are kept
// sorted, whatever order its engine lists them in, so that serves and
// sched's model filter find an adapter by binary search (before: a linear
// scan per endpoint per pick, ~3 µs per endpoint listing 1,024 adapters);
// every listed adapter, first or last, is still routed to it.
func TestLoRAServedSortedForSearch(t *testing.T) {
	e := newFakeEngine(t, "e")
	var b strings.Builder
	b.WriteString(`{"object":"list","data":[{"id":"m"}`)
	for i := 99; i >= 0; i-- {
		fmt.Fprintf(&b, `,{"id":"lora-%02d","parent":"m"},{"id":"lora-%02d","parent":"m"}`, i, i)
	}
	b.WriteString(`]}`)
	setModels(e, b.String())
	g, url := startGateway(t, testConfig(sched.CacheAware, e))
	waitFor(t, "the adapters to be discovered", func() bool { return g.state.Load().adapters["lora-00"] == "m" })
	served := g.state.Load().pools["m"].served[0]
	if len(served) != 101 || !slices.IsSorted(served) {
		t.Fatalf("served names not sorted and unique: %d %v", len(served), served)
	}
	c := testClient(t)
	for _, m := range []string{"lora-99", "lora-00", "lora-42", "m"} {
		if resp, body := post(t, c, url+pathChat, `{"model":"`+m+`","messages":[{"role":"user","content":"hi"}],"max_tokens":1}`); resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", m, resp.StatusCode, body)
		}
	}
	if resp, body := post(t, c, url+pathChat, `{"model":"lora-100","messages":[{"role":"user","content":"hi"}],"max_tokens":1}`); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("an adapter no engine lists: %d %s", resp.StatusCode, body)
	}
	if serves(served, "lora-100") || !serves(served, "lora-50") || !serves(nil, "x") || !serves(served, "") {
		t.Fatal("serves")
	}
}

// BenchmarkServes1024: the pick path's per-endpoint adapter check on an
// engine listing fleet.MaxListedModels adapters (the last one asked).
func BenchmarkServes1024(b *testing.B) {
	names := []string{"m"}
	for i := range fleet.MaxListedModels {
		names = append(names, fmt.Sprintf("org/lora-adapter-%05d", i))
	}
	slices.Sort(names)
	want := fmt.Sprintf("org/lora-adapter-%05d", fleet.MaxListedModels-1)
	b.ReportAllocs()
	for b.Loop() {
		if !serves(names, want) {
			b.Fatal("not found")
		}
	}
}
