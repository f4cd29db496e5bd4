package gateway

import (
	"encoding/json"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
)

// TestPrecisePrefixOnSimFleet runs precise-prefix in front of real
// simulated engines that publish KV events: the
// gateway subscribes over ZeroMQ, the precise index learns what the engine
// cached, and a follow-up sharing the prompt goes to that engine and is
// served from its cache as predicted.
func TestPrecisePrefixOnSimFleet(t *testing.T) {
	f, err := sim.StartFleet(3, sim.ServerConfig{Model: "m", TimeScale: 100, KVEvents: sim.KVEventsConfig{Enable: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	pub, replay := f.KVEventEndpoints()
	cfg := Config{HealthCheckInterval: time.Second}
	cfg.Routing.Policy = sched.PrecisePrefix
	for i, u := range f.URLs {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: u, Model: "m", Kind: fleet.Sim,
			KVEvents: &KVEventsConfig{Endpoint: pub[i], ReplayEndpoint: replay[i]}})
	}
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
		if err := json.Unmarshal(b, &out); err != nil {
			t.Fatal(err)
		}
		return out.Usage.Details.Cached
	}
	chat("first question")
	ix := g.PreciseIndex("m")
	held := func() (n int) {
		for e := range ix.Endpoints() {
			if ix.Len(e, prefix.MediumGPU) > 0 {
				n++
			}
		}
		return n
	}
	deadline := time.Now().Add(10 * time.Second)
	for held() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no KV event reached the precise index in 10s: %+v", ix.Stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := held(); n != 1 {
		t.Fatalf("%d engines hold blocks after one request", n)
	}
	for _, q := range []string{"second question", "third question"} {
		if got := chat(q); got < 400 {
			t.Fatalf("follow-up %q: %d cached tokens, want the ~480-token system prompt", q, got)
		}
	}
	if n := held(); n != 1 {
		t.Fatalf("follow-ups spread over %d engines", n)
	}
	m := scrape(t, c, url)
	if n := m.value("infergate_prefix_prediction_error_tokens_count", `index="precise"`); n < 3 {
		t.Fatalf("precise prediction error observed %v times, want 3", n)
	}
	if mean := m.value("infergate_prefix_prediction_error_tokens_sum", `index="precise"`) / 3; mean > 32 {
		t.Errorf("precise prediction off by %.0f tokens on average", mean)
	}
}

// restartableEngine is one simulated engine, with KV events, that can be
// stopped and started again on the same HTTP and PUB ports: an engine
// restarting in place (a new process: empty cache, sequence numbers from 0).
type restartableEngine struct {
	t                *testing.T
	url, pub, replay string
	srv              *sim.Server
	hs               *http.Server
	done             chan struct{}
}

func startRestartable(t *testing.T) *restartableEngine {
	t.Helper()
	e := &restartableEngine{t: t}
	e.start("127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
	t.Cleanup(e.stop)
	return e
}

func (e *restartableEngine) start(httpAddr, pub, replay string) {
	e.t.Helper()
	s, err := sim.NewServer(sim.ServerConfig{Model: "m", TimeScale: 100,
		KVEvents: sim.KVEventsConfig{Enable: true, Endpoint: pub, ReplayEndpoint: replay, Bind: true}})
	if err != nil {
		e.t.Fatal(err)
	}
	ln, err := net.Listen("tcp", httpAddr)
	if err != nil {
		s.Close()
		e.t.Fatal(err)
	}
	s.Start()
	e.srv, e.hs, e.done = s, &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 10 * time.Second}, make(chan struct{})
	e.url = "http://" + ln.Addr().String()
	e.pub = "tcp://" + s.KVEventPublisher().Addr().String()
	e.replay = "tcp://" + s.KVEventPublisher().ReplayAddr().String()
	go func() {
		defer close(e.done)
		_ = e.hs.Serve(ln)
	}()
}

func (e *restartableEngine) stop() {
	if e.srv == nil {
		return
	}
	_ = e.hs.Close()
	<-e.done
	e.srv.Close()
	e.srv = nil
}

// TestPreciseForgetsRestartedEngine: an engine restarts in place. While it
// is down its health check fails, and the gateway forgets its KV-event
// state (the precise index's blocks, the subscription's stream); the
// restarted engine publishes nothing until it serves, so before this fix the
// first request after its return was routed on the blocks of its previous
// life: predicted ~480 cached tokens, got 0.
func TestPreciseForgetsRestartedEngine(t *testing.T) {
	e := startRestartable(t)
	cfg := Config{HealthCheckInterval: 20 * time.Millisecond, HealthCheckTimeout: time.Second}
	cfg.Routing.Policy = sched.PrecisePrefix
	cfg.Endpoints = []EndpointConfig{{URL: e.url, Model: "m", Kind: fleet.Sim, KVEvents: &KVEventsConfig{Endpoint: e.pub, ReplayEndpoint: e.replay}}}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	sys := strings.Repeat("You are a careful assistant who answers in full sentences. ", 40)
	body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 4, "messages": []map[string]string{
		{"role": "system", "content": sys}, {"role": "user", "content": "a question"}}})
	chat := func() (predicted, cached int) {
		t.Helper()
		before := scrape(t, c, url).value("infergate_prefix_predicted_matched_tokens_total", "")
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
		if err := json.Unmarshal(b, &out); err != nil {
			t.Fatal(err)
		}
		after := scrape(t, c, url).value("infergate_prefix_predicted_matched_tokens_total", "")
		return int(after - before), out.Usage.Details.Cached
	}
	ix, ep := g.PreciseIndex("m"), g.endpoints[0]
	chat()
	waitFor(t, "the engine's blocks in the index", func() bool { return ix.Len(0, prefix.MediumGPU) > 0 })
	if p, cached := chat(); p < 400 || cached < 400 {
		t.Fatalf("before the restart: predicted %d, cached %d; want the ~480-token system prompt both", p, cached)
	}

	e.stop()
	waitFor(t, "the failed health check", func() bool { return !ep.ready.Load() })
	if n := ix.Len(0, prefix.MediumGPU); n != 0 {
		t.Fatalf("endpoint out of rotation still holds %d blocks in the precise index", n)
	}
	e.start(strings.TrimPrefix(e.url, "http://"), e.pub, e.replay)
	waitFor(t, "the engine back in rotation", func() bool { return ep.ready.Load() })
	p, cached := chat()
	t.Logf("first request after the restart: predicted %d cached tokens, the engine reported %d", p, cached)
	if p != cached {
		t.Fatalf("first request after the restart: predicted %d cached tokens, the engine reported %d", p, cached)
	}
	if st := g.kvSubs[0].sub.Stats(); st.Resyncs == 0 {
		t.Fatalf("subscriber stats %+v: no resync", st)
	}
	// The index learns the restarted engine's blocks again (the subscriber
	// redials after its backoff and replays what it missed).
	for deadline := time.Now().Add(30 * time.Second); ix.Len(0, prefix.MediumGPU) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the restarted engine's blocks never reached the index: %+v", g.kvSubs[0].sub.Stats())
		}
	}
	if p, cached := chat(); p < 400 || p != cached {
		t.Fatalf("second request after the restart: predicted %d, cached %d", p, cached)
	}

	// An ejection by outlier detection forgets the endpoint's blocks too.
	resyncs := g.kvSubs[0].sub.Stats().Resyncs
	if !g.ejectOutlier(ep, reasonConnect, time.Now()) {
		t.Fatal("not ejected")
	}
	if n, st := ix.Len(0, prefix.MediumGPU), g.kvSubs[0].sub.Stats(); n != 0 || st.Resyncs != resyncs+1 {
		t.Fatalf("after the ejection: %d blocks held, %d resyncs (was %d)", n, st.Resyncs, resyncs)
	}
}
