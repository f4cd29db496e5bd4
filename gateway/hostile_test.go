package gateway

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

// deepJSON is a JSON array nested one level past openai.MaxDepth.
var deepJSON = strings.Repeat("[", openai.MaxDepth+1) + strings.Repeat("]", openai.MaxDepth+1)

// TestEngineJSONDepthBounded: an engine's JSON is held to the nesting bound
// of a client's (openai.MaxDepth). A deeper error body is not relayed as
// JSON (502 upstream_error with an excerpt), and usage in a deeper answer
// or stream chunk is not decoded (the answer is relayed untouched,
// unaccounted). encoding/json alone would have read them, to 10000 levels.
func TestEngineJSONDepthBounded(t *testing.T) {
	usage := `"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8}`
	for _, tc := range []struct {
		name   string
		stream bool
		serve  func(w http.ResponseWriter)
		status int
	}{
		{"error body", false, func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"error":{"message":"no","type":"BadRequestError","code":400},"x":`+deepJSON+`}`)
		}, http.StatusBadGateway},
		{"answer", false, func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"choices":[{"index":0,"text":"a"}],`+usage+`,"x":`+deepJSON+`}`)
		}, http.StatusOK},
		{"stream chunk", true, func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, `data: {"choices":[{"index":0,"text":"a"}]}`+"\n\n"+
				`data: {"choices":[],`+usage+`,"x":`+deepJSON+`}`+"\n\ndata: [DONE]\n\n")
		}, http.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eng := newServerNoCleanup(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == pathCompletions {
					_, _ = io.Copy(io.Discard, r.Body)
					tc.serve(w)
				}
			}))
			defer eng.Close()
			cfg := testConfig(sched.RoundRobin)
			cfg.HealthCheckPath = healthCheckOff
			cfg.Endpoints = []EndpointConfig{{URL: eng.URL, Model: "m", KVBlocks: 1000}}
			_, url := startGateway(t, cfg)
			c := testClient(t)
			body := `{"model":"m","prompt":"x","stream":` + map[bool]string{true: "true", false: "false"}[tc.stream] + `}`
			resp, b := post(t, c, url+pathCompletions, body)
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d: %.200s", resp.StatusCode, tc.status, b)
			}
			if tc.status == http.StatusBadGateway && !strings.Contains(string(b), openai.CodeUpstream) {
				t.Errorf("body %.200s, want %s", b, openai.CodeUpstream)
			}
			if tc.status == http.StatusOK && !strings.Contains(string(b), deepJSON) {
				t.Errorf("the deep answer was not relayed whole: %.200s", b)
			}
			if n := scrape(t, c, url).value("infergate_prompt_tokens_total", `model="m"`); n != 0 {
				t.Errorf("prompt tokens %v accounted from JSON nested past the bound", n)
			}
		})
	}
}

// TestNestingAttackRefused: 2 MB of "[" in a field the gateway does not
// type, sent to an open gateway, is a 400 invalid_json, and the gateway
// still serves (before the bound: fatal error: stack overflow, the process
// and every request in flight gone).
func TestNestingAttackRefused(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := testConfig(sched.RoundRobin, e)
	cfg.HealthCheckPath = healthCheckOff
	_, url := startGateway(t, cfg)
	c := testClient(t)
	attack := strings.Repeat("[", 2<<20)
	for _, tc := range []struct{ path, body string }{
		{pathChat, `{"model":"m","messages":[{"role":"user","content":"hi"}],"x":` + attack + `}`},
		{pathChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a","y":` + attack + `}]}]}`},
		{pathChat, `{"model":"m","tools":` + attack + `}`},
		{pathCompletions, `{"model":"m","prompt":` + attack + `}`},
	} {
		resp, b := post(t, c, url+tc.path, tc.body)
		if e := decodeError(t, b); resp.StatusCode != http.StatusBadRequest || codeStr(e.Code) != openai.CodeInvalidJSON {
			t.Errorf("%s: %d %.200s, want 400 invalid_json", tc.path, resp.StatusCode, b)
		}
	}
	if resp, b := post(t, c, url+pathChat, chatBody); resp.StatusCode != http.StatusOK {
		t.Fatalf("after the attack: %d %.200s", resp.StatusCode, b)
	}
}

// TestHoldBudget: the bytes of non-streaming answers held for retries are
// bounded gateway-wide (max_held_response_bytes, here 1 MiB). A holds
// 600 KiB of an unfinished answer; B's answer, which would take the total
// past the budget, is relayed as it arrives: B's client gets the status and
// the first 600 KiB while the engine has not finished either answer. Before
// the budget, B was held too (each answer up to 4 MiB, however many), and
// its client saw nothing until the engine finished.
func TestHoldBudget(t *testing.T) {
	const part = 600 << 10
	release := make(chan struct{})
	chunk := strings.Repeat("a", part)
	eng := newServerNoCleanup(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != pathCompletions {
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"text":"`+chunk)
		_ = http.NewResponseController(w).Flush()
		<-release
		_, _ = io.WriteString(w, `","usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	}))
	defer eng.Close()
	cfg := testConfig(sched.RoundRobin)
	cfg.HealthCheckPath = healthCheckOff
	cfg.Endpoints = []EndpointConfig{{URL: eng.URL, Model: "m", KVBlocks: 1000}}
	cfg.MaxHeldResponseBytes = 1 << 20
	g, url := startGateway(t, cfg)
	c := testClient(t)
	body := `{"model":"m","prompt":"x"}`
	ctx, cancel := contextWithCancel(t)
	defer cancel()

	a := sendAsync(ctx, c, url+pathCompletions, body)
	waitFor(t, "A's first part held", func() bool { return g.hold.held.Load() >= part })

	type headers struct {
		resp *http.Response
		err  error
	}
	bc := make(chan headers, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+pathCompletions, strings.NewReader(body))
		resp, err := c.Do(req)
		bc <- headers{resp, err}
	}()
	var b headers
	select {
	case b = <-bc:
	case <-time.After(10 * time.Second):
		close(release)
		t.Fatal("B's answer is held although the hold budget is spent")
	}
	if b.err != nil || b.resp.StatusCode != http.StatusOK {
		t.Fatalf("B: %v %v", b.resp, b.err)
	}
	first := make([]byte, part)
	if _, err := io.ReadFull(b.resp.Body, first); err != nil {
		t.Fatalf("B's first part, relayed before the engine finished: %v", err)
	}
	if held := g.hold.held.Load(); held > cfg.MaxHeldResponseBytes {
		t.Errorf("held %d bytes, over the budget %d", held, cfg.MaxHeldResponseBytes)
	}
	close(release)
	rest, err := io.ReadAll(b.resp.Body)
	b.resp.Body.Close()
	want := `{"text":"` + chunk + `","usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`
	if err != nil || string(first)+string(rest) != want {
		t.Errorf("B's answer: %d bytes, %v", len(first)+len(rest), err)
	}
	if r := await(t, a); r.status != http.StatusOK || string(r.body) != want {
		t.Errorf("A: %d, %d bytes", r.status, len(r.body))
	}
	waitFor(t, "nothing held", func() bool { return g.hold.held.Load() == 0 })
	s := scrape(t, c, url)
	if v := s.value("infergate_response_hold_overflows_total", ""); v != 1 {
		t.Errorf("overflows %v, want 1", v)
	}
	if !s.has("infergate_response_held_bytes") {
		t.Error("no infergate_response_held_bytes")
	}
}

func TestHoldBudgetReserve(t *testing.T) {
	h := &byteBudget{limit: 100}
	if !h.reserve(60) || h.reserve(41) || !h.reserve(40) || h.reserve(1) {
		t.Fatalf("reservations against 100: held %d", h.held.Load())
	}
	n := int64(60)
	h.release(&n)
	if n != 0 || h.held.Load() != 40 {
		t.Fatalf("after release: held %d, n %d", h.held.Load(), n)
	}
	if none := (&byteBudget{limit: -1}); none.reserve(1) {
		t.Error("a negative budget holds")
	}
}

// TestEngineInvalidStatus: an engine whose status line carries a code
// outside 100-599 ("HTTP/1.1 000", "050", "600", "999": http.ReadResponse
// takes any three digits) is answered 502 upstream_error in OpenAI's
// shape. A code below 100 made the handler panic in WriteHeader (the
// client got an empty reply), one above 599 was relayed to the client.
func TestEngineInvalidStatus(t *testing.T) {
	for _, code := range []string{"000", "050", "600", "999"} {
		t.Run(code, func(t *testing.T) {
			eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				c, bw, err := http.NewResponseController(w).Hijack()
				if err != nil {
					return
				}
				defer c.Close()
				_, _ = bw.WriteString("HTTP/1.1 " + code + " Odd\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
				_ = bw.Flush()
			}))
			t.Cleanup(eng.Close)
			cfg := resilienceConfig(sched.RoundRobin, eng.URL)
			cfg.Retry.MaxAttempts = 1
			_, url := startGateway(t, cfg)
			for _, stream := range []string{"false", "true"} {
				resp, body := post(t, http.DefaultClient, url+pathChat,
					`{"model":"m","stream":`+stream+`,"messages":[{"role":"user","content":"hi"}]}`)
				if resp.StatusCode != http.StatusBadGateway {
					t.Fatalf("stream %s: status %d, want 502; body %s", stream, resp.StatusCode, body)
				}
				var e struct {
					Error struct{ Code string } `json:"error"`
				}
				if err := json.Unmarshal(body, &e); err != nil || e.Error.Code != openai.CodeUpstream {
					t.Fatalf("stream %s: body %s, want an upstream_error", stream, body)
				}
			}
		})
	}
}

// TestEngineRedirectNotRelayed: an engine's 3xx (with an OpenAI-shaped
// JSON body or none) is not relayed: the client got the 3xx itself, its
// Location dropped, instead of an answer or an error. It is a failure of
// the endpoint: 502 upstream_error when no retry is left.
func TestEngineRedirectNotRelayed(t *testing.T) {
	for _, tc := range []struct {
		status int
		body   string
	}{
		{http.StatusFound, `{"error":{"message":"moved","type":"x","code":"moved"}}`},
		{http.StatusTemporaryRedirect, ""},
		{http.StatusNotModified, ""},
	} {
		eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Location", "http://elsewhere.example/")
			if tc.body != "" {
				w.Header().Set("Content-Type", "application/json")
			}
			w.WriteHeader(tc.status)
			_, _ = io.WriteString(w, tc.body)
		}))
		cfg := resilienceConfig(sched.RoundRobin, eng.URL)
		cfg.Retry.MaxAttempts = 1
		_, url := startGateway(t, cfg)
		for _, stream := range []string{"false", "true"} {
			resp, body := post(t, http.DefaultClient, url+pathChat,
				`{"model":"m","stream":`+stream+`,"messages":[{"role":"user","content":"hi"}]}`)
			if resp.StatusCode != http.StatusBadGateway || resp.Header.Get("Location") != "" {
				t.Errorf("engine %d, stream %s: status %d (Location %q), want 502; body %s",
					tc.status, stream, resp.StatusCode, resp.Header.Get("Location"), body)
				continue
			}
			var e struct {
				Error struct{ Code string } `json:"error"`
			}
			if err := json.Unmarshal(body, &e); err != nil || e.Error.Code != openai.CodeUpstream {
				t.Errorf("engine %d, stream %s: body %s, want an upstream_error", tc.status, stream, body)
			}
		}
		eng.Close()
	}
}
