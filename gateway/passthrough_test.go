package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/simserver"
)

// simFleet starts n simulated engines serving model with the Responses
// store on, closed at the end of the test.
func simFleet(t *testing.T, n int, model string) *simserver.Fleet {
	t.Helper()
	f, err := simserver.StartFleet(n, simserver.ServerConfig{Model: model, TimeScale: 1000, ResponsesStore: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	return f
}

// fleetConfig is a gateway config over the fleets' engines, each fleet
// serving its model, with policy.
func fleetConfig(policy string, fleets map[string]*simserver.Fleet) Config {
	cfg := Config{HealthCheckInterval: 20 * time.Millisecond, ScrapeInterval: -1}
	cfg.Routing.Policy = policy
	for model, f := range fleets {
		for _, u := range f.URLs {
			cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: u, Model: model, Kind: fleet.Sim})
		}
	}
	return cfg
}

func jsonOf[T any](t *testing.T, b []byte) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("decode %s: %v", b, err)
	}
	return v
}

// respAnswer is what the tests read of a Responses answer.
type respAnswer struct {
	ID     string `json:"id"`
	Model  string `json:"model"`
	Output []struct {
		Content []struct {
			Text string `json:"text"`
		} `json:"content"`
	} `json:"output"`
	Usage *openai.ResponseUsage `json:"usage"`
}

// TestResponsesAffinity: under round-robin over two engines, a chain of
// continuations (previous_response_id) each reaches the engine that stored
// the previous response; without affinity half of them would go to the
// other engine, which answers 404. The continuations also hit the stored
// conversation in the prefix cache, and their usage is accounted.
func TestResponsesAffinity(t *testing.T) {
	f := simFleet(t, 2, "m")
	g, url := startGateway(t, fleetConfig(sched.RoundRobin, map[string]*simserver.Fleet{"m": f}))
	c := testClient(t)

	prev, input := "", 0
	for turn := range 6 {
		body := fmt.Sprintf(`{"model":"m","input":"turn %d of a conversation","max_output_tokens":4`, turn)
		if prev != "" {
			body += `,"previous_response_id":"` + prev + `"`
		}
		resp, b := post(t, c, url+pathResponses, body+"}")
		if resp.StatusCode != 200 {
			t.Fatalf("turn %d: %d %s", turn, resp.StatusCode, b)
		}
		r := jsonOf[respAnswer](t, b)
		if r.Usage == nil || r.Usage.InputTokens <= input {
			t.Fatalf("turn %d: usage %+v, want more input than %d (the stored turns)", turn, r.Usage, input)
		}
		if turn > 0 && r.Usage.InputTokensDetails.CachedTokens == 0 {
			t.Errorf("turn %d: no cached tokens on the engine holding the conversation", turn)
		}
		prev, input = r.ID, r.Usage.InputTokens
	}
	if n := g.affinity.len(); n != 6 {
		t.Errorf("affinity remembers %d ids, want 6", n)
	}
	// GET /v1/responses/{id} reaches the engine that stored it.
	for range 4 {
		resp, err := c.Get(url + pathResponses + "/" + prev)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || jsonOf[respAnswer](t, b).ID != prev {
			t.Fatalf("retrieve: %d %s", resp.StatusCode, b)
		}
	}
	resp, b := post(t, c, url+pathResponses+"/"+prev+"/cancel", "")
	if resp.StatusCode != 400 || !strings.Contains(string(b), "Cannot cancel") {
		t.Errorf("cancel: %d %s", resp.StatusCode, b)
	}
	// An id the gateway does not know: routed by load (auth off), the
	// engine's 404 relayed; by id it cannot be routed at all.
	resp, b = post(t, c, url+pathResponses, `{"model":"m","input":"x","previous_response_id":"resp_unknown"}`)
	if resp.StatusCode != 404 || !strings.Contains(string(b), "resp_unknown") {
		t.Errorf("unknown continuation: %d %s", resp.StatusCode, b)
	}
	r2, err := c.Get(url + pathResponses + "/resp_unknown")
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(r2.Body)
	r2.Body.Close()
	if r2.StatusCode != 404 || codeStr(decodeError(t, b).Code) != "not_found" {
		t.Errorf("unknown id: %d %s", r2.StatusCode, b)
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_prompt_tokens_total", `model="m"`); v < float64(input) {
		t.Errorf("prompt_tokens_total %v, want at least %d", v, input)
	}
	if v := m.value("infergate_cached_prompt_tokens_total", `model="m"`); v == 0 {
		t.Error("no cached tokens accounted")
	}
	if v := m.value("infergate_api_requests_total", `api="responses"`); v != 7 {
		t.Errorf("api_requests_total{responses} = %v, want 7", v)
	}
	if v := m.value("infergate_api_requests_total", `api="responses_by_id"`); v != 6 {
		t.Errorf("api_requests_total{responses_by_id} = %v, want 6", v)
	}
}

// TestResponsesAffinityOwnedByKey: with API keys a response id belongs to
// the key that created it; another key's continuation or retrieval is not
// found, and so is an id the gateway never saw.
func TestResponsesAffinityOwnedByKey(t *testing.T) {
	f := simFleet(t, 2, "m")
	cfg := fleetConfig(sched.RoundRobin, map[string]*simserver.Fleet{"m": f})
	if err := cfg.Auth.AddKeys("alice plain:"+keyAlice+"; bob plain:"+keyBob, "test"); err != nil {
		t.Fatal(err)
	}
	_, url := startGateway(t, cfg)
	c := testClient(t)
	resp, b := post(t, c, url+pathResponses, `{"model":"m","input":"secret","max_output_tokens":2}`, "Authorization", "Bearer "+keyAlice)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	id := jsonOf[respAnswer](t, b).ID
	cont := `{"model":"m","input":"more","max_output_tokens":2,"previous_response_id":"` + id + `"}`
	for range 3 { // round-robin: every turn must reach the engine
		if resp, b := post(t, c, url+pathResponses, cont, "Authorization", "Bearer "+keyAlice); resp.StatusCode != 200 {
			t.Fatalf("owner's continuation: %d %s", resp.StatusCode, b)
		}
	}
	for _, prev := range []string{id, "resp_never_seen"} {
		resp, b := post(t, c, url+pathResponses, strings.Replace(cont, id, prev, 1), "Authorization", "Bearer "+keyBob)
		e := decodeError(t, b)
		if resp.StatusCode != 404 || codeStr(e.Code) != codePreviousNotFound || str(e.Param) != "previous_response_id" {
			t.Errorf("bob continues %s: %d %s", prev, resp.StatusCode, b)
		}
	}
	req, _ := http.NewRequest(http.MethodGet, url+pathResponses+"/"+id, nil)
	req.Header.Set("Authorization", "Bearer "+keyBob)
	r, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	r.Body.Close()
	if r.StatusCode != 404 {
		t.Errorf("bob retrieves alice's response: %d", r.StatusCode)
	}
	// Unauthenticated: 401 on every new path.
	for _, p := range []string{pathResponses, pathEmbeddings, pathTokenize, pathDetokenize, "/v1/rerank", pathResponses + "/" + id} {
		if resp, b := post(t, c, url+p, `{"model":"m"}`); resp.StatusCode != 401 {
			t.Errorf("%s without a key: %d %s", p, resp.StatusCode, b)
		}
	}
}

// TestResponsesRequestIDTakeover is the attack run's takeover: Bob sends
// request_id set to Alice's response id (vLLM stores the response under it,
// replacing hers). It is refused 400, Alice keeps retrieving and
// continuing her response, and Bob still cannot read it; Bob's own
// request_id passes, and so does reusing it (his own response, replaced).
func TestResponsesRequestIDTakeover(t *testing.T) {
	f := simFleet(t, 2, "m")
	cfg := fleetConfig(sched.RoundRobin, map[string]*simserver.Fleet{"m": f})
	if err := cfg.Auth.AddKeys("alice plain:"+keyAlice+"; bob plain:"+keyBob, "test"); err != nil {
		t.Fatal(err)
	}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	resp, b := post(t, c, url+pathResponses, `{"model":"m","input":"secret","max_output_tokens":2}`, "Authorization", "Bearer "+keyAlice)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	id := jsonOf[respAnswer](t, b).ID
	resp, b = post(t, c, url+pathResponses, `{"model":"m","input":"mine now","max_output_tokens":2,"request_id":"`+id+`"}`, "Authorization", "Bearer "+keyBob)
	if e := decodeError(t, b); resp.StatusCode != 400 || str(e.Param) != "request_id" {
		t.Errorf("bob's request_id = alice's id: %d %s, want 400 on request_id", resp.StatusCode, b)
	}
	get := func(key string) int {
		req, _ := http.NewRequest(http.MethodGet, url+pathResponses+"/"+id, nil)
		req.Header.Set("Authorization", "Bearer "+key)
		r, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		r.Body.Close()
		return r.StatusCode
	}
	if a, b := get(keyAlice), get(keyBob); a != 200 || b != 404 {
		t.Errorf("GET alice's response: alice %d, bob %d; want 200, 404", a, b)
	}
	cont := `{"model":"m","input":"more","max_output_tokens":2,"previous_response_id":"` + id + `"}`
	if resp, b := post(t, c, url+pathResponses, cont, "Authorization", "Bearer "+keyAlice); resp.StatusCode != 200 {
		t.Errorf("alice continues: %d %s", resp.StatusCode, b)
	}
	for _, bad := range []string{"resp with space", "resp/slash", "résumé", strings.Repeat("r", 257)} {
		body := `{"model":"m","input":"x","max_output_tokens":2,"request_id":"` + bad + `"}`
		if resp, b := post(t, c, url+pathResponses, body, "Authorization", "Bearer "+keyBob); resp.StatusCode != 400 {
			t.Errorf("request_id %q (not retrievable by path): %d %s", bad, resp.StatusCode, b)
		}
	}
	for range 2 { // bob's own id, twice: his to replace
		own := `{"model":"m","input":"x","max_output_tokens":2,"request_id":"resp_bobs_own"}`
		if resp, b := post(t, c, url+pathResponses, own, "Authorization", "Bearer "+keyBob); resp.StatusCode != 200 || jsonOf[respAnswer](t, b).ID != "resp_bobs_own" {
			t.Errorf("bob's own request_id: %d %s", resp.StatusCode, b)
		}
	}
	g.affinity.mu.Lock()
	defer g.affinity.mu.Unlock()
	if n := len(g.affinity.reserved); n != 0 {
		t.Errorf("%d request_id reservations left after the requests ended", n)
	}
}

// TestResponsesPinnedEndpointDown: a continuation whose engine is out of
// rotation is not sent to another engine (which cannot hold the
// conversation): 503 naming the response.
func TestResponsesPinnedEndpointDown(t *testing.T) {
	f := simFleet(t, 2, "m")
	g, url := startGateway(t, fleetConfig(sched.RoundRobin, map[string]*simserver.Fleet{"m": f}))
	c := testClient(t)
	_, b := post(t, c, url+pathResponses, `{"model":"m","input":"hi","max_output_tokens":2}`)
	id := jsonOf[respAnswer](t, b).ID
	e, _ := g.affinity.lookup(id)
	e.ep.eject(time.Now(), time.Hour)
	resp, b := post(t, c, url+pathResponses, `{"model":"m","input":"x","previous_response_id":"`+id+`"}`)
	if resp.StatusCode != 503 || !strings.Contains(string(b), id) || resp.Header.Get("Retry-After") == "" {
		t.Errorf("%d %s", resp.StatusCode, b)
	}
}

// TestResponsesStreamThroughGateway: the typed events pass with their
// "event:" lines and no [DONE]; usage is read from response.completed and
// TTFT taken at the first delta.
func TestResponsesStreamThroughGateway(t *testing.T) {
	f := simFleet(t, 1, "m")
	_, url := startGateway(t, fleetConfig(sched.Prefix, map[string]*simserver.Fleet{"m": f}))
	c := testClient(t)
	body := `{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"hello"}]}],"instructions":"Be brief.","stream":true,"max_output_tokens":3}`
	resp, b := post(t, c, url+pathResponses, body)
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if bytes.Contains(b, []byte("[DONE]")) || !bytes.HasPrefix(b, []byte("event: response.created\ndata: {")) ||
		!bytes.Contains(b, []byte("\n\nevent: response.completed\ndata: {")) || !bytes.HasSuffix(b, []byte("}\n\n")) {
		t.Fatalf("stream:\n%s", b)
	}
	if n := bytes.Count(b, []byte("event: response.output_text.delta\n")); n != 3 {
		t.Errorf("%d deltas, want 3", n)
	}
	if last := b[bytes.LastIndex(b, []byte("event: ")):]; !bytes.HasPrefix(last, []byte("event: response.completed\n")) {
		t.Errorf("the stream does not end with its completed event: %s", last)
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_requests_total", `code="200"`); v != 1 {
		t.Errorf("requests_total{code=200} = %v, want 1 (a complete stream)", v)
	}
	if v := m.value("infergate_time_to_first_token_seconds_count", `model="m"`); v != 1 {
		t.Errorf("ttft count %v", v)
	}
	if v := m.value("infergate_generation_tokens_total", `model="m"`); v != 3 {
		t.Errorf("generation tokens %v, want 3", v)
	}
	if v := m.value("infergate_prompt_tokens_total", `model="m"`); v == 0 {
		t.Error("no prompt tokens accounted")
	}
}

// responsesEngine is a fake Responses engine: it answers a stream whose
// events up to the first delta are created and in_progress, then breaks
// (before output when early, after one delta otherwise).
type responsesEngine struct {
	early    bool
	requests atomic.Int32
}

func (e *responsesEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/health" {
		return
	}
	e.requests.Add(1)
	w.Header().Set("Content-Type", "text/event-stream")
	_, _ = io.WriteString(w, "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_x\",\"status\":\"in_progress\"}}\n\n")
	if !e.early {
		_, _ = io.WriteString(w, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"delta\":\"Hi\"}\n\n")
	}
	w.(http.Flusher).Flush()
	conn, _, err := http.NewResponseController(w).Hijack()
	if err == nil {
		_ = conn.Close()
	}
}

// TestResponsesStreamFailures: a Responses stream that breaks before its
// first delta is retried on another engine with nothing sent; one that
// breaks after it ends with an "error" event.
func TestResponsesStreamFailures(t *testing.T) {
	f := simFleet(t, 1, "m")
	bad := &responsesEngine{early: true}
	srv := newServerNoCleanup(bad)
	defer srv.Close()
	cfg := fleetConfig(sched.RoundRobin, map[string]*simserver.Fleet{"m": f})
	cfg.Endpoints = append([]EndpointConfig{{URL: srv.URL, Model: "m", KVBlocks: 1000}}, cfg.Endpoints...)
	cfg.Retry.BudgetPercent = 100
	_, url := startGateway(t, cfg)
	c := testClient(t)
	body := `{"model":"m","input":"hi","stream":true,"max_output_tokens":2}`
	for range 2 { // round-robin: one of the two starts on the bad engine
		resp, b := post(t, c, url+pathResponses, body)
		if resp.StatusCode != 200 || !bytes.Contains(b, []byte("event: response.completed")) || bytes.Count(b, []byte("event: response.created")) != 1 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	if bad.requests.Load() == 0 {
		t.Fatal("the breaking engine got no request")
	}

	bad.early = false
	cfg2 := Config{HealthCheckInterval: 20 * time.Millisecond}
	cfg2.Routing.Policy = sched.RoundRobin
	cfg2.Endpoints = []EndpointConfig{{URL: srv.URL, Model: "m", KVBlocks: 1000}}
	_, url2 := startGateway(t, cfg2)
	resp, b := post(t, c, url2+pathResponses, body)
	if resp.StatusCode != 200 || !bytes.Contains(b, []byte("event: response.output_text.delta")) ||
		!bytes.HasSuffix(b, []byte("\n\n")) || !bytes.Contains(b, []byte("event: error\ndata: {\"type\":\"error\",\"code\":\"upstream_error\"")) ||
		bytes.Contains(b, []byte("[DONE]")) {
		t.Fatalf("mid-stream break: %d %s", resp.StatusCode, b)
	}
	if !bytes.Contains(b, []byte(`"sequence_number":2`)) {
		t.Errorf("the error event should follow the engine's numbering: %s", b)
	}
}

// TestEmbeddingsAndTokenizerThroughGateway: embeddings and the tokenizer's
// endpoints reach the model's engines under the key's limits; embeddings'
// usage settles the token charge, the tokenizer's calls cost requests only.
func TestEmbeddingsAndTokenizerThroughGateway(t *testing.T) {
	f := simFleet(t, 2, "m")
	cfg := fleetConfig(sched.Prefix, map[string]*simserver.Fleet{"m": f})
	if err := cfg.Auth.AddKeys("alice plain:"+keyAlice+" rpm=5 tpm=100000", "test"); err != nil {
		t.Fatal(err)
	}
	g, url := startGatewayStopped(t, cfg)
	c := testClient(t)
	auth := []string{"Authorization", "Bearer " + keyAlice}
	resp, b := post(t, c, url+pathEmbeddings, `{"model":"m","input":["hello world","second input"]}`, auth...)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	emb := jsonOf[struct {
		Data  []json.RawMessage `json:"data"`
		Usage openai.Usage      `json:"usage"`
	}](t, b)
	if len(emb.Data) != 2 || emb.Usage.PromptTokens == 0 {
		t.Fatalf("embeddings: %s", b)
	}
	_, tok := keyLevels(g, 0)
	if want := 100000 - float64(emb.Usage.TotalTokens); tok != want {
		t.Errorf("token level %v after embeddings of %d tokens, want %v (settled from usage)", tok, emb.Usage.TotalTokens, want)
	}
	resp, b = post(t, c, url+pathTokenize, `{"model":"m","prompt":"Hello there"}`, auth...)
	if resp.StatusCode != 200 || jsonOf[openai.TokenizeResponse](t, b).Count == 0 {
		t.Fatalf("tokenize: %d %s", resp.StatusCode, b)
	}
	ids, _ := json.Marshal(jsonOf[openai.TokenizeResponse](t, b).Tokens)
	resp, b = post(t, c, url+pathDetokenize, `{"model":"m","tokens":`+string(ids)+`}`, auth...)
	if resp.StatusCode != 200 || jsonOf[openai.DetokenizeResponse](t, b).Prompt != "Hello there" {
		t.Fatalf("detokenize: %d %s", resp.StatusCode, b)
	}
	if _, tok2 := keyLevels(g, 0); tok2 != tok {
		t.Errorf("the tokenizer's calls charged tokens: %v → %v", tok, tok2)
	}
	// Three requests so far, the fourth and fifth pass, the sixth is over
	// requests_per_minute (the clock is stopped).
	for i := range 3 {
		resp, b := post(t, c, url+pathTokenize, `{"model":"m","prompt":"x"}`, auth...)
		want := 200
		if i == 2 {
			want = 429
		}
		if resp.StatusCode != want {
			t.Fatalf("tokenize %d: %d %s", i, resp.StatusCode, b)
		}
	}
	// Bad bodies: no model, an unknown model.
	for _, tc := range []struct {
		path, body string
		status     int
	}{
		{pathTokenize, `{"prompt":"x"}`, 400}, {pathEmbeddings, `{"input":"x"}`, 400},
		{pathEmbeddings, `{"model":"m","input":[]}`, 400}, {pathDetokenize, `{"model":"nope","tokens":[1]}`, 404},
	} {
		resp, b := post(t, c, url+tc.path, tc.body, "Authorization", "Bearer "+keyAlice)
		if resp.StatusCode != tc.status && resp.StatusCode != 429 {
			t.Errorf("%s %s: %d %s", tc.path, tc.body, resp.StatusCode, b)
		}
	}
}

// TestUnknownPathPassthrough: a POST to another /v1/ path is routed by the
// body's model and relayed as the engine answers; paths that could mean
// something else to the engine, denied paths, other methods and bodies
// without a model are refused; every unknown path shares one api label.
func TestUnknownPathPassthrough(t *testing.T) {
	f := simFleet(t, 1, "m")
	_, url := startGateway(t, fleetConfig(sched.Prefix, map[string]*simserver.Fleet{"m": f}))
	c := testClient(t)
	for _, p := range []string{"/v1/rerank", "/v1/score", "/v1/audio/x-1"} {
		resp, b := post(t, c, url+p, `{"model":"m","query":"q"}`)
		if resp.StatusCode != 404 || string(b) != `{"detail":"Not Found"}` { // the engine's own answer
			t.Errorf("%s: %d %s", p, resp.StatusCode, b)
		}
	}
	for _, tc := range []struct {
		method, path, body string
		status             int
	}{
		{http.MethodPost, "/v1/rerank", `{"query":"q"}`, 400},
		{http.MethodPost, "/v1/rerank", `not json`, 400},
		{http.MethodPost, "/v1/rerank", `{"model":"nope"}`, 404},
		{http.MethodPost, "/v1/load_lora_adapter", `{"model":"m","lora_name":"a","lora_path":"/etc"}`, 404},
		{http.MethodPost, "/v1/a/../../metrics", `{"model":"m"}`, 404},
		{http.MethodPost, "/v1/a%2F..%2Fb", `{"model":"m"}`, 404},
		{http.MethodPost, "/v1//x", `{"model":"m"}`, 404},
		{http.MethodGet, "/v1/rerank", ``, 404},
		{http.MethodPut, pathResponses + "/resp_1", ``, 405},
	} {
		req, _ := http.NewRequest(tc.method, url+tc.path, strings.NewReader(tc.body))
		req.URL.RawPath = "" // as sent
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("%s %s %s: %d %s", tc.method, tc.path, tc.body, resp.StatusCode, b)
		} else {
			decodeError(t, b) // the gateway's own answer
		}
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_api_requests_total", `api="other"`); v != 6 {
		t.Errorf("api_requests_total{other} = %v, want 6", v)
	}
	for _, l := range m {
		if strings.HasPrefix(l, "infergate_api_requests_total{") && strings.Contains(l, "rerank") {
			t.Errorf("a path in a label: %s", l)
		}
	}
}

// failingEngine answers every inference request 500 with a JSON error.
type failingEngine struct{ requests atomic.Int32 }

func (e *failingEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.URL.Path == "/health":
		return
	case r.Method != http.MethodPost: // discovery
		http.NotFound(w, r)
		return
	}
	e.requests.Add(1)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusInternalServerError)
	_, _ = io.WriteString(w, `{"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}`)
}

// TestUnknownPathNotRetried: an unknown path's 5xx is answered as is, never
// resent (the gateway cannot know the request had no effect), where a
// chat's is retried on the other engine.
func TestUnknownPathNotRetried(t *testing.T) {
	a, b := &failingEngine{}, &failingEngine{}
	sa, sb := newServerNoCleanup(a), newServerNoCleanup(b)
	defer sa.Close()
	defer sb.Close()
	cfg := Config{HealthCheckInterval: 20 * time.Millisecond, Retry: RetryConfig{BudgetPercent: 100}}
	cfg.Routing.Policy = sched.RoundRobin
	cfg.Endpoints = []EndpointConfig{{URL: sa.URL, Model: "m", KVBlocks: 1000}, {URL: sb.URL, Model: "m", KVBlocks: 1000}}
	_, url := startGateway(t, cfg)
	c := testClient(t)
	resp, body := post(t, c, url+"/v1/score", `{"model":"m"}`)
	if resp.StatusCode != 500 || a.requests.Load()+b.requests.Load() != 1 {
		t.Errorf("unknown path: %d %s after %d attempts", resp.StatusCode, body, a.requests.Load()+b.requests.Load())
	}
	resp, _ = post(t, c, url+pathChat, chatBody)
	if resp.StatusCode != 500 || a.requests.Load()+b.requests.Load() != 3 {
		t.Errorf("chat: %d after %d attempts in all, want 3", resp.StatusCode, a.requests.Load()+b.requests.Load())
	}
}

// deadURL is a loopback URL nothing listens on.
func deadURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := "http://" + ln.Addr().String()
	ln.Close()
	return u
}

// TestAliasFallback: an alias's requests fall back to its next model when
// the first has no endpoint in rotation or fails; the engine receives the
// target's name (a sim refuses any other model), the answer names it, and
// keys are allowed the alias by name.
func TestAliasFallback(t *testing.T) {
	small, big := simFleet(t, 1, "small"), simFleet(t, 1, "big")
	fail := &failingEngine{}
	fs := newServerNoCleanup(fail)
	defer fs.Close()
	cfg := fleetConfig(sched.Prefix, map[string]*simserver.Fleet{"small": small, "big": big})
	cfg.Endpoints = append(cfg.Endpoints,
		EndpointConfig{URL: deadURL(t), Model: "gone", KVBlocks: 1000},
		EndpointConfig{URL: fs.URL, Model: "broken", KVBlocks: 1000})
	cfg.Aliases = map[string][]string{"fast": {"gone", "small", "big"}, "flaky": {"broken", "big"}, "direct": {"small"}}
	if err := cfg.Auth.AddKeys("alice plain:"+keyAlice+" models=fast,flaky; bob plain:"+keyBob+" models=small", "test"); err != nil {
		t.Fatal(err)
	}
	_, url := startGateway(t, cfg)
	c := testClient(t)
	alice := []string{"Authorization", "Bearer " + keyAlice}
	for _, tc := range []struct{ path, body, served string }{
		{pathChat, `{"model":"fast","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`, "small"},
		{pathChat, `{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"stream":true,"model":"fast"}`, "small"},
		{pathCompletions, `{"model":"flaky","prompt":"hi","max_tokens":2}`, "big"},
		{pathResponses, `{"model" : "fast","input":"hi","max_output_tokens":2}`, "small"},
		{pathEmbeddings, `{"input":"hi","model":"flaky"}`, "big"},
		{pathTokenize, `{"model":"fast","prompt":"hi"}`, "small"},
	} {
		resp, b := post(t, c, url+tc.path, tc.body, alice...)
		if resp.StatusCode != 200 || resp.Header.Get(modelHeader) != tc.served {
			t.Errorf("%s %s: %d %s=%q %s", tc.path, tc.body, resp.StatusCode, modelHeader, resp.Header.Get(modelHeader), b)
			continue
		}
		if tc.path != pathTokenize && !bytes.Contains(b, []byte(`"model":"`+tc.served+`"`)) {
			t.Errorf("%s: the answer does not name %s: %s", tc.path, tc.served, b)
		}
	}
	if fail.requests.Load() == 0 {
		t.Error("the broken model's engine got no request")
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_model_fallbacks_total", `alias="fast",model="gone",reason="no_endpoint"`); v != 4 {
		t.Errorf("fallbacks fast/gone = %v, want 4", v)
	}
	if v := m.value("infergate_model_fallbacks_total", `alias="flaky",model="broken",reason="failed"`); v != 2 {
		t.Errorf("fallbacks flaky/broken = %v, want 2", v)
	}
	// The allow-list applies to the name sent.
	if resp, b := post(t, c, url+pathChat, `{"model":"small","messages":[{"role":"user","content":"hi"}]}`, alice...); resp.StatusCode != 404 {
		t.Errorf("alice may not use small directly: %d %s", resp.StatusCode, b)
	}
	if resp, b := post(t, c, url+pathChat, `{"model":"direct","messages":[{"role":"user","content":"hi"}]}`, "Authorization", "Bearer "+keyBob); resp.StatusCode != 404 {
		t.Errorf("bob may not use the alias direct: %d %s", resp.StatusCode, b)
	}
	// /v1/models lists the aliases a key may use.
	req, _ := http.NewRequest(http.MethodGet, url+pathModels, nil)
	req.Header.Set("Authorization", "Bearer "+keyAlice)
	r, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	lb, _ := io.ReadAll(r.Body)
	r.Body.Close()
	list := jsonOf[openai.ModelList](t, lb)
	if len(list.Data) != 2 || list.Data[0].ID != "fast" || list.Data[0].Root != "gone" || list.Data[1].ID != "flaky" && list.Data[1].ID != "fast" {
		t.Errorf("alice's models: %s", lb)
	}
	// The last model's refusal is answered: every target down.
	cfg2 := Config{HealthCheckInterval: 20 * time.Millisecond, Aliases: map[string][]string{"none": {"gone"}}}
	cfg2.Routing.Policy = sched.RoundRobin
	cfg2.Endpoints = []EndpointConfig{{URL: deadURL(t), Model: "gone", KVBlocks: 1000}}
	_, url2 := startGateway(t, cfg2)
	if resp, b := post(t, c, url2+pathChat, `{"model":"none","messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 503 ||
		codeStr(decodeError(t, b).Code) != openai.CodeNoEndpoint {
		t.Errorf("all targets down: %d %s", resp.StatusCode, b)
	}
}

func TestAliasConfigValidation(t *testing.T) {
	base := Config{Endpoints: []EndpointConfig{{URL: "http://127.0.0.1:1", Model: "m"}}}
	for _, tc := range []struct {
		aliases map[string][]string
		want    string
	}{
		{map[string][]string{"m": {"m"}}, "an endpoint serves a model of that name"},
		{map[string][]string{"a": {}}, "want 1 to"},
		{map[string][]string{"a": {"x"}}, "served by no endpoint"},
		{map[string][]string{"a": {"m", "m"}}, "listed twice"},
		{map[string][]string{"a": {"m"}, "b": {"a"}}, "served by no endpoint"},
	} {
		c := base
		c.Aliases = tc.aliases
		err := c.WithDefaults().Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.aliases, err, tc.want)
		}
	}
	c := base
	c.Aliases = map[string][]string{"a": {"m"}}
	if err := c.WithDefaults().Validate(); err != nil {
		t.Error(err)
	}
}

// TestResponsesPrefixRouting: a responses request that starts a
// conversation is hashed like a chat (instructions, then input items), so
// the prefix index predicts the blocks the engine holds; a continuation is
// pinned and not hashed.
func TestResponsesPrefixRouting(t *testing.T) {
	f := simFleet(t, 2, "m")
	_, url := startGateway(t, fleetConfig(sched.Prefix, map[string]*simserver.Fleet{"m": f}))
	c := testClient(t)
	instructions := strings.Repeat("You answer questions about caches, briefly and exactly. ", 20)
	for i := range 3 {
		resp, b := post(t, c, url+pathResponses, fmt.Sprintf(`{"model":"m","instructions":%q,"input":"question %d","max_output_tokens":2}`, instructions, i))
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		if r := jsonOf[respAnswer](t, b); i > 0 && r.Usage.InputTokensDetails.CachedTokens < 100 {
			t.Errorf("request %d: %d cached tokens, want the shared instructions", i, r.Usage.InputTokensDetails.CachedTokens)
		}
	}
	if v := scrape(t, c, url).value("infergate_prefix_predicted_matched_tokens_total", `model="m"`); v < 200 {
		t.Errorf("predicted matched tokens %v: the instructions were not hashed for routing", v)
	}
}

// TestPassthroughNoGoroutineLeak: the new APIs, streams and refusals leave
// no goroutine behind.
func TestPassthroughNoGoroutineLeak(t *testing.T) {
	before := settledGoroutines()
	func() {
		f, err := simserver.StartFleet(1, simserver.ServerConfig{Model: "m", TimeScale: 1000, ResponsesStore: true})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		cfg := fleetConfig(sched.Prefix, map[string]*simserver.Fleet{"m": f})
		cfg.Aliases = map[string][]string{"a": {"m"}}
		g, err := New(context.Background(), cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer g.Close()
		srv := newServerNoCleanup(g.Handler())
		defer srv.Close()
		tr := &http.Transport{}
		defer tr.CloseIdleConnections()
		c := &http.Client{Transport: tr}
		_, b := post(t, c, srv.URL+pathResponses, `{"model":"a","input":"hi","max_output_tokens":2}`)
		id := jsonOf[respAnswer](t, b).ID
		post(t, c, srv.URL+pathResponses, `{"model":"m","input":"hi","stream":true,"max_output_tokens":2,"previous_response_id":"`+id+`"}`)
		post(t, c, srv.URL+pathEmbeddings, `{"model":"a","input":["x","y"]}`)
		post(t, c, srv.URL+pathTokenize, `{"model":"m","prompt":"x"}`)
		post(t, c, srv.URL+"/v1/rerank", `{"model":"m"}`)
		post(t, c, srv.URL+"/v1/rerank", `{}`)
		if resp, err := c.Get(srv.URL + pathResponses + "/" + id); err == nil {
			resp.Body.Close()
		}
	}()
	requireGoroutinesBack(t, before)
}

// streamEngine answers any POST with two SSE events, then [DONE] when done
// is set, else EOF.
type streamEngine struct{ done bool }

func (e *streamEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	_, _ = io.WriteString(w, "data: {\"type\":\"transcript.text.delta\",\"delta\":\"Hel\"}\n\ndata: {\"text\":\"lo\"}\n\n")
	if e.done {
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}
}

// TestUnknownPathStream: an unknown path's event stream is relayed event by
// event and is complete at EOF, with [DONE] only when the engine sent it.
func TestUnknownPathStream(t *testing.T) {
	for _, done := range []bool{false, true} {
		srv := newServerNoCleanup(&streamEngine{done: done})
		cfg := Config{HealthCheckInterval: 20 * time.Millisecond}
		cfg.Routing.Policy = sched.RoundRobin
		cfg.Endpoints = []EndpointConfig{{URL: srv.URL, Model: "m", KVBlocks: 1000}}
		_, url := startGateway(t, cfg)
		c := testClient(t)
		resp, b := post(t, c, url+"/v1/audio/stream", `{"model":"m","stream":true}`)
		want := "data: {\"type\":\"transcript.text.delta\",\"delta\":\"Hel\"}\n\ndata: {\"text\":\"lo\"}\n\n"
		if done {
			want += "data: [DONE]\n\n"
		}
		if resp.StatusCode != 200 || string(b) != want {
			t.Errorf("done %v: %d %q", done, resp.StatusCode, b)
		}
		if v := scrape(t, c, url).value("infergate_time_to_first_token_seconds_count", `model="m"`); v != 1 {
			t.Errorf("ttft count %v", v)
		}
		srv.Close()
	}
}

// TestAffinityEvictionFair: a full affinity table forgets the oldest id of
// the key holding the most, so one key creating responses fast evicts its
// own ids, not another key's (with one first-in first-out list, Bob's 100
// new responses evicted every one of Alice's); without keys (one owner) it
// is first-in first-out.
func TestAffinityEvictionFair(t *testing.T) {
	a := newResponseAffinity(10)
	alice, bob := &principal{Principal: &auth.Principal{Name: "alice"}}, &principal{Principal: &auth.Principal{Name: "bob"}}
	for i := range 4 {
		a.learn(fmt.Sprintf("alice-%d", i), "m", nil, alice)
	}
	for i := range 100 {
		a.learn(fmt.Sprintf("bob-%d", i), "m", nil, bob)
	}
	if n := a.len(); n != 10 {
		t.Fatalf("%d entries, want 10", n)
	}
	for i := range 4 {
		if _, ok := a.lookup(fmt.Sprintf("alice-%d", i)); !ok {
			t.Errorf("alice-%d forgotten", i)
		}
	}
	for i := range 100 {
		_, ok := a.lookup(fmt.Sprintf("bob-%d", i))
		if want := i >= 94; ok != want { // bob's newest 6
			t.Errorf("bob-%d known %v, want %v", i, ok, want)
		}
	}
	// Alice's next ids: she holds fewer, so bob's oldest go first until
	// both hold 5.
	a.learn("alice-4", "m", nil, alice)
	if _, ok := a.lookup("bob-94"); ok {
		t.Error("bob-94 kept although bob held the most")
	}
	open := newResponseAffinity(3)
	for i := range 5 {
		open.learn(fmt.Sprintf("r-%d", i), "m", nil, nil)
	}
	for i := range 5 {
		if _, ok := open.lookup(fmt.Sprintf("r-%d", i)); ok != (i >= 2) {
			t.Errorf("without keys r-%d known %v", i, ok)
		}
	}
}

// BenchmarkAffinityLearnFull: a new id into a full table of 100,000 ids
// over 100, 10,000 and 100,000 keys.
func BenchmarkAffinityLearnFull(b *testing.B) {
	for _, nkeys := range []int{100, 10_000, 100_000} {
		b.Run(fmt.Sprintf("keys=%d", nkeys), func(b *testing.B) {
			a := newResponseAffinity(DefaultAffinityMaxEntries)
			keys := make([]*principal, nkeys)
			for i := range keys {
				keys[i] = &principal{Principal: &auth.Principal{Name: fmt.Sprintf("key-%d", i)}}
			}
			ids := make([]string, DefaultAffinityMaxEntries+b.N)
			for i := range ids {
				ids[i] = fmt.Sprintf("resp_%032x", i)
			}
			for i := range DefaultAffinityMaxEntries {
				a.learn(ids[i], "m", nil, keys[i%len(keys)])
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				a.learn(ids[DefaultAffinityMaxEntries+i], "m", nil, keys[i%len(keys)])
			}
		})
	}
}

// TestRequestIDReservedInFlight: a request_id is held for its key while
// its request is in flight: another key's request with it is refused, the
// same key's is not, and the id is free again when the last ends (without
// it, the first answer's key kept the id: another key could race a known
// in-flight request_id and take it).
func TestRequestIDReservedInFlight(t *testing.T) {
	a := newResponseAffinity(10)
	if !a.reserve("r1", "alice") || !a.reserve("r1", "alice") {
		t.Fatal("alice cannot reserve her id twice")
	}
	if a.reserve("r1", "bob") {
		t.Fatal("bob reserved alice's in-flight id")
	}
	a.unreserve("r1")
	if a.reserve("r1", "bob") {
		t.Fatal("bob reserved alice's id with one of her requests still in flight")
	}
	a.unreserve("r1")
	if !a.reserve("r1", "bob") {
		t.Fatal("bob cannot reserve a free id")
	}
	a.unreserve("r1")
	a.learn("r1", "m", nil, &principal{Principal: &auth.Principal{Name: "alice"}})
	if a.reserve("r1", "bob") || !a.reserve("r1", "alice") {
		t.Error("a learnt id: reserved by its owner only")
	}
	a.unreserve("r1")
	if n := len(a.reserved); n != 0 {
		t.Errorf("%d reservations left", n)
	}
}
