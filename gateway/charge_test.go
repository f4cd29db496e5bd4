package gateway

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/sched"
)

// startGatewayStopped is startGateway with the rate limits' clock stopped
// (no bucket refills while the test runs, however slowly).
func startGatewayStopped(t *testing.T, cfg Config) (*Gateway, string) {
	t.Helper()
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t0 := time.Now()
	g.clock = func() time.Time { return t0 } // before any request goroutine exists
	srv := httptest.NewServer(g.Handler())
	t.Cleanup(func() {
		srv.Close()
		g.Close()
	})
	return g, srv.URL
}

// keyLevels reads key i's request and token bucket levels.
func keyLevels(g *Gateway, i int) (req, tok float64) {
	return g.state.Load().keys.principals[i].Limits.Levels()
}

// heldEngine answers completions with a stream of one output chunk and a
// usage chunk, each request held until release is closed. Without
// max_tokens it generates what a real engine does, up to the context:
// maxModelLen − prompt tokens (the prompt: 10 token ids). served sums the
// total tokens its usage reported.
type heldEngine struct {
	maxModelLen int
	arrived     chan struct{}
	release     chan struct{}
	served      atomic.Int64
}

func (e *heldEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != pathCompletions {
		http.NotFound(w, r)
		return
	}
	body, _ := io.ReadAll(r.Body)
	e.arrived <- struct{}{}
	<-e.release
	prompt, completion := 10, e.maxModelLen-10
	if bytes.Contains(body, []byte(`"max_tokens"`)) {
		completion = 1
	}
	e.served.Add(int64(prompt + completion))
	w.Header().Set("Content-Type", "text/event-stream")
	fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n"+
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d}}\n\ndata: [DONE]\n\n",
		prompt, completion, prompt+completion)
}

// TestTokenLimitHoldsUnderConcurrency: 100 concurrent streams without
// max_tokens against a key of 3000 tokens per minute, on an engine that
// fills its 256-token context. Each is charged the context at admission,
// so the tokens of the accepted requests never exceed the limit by more
// than one request's worth (256). Charged body bytes / 4 instead (the
// estimate before), all 100 were accepted: 25,600 tokens, 8.5 minutes'
// worth, the excess forgiven at one minute of debt.
func TestTokenLimitHoldsUnderConcurrency(t *testing.T) {
	const clients, tpm, ctxLen = 100, 3000, 256
	e := &heldEngine{maxModelLen: ctxLen, arrived: make(chan struct{}, clients), release: make(chan struct{})}
	eng := httptest.NewServer(e)
	defer eng.Close()
	cfg := testConfig(sched.RoundRobin)
	cfg.HealthCheckPath = healthCheckOff
	cfg.Endpoints = []EndpointConfig{{URL: eng.URL, Model: "m", KVBlocks: 1000, MaxModelLen: ctxLen}}
	if err := cfg.Auth.AddKeys("alice plain:"+keyAlice+" tpm="+strconv.Itoa(tpm), "test"); err != nil {
		t.Fatal(err)
	}
	g, url := startGatewayStopped(t, cfg)
	c := testClient(t)
	body := `{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10],"stream":true}`

	refused := make(chan struct{}, clients)
	statuses := make([]int, clients)
	var wg sync.WaitGroup
	for i := range clients {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodPost, url+pathCompletions, strings.NewReader(body))
			req.Header.Set("Authorization", "Bearer "+keyAlice)
			resp, err := c.Do(req)
			if err != nil {
				t.Error(err)
				refused <- struct{}{}
				return
			}
			statuses[i] = resp.StatusCode
			if resp.StatusCode != http.StatusOK {
				refused <- struct{}{}
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		})
	}
	// Every request is either at the engine or refused: only then do the
	// accepted ones generate (and settle), so all 100 competed at once.
	accepted := 0
	for n := 0; n < clients; n++ {
		select {
		case <-e.arrived:
			accepted++
		case <-refused:
		case <-time.After(30 * time.Second):
			t.Fatalf("after %d of %d requests resolved, the rest hang", n, clients)
		}
	}
	close(e.release)
	wg.Wait()

	got := 0
	for _, s := range statuses {
		if s == http.StatusOK {
			got++
		} else if s != http.StatusTooManyRequests {
			t.Errorf("status %d, want 200 or 429", s)
		}
	}
	used := e.served.Load()
	t.Logf("%d of %d accepted, %d tokens used of a %d-token minute", got, clients, used, tpm)
	if used > tpm+ctxLen {
		t.Errorf("accepted requests used %d tokens, over the limit %d by more than one request's %d", used, tpm, ctxLen)
	}
	if got != accepted || got != tpm/ctxLen {
		t.Errorf("%d answered 200, %d reached the engine, want %d (3000 / 256)", got, accepted, tpm/ctxLen)
	}
	// Settled from usage: each used exactly what it reserved.
	if _, tok := keyLevels(g, 0); tok != float64(tpm-int(used)) {
		t.Errorf("token level %v after settling, want %d", tok, tpm-int(used))
	}
}

// TestContextLengthDiscovered: max_model_len 0 is read from the engine's
// GET /v1/models (the largest reported), else DefaultMaxModelLen; a pool's
// is the largest of its endpoints'.
func TestContextLengthDiscovered(t *testing.T) {
	models := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == pathModels {
			_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"m","max_model_len":40960},{"id":"lora","parent":"m"}]}`)
		}
	}))
	defer models.Close()
	none := newFakeEngine(t, "none") // 404 on /v1/models
	cfg := testConfig(sched.RoundRobin)
	cfg.Endpoints = []EndpointConfig{{URL: models.URL, Model: "m", KVBlocks: 1}, {URL: none.URL(), Model: "n", KVBlocks: 1},
		{URL: none.URL(), Model: "m", KVBlocks: 1}}
	g, _ := startGateway(t, cfg)
	if got := g.state.Load().pools["m"].maxModelLen; got != DefaultMaxModelLen {
		t.Errorf("pool m: %d, want the larger of 40960 and the default %d", got, DefaultMaxModelLen)
	}
	byURL := map[string]int{}
	for _, ec := range g.Config().Endpoints {
		byURL[ec.URL] = ec.MaxModelLen
	}
	if byURL[models.URL] != 40960 || byURL[none.URL()] != DefaultMaxModelLen {
		t.Errorf("discovered %v", byURL)
	}
	for body, want := range map[string]int{
		`{"data":[{"max_model_len":8192},{"max_model_len":4096}]}`: 8192,
		`{"data":[{"max_model_len":-1}]}`:                          0,
		`{"data":[{"max_model_len":"8192"}]}`:                      0,
		`{"data":` + deepJSON + `}`:                                0,
	} {
		if got, _ := fleet.ParseMaxModelLen([]byte(body)); got != want {
			t.Errorf("%s: %d, want %d", body, got, want)
		}
	}
}

// TestRefusalsNotCharged: a request the gateway refuses before sending it
// anywhere — the admission queue full (here: no queue), a model nobody
// serves — gives its charge back to the key: 29 requests refused with 429
// by admission leave the key's request limit as one admitted request left
// it, and the refusals report the refunded remainder. Before, each
// refusal used one of the key's 30 requests and the next request was
// refused by the key's own limit.
func TestRefusalsNotCharged(t *testing.T) {
	const rpm = 30
	e := &heldEngine{maxModelLen: 64, arrived: make(chan struct{}, 2), release: make(chan struct{})}
	eng := httptest.NewServer(e)
	defer eng.Close()
	cfg := testConfig(sched.RoundRobin)
	cfg.HealthCheckPath = healthCheckOff
	cfg.Endpoints = []EndpointConfig{{URL: eng.URL, Model: "m", KVBlocks: 1000, MaxModelLen: 64}}
	cfg.Admission.MaxInFlight, cfg.Admission.MaxQueue = 1, -1
	if err := cfg.Auth.AddKeys("alice plain:"+keyAlice+" rpm="+strconv.Itoa(rpm)+" tpm=100000", "test"); err != nil {
		t.Fatal(err)
	}
	g, url := startGatewayStopped(t, cfg)
	c := testClient(t)
	alice := []string{"Authorization", "Bearer " + keyAlice}
	body := `{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10],"max_tokens":1,"stream":true}`
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := sendAsync(ctx, c, url+pathCompletions, body, alice...)
	<-e.arrived // admitted, and holds the model's one slot

	for range rpm - 1 { // one after another, so that each sees the others' refunds
		r := await(t, sendAsync(ctx, c, url+pathCompletions, body, alice...))
		if r.status != http.StatusTooManyRequests || !strings.Contains(string(r.body), "overloaded") {
			t.Fatalf("with the slot taken: %d %.200s, want 429 (admission)", r.status, r.body)
		}
		if got := r.header.Get("X-Ratelimit-Remaining-Requests"); got != strconv.Itoa(rpm-1) {
			t.Errorf("an admission 429 reports %s requests remaining, want %d (refunded)", got, rpm-1)
		}
	}
	resp, b := send(t, c, http.MethodPost, url+pathCompletions, `{"model":"nope","prompt":"x"}`, alice...)
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("unknown model: %d %s", resp.StatusCode, b)
	}
	if req, tok := keyLevels(g, 0); req != rpm-1 || tok != 100000-11 {
		t.Errorf("key levels %v requests, %v tokens; want %d and %d: only the admitted request charged", req, tok, rpm-1, 100000-11)
	}
	close(e.release)
	if r := await(t, first); r.status != http.StatusOK {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	// The key still has its 29 requests: the next is admitted.
	if r := await(t, sendAsync(ctx, c, url+pathCompletions, body, alice...)); r.status != http.StatusOK ||
		r.header.Get("X-Ratelimit-Remaining-Requests") != strconv.Itoa(rpm-2) {
		t.Errorf("after the refusals: %d remaining %q %.200s, want 200 and %d", r.status, r.header.Get("X-Ratelimit-Remaining-Requests"), r.body, rpm-2)
	}
}
