package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/simserver"
)

// parkedEngine answers completions only when told to: arrived receives each
// request's X-Request-Id, and the request is answered (a normal chat
// completion) when release is closed.
type parkedEngine struct {
	srv     *httptest.Server
	arrived chan string
	release chan struct{}
}

func newParkedEngine(t *testing.T) *parkedEngine {
	t.Helper()
	e := &parkedEngine{arrived: make(chan string, 16), release: make(chan struct{})}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return // /health: 200
		}
		_, _ = io.Copy(io.Discard, r.Body)
		e.arrived <- r.Header.Get("X-Request-Id")
		select {
		case <-e.release:
		case <-r.Context().Done():
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}`)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

// reloadConfig is testConfig over endpoints urls of model m.
func reloadConfig(policy string, urls ...string) Config {
	cfg := testConfig(policy)
	for _, u := range urls {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: u, Model: "m", KVBlocks: 1000})
	}
	return cfg
}

// endpointOf returns the gateway's endpoint object of url (nil if none).
func endpointOf(g *Gateway, url string) *endpoint {
	for _, ep := range g.state.Load().endpoints {
		if ep.name == url {
			return ep
		}
	}
	return nil
}

// mustReload reloads cfg or fails the test.
func mustReload(t *testing.T, g *Gateway, cfg Config) {
	t.Helper()
	if err := g.Reload(cfg); err != nil {
		t.Fatalf("Reload: %v", err)
	}
}

// TestReloadUnderLoad: clients send chats (streaming and not) without a
// pause while the configuration is reloaded 40 times: endpoints added,
// removed and put back (some reloads replace them all), a key added and
// removed, the admission limits changed. Every request is answered, and
// answered 200 in full; the endpoints removed stop their loops; no
// goroutine is left behind.
func TestReloadUnderLoad(t *testing.T) {
	before := settledGoroutines()
	engines := make([]*fakeEngine, 4)
	for i := range engines {
		engines[i] = newEngineNoCleanup(t, fmt.Sprintf("e%d", i))
	}
	key := auth.Key{Name: "client", Hash: auth.HashKey("client-key")}
	other := auth.Key{Name: "other", Hash: auth.HashKey("other-key"), RequestsPerMinute: 1000}
	// Some reloads replace every endpoint at once.
	sets := [][]int{{0, 1}, {2, 3}, {3, 0}, {1}, {0, 1, 2, 3}, {2}}
	config := func(n int) Config {
		var urls []string
		for _, i := range sets[n%len(sets)] {
			urls = append(urls, engines[i].URL())
		}
		cfg := reloadConfig(sched.Prefix, urls...)
		cfg.Auth.Keys = []auth.Key{key}
		if n%2 == 1 {
			cfg.Auth.Keys = append(cfg.Auth.Keys, other)
			cfg.Admission.MaxQueue = 64 + n
		}
		return cfg
	}
	func() {
		g, err := New(context.Background(), config(0), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer g.Close()
		srv := newServerNoCleanup(g.Handler())
		defer srv.Close()
		tr := &http.Transport{MaxIdleConnsPerHost: 16}
		defer tr.CloseIdleConnections()
		c := &http.Client{Transport: tr, Timeout: 30 * time.Second}

		var (
			stop     atomic.Bool
			answered atomic.Int64
			wg       sync.WaitGroup
			mu       sync.Mutex
			failures []string
		)
		for w := range 6 {
			wg.Go(func() {
				for i := 0; !stop.Load(); i++ {
					stream := (w+i)%2 == 0
					body := chatBody
					if stream {
						body = streamBody(true)
					}
					req, _ := http.NewRequest(http.MethodPost, srv.URL+pathChat, strings.NewReader(body))
					req.Header.Set("Authorization", "Bearer client-key")
					resp, err := c.Do(req)
					var b []byte
					if err == nil {
						b, err = io.ReadAll(resp.Body)
						resp.Body.Close()
					}
					switch {
					case err != nil:
						err = fmt.Errorf("transport: %w", err)
					case resp.StatusCode != http.StatusOK:
						err = fmt.Errorf("status %d: %s", resp.StatusCode, b)
					case stream && !strings.HasSuffix(string(b), "data: [DONE]\n\n"):
						err = fmt.Errorf("stream without [DONE]: %s", b)
					case !stream && !strings.Contains(string(b), `"choices"`):
						err = fmt.Errorf("answer without choices: %s", b)
					}
					if err != nil {
						mu.Lock()
						failures = append(failures, err.Error())
						mu.Unlock()
					}
					answered.Add(1)
				}
			})
		}
		var removed []*endpoint
		for n := 1; n <= 40; n++ {
			// Some requests between two reloads (a condition, not a delay).
			seen := answered.Load()
			waitFor(t, "requests between reloads", func() bool { return answered.Load() >= seen+3 })
			old := g.state.Load().endpoints
			mustReload(t, g, config(n))
			for _, ep := range old {
				if endpointOf(g, ep.name) != ep {
					removed = append(removed, ep)
				}
			}
		}
		stop.Store(true)
		wg.Wait()
		if len(failures) > 0 {
			t.Fatalf("%d of %d requests failed during the reloads; first: %s", len(failures), answered.Load(), failures[0])
		}
		if len(removed) == 0 {
			t.Fatal("no endpoint was removed")
		}
		for _, ep := range removed {
			select {
			case <-ep.done:
			case <-time.After(time.Minute):
				t.Fatalf("removed endpoint %s: health loop still running with nothing in flight (%d)", ep.name, ep.ledger.InFlight())
			}
		}
		if got := scrape(t, c, srv.URL).value("infergate_config_reloads_total", `result="success"`); got != 40 {
			t.Errorf("config_reloads_total{result=success} %v, want 40", got)
		}
		t.Logf("%d requests answered over 40 reloads", answered.Load())
	}()
	for _, e := range engines {
		e.srv.Close()
	}
	requireGoroutinesBack(t, before)
}

// TestReloadKeys: a key removed by a reload is refused (401) from the next
// request on, an added one admitted, and a key that stays keeps its rate
// limit's state: a reload does not hand it a fresh minute (a limit bypass,
// were it so), and a changed limit applies to what it has already used.
func TestReloadKeys(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := reloadConfig(sched.RoundRobin, e.URL())
	a := auth.Key{Name: "a", Hash: auth.HashKey("key-a"), RequestsPerMinute: 2}
	b := auth.Key{Name: "b", Hash: auth.HashKey("key-b")}
	cfg.Auth.Keys = []auth.Key{a, b}
	g, url := startGatewayStopped(t, cfg)
	c := testClient(t)
	send := func(key string) int {
		t.Helper()
		resp, _ := post(t, c, url+pathChat, chatBody, "Authorization", "Bearer "+key)
		return resp.StatusCode
	}
	for range 2 {
		if s := send("key-a"); s != 200 {
			t.Fatalf("a within its limit: %d", s)
		}
	}
	if s := send("key-a"); s != 429 {
		t.Fatalf("a over its limit of 2: %d, want 429", s)
	}

	// The same keys again (a, rotated to a second hash; b gone; c new).
	a2 := a
	a2.Hash = auth.HashKey("key-a2")
	c1 := auth.Key{Name: "c", Hash: auth.HashKey("key-c")}
	cfg.Auth.Keys = []auth.Key{a, a2, c1}
	mustReload(t, g, cfg)
	if s := send("key-b"); s != 401 {
		t.Errorf("removed key b: %d, want 401", s)
	}
	if s := send("key-c"); s != 200 {
		t.Errorf("added key c: %d, want 200", s)
	}
	if s, s2 := send("key-a"), send("key-a2"); s != 429 || s2 != 429 {
		t.Fatalf("key a after a reload: %d and %d (new hash), want 429: its used minute was reset", s, s2)
	}

	// Raised to 3 per minute: one more now (2 of 3 used), then 429.
	cfg.Auth.Keys[0].RequestsPerMinute, cfg.Auth.Keys[1].RequestsPerMinute = 3, 3
	mustReload(t, g, cfg)
	if s := send("key-a"); s != 200 {
		t.Fatalf("a after its limit was raised to 3: %d, want 200", s)
	}
	if s := send("key-a"); s != 429 {
		t.Fatalf("a over its raised limit: %d, want 429", s)
	}
	if r, _ := keyLevels(g, 0); r != 0 {
		t.Errorf("a's request bucket at %v, want 0", r)
	}

	// Lowered to 1: still over (3 used).
	cfg.Auth.Keys[0].RequestsPerMinute, cfg.Auth.Keys[1].RequestsPerMinute = 1, 1
	mustReload(t, g, cfg)
	if s := send("key-a"); s != 429 {
		t.Fatalf("a after its limit was lowered to 1: %d, want 429", s)
	}

	// Authentication off, then on again.
	off := cfg
	off.Auth = AuthConfig{}
	mustReload(t, g, off)
	if s := send("nothing"); s != 200 || g.AuthEnabled() {
		t.Fatalf("auth off: %d (enabled %v)", s, g.AuthEnabled())
	}
	mustReload(t, g, cfg)
	if s := send("key-b"); s != 401 {
		t.Fatalf("auth on again, unknown key: %d", s)
	}
}

// TestReloadKeyUsage: per-key usage counters follow a key's name across
// reloads (the series goes on, whatever its hashes), a renamed key is a
// new series and the old one keeps its totals, and keys turned on by a
// reload are counted (the counters exist from start).
func TestReloadKeyUsage(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := reloadConfig(sched.RoundRobin, e.URL())
	g, url := startGateway(t, cfg)
	c := testClient(t)
	send := func(key string) {
		t.Helper()
		if resp, b := post(t, c, url+pathChat, chatBody, "Authorization", "Bearer "+key); resp.StatusCode != 200 {
			t.Fatalf("key %s: %d %s", key, resp.StatusCode, b)
		}
	}
	requests := func(name string) float64 {
		t.Helper()
		return scrape(t, c, url).value("infergate_key_requests_total", `key="`+name+`"`)
	}

	cfg.Auth.Keys = []auth.Key{{Name: "a", Hash: auth.HashKey("key-a")}} // authentication turned on by the reload
	mustReload(t, g, cfg)
	send("key-a")
	send("key-a")
	if n := requests("a"); n != 2 {
		t.Fatalf("a after authentication was turned on: %v requests, want 2", n)
	}
	prompt := scrape(t, c, url).value("infergate_key_prompt_tokens_total", `key="a"`)
	if prompt == 0 {
		t.Fatal("no prompt tokens counted for a")
	}

	cfg.Auth.Keys = []auth.Key{{Name: "a", Hash: auth.HashKey("key-a2")}, {Name: "b", Hash: auth.HashKey("key-b")}} // a rotated, b added
	mustReload(t, g, cfg)
	send("key-a2")
	send("key-b")
	if n, m := requests("a"), requests("b"); n != 3 || m != 1 {
		t.Fatalf("after a reload: a %v (want 3: its series goes on), b %v (want 1)", n, m)
	}
	if p := scrape(t, c, url).value("infergate_key_prompt_tokens_total", `key="a"`); p != prompt*3/2 {
		t.Fatalf("a's prompt tokens %v after a reload, want %v (three requests)", p, prompt*3/2)
	}

	cfg.Auth.Keys = []auth.Key{{Name: "c", Hash: auth.HashKey("key-a2")}} // a renamed c
	mustReload(t, g, cfg)
	send("key-a2")
	if n, m := requests("a"), requests("c"); n != 3 || m != 1 {
		t.Fatalf("after a rename: a %v (want its 3 kept), c %v (want 1, a new series)", n, m)
	}
	st := g.DashboardState(time.Now())
	if len(st.Keys) != 1 || st.Keys[0].Key != "c" || st.Keys[0].Requests != 1 {
		t.Fatalf("dashboard keys %+v, want c with 1 request", st.Keys)
	}
}

// TestReloadPreciseSlots: the precise index's per-slot bound follows its
// endpoint (kv_blocks plus kv_events.offload_blocks): set again when
// kv_blocks changes, and when a removed endpoint's slot goes to a new one;
// the endpoints that stay and the one added have their hooks (the policy
// forgets their slot, the KV feed resynchronises) and the removed one has
// none. The hooks act: the kept endpoint leaving rotation empties its slot.
func TestReloadPreciseSlots(t *testing.T) {
	e0, e1, e2 := newFakeEngine(t, "e0"), newFakeEngine(t, "e1"), newFakeEngine(t, "e2")
	ec := func(e *fakeEngine, kvBlocks, offload int) EndpointConfig {
		return EndpointConfig{URL: e.URL(), Model: "m", KVBlocks: kvBlocks, BlockSize: 16,
			KVEvents: &KVEventsConfig{Endpoint: "tcp://127.0.0.1:1", OffloadBlocks: offload}}
	}
	cfg := testConfig(sched.PrecisePrefix)
	cfg.HealthCheckPath = healthCheckOff
	cfg.Routing.Prefix.BlockSize = 16
	cfg.Endpoints = []EndpointConfig{ec(e0, 100, 10), ec(e1, 200, 0)}
	g, _ := startGateway(t, cfg)
	ix := g.PreciseIndex("m")
	bound := func(i int) int { return ix.EndpointStats(i).Capacity }
	if bound(0) != 110 || bound(1) != 200 {
		t.Fatalf("bounds at start: %d, %d; want 110, 200", bound(0), bound(1))
	}
	ep0, ep1 := endpointOf(g, e0.URL()), endpointOf(g, e1.URL())

	cfg.Endpoints = []EndpointConfig{ec(e0, 50, 10), ec(e1, 200, 0)}
	mustReload(t, g, cfg)
	if bound(0) != 60 || bound(1) != 200 {
		t.Fatalf("after kv_blocks changed: %d, %d; want 60, 200", bound(0), bound(1))
	}

	cfg.Endpoints = []EndpointConfig{ec(e0, 50, 10), ec(e2, 30, 5)} // e1 out, e2 in its slot
	mustReload(t, g, cfg)
	p := g.state.Load().pools["m"]
	ep2 := endpointOf(g, e2.URL())
	if g.PreciseIndex("m") != ix || slot(t, p, ep2) != 1 {
		t.Fatal("the index was rebuilt, or the new endpoint did not take the removed one's slot")
	}
	if bound(0) != 60 || bound(1) != 35 {
		t.Fatalf("after the slot changed hands: %d, %d; want 60, 35", bound(0), bound(1))
	}
	for _, ep := range []*endpoint{ep0, ep2} {
		if hs := ep.onDown.Load(); hs == nil || len(*hs) != 2 {
			t.Fatalf("%s: hooks %v, want 2 (the policy's, the KV feed's)", ep.name, hs)
		}
	}
	if hs := ep1.onDown.Load(); hs != nil && len(*hs) > 0 {
		t.Fatalf("the removed endpoint keeps %d hooks", len(*hs))
	}

	hashes := []uint64{1, 2, 3}
	if err := ix.Stored(0, prefix.MediumGPU, hashes, 0, false, make([]uint32, 3*16), fleet.KVSeeds("m")("")); err != nil {
		t.Fatal(err)
	}
	if ix.Len(0, prefix.MediumGPU) == 0 {
		t.Fatal("nothing stored")
	}
	ep0.setReady(false)
	if n := ix.Len(0, prefix.MediumGPU); n != 0 {
		t.Fatalf("the kept endpoint left rotation: its slot still holds %d blocks", n)
	}
}

// TestReloadKeysFile: the keys file is read again at a reload; one that no
// longer parses refuses the reload and the keys in force stay.
func TestReloadKeysFile(t *testing.T) {
	e := newFakeEngine(t, "e0")
	path := filepath.Join(t.TempDir(), "keys")
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("a plain:key-a\n")
	cfg := reloadConfig(sched.RoundRobin, e.URL())
	cfg.Auth.KeysFile = path
	g, url := startGateway(t, cfg)
	c := testClient(t)
	send := func(key string) int {
		t.Helper()
		resp, _ := post(t, c, url+pathChat, chatBody, "Authorization", "Bearer "+key)
		return resp.StatusCode
	}
	write("b plain:key-b\n")
	mustReload(t, g, cfg)
	if sa, sb := send("key-a"), send("key-b"); sa != 401 || sb != 200 {
		t.Fatalf("after the keys file changed: a %d b %d, want 401 200", sa, sb)
	}
	write("b not-a-hash\n")
	if err := g.Reload(cfg); err == nil {
		t.Fatal("a keys file that does not parse was accepted")
	}
	if sb := send("key-b"); sb != 200 {
		t.Fatalf("after a refused reload: b %d, want 200 (the keys in force stay)", sb)
	}
}

// TestReloadEndpoints: an endpoint added takes traffic; one removed while
// a request is in flight on it gets no new request, finishes that one
// (200), and only then stops its health loop; a changed endpoint keeps its
// object (and live state).
func TestReloadEndpoints(t *testing.T) {
	before := settledGoroutines()
	func() {
		held := newParkedEngine(t)
		defer held.srv.Close()
		e1 := newEngineNoCleanup(t, "e1")
		defer e1.srv.Close()
		g, err := New(context.Background(), reloadConfig(sched.RoundRobin, held.srv.URL), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer g.Close()
		srv := newServerNoCleanup(g.Handler())
		defer srv.Close()
		tr := &http.Transport{}
		defer tr.CloseIdleConnections()
		c := &http.Client{Transport: tr, Timeout: 30 * time.Second}

		inflight := make(chan int, 1)
		go func() {
			req, _ := http.NewRequest(http.MethodPost, srv.URL+pathChat, strings.NewReader(chatBody))
			req.Header.Set("X-Request-Id", "held")
			resp, err := c.Do(req)
			if err != nil {
				inflight <- -1
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			inflight <- resp.StatusCode
		}()
		<-held.arrived
		old := endpointOf(g, held.srv.URL)
		mustReload(t, g, reloadConfig(sched.RoundRobin, e1.URL()))
		if endpointOf(g, held.srv.URL) != nil {
			t.Fatal("removed endpoint still configured")
		}
		for range 4 {
			resp, b := post(t, c, srv.URL+pathChat, chatBody)
			if resp.StatusCode != 200 || resp.Header.Get("X-Engine") != "e1" {
				t.Fatalf("after the reload: %d from %q: %s", resp.StatusCode, resp.Header.Get("X-Engine"), b)
			}
		}
		select {
		case <-old.done:
			t.Fatal("the removed endpoint's health loop stopped with a request still in flight on it")
		default:
		}
		if n := old.ledger.InFlight(); n != 1 {
			t.Fatalf("removed endpoint: %d in flight, want 1 (the held request)", n)
		}
		close(held.release)
		if s := <-inflight; s != 200 {
			t.Fatalf("the request in flight on the removed endpoint: %d, want 200", s)
		}
		select {
		case <-old.done:
		case <-time.After(time.Minute):
			t.Fatal("the removed endpoint's health loop still runs after its last request")
		}

		// A changed setting keeps the endpoint (and its state).
		ep1 := endpointOf(g, e1.URL())
		ep1.ledger.Observe(1000, time.Second)
		cfg := reloadConfig(sched.RoundRobin, e1.URL())
		cfg.Endpoints[0].Kind = fleet.Sim
		cfg.Endpoints[0].KVBlocks = 2000
		mustReload(t, g, cfg)
		if endpointOf(g, e1.URL()) != ep1 || ep1.spec.Load().kind != fleet.Sim || ep1.spec.Load().kvBlocks != 2000 {
			t.Fatalf("changed endpoint: same object %v, spec %+v", endpointOf(g, e1.URL()) == ep1, ep1.spec.Load())
		}
		if ep1.ledger.PrefillRate() != 1000 {
			t.Fatalf("learnt prefill rate %v after a reload, want 1000", ep1.ledger.PrefillRate())
		}
		if resp, _ := post(t, c, srv.URL+pathChat, chatBody); resp.StatusCode != 200 {
			t.Fatalf("after changing the endpoint: %d", resp.StatusCode)
		}
	}()
	requireGoroutinesBack(t, before)
}

// TestReloadQueuedRequestPicksNewPool: a request waiting in the admission
// queue when a reload replaces its model's endpoints is sent to the new
// ones when admitted, not to one the reload removed.
func TestReloadQueuedRequestPicksNewPool(t *testing.T) {
	held := newParkedEngine(t)
	e1 := newFakeEngine(t, "e1")
	cfg := reloadConfig(sched.RoundRobin, held.srv.URL)
	cfg.Admission.MaxInFlight = 1
	g, url := startGateway(t, cfg)
	c := testClient(t)
	first, second := make(chan int, 1), make(chan *http.Response, 1)
	go func() {
		resp, _ := post(t, c, url+pathChat, chatBody, "X-Request-Id", "first")
		first <- resp.StatusCode
	}()
	<-held.arrived
	go func() {
		resp, _ := post(t, c, url+pathChat, chatBody, "X-Request-Id", "second")
		second <- resp
	}()
	waitFor(t, "the second request queued", func() bool { return g.state.Load().pools["m"].gate.waiting.Load() == 1 })
	cfg.Endpoints = reloadConfig(sched.RoundRobin, held.srv.URL, e1.URL()).Endpoints
	mustReload(t, g, cfg) // both: the held engine still serves the first
	if ep, p := endpointOf(g, held.srv.URL), g.state.Load().pools["m"]; ep.ledger.InFlight() != 1 || p.gate.active.Load() != 1 {
		t.Fatalf("after a reload that keeps the endpoint: %d in flight on it, %d admitted; want 1 and 1", ep.ledger.InFlight(), p.gate.active.Load())
	}
	cfg.Endpoints = reloadConfig(sched.RoundRobin, e1.URL()).Endpoints
	mustReload(t, g, cfg)
	if n := g.state.Load().pools["m"].gate.waiting.Load(); n != 1 {
		t.Fatalf("%d queued after the reloads, want 1 (the queue is kept)", n)
	}
	close(held.release)
	if s := <-first; s != 200 {
		t.Fatalf("first: %d", s)
	}
	resp := <-second
	if resp.StatusCode != 200 || resp.Header.Get("X-Engine") != "e1" {
		t.Fatalf("the queued request: %d from %q, want 200 from e1 (the removed engine got it)", resp.StatusCode, resp.Header.Get("X-Engine"))
	}
	select {
	case id := <-held.arrived:
		t.Fatalf("request %q reached the removed engine", id)
	default:
	}
}

// TestReloadRefusesInvalid: an invalid configuration changes nothing: the
// error is returned, counted and the last reload marked failed; requests
// are served as before; the next valid reload succeeds.
func TestReloadRefusesInvalid(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := reloadConfig(sched.Prefix, e.URL())
	g, url := startGateway(t, cfg)
	c := testClient(t)
	st := g.state.Load()
	for _, bad := range []func(*Config){
		func(c *Config) { c.Endpoints = nil },
		func(c *Config) { c.Endpoints[0].Model = "" },
		func(c *Config) { c.Routing.Policy = "nope" },
		func(c *Config) { c.Admission.QueueTimeout = -time.Second },
		func(c *Config) { c.Auth.Keys = []auth.Key{{Name: "x", Hash: "sha256:zz"}} },
		func(c *Config) { c.Listen = "not an address" },
	} {
		next := cfg
		next.Endpoints = append([]EndpointConfig(nil), cfg.Endpoints...)
		bad(&next)
		if err := g.Reload(next); err == nil {
			t.Fatalf("invalid configuration accepted: %+v", next)
		}
		if g.state.Load() != st {
			t.Fatal("a refused reload replaced the state")
		}
	}
	if err := g.ReloadWith(func() (Config, error) { return Config{}, fmt.Errorf("yaml: line 3: bad") }); err == nil {
		t.Fatal("a load error was not a failed reload")
	}
	if resp, _ := post(t, c, url+pathChat, chatBody); resp.StatusCode != 200 {
		t.Fatalf("after refused reloads: %d", resp.StatusCode)
	}
	m := scrape(t, c, url)
	if f, s, ok := m.value("infergate_config_reloads_total", `result="failure"`), m.value("infergate_config_reloads_total", `result="success"`),
		m.value("infergate_config_last_reload_successful", ""); f != 7 || s != 0 || ok != 0 {
		t.Fatalf("reloads: %v failed, %v succeeded, last successful %v; want 7, 0, 0", f, s, ok)
	}
	at := m.value("infergate_config_last_reload_success_timestamp_seconds", "")
	mustReload(t, g, cfg)
	m = scrape(t, c, url)
	if s, ok := m.value("infergate_config_reloads_total", `result="success"`), m.value("infergate_config_last_reload_successful", ""); s != 1 || ok != 1 {
		t.Fatalf("after a valid reload: %v succeeded, last successful %v", s, ok)
	}
	if at2 := m.value("infergate_config_last_reload_success_timestamp_seconds", ""); at == 0 || at2 < at {
		t.Fatalf("last success timestamp %v then %v", at, at2)
	}
}

// TestReloadKeepsUnreloadable: a setting that needs a restart keeps its
// value from start (and is named); the reloadable ones apply.
func TestReloadKeepsUnreloadable(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := reloadConfig(sched.Prefix, e.URL())
	g, url := startGateway(t, cfg)
	next := cfg
	next.Listen = "127.0.0.1:9999"
	next.MaxBodyBytes = 1 << 10
	next.Routing.Policy = sched.RoundRobin
	next.Admission.MaxQueue = 7
	mustReload(t, g, next)
	got := g.Config()
	if got.Listen != g.cfg.Listen || got.MaxBodyBytes != DefaultMaxBodyBytes {
		t.Errorf("kept settings changed: listen %q max_body_bytes %d", got.Listen, got.MaxBodyBytes)
	}
	if got.Routing.Policy != sched.RoundRobin || g.Policy() != sched.RoundRobin || got.Admission.MaxQueue != 7 {
		t.Errorf("reloadable settings not applied: %+v %+v", got.Routing, got.Admission)
	}
	if _, q, _ := g.state.Load().pools["m"].gate.settings(); q != 7 {
		t.Errorf("admission max_queue %d, want 7", q)
	}
	c := testClient(t)
	for range 2 {
		if resp, b := post(t, c, url+pathChat, chatBody); resp.StatusCode != 200 {
			t.Fatalf("under the new policy: %d %s", resp.StatusCode, b)
		}
	}
	if n := scrape(t, c, url).value("infergate_requests_total", `policy="round-robin"`); n != 2 {
		t.Errorf("requests counted under the new policy: %v, want 2", n)
	}
	old, nc := cfg.WithDefaults(), next.WithDefaults()
	if kept := keepUnreloadable(&nc, old); strings.Join(kept, ",") != "listen,max_body_bytes" {
		t.Errorf("kept %v, want listen and max_body_bytes", kept)
	}
}

// TestReloadKeepsEndpointState: what the gateway learnt of the endpoints
// that stay survives a reload that removes and adds others: the
// approximate prefix index's blocks (the slot is the endpoint's), the
// ejection; a new endpoint that takes a removed one's slot starts with
// nothing of what the removed one held.
func TestReloadKeepsEndpointState(t *testing.T) {
	e0, e1, e2 := newFakeEngine(t, "e0"), newFakeEngine(t, "e1"), newFakeEngine(t, "e2")
	cfg := reloadConfig(sched.Prefix, e0.URL(), e1.URL())
	cfg.EjectDuration = time.Hour
	cfg.Outlier.MaxEjectionTime = time.Hour
	cfg.HealthCheckPath = healthCheckOff // a probe slowed by a loaded machine must not forget an endpoint's blocks
	g, url := startGateway(t, cfg)
	c := testClient(t)
	ep0, ep1 := endpointOf(g, e0.URL()), endpointOf(g, e1.URL())
	body := func(system, q string) string {
		b, _ := json.Marshal(map[string]any{"model": "m", "messages": []map[string]string{
			{"role": "system", "content": strings.Repeat(system, 40)}, {"role": "user", "content": q}}})
		return string(b)
	}
	sysA, sysB := "You are a careful assistant who answers in full sentences. ", "Answer tersely, in lists, as a pirate would. "
	send := func(system, q string) (engine string, predicted float64) {
		t.Helper()
		before := scrape(t, c, url).value("infergate_prefix_predicted_matched_tokens_total", "")
		resp, b := post(t, c, url+pathChat, body(system, q))
		if resp.StatusCode != 200 {
			t.Fatalf("%d: %s", resp.StatusCode, b)
		}
		return resp.Header.Get("X-Engine"), scrape(t, c, url).value("infergate_prefix_predicted_matched_tokens_total", "") - before
	}
	// Conversation A learnt on e0, B on e1: the other one held out of
	// rotation for the first turn (its ejection set without the hooks
	// that forget its blocks).
	steer := func(away *endpoint, system string) string {
		t.Helper()
		away.ejectedUntil.Store(time.Now().Add(time.Hour).UnixNano())
		away.ready.Store(false)
		defer func() {
			away.ejectedUntil.Store(0)
			away.ready.Store(true)
		}()
		eng, _ := send(system, "one")
		return eng
	}
	if a, b := steer(ep1, sysA), steer(ep0, sysB); a != "e0" || b != "e1" {
		t.Fatalf("first turns went to %s and %s", a, b)
	}

	// e1 goes, e2 comes: it takes e1's slot.
	mustReload(t, g, reloadConfig(sched.Prefix, e0.URL(), e2.URL()))
	p := g.state.Load().pools["m"]
	if endpointOf(g, e0.URL()) != ep0 || slot(t, p, ep0) != 0 || slot(t, p, endpointOf(g, e2.URL())) != 1 {
		t.Fatal("slots: the kept endpoint moved, or the new one did not take the removed one's")
	}
	if eng, predicted := send(sysA, "two"); eng != "e0" || predicted < 400 {
		t.Fatalf("A after the reload: %s with %v tokens predicted; want e0 with its ~480-token system prompt (the index lost the kept endpoint's blocks)",
			eng, predicted)
	}
	if eng, predicted := send(sysB, "two"); predicted > 16 {
		t.Fatalf("B after the reload: %s with %v tokens predicted; want at most the one block A and B share (the new endpoint inherited the removed one's blocks)",
			eng, predicted)
	}

	// An ejection survives a reload, for an endpoint that stays.
	g.ejectOutlier(ep0, reasonConnect, time.Now())
	mustReload(t, g, reloadConfig(sched.Prefix, e0.URL(), e2.URL(), e1.URL()))
	if ep0.ready.Load() || time.Now().UnixNano() >= ep0.ejectedUntil.Load() {
		t.Fatal("the kept endpoint's ejection was lost")
	}
	if endpointOf(g, e1.URL()) == ep1 {
		t.Fatal("an endpoint put back after its removal reused the drained object")
	}
	for range 4 {
		if eng, _ := send(sysA, "three"); eng == "e0" {
			t.Fatal("the ejected endpoint got a request")
		}
	}
}

// slot returns ep's slot in p.
func slot(t *testing.T, p *pool, ep *endpoint) int {
	t.Helper()
	for i, e := range p.endpoints {
		if e == ep {
			return i
		}
	}
	t.Fatalf("%s not in the pool", ep.name)
	return -1
}

// TestReloadPreciseIndex: engines publishing KV events; a reload removes
// one and adds another. The precise index is the same, what it holds of the
// engine that stays survives (its subscription is kept: no reset), and the
// new engine's slot starts empty.
func TestReloadPreciseIndex(t *testing.T) {
	f, err := simserver.StartFleet(3, simserver.ServerConfig{Model: "m", TimeScale: 100, KVEvents: kvevents.PublisherConfig{Enable: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	pub, replay := f.KVEventEndpoints()
	ec := func(i int) EndpointConfig {
		return EndpointConfig{URL: f.URLs[i], Model: "m", Kind: fleet.Sim,
			KVEvents: &KVEventsConfig{Endpoint: pub[i], ReplayEndpoint: replay[i]}}
	}
	// No probes: one slowed by a loaded machine would forget an engine's
	// blocks and reset its subscription.
	cfg := Config{HealthCheckInterval: time.Second, HealthCheckPath: healthCheckOff}
	cfg.Routing.Policy = sched.PrecisePrefix
	cfg.Endpoints = []EndpointConfig{ec(0), ec(1)}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	sys := strings.Repeat("You are a careful assistant who answers in full sentences. ", 40)
	chat := func(q string) (cached int) {
		t.Helper()
		body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 4, "messages": []map[string]string{
			{"role": "system", "content": sys}, {"role": "user", "content": q}}})
		resp, b := post(t, c, url+pathChat, string(body))
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
		var out struct {
			Usage struct {
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		_ = json.Unmarshal(b, &out)
		return out.Usage.Details.Cached
	}
	chat("first question")
	ix := g.PreciseIndex("m")
	p := g.state.Load().pools["m"]
	holder := -1
	waitFor(t, "the engine's blocks in the precise index", func() bool {
		for i := range 2 {
			if ix.Len(i, prefix.MediumGPU) > 0 {
				holder = i
				return true
			}
		}
		return false
	})
	held := ix.Len(holder, prefix.MediumGPU)
	keep := p.endpoints[holder]
	other := 1 - holder
	resets := kvFeedOf(g, holder).sub.Stats().Resets
	gone := g.state.Load().feeds[p.endpoints[1-holder]].kv
	cfg.Endpoints = []EndpointConfig{ec(holder), ec(2)}
	mustReload(t, g, cfg)
	select {
	case <-gone.done: // drained: nothing was in flight on it
	case <-time.After(time.Minute):
		t.Fatal("the removed engine's KV-event subscription still runs")
	}
	if as, _ := gone.current(); len(as) != 0 {
		t.Fatalf("the removed engine's stream still feeds %d appliers", len(as))
	}
	p2 := g.state.Load().pools["m"]
	if g.PreciseIndex("m") != ix || p2.endpoints[holder] != keep {
		t.Fatal("the precise index or the kept endpoint's slot changed")
	}
	if n := ix.Len(holder, prefix.MediumGPU); n < held {
		t.Fatalf("the kept engine's blocks: %d after the reload, %d before", n, held)
	}
	if st := g.state.Load().feeds[keep].kv.sub.Stats(); st.Resets != resets {
		t.Fatalf("the kept engine's subscription was reset (%d resets, %d before)", st.Resets, resets)
	}
	if got := p2.endpoints[other].name; got != f.URLs[2] {
		t.Fatalf("slot %d holds %s, want the new engine", other, got)
	}
	if n := ix.Len(other, prefix.MediumGPU); n != 0 {
		t.Fatalf("the new engine's slot holds %d blocks of the removed one", n)
	}
	if cached := chat("second question"); cached < 400 {
		t.Fatalf("follow-up after the reload: %d cached tokens, want the ~480-token system prompt", cached)
	}
}

// TestReloadThenDrain: a model added by a reload is drained at shutdown
// like the others.
func TestReloadThenDrain(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := reloadConfig(sched.RoundRobin, e.URL())
	g, url := startGateway(t, cfg)
	c := testClient(t)
	cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: e.URL(), Model: "m2", KVBlocks: 1000})
	mustReload(t, g, cfg)
	if resp, b := post(t, c, url+pathChat, strings.Replace(chatBody, `"m"`, `"m2"`, 1)); resp.StatusCode != 200 {
		t.Fatalf("model added by a reload: %d %s", resp.StatusCode, b)
	}
	g.Drain()
	resp, b := post(t, c, url+pathChat, strings.Replace(chatBody, `"m"`, `"m2"`, 1))
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(b), codeShuttingDown) {
		t.Fatalf("after Drain: %d %s", resp.StatusCode, b)
	}
	if err := g.Reload(cfg); err == nil {
		t.Fatal("a reload during the shutdown was accepted")
	}
}
