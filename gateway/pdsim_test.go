package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/simserver"
)

// P/D end to end: simulated engines (simserver, speaking each connector's
// engine side) behind a real gateway.

// pdSimThreshold is the split threshold of the simulated P/D pools, in
// uncached prompt tokens: pdSimPrompt's prompts reach it, a short chat
// does not.
const pdSimThreshold = 128

// startSimPD starts a P/D fleet of p prefill and d decode simulated engines
// (fast: 1000× real time) and returns it with a gateway configuration of
// it: roles, bootstrap ports, connector, releases on.
func startSimPD(t testing.TB, p, d int, connector string) (*simserver.Fleet, Config) {
	t.Helper()
	f, err := simserver.StartPDFleet(p, d, simserver.ServerConfig{Model: "m", TimeScale: 1000})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	cfg := Config{EjectDuration: 5 * time.Minute, HealthCheckPath: "-"}
	cfg.Routing.PD.Threshold = pdSimThreshold
	cfg.PD.Connector, cfg.PD.Release = connector, true
	for _, m := range f.Members {
		e := EndpointConfig{URL: m.URL, Model: "m", KVBlocks: f.KVBlocks(), BlockSize: f.BlockSize(), Kind: fleet.Sim, Role: string(m.Role)}
		if m.BootstrapAddr != "" {
			e.BootstrapPort = bootstrapPort(m.BootstrapAddr)
		}
		cfg.Endpoints = append(cfg.Endpoints, e)
	}
	return f, cfg
}

// pdSimPrompt is a chat body whose system message (tag's, ~300 words) is
// followed by a user message of about words words.
func pdSimPrompt(tag string, words int, stream bool) string {
	var sys, user strings.Builder
	for i := range 300 {
		fmt.Fprintf(&sys, "%s%d ", tag, i)
	}
	for i := range words {
		fmt.Fprintf(&user, "q%s%d ", tag, i)
	}
	b, _ := json.Marshal(map[string]any{
		"model": "m", "max_tokens": 12, "stream": stream,
		"messages": []map[string]string{{"role": "system", "content": sys.String()}, {"role": "user", "content": user.String()}},
	})
	if stream {
		b = append(b[:len(b)-1], `,"stream_options":{"include_usage":true}}`...)
	}
	return string(b)
}

// chatAnswer is what a client got: its text, usage, or the OpenAI error
// that ended it.
type chatAnswer struct {
	status  int
	text    string
	usage   *openai.Usage
	errMsg  string // an OpenAI error (status ≥ 400, or an error event in a stream)
	done    bool   // a stream's [DONE]
	rawBody string
}

// chat sends body to the gateway's chat endpoint under ctx and reads the
// answer, streamed or whole. A transport error or a malformed answer is
// returned as an error.
func chat(ctx context.Context, c *http.Client, gw, body string) (chatAnswer, error) {
	var a chatAnswer
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, gw+pathChat, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return a, err
	}
	defer resp.Body.Close()
	a.status = resp.StatusCode
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return a, err
		}
		a.rawBody = string(b)
		if resp.StatusCode != http.StatusOK {
			var er openai.ErrorResponse
			if json.Unmarshal(b, &er) != nil || er.Error == nil || er.Error.Message == "" {
				return a, fmt.Errorf("status %d, not an OpenAI error: %q", resp.StatusCode, b)
			}
			a.errMsg = er.Error.Message
			return a, nil
		}
		var v struct {
			Choices []struct {
				Message struct{ Content string }
			}
			Usage *openai.Usage
		}
		if err := json.Unmarshal(b, &v); err != nil || len(v.Choices) != 1 || v.Usage == nil {
			return a, fmt.Errorf("answer %q: %v", b, err)
		}
		a.text, a.usage = v.Choices[0].Message.Content, v.Usage
		return a, nil
	}
	er := openai.NewEventReader(resp.Body, 0)
	for {
		data, err := er.Next()
		if err != nil {
			if !errors.Is(err, io.EOF) || !er.Done() {
				return a, fmt.Errorf("stream cut without [DONE]: %v", err)
			}
			a.done = true
			return a, nil
		}
		var ch struct {
			Choices []struct {
				Delta struct{ Content string }
			}
			Usage *openai.Usage
			Error *openai.Error
		}
		if err := json.Unmarshal(data, &ch); err != nil {
			return a, fmt.Errorf("event %q: %v", data, err)
		}
		if ch.Error != nil {
			a.errMsg = ch.Error.Message
		}
		for _, c := range ch.Choices {
			a.text += c.Delta.Content
		}
		if ch.Usage != nil {
			a.usage = ch.Usage
		}
	}
}

// simValue is the sum of an engine's samples of name.
func simValue(t testing.TB, c *http.Client, u, name string) float64 {
	return scrape(t, c, u).value(name, "")
}

// waitHeldZero polls until no engine of f holds KV for a decode.
func waitHeldZero(t testing.TB, c *http.Client, f *simserver.Fleet, alive func(i int) bool) {
	t.Helper()
	for i, m := range f.Members {
		if m.Role != simserver.RolePrefill || !alive(i) {
			continue
		}
		waitFor(t, "prefill engine "+m.URL+" holds no KV", func() bool {
			s := scrape(t, c, m.URL)
			return s.value("infergate_sim_pd_held_blocks", "") == 0 && s.value("infergate_sim_pd_held_requests", "") == 0
		})
	}
}

// TestPDSimFleet: a 1:1 simulated P/D fleet behind the gateway, for each
// connector the engines speak, streaming and not. A long chat is split:
// P serves a prefill leg and holds its KV, D reads it (a remote prefill)
// and answers; the client's cached_tokens are P's (not D's count of the
// prompt it read), a second long turn's prefix included; P's hold is
// released once D has read it. A short chat is served whole on D.
func TestPDSimFleet(t *testing.T) {
	for _, conn := range []string{"nixl", "mooncake", "sglang"} {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/stream=%v", conn, stream), func(t *testing.T) {
				f, cfg := startSimPD(t, 1, 1, conn)
				_, gw := startGateway(t, cfg)
				c := testClient(t)
				P, D := f.URLs[0], f.URLs[1]
				ctx := context.Background()
				tag := strings.ReplaceAll(fmt.Sprintf("%s%v", conn, stream), "-", "")
				for turn, words := range []int{10, 300} {
					// Turn 2 shares turn 1's system message: P has it
					// cached, D's uncached part (the new user message)
					// still reaches the threshold.
					cachedBefore := simValue(t, c, P, "vllm:prompt_tokens_cached_total")
					a, err := chat(ctx, c, gw, pdSimPrompt(tag, words, stream))
					if err != nil || a.status != 200 || a.errMsg != "" || a.text == "" || a.usage == nil {
						t.Fatalf("turn %d: %+v %v", turn, a, err)
					}
					if stream && !a.done {
						t.Fatalf("turn %d: no [DONE]", turn)
					}
					waitFor(t, "P's prefill leg counted", func() bool {
						return simValue(t, c, P, "vllm:request_success_total") == float64(turn+1)
					})
					pCached := int(simValue(t, c, P, "vllm:prompt_tokens_cached_total") - cachedBefore)
					if got := a.usage.Cached(); max(got, 0) != pCached {
						t.Fatalf("turn %d: client's cached_tokens %d, P's %d (prompt %d)", turn, got, pCached, a.usage.PromptTokens)
					}
					if turn == 1 && (pCached == 0 || pCached >= a.usage.PromptTokens-1) {
						t.Fatalf("turn 2: P cached %d of %d: want the system message's blocks only", pCached, a.usage.PromptTokens)
					}
					if v := metricValue(t, gw, "infergate_pd_decisions_total", `outcome="split"`); v != float64(turn+1) {
						t.Fatalf("turn %d: %v split decisions", turn, v)
					}
					waitFor(t, "D's remote prefill", func() bool {
						return simValue(t, c, D, "infergate_sim_pd_kv_transfers_total") == float64(turn+1)
					})
				}
				if v := simValue(t, c, D, "infergate_sim_pd_transferred_blocks_total"); v <= 0 {
					t.Fatalf("D read %v blocks", v)
				}
				if v := simValue(t, c, D, `infergate_sim_pd_recompute_total`); v != 0 {
					t.Fatalf("D recomputed %v prompts", v)
				}
				waitHeldZero(t, c, f, func(int) bool { return true })
				if v := simValue(t, c, P, "infergate_sim_pd_held_released_total"); v != 2 {
					t.Fatalf("P released %v holds, want 2", v)
				}

				// A short chat: whole on D, P untouched.
				short := `{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hello there"}]}`
				if stream {
					short = strings.Replace(short, `"max_tokens":4`, `"max_tokens":4,"stream":true`, 1)
				}
				a, err := chat(ctx, c, gw, short)
				if err != nil || a.status != 200 || a.text == "" {
					t.Fatalf("short: %+v %v", a, err)
				}
				if v := metricValue(t, gw, "infergate_pd_decisions_total", `reason="below-threshold"`); v != 1 {
					t.Fatalf("short decisions %v", v)
				}
				if n := simValue(t, c, P, "vllm:request_success_total"); n != 2 {
					t.Fatalf("P served %v requests, want 2 (none for the short chat)", n)
				}
				waitFor(t, "D served the short chat", func() bool {
					return simValue(t, c, D, "vllm:request_success_total") == 3
				})
				if v := simValue(t, c, D, "infergate_sim_pd_kv_transfers_total"); v != 2 {
					t.Fatalf("D read %v times", v)
				}
			})
		}
	}
}

// bootstrapPort is the port of a host:port ("" → 0).
func bootstrapPort(addr string) int {
	u, err := url.Parse("http://" + addr)
	if err != nil {
		return 0
	}
	p, _ := strconv.Atoi(u.Port())
	return p
}
