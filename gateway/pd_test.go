package gateway

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/disagg"
	"github.com/infergate/infergate/sched"
)

// pdLeg is one request a fake P/D engine received.
type pdLeg struct {
	path   string
	header http.Header
	body   map[string]any
	raw    []byte
}

// pdEngine is a fake engine of a P/D pool speaking the connectors'
// protocols: as a prefill endpoint it answers NIXL legs with
// kv_transfer_params naming its blocks (and P's cached tokens, 16), its
// bootstrap server (boot) answers Mooncake's /query; as a decode endpoint
// it answers like vLLM given a remote prefill: cached tokens prompt − 1.
type pdEngine struct {
	*httptest.Server
	boot *httptest.Server // Mooncake bootstrap server

	name     string
	fail     atomic.Int32  // the next n inference requests answer 503
	shared   *atomic.Int32 // instead of fail, shared with other engines
	unhealth atomic.Bool   // /health answers 503
	hang     atomic.Bool   // streams stop after their first chunk until the client goes
	mu       sync.Mutex
	legs     []pdLeg
	releases []pdLeg
	released chan struct{} // a release arrived
}

func newPDEngine(t *testing.T, name string) *pdEngine {
	e := &pdEngine{name: name, released: make(chan struct{}, 8)}
	e.Server = httptest.NewServer(http.HandlerFunc(e.serve))
	e.boot = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == disagg.BootstrapQueryPath {
			fmt.Fprintf(w, `{"0":{"engine_id":"eng-%s"}}`, e.name)
			return
		}
		http.NotFound(w, r)
	}))
	t.Cleanup(func() { e.Close(); e.boot.Close() })
	return e
}

func (e *pdEngine) bootPort() int {
	u, _ := url.Parse(e.boot.URL)
	var p int
	fmt.Sscan(u.Port(), &p)
	return p
}

func (e *pdEngine) got() []pdLeg {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]pdLeg(nil), e.legs...)
}

func (e *pdEngine) serve(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/v1/models" { // the gateway's model list refresh: no leg
		http.NotFound(w, r)
		return
	}
	if r.URL.Path == "/health" {
		if e.unhealth.Load() {
			w.WriteHeader(503)
		}
		return
	}
	raw, _ := io.ReadAll(r.Body)
	var body map[string]any
	_ = json.Unmarshal(raw, &body)
	leg := pdLeg{path: r.URL.Path, header: r.Header.Clone(), body: body, raw: raw}
	e.mu.Lock()
	if r.URL.Path == disagg.ReleasePath {
		e.releases = append(e.releases, leg)
		e.mu.Unlock()
		e.released <- struct{}{}
		return
	}
	e.legs = append(e.legs, leg)
	e.mu.Unlock()
	fail := &e.fail
	if e.shared != nil {
		fail = e.shared
	}
	if fail.Add(-1) >= 0 {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(503)
		io.WriteString(w, `{"error":{"message":"overloaded","type":"ServiceUnavailable","code":503}}`)
		return
	}
	fail.Store(0)
	kv, _ := body["kv_transfer_params"].(map[string]any)
	if kv != nil && kv["do_remote_decode"] == true {
		// A prefill leg: one token, the blocks held for D (NIXL), or
		// discarded (Mooncake).
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"cmpl-p","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}],`+
			`"usage":{"prompt_tokens":100,"completion_tokens":1,"total_tokens":101,"prompt_tokens_details":{"cached_tokens":16}},`+
			`"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[3,4,5]],"remote_engine_id":"eng-%s",`+
			`"remote_request_id":%q,"remote_host":"127.0.0.1","remote_port":5600,"tp_size":1,"future_key":{"x":[1]}}}`, e.name, r.Header.Get("X-Request-Id"))
		return
	}
	usage := `{"prompt_tokens":100,"completion_tokens":1,"total_tokens":101,"prompt_tokens_details":{"cached_tokens":99}}`
	if body["stream"] != true {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"cmpl-d","object":"text_completion","choices":[{"index":0,"text":"hello from %s","finish_reason":"stop"}],"usage":%s}`, e.name, usage)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fmt.Fprintf(w, "data: {\"id\":\"cmpl-d\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"hello from %s\",\"finish_reason\":null}],\"usage\":null}\n\n", e.name)
	w.(http.Flusher).Flush()
	if e.hang.Load() {
		<-r.Context().Done()
		return
	}
	fmt.Fprintf(w, "data: {\"id\":\"cmpl-d\",\"object\":\"text_completion\",\"choices\":[],\"usage\":%s}\n\ndata: [DONE]\n\n", usage)
}

// pdConfig is a P/D pool of ps (prefill) and ds (decode), splitting
// prompts of at least 32 tokens.
func pdConfig(connector string, ps, ds []*pdEngine) Config {
	cfg := Config{EjectDuration: 100 * time.Millisecond, HealthCheckInterval: 20 * time.Millisecond,
		HealthCheckTimeout: time.Second, ScrapeInterval: -1}
	cfg.Routing.Policy = "least-request"
	cfg.Routing.PD.Threshold = 32
	cfg.PD.Connector = connector
	cfg.PD.Release = true
	for _, e := range ps {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: e.URL, Model: "m", KVBlocks: 1000, MaxModelLen: 4096,
			Role: "prefill", BootstrapPort: e.bootPort()})
	}
	for _, e := range ds {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: e.URL, Model: "m", KVBlocks: 1000, MaxModelLen: 4096, Role: "decode"})
	}
	return cfg
}

// longPrompt is a completion body with a 100-token prompt.
func longPrompt(extra string) string {
	ids := make([]string, 100)
	for i := range ids {
		ids[i] = fmt.Sprint(i + 1)
	}
	return `{"model":"m","prompt":[` + strings.Join(ids, ",") + `],"max_tokens":20,"min_tokens":2,"vendor_x":{"k":[1,2]}` + extra + `}`
}

func metricValue(t *testing.T, url, name, sel string) float64 {
	return scrape(t, http.DefaultClient, url).value(name, sel)
}

func TestPDNIXL(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			p, d := newPDEngine(t, "p"), newPDEngine(t, "d")
			_, gw := startGateway(t, pdConfig("nixl", []*pdEngine{p}, []*pdEngine{d}))
			extra := ""
			if stream {
				extra = `,"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":false}`
			}
			resp, body := post(t, http.DefaultClient, gw+"/v1/completions", longPrompt(extra), "X-Request-Id", "req-1")
			if resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			pl, dl := p.got(), d.got()
			if len(pl) != 1 || len(dl) != 1 {
				t.Fatalf("P got %d, D got %d requests", len(pl), len(dl))
			}
			pb, db := pl[0].body, dl[0].body
			// P: the original body, one token, no stream, the remote fields null.
			want := map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
				"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
			if fmt.Sprint(pb["kv_transfer_params"]) != fmt.Sprint(want) || pb["stream"] != false || pb["max_tokens"] != 1.0 ||
				pb["min_tokens"] != nil || pb["stream_options"] != nil || fmt.Sprint(pb["vendor_x"]) != "map[k:[1 2]]" {
				t.Fatalf("P's body: %s", pl[0].raw)
			}
			// D: the original body with P's kv_transfer_params verbatim.
			kv := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[3,4,5]],"remote_engine_id":"eng-p","remote_request_id":"req-1","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1,"future_key":{"x":[1]}}`
			if !strings.Contains(string(dl[0].raw), `"kv_transfer_params":`+kv) || db["max_tokens"] != 20.0 || db["min_tokens"] != 2.0 ||
				(db["stream"] == true) != stream {
				t.Fatalf("D's body: %s", dl[0].raw)
			}
			if stream {
				if so, _ := db["stream_options"].(map[string]any); so["continuous_usage_stats"] != false || so["include_usage"] != true {
					t.Fatalf("D's stream_options: %s", dl[0].raw)
				}
			}
			if a, b := pl[0].header.Get("X-Request-Id"), dl[0].header.Get("X-Request-Id"); a != "req-1" || b != "req-1" {
				t.Fatalf("X-Request-Id P %q, D %q", a, b)
			}
			// D's usage: P's cached tokens (16), not the 99 D counted.
			if !strings.Contains(string(body), `"prompt_tokens_details":{"cached_tokens":16}`) || strings.Contains(string(body), `"cached_tokens":99`) {
				t.Fatalf("answer: %s", body)
			}
			if v := metricValue(t, gw, "infergate_pd_decisions_total", `outcome="split"`); v != 1 {
				t.Fatalf("split decisions %v", v)
			}
			// Hand-offs are timed to a streamed D's headers only (a whole
			// answer's come after its decode).
			if v, want := metricValue(t, gw, "infergate_pd_handoff_seconds_count", ""), map[bool]float64{true: 1, false: 0}[stream]; v != want {
				t.Fatalf("hand-offs %v, want %v", v, want)
			}
			if v := metricValue(t, gw, "infergate_pd_prefill_legs_total", `result="ok"`); v != 1 {
				t.Fatalf("prefill legs %v", v)
			}
			if v := metricValue(t, gw, "infergate_cached_prompt_tokens_total", ""); v != 16 {
				t.Fatalf("cached tokens accounted %v", v)
			}
			// D answered: nothing to release.
			if len(p.releases) != 0 || metricValue(t, gw, "infergate_pd_stranded_holds_total", "") != 0 {
				t.Fatal("released after a decode that answered")
			}
		})
	}
}

func TestPDPrefillFailures(t *testing.T) {
	t.Run("retry-other-prefill", func(t *testing.T) {
		p1, p2, d := newPDEngine(t, "p1"), newPDEngine(t, "p2"), newPDEngine(t, "d")
		p1.fail.Store(1 << 20)
		p2.fail.Store(1 << 20)
		cfg := pdConfig("nixl", []*pdEngine{p1, p2}, []*pdEngine{d})
		_, gw := startGateway(t, cfg)
		// The first P picked fails; least-request ties break in order, so
		// make the second one succeed whichever is tried first.
		p2.fail.Store(0)
		p1.fail.Store(1 << 20)
		resp, body := post(t, http.DefaultClient, gw+"/v1/completions", longPrompt(""))
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		if n1, n2 := len(p1.got()), len(p2.got()); n1 > 1 || n2 != 1 {
			t.Fatalf("P1 got %d, P2 %d", n1, n2)
		}
		if !strings.Contains(string(d.got()[0].raw), `"remote_engine_id":"eng-p2"`) {
			t.Fatalf("D's body %s", d.got()[0].raw)
		}
		if len(p1.got()) == 1 && metricValue(t, gw, "infergate_pd_retries_total", `leg="prefill"`) != 1 {
			t.Fatal("prefill retry not counted")
		}
	})
	t.Run("all-fail-aggregated", func(t *testing.T) {
		p1, p2, d := newPDEngine(t, "p1"), newPDEngine(t, "p2"), newPDEngine(t, "d")
		p1.fail.Store(1 << 20)
		p2.fail.Store(1 << 20)
		_, gw := startGateway(t, pdConfig("nixl", []*pdEngine{p1, p2}, []*pdEngine{d}))
		in := longPrompt("")
		resp, body := post(t, http.DefaultClient, gw+"/v1/completions", in)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		if len(p1.got()) != 1 || len(p2.got()) != 1 {
			t.Fatalf("P1 got %d, P2 %d (want one each)", len(p1.got()), len(p2.got()))
		}
		if got := string(d.got()[0].raw); got != in {
			t.Fatalf("D got %s, want the original body", got)
		}
		if v := metricValue(t, gw, "infergate_pd_fallbacks_total", `reason="5xx"`); v != 1 {
			t.Fatalf("fallbacks %v", v)
		}
		if !strings.Contains(string(body), `"cached_tokens":99`) {
			t.Fatalf("an aggregated answer's usage was rewritten: %s", body)
		}
	})
}

func TestPDDecodeRetryKeepsParams(t *testing.T) {
	p, d1, d2 := newPDEngine(t, "p"), newPDEngine(t, "d1"), newPDEngine(t, "d2")
	var first atomic.Int32 // the first D tried answers 503
	first.Store(1)
	d1.shared, d2.shared = &first, &first
	_, gw := startGateway(t, pdConfig("nixl", []*pdEngine{p}, []*pdEngine{d1, d2}))
	resp, body := post(t, http.DefaultClient, gw+"/v1/completions", longPrompt(`,"stream":true,"stream_options":{"include_usage":true}`))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	legs := append(d1.got(), d2.got()...)
	if len(legs) != 2 || len(p.got()) != 1 {
		t.Fatalf("D legs %d, P legs %d", len(legs), len(p.got()))
	}
	a, b := legs[0].body["kv_transfer_params"], legs[1].body["kv_transfer_params"]
	if a == nil || fmt.Sprint(a) != fmt.Sprint(b) {
		t.Fatalf("kv_transfer_params differ: %v / %v", a, b)
	}
	if v := metricValue(t, gw, "infergate_pd_retries_total", `leg="decode"`); v != 1 {
		t.Fatalf("decode retries %v", v)
	}
	if !strings.Contains(string(body), `"cached_tokens":16`) {
		t.Fatalf("answer %s", body)
	}
}

// cancelMidStream sends a streaming split request, reads D's first event
// and goes away.
func cancelMidStream(t *testing.T, gw string) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, gw+"/v1/completions", strings.NewReader(longPrompt(`,"stream":true`)))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || !strings.Contains(line, "hello from d") {
		t.Fatalf("first line %q, %v", line, err)
	}
	cancel()
}

func TestPDClientCancelReleases(t *testing.T) {
	p, d := newPDEngine(t, "p"), newPDEngine(t, "d")
	d.hang.Store(true)
	_, gw := startGateway(t, pdConfig("nixl", []*pdEngine{p}, []*pdEngine{d}))
	cancelMidStream(t, gw)
	select {
	case <-p.released:
	case <-time.After(time.Minute):
		t.Fatal("no release")
	}
	p.mu.Lock()
	rb := string(p.releases[0].raw)
	p.mu.Unlock()
	if rb != `{"remote_engine_id":"eng-p","remote_request_id":"`+p.got()[0].header.Get("X-Request-Id")+`"}` {
		t.Fatalf("release body %s", rb)
	}
	waitFor(t, "the release counted", func() bool {
		return metricValue(t, gw, "infergate_pd_releases_total", `result="released"`) == 1
	})
}

func TestPDStrandedWithoutRelease(t *testing.T) {
	p, d := newPDEngine(t, "p"), newPDEngine(t, "d")
	d.hang.Store(true)
	cfg := pdConfig("nixl", []*pdEngine{p}, []*pdEngine{d})
	cfg.PD.Release = false
	_, gw := startGateway(t, cfg)
	cancelMidStream(t, gw)
	waitFor(t, "the stranded hold counted", func() bool {
		return metricValue(t, gw, "infergate_pd_stranded_holds_total", "") == 1
	})
	if len(p.releases) != 0 {
		t.Fatal("released with pd.release off")
	}
}

func TestPDWholeOnDecode(t *testing.T) {
	t.Run("short-prompt", func(t *testing.T) {
		p, d := newPDEngine(t, "p"), newPDEngine(t, "d")
		_, gw := startGateway(t, pdConfig("nixl", []*pdEngine{p}, []*pdEngine{d}))
		in := `{"model":"m","prompt":[1,2,3,4,5,6,7,8],"max_tokens":3}`
		resp, body := post(t, http.DefaultClient, gw+"/v1/completions", in)
		if resp.StatusCode != 200 || len(p.got()) != 0 || string(d.got()[0].raw) != in {
			t.Fatalf("status %d, P legs %d, D body %s", resp.StatusCode, len(p.got()), body)
		}
		if v := metricValue(t, gw, "infergate_pd_decisions_total", `reason="below-threshold"`); v != 1 {
			t.Fatalf("short decisions %v", v)
		}
	})
	t.Run("no-prefill-ready", func(t *testing.T) {
		p, d := newPDEngine(t, "p"), newPDEngine(t, "d")
		p.unhealth.Store(true)
		g, gw := startGateway(t, pdConfig("nixl", []*pdEngine{p}, []*pdEngine{d}))
		waitFor(t, "P out of rotation", func() bool { return !g.state.Load().pools["m"].endpoints[0].ready.Load() })
		in := longPrompt("")
		resp, _ := post(t, http.DefaultClient, gw+"/v1/completions", in)
		if resp.StatusCode != 200 || len(p.got()) != 0 || string(d.got()[0].raw) != in {
			t.Fatalf("status %d, P legs %d", resp.StatusCode, len(p.got()))
		}
		if v := metricValue(t, gw, "infergate_pd_decisions_total", `reason="no-prefill"`); v != 1 {
			t.Fatalf("no-prefill decisions %v", v)
		}
	})
}

func TestPDMooncake(t *testing.T) {
	p, d := newPDEngine(t, "p"), newPDEngine(t, "d")
	_, gw := startGateway(t, pdConfig("mooncake", []*pdEngine{p}, []*pdEngine{d}))
	resp, body := post(t, http.DefaultClient, gw+"/v1/completions", longPrompt(`,"stream":true`), "X-Request-Id", "mc-1")
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	pl, dl := p.got(), d.got()
	if len(pl) != 1 || len(dl) != 1 {
		t.Fatalf("P %d, D %d", len(pl), len(dl))
	}
	pkv, _ := pl[0].body["kv_transfer_params"].(map[string]any)
	dkv, _ := dl[0].body["kv_transfer_params"].(map[string]any)
	tid, _ := pkv["transfer_id"].(string)
	if !strings.HasPrefix(tid, "xfer-") || pkv["do_remote_decode"] != true || pl[0].body["stream"] != false || pl[0].body["max_tokens"] != 1.0 {
		t.Fatalf("P's body %s", pl[0].raw)
	}
	if pl[0].header.Get(disagg.DataParallelRankHeader) != "0" {
		t.Fatalf("P's headers %v", pl[0].header)
	}
	if dkv["transfer_id"] != tid || dkv["do_remote_prefill"] != true || dkv["remote_engine_id"] != "eng-p" ||
		dkv["remote_bootstrap_addr"] != fmt.Sprintf("http://127.0.0.1:%d", p.bootPort()) || dl[0].body["stream"] != true {
		t.Fatalf("D's body %s", dl[0].raw)
	}
	if pl[0].header.Get("X-Request-Id") != "mc-1" || dl[0].header.Get("X-Request-Id") != "mc-1" {
		t.Fatal("X-Request-Id differs")
	}
}

func TestPDSGLang(t *testing.T) {
	p, d := newPDEngine(t, "p"), newPDEngine(t, "d")
	_, gw := startGateway(t, pdConfig("sglang", []*pdEngine{p}, []*pdEngine{d}))
	for _, batch := range []bool{false, true} {
		in := longPrompt("")
		if batch { // two prompts: one room each
			in = strings.Replace(in, `"prompt":[`, `"prompt":[[`, 1)
			in = strings.Replace(in, `],"max_tokens"`, `],[9,9]],"max_tokens"`, 1)
		}
		resp, body := post(t, http.DefaultClient, gw+"/v1/completions", in)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
	}
	waitFor(t, "both prefill legs", func() bool { return len(p.got()) == 2 })
	pl, dl := p.got(), d.got()
	if len(pl) != 2 || len(dl) != 2 {
		t.Fatalf("P %d, D %d", len(pl), len(dl))
	}
	for i := range 2 {
		if string(pl[i].raw) != string(dl[i].raw) {
			t.Fatalf("P and D bodies differ:\n%s\n%s", pl[i].raw, dl[i].raw)
		}
	}
	b := pl[0].body
	if b["bootstrap_host"] != "127.0.0.1" || b["bootstrap_port"] != float64(p.bootPort()) || b["bootstrap_room"] == nil {
		t.Fatalf("single: %s", pl[0].raw)
	}
	b = pl[1].body
	if h, _ := b["bootstrap_host"].([]any); len(h) != 2 {
		t.Fatalf("batch: %s", pl[1].raw)
	}
	if r, _ := b["bootstrap_room"].([]any); len(r) != 2 {
		t.Fatalf("batch rooms: %s", pl[1].raw)
	}
}

func TestPDLLMDHeader(t *testing.T) {
	p, d := newPDEngine(t, "p"), newPDEngine(t, "d")
	_, gw := startGateway(t, pdConfig("llm-d", []*pdEngine{p}, []*pdEngine{d}))
	in := longPrompt("")
	resp, body := post(t, http.DefaultClient, gw+"/v1/completions", in)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	u, _ := url.Parse(p.URL)
	dl := d.got()
	if len(p.got()) != 0 || len(dl) != 1 || dl[0].header.Get(disagg.PrefillerHeader) != u.Host || string(dl[0].raw) != in {
		t.Fatalf("P legs %d; D header %q body %s", len(p.got()), dl[0].header.Get(disagg.PrefillerHeader), dl[0].raw)
	}
}

func TestPDConfigErrors(t *testing.T) {
	p := EndpointConfig{URL: "http://127.0.0.1:1", Model: "m", Role: "prefill"}
	for _, tc := range []struct {
		mut  func(*Config)
		want string
	}{
		{func(c *Config) { c.PD.Connector = "rdma" }, "pd.connector"},
		{func(c *Config) { c.PD.PrefillAttempts = 11 }, "pd.prefill_attempts"},
		{func(c *Config) { c.PD.PrefillTimeout = -1 }, "pd.prefill_timeout"},
		{func(c *Config) { c.Endpoints[0].Role = "encoder" }, "endpoints[0].role"},
		{func(c *Config) { c.Endpoints[0].BootstrapPort = 70000 }, "endpoints[0].bootstrap_port"},
		{func(c *Config) { c.Endpoints = c.Endpoints[:1] }, "needs a decode"},
	} {
		cfg := Config{Endpoints: []EndpointConfig{p, {URL: "http://127.0.0.1:2", Model: "m", Role: "decode"}}}
		tc.mut(&cfg)
		err := cfg.WithDefaults().Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("want an error naming %s, got %v", tc.want, err)
		}
	}
}

// TestPDExampleConfig: deploy/pd's example loads and validates.
func TestPDExampleConfig(t *testing.T) {
	cfg, err := LoadConfig("../deploy/pd/infergate-pd.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.WithDefaults().Validate(); err != nil {
		t.Fatal(err)
	}
	if cfg.Endpoints[0].Role != "prefill" || cfg.PD.Connector != "nixl" || cfg.Routing.PD.Threshold != 2048 {
		t.Fatalf("%+v", cfg.PD)
	}
}

// TestPDNoGoroutineLeak: the concurrent connectors' prefill legs end with
// their requests: answered, D failed and retried, client gone.
func TestPDNoGoroutineLeak(t *testing.T) {
	before := settledGoroutines()
	for _, conn := range []string{"mooncake", "sglang", "nixl"} {
		func() {
			p, d1, d2 := newPDEngine(t, "p"), newPDEngine(t, "d"), newPDEngine(t, "d")
			defer func() {
				for _, e := range []*pdEngine{p, d1, d2} {
					e.Close()
					e.boot.Close()
				}
			}()
			var first atomic.Int32
			first.Store(1)
			d1.shared, d2.shared = &first, &first
			g, err := New(context.Background(), pdConfig(conn, []*pdEngine{p}, []*pdEngine{d1, d2}), nil)
			if err != nil {
				t.Fatal(err)
			}
			defer g.Close()
			srv := newServerNoCleanup(g.Handler())
			defer srv.Close()
			tr := &http.Transport{}
			defer tr.CloseIdleConnections()
			c := &http.Client{Transport: tr}
			if resp, body := post(t, c, srv.URL+"/v1/completions", longPrompt(`,"stream":true`)); resp.StatusCode != 200 {
				t.Fatalf("%s: %d %s", conn, resp.StatusCode, body)
			}
			post(t, c, srv.URL+"/v1/completions", longPrompt(""))
			d1.hang.Store(true)
			d2.hang.Store(true)
			cancelMidStream(t, srv.URL)
			waitFor(t, "the canceled request's end", func() bool {
				return scrape(t, c, srv.URL).value("infergate_requests_total", `code="499"`) == 1
			})
		}()
	}
	requireGoroutinesBack(t, before)
}

func TestPDWarnsOfAssumedBootstrapPort(t *testing.T) {
	c := Config{PD: PDConfig{Connector: "sglang"}, Endpoints: []EndpointConfig{
		{URL: "http://127.0.0.1:1", Model: "m", Role: "prefill"},
		{URL: "http://127.0.0.1:2", Model: "m", Role: "prefill", BootstrapPort: 9000},
		{URL: "http://127.0.0.1:3", Model: "m", Role: "decode"},
	}}
	w := c.pdWarnings()
	if len(w) != 1 || !strings.Contains(w[0], "endpoints[0]") || !strings.Contains(w[0], "8998") {
		t.Fatalf("warnings %q", w)
	}
	c.PD.Connector = "nixl"
	if w := c.pdWarnings(); len(w) != 0 {
		t.Fatalf("nixl warnings %q", w)
	}
}

// A client's own P/D members never reach an engine: not on a P/D pool's
// whole-on-D path, not on a plain pool; pd.client_params pass forwards them.
func TestPDStripsClientParams(t *testing.T) {
	for _, pass := range []bool{false, true} {
		e := newFakeEngine(t, "e0")
		cfg := testConfig(sched.RoundRobin, e)
		if pass {
			cfg.PD.ClientParams = PDClientParamsPass
		}
		gw, url := startGateway(t, cfg)
		_ = gw
		body := `{"model":"m","messages":[{"role":"user","content":"Hi"}],"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"127.0.0.1","remote_port":19999},"bootstrap_host":"127.0.0.1","bootstrap_port":19999,"bootstrap_room":5}`
		resp, _ := post(t, testClient(t), url+pathChat, body)
		if resp.StatusCode != 200 {
			t.Fatalf("pass=%v: status %d", pass, resp.StatusCode)
		}
		_, upstream := e.last()
		has := bytes.Contains(upstream, []byte("kv_transfer_params")) || bytes.Contains(upstream, []byte("bootstrap_"))
		if has != pass {
			t.Fatalf("pass=%v: upstream body %s", pass, upstream)
		}
	}
}
