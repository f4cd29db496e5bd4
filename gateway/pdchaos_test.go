package gateway

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/disagg"
	"github.com/infergate/infergate/simserver"
)

// TestPDChaosKill runs 40 streaming chats, long (split) and short (whole
// on D), 8 at a time, through a 2:2 simulated P/D fleet (nixl), and kills
// one prefill and one decode engine a quarter of the way in. Every request
// ends with a valid answer or an explicit OpenAI error, none hangs (each
// client has a deadline); the P/D retries and fallbacks moved; once the
// work has drained the surviving prefill engine holds no KV (D read it and
// said so, or the gateway released it).
func TestPDChaosKill(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos test in -short mode")
	}
	const (
		requests  = 40
		clients   = 8
		killAfter = requests / 4
		deadP     = 0 // f.Members: P0, P1, D0, D1
		deadD     = 2
	)
	f, cfg := startSimPD(t, 2, 2, "nixl")
	// P is picked in turn: the dead P is tried, whatever the prompts'
	// prefixes, until outlier detection ejects it.
	cfg.Routing.PD.Prefill = "round-robin"
	cfg.Retry.BudgetPercent = 100 // a kill fails many attempts at once
	g, gw := startGateway(t, cfg)
	c := testClient(t)
	c.Timeout = 0 // each request's deadline below

	type result struct {
		a    chatAnswer
		err  error
		long bool
	}
	results := make([]result, requests)
	var (
		next, done atomic.Int64
		kill       = make(chan struct{})
		killed     = make(chan struct{})
		wg         sync.WaitGroup
	)
	wg.Go(func() {
		<-kill
		f.Kill(deadP)
		f.Kill(deadD)
		close(killed)
	})
	for range clients {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= requests {
					return
				}
				long := i%4 != 3 // three in four split
				body := `{"model":"m","max_tokens":48,"stream":true,"stream_options":{"include_usage":true},` +
					`"messages":[{"role":"user","content":"short question ` + fmt.Sprint(i) + `"}]}`
				if long {
					body = pdSimPrompt(fmt.Sprintf("chaos%dx", i), 10, true)
					body = strings.Replace(body, `"max_tokens":12`, `"max_tokens":48`, 1)
				}
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				a, err := chat(ctx, c, gw, body)
				cancel()
				results[i] = result{a, err, long}
				if done.Add(1) == killAfter {
					close(kill)
				}
			}
		})
	}
	wg.Wait()
	<-killed

	var ok, explicit int
	for i, r := range results {
		switch {
		case r.err != nil:
			t.Errorf("request %d (long %v): %v (%+v)", i, r.long, r.err, r.a)
		case r.a.errMsg != "":
			explicit++
		case r.a.status == 200 && r.a.done && r.a.text != "" && r.a.usage != nil && r.a.usage.CompletionTokens > 0:
			ok++
		default:
			t.Errorf("request %d (long %v): neither an answer nor an OpenAI error: %+v", i, r.long, r.a)
		}
	}
	m := scrape(t, c, gw)
	pdRetries := m.value("infergate_pd_retries_total", "")
	fallbacks := m.value("infergate_pd_fallbacks_total", "")
	if pdRetries+fallbacks == 0 {
		t.Error("no P/D retry or fallback after a prefill engine died")
	}
	if v := m.value("infergate_pd_prefill_legs_total", `result="connect_failure"`) + m.value("infergate_pd_prefill_legs_total", `result="5xx"`); v == 0 {
		t.Error("no prefill leg failed on the dead engine")
	}
	if v := m.value("infergate_pd_decisions_total", `outcome="split"`); v == 0 {
		t.Error("nothing was split")
	}
	waitHeldZero(t, c, f, func(i int) bool { return i != deadP })
	t.Logf("%d answered, %d explicit errors; pd retries %v (prefill %v, decode %v), fallbacks %v, releases %v, stranded %v; "+
		"surviving P released %v holds",
		ok, explicit, pdRetries, m.value("infergate_pd_retries_total", `leg="prefill"`), m.value("infergate_pd_retries_total", `leg="decode"`),
		fallbacks, m.value("infergate_pd_releases_total", ""), m.value("infergate_pd_stranded_holds_total", ""),
		simValue(t, c, f.URLs[1], "infergate_sim_pd_held_released_total"))
	_ = g
}

// hostileP is a fake prefill engine whose answers to inference requests
// (and Mooncake bootstrap queries, on the same listener) are served by
// answer; anything else (the gateway's discovery) is 404.
func hostileP(t *testing.T, answer func(w http.ResponseWriter, r *http.Request)) *httptest.Server {
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost && r.URL.Path != disagg.BootstrapQueryPath {
			http.NotFound(w, r)
			return
		}
		// Read to its end: the server then watches the connection, and a
		// stalled handler sees the gateway go away.
		_, _ = io.Copy(io.Discard, r.Body)
		answer(w, r)
	}))
	t.Cleanup(s.Close)
	return s
}

// TestPDHostilePrefill: a prefill endpoint answering garbage, a huge or
// deeply nested body, kv_transfer_params of the wrong shape or naming a KV
// holder that does not exist, or nothing at all (a stall), in front of a
// real simulated decode engine. Every request is answered 200 by D, the
// gateway falling back to a whole request within pd.prefill_timeout where
// P's answer is unusable; nothing panics.
func TestPDHostilePrefill(t *testing.T) {
	deep := `{"kv_transfer_params":` + strings.Repeat(`{"a":`, 200000) + `1` + strings.Repeat(`}`, 200000) + `}`
	huge := `{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[` +
		strings.Repeat(`1,`, 1<<20) + `1]}}`
	const okShape = `"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"ghost","remote_request_id":"r","remote_block_ids":[1,2,3]`
	for _, tc := range []struct {
		name, conn string
		answer     func(w http.ResponseWriter, r *http.Request)
		fallback   string // the fallback reason; "" when D is sent P's params
		recompute  string // else D's recompute reason (infergate_sim_pd_recompute_total)
	}{
		{"garbage", "nixl", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, "\x00\xffnot json{{{") }, disagg.ReasonBadParams, ""},
		{"huge", "nixl", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, huge) }, disagg.ReasonBadParams, ""},
		{"deep", "nixl", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, deep) }, disagg.ReasonBadParams, ""},
		{"wrong-types", "nixl", func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprint(w, `{"kv_transfer_params":{"do_remote_prefill":"yes","remote_engine_id":7,"remote_block_ids":{"x":1}}}`)
		}, disagg.ReasonBadParams, ""},
		{"params-array", "nixl", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, `{"kv_transfer_params":[1,2]}`) }, disagg.ReasonBadParams, ""},
		{"error-status", "nixl", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(500); fmt.Fprint(w, deep) }, disagg.Reason5xx, ""},
		{"stall", "nixl", func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }, disagg.ReasonTimeout, ""},
		{"stall-mooncake-bootstrap", "mooncake", func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }, disagg.ReasonTimeout, ""},
		{"garbage-mooncake-bootstrap", "mooncake", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, deep) }, disagg.ReasonBadParams, ""},
		// Plausible params naming blocks nobody holds, on a closed port: D
		// cannot read them and computes the prompt itself.
		{"ghost-holder", "nixl", func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprintf(w, `{"choices":[],"kv_transfer_params":{%s,"remote_host":"127.0.0.1","remote_port":1,"tp_size":1}}`, okShape)
		}, "", "unreachable"},
		// SGLang's legs run at once: D, finding nothing to read on P's
		// bootstrap server, computes the prompt; the stalled leg ends at
		// pd.prefill_timeout, and D's usage is kept.
		{"stall-sglang", "sglang", func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }, "", "not_held"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hp := hostileP(t, tc.answer)
			f, err := simserver.StartFleetEngines(simserver.ServerConfig{Model: "m", TimeScale: 1000},
				[]simserver.FleetEngine{{Role: simserver.RoleDecode}})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(f.Close)
			cfg := Config{EjectDuration: 5 * time.Minute, HealthCheckPath: "-"}
			cfg.Routing.PD.Threshold = pdSimThreshold
			// The stalled legs end at a short prefill_timeout; the others
			// get a long one, so that a loaded host reading a 2 MB or
			// 200,000-deep answer under the race detector is not taken
			// for a stall (their fallback reason is the answer's).
			timeout := 30 * time.Second
			if strings.HasPrefix(tc.name, "stall") {
				timeout = 300 * time.Millisecond
			}
			cfg.PD = PDConfig{Connector: tc.conn, PrefillTimeout: timeout, PrefillAttempts: 1, Release: true}
			cfg.Endpoints = []EndpointConfig{
				{URL: hp.URL, Model: "m", Role: "prefill", BootstrapPort: bootstrapPort(strings.TrimPrefix(hp.URL, "http://"))},
				{URL: f.URLs[0], Model: "m", KVBlocks: f.KVBlocks(), BlockSize: f.BlockSize(), Role: "decode"},
			}
			_, gw := startGateway(t, cfg)
			c := testClient(t)
			for _, stream := range []bool{false, true} {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				a, err := chat(ctx, c, gw, pdSimPrompt(fmt.Sprintf("h%s%v", strings.ReplaceAll(tc.name, "-", ""), stream), 10, stream))
				cancel()
				if err != nil || a.status != 200 || a.errMsg != "" || a.text == "" || a.usage == nil {
					t.Fatalf("stream %v: %+v %v", stream, a, err)
				}
			}
			m := scrape(t, c, gw)
			if tc.fallback != "" {
				if v := m.value("infergate_pd_fallbacks_total", `reason="`+tc.fallback+`"`); v != 2 {
					t.Fatalf("fallbacks (%s) %v, want 2", tc.fallback, v)
				}
			} else if v := scrape(t, c, f.URLs[0]).value("infergate_sim_pd_recompute_total", `reason="`+tc.recompute+`"`); v != 2 {
				t.Fatalf("D recomputed %v prompts (%s), want 2", v, tc.recompute)
			}
		})
	}
}
