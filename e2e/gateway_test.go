package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/gguf"
	"github.com/infergate/infergate/sched"
)

// requireE2E skips a real-engine test in -short mode (unless
// INFERGATE_E2E_REQUIRE=1) and returns the Ollama binary (RequireOllama).
func requireE2E(t *testing.T) string {
	t.Helper()
	if testing.Short() && os.Getenv(EnvRequire) != "1" {
		t.Skip("skipping Ollama end-to-end test in -short mode")
	}
	return RequireOllama(t)
}

// policyRun is what one routing policy did with the session workload.
type policyRun struct {
	policy    string
	turns     []TurnResult
	followUps []time.Duration // TTFT of every turn after a session's first
	followCPU []time.Duration // their on-CPU TTFT (TurnResult.CPU)
	colds     []time.Duration
	shares    []float64
	wall      time.Duration
}

// TestGatewayOllamaPolicies runs the multi-turn chat workload through the
// gateway in front of two real Ollama instances, once per routing policy,
// with fresh instances (empty caches) each time, and checks that the
// cache-aware policies keep each session on the instance that holds its
// context: their follow-up turns' time to first token is a fraction of
// round-robin's, which sends every follow-up to an instance that has
// evicted (or never held) the session. See README.md for the workload and
// the measured table.
func TestGatewayOllamaPolicies(t *testing.T) {
	bin := requireE2E(t)
	dir := t.TempDir()
	model, err := WriteModelDir(dir, gguf.Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	v := model.Vocab
	sessions := LoadChatSessions(t, v, SessionOptions{})
	for s, cs := range sessions {
		lens := make([]int, len(cs.Turns))
		for k, u := range cs.Turns {
			lens[k] = len(v.Encode(u))
		}
		t.Logf("session %d: system prompt %d tokens, MT-bench questions %v, user turns %v tokens",
			s, len(v.Encode(cs.System)), cs.Questions, lens)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var runs []policyRun
	// "" is the gateway's default, which without KV events is cache-aware.
	for _, configured := range []string{sched.Prefix, "", sched.RoundRobin} {
		policy := configured
		if policy == "" {
			policy = sched.CacheAware
		}
		start := time.Now()
		insts := StartOllamasT(t, bin, dir, 2, Options{})
		gw, err := StartGateway(insts, configured)
		if err != nil {
			t.Fatal(err)
		}
		if gw.Policy() != policy {
			t.Fatalf("gateway runs policy %q, want %q", gw.Policy(), policy)
		}
		rs, err := RunSessions(ctx, gw, insts[0].Model, sessions, RunOptions{})
		gw.Close()
		if serr := StopAll(insts); serr != nil {
			t.Errorf("%s: stopping the instances: %v", policy, serr)
		}
		if err != nil {
			t.Fatalf("%s: %v", policy, err)
		}
		run := policyRun{policy: policy, turns: rs, shares: Shares(rs, len(insts)), wall: time.Since(start)}
		for _, r := range rs {
			if want := len(PromptTokenIDs(v, r.Messages)); r.PromptTokens != want {
				t.Errorf("%s: session %d turn %d: engine counted %d prompt tokens, gguf.Vocab.Tokenize %d",
					policy, r.Session, r.Turn, r.PromptTokens, want)
			}
			if r.PromptTokens >= gguf.DefaultNumCtx {
				t.Errorf("%s: session %d turn %d: %d prompt tokens, over num_ctx %d", policy, r.Session, r.Turn, r.PromptTokens, gguf.DefaultNumCtx)
			}
			if r.Cold() {
				run.colds = append(run.colds, r.TTFT)
			} else {
				run.followUps = append(run.followUps, r.TTFT)
				run.followCPU = append(run.followCPU, r.CPU)
			}
			t.Logf("%-12s s%d t%d  instance %d  prompt %4d tokens  TTFT %8v (on-CPU %8v)  total %8v  answer %q",
				policy, r.Session, r.Turn+1, r.Endpoint, r.PromptTokens, r.TTFT.Round(100*time.Microsecond),
				r.CPU.Round(100*time.Microsecond), r.Total.Round(100*time.Microsecond), r.Text)
		}
		runs = append(runs, run)
	}

	var table strings.Builder
	fmt.Fprintf(&table, "\n| policy | follow-up TTFT p50 | p90 | follow-up on-CPU p50 | first-turn TTFT p50 | instance share (all turns) | run |\n|---|---|---|---|---|---|---|\n")
	for _, r := range runs {
		fmt.Fprintf(&table, "| %s | %v | %v | %v | %v | %s | %v |\n", r.policy,
			Percentile(r.followUps, 50).Round(100*time.Microsecond), Percentile(r.followUps, 90).Round(100*time.Microsecond),
			Percentile(r.followCPU, 50).Round(100*time.Microsecond),
			Percentile(r.colds, 50).Round(time.Millisecond), formatShares(r.shares), r.wall.Round(100*time.Millisecond))
	}
	t.Log(table.String())

	// The ordering, with a wide margin. Round-robin alternates each
	// session's turns between the instances (3 sessions over 2), so every
	// follow-up recomputes the whole conversation (~2,000 tokens, ~0.4-0.9 s
	// of CPU); the cache-aware policies recompute only the new user turn
	// and the re-tokenised answer (~50-140 tokens, tens of ms). Measured
	// (README.md): on-CPU p50 ratios 16-19x, wall-clock 6.6-23x — wall
	// times move with whatever else runs on the machine, and a load spike
	// during one policy's run skews the ratio. So: 3x on the instance's
	// on-CPU TTFT; 2x on the client's wall-clock TTFT only with -tags twin
	// (wallClockChecks), and then only when the instances were not kept
	// waiting for a CPU (follow-up wall/on-CPU p50 at most 2 in both runs).
	rr := runs[2]
	for _, r := range runs[:2] {
		p50, rrp50 := Percentile(r.followUps, 50), Percentile(rr.followUps, 50)
		busy := cpuWait(r) > 2 || cpuWait(rr) > 2
		switch {
		case !wallClockChecks:
			t.Logf("%s: follow-up TTFT p50 %v, round-robin's %v (wall clock: checked with -tags twin)", r.policy, p50, rrp50)
		case busy:
			t.Logf("BEHIND: %s: the host kept the instances waiting for a CPU (follow-up wall/on-CPU p50 %.1f, round-robin %.1f): wall-clock TTFT %v vs round-robin's %v not judged",
				r.policy, cpuWait(r), cpuWait(rr), p50, rrp50)
		case p50 >= rrp50/2:
			t.Errorf("%s: follow-up TTFT p50 %v, not under round-robin's %v / 2", r.policy, p50, rrp50)
		}
		cpu, rrcpu := Percentile(r.followCPU, 50), Percentile(rr.followCPU, 50)
		if rrcpu == 0 {
			t.Logf("no per-thread schedstat in /proc: on-CPU TTFT not measured, not checked")
		} else if cpu >= rrcpu/3 {
			t.Errorf("%s: follow-up on-CPU TTFT p50 %v, not under round-robin's %v / 3", r.policy, cpu, rrcpu)
		}
		// Each cache-aware policy keeps a session on one instance.
		home := map[int]int{}
		for _, tr := range r.turns {
			if h, ok := home[tr.Session]; !ok {
				home[tr.Session] = tr.Endpoint
			} else if h != tr.Endpoint {
				t.Errorf("%s: session %d moved from instance %d to %d at turn %d", r.policy, tr.Session, h, tr.Endpoint, tr.Turn+1)
			}
		}
	}
}

// cpuWait is the median over r's follow-up turns of wall-clock TTFT over
// on-CPU TTFT: 1 when the instance ran the whole time, more when it waited
// for a CPU; 0 when on-CPU time is not measured.
func cpuWait(r policyRun) float64 {
	var ratios []float64
	for i, d := range r.followUps {
		if c := r.followCPU[i]; c > 0 {
			ratios = append(ratios, float64(d)/float64(c))
		}
	}
	if len(ratios) == 0 {
		return 0
	}
	slices.Sort(ratios)
	return ratios[len(ratios)/2]
}

func formatShares(s []float64) string {
	parts := make([]string, len(s))
	for i, x := range s {
		parts[i] = fmt.Sprintf("%.0f%%", 100*x)
	}
	return strings.Join(parts, " / ")
}

// perCall matches the fields of an Ollama OpenAI response that differ
// between two otherwise identical calls: the random completion id and the
// creation time (per chunk when streaming).
var perCall = regexp.MustCompile(`"id":"(chatcmpl|cmpl)-[0-9]+"|"created":[0-9]+`)

func normalize(b []byte) []byte {
	return perCall.ReplaceAllFunc(b, func(m []byte) []byte {
		if bytes.HasPrefix(m, []byte(`"id"`)) {
			return []byte(`"id":"ID"`)
		}
		return []byte(`"created":0`)
	})
}

type rawResponse struct {
	status      int
	contentType string
	body        []byte
}

func postRaw(t *testing.T, url string, body []byte) rawResponse {
	t.Helper()
	resp, err := http.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return rawResponse{resp.StatusCode, resp.Header.Get("Content-Type"), b}
}

// TestGatewayOllamaByteCompat checks that the gateway relays Ollama's
// answers byte for byte: for a non-streaming and a streaming chat
// completion, the gateway's response body equals a direct call's to the
// same instance, in the same cache state, once the per-call id and created
// fields are normalised. The streaming client does not ask for usage, so
// the gateway injects stream_options.include_usage upstream and must strip
// the usage chunk Ollama then sends: the client sees exactly Ollama's
// stream without it, SSE framing included.
func TestGatewayOllamaByteCompat(t *testing.T) {
	bin := requireE2E(t)
	dir := ModelDirT(t, gguf.Options{Seed: 1})
	insts := StartOllamasT(t, bin, dir, 1, Options{})
	in := insts[0]
	gw, err := StartGateway(insts, "")
	if err != nil {
		t.Fatal(err)
	}
	defer gw.Close()

	msgs := []Message{
		{Role: "system", Content: "You are a helpful assistant. Answer in one short paragraph."},
		{Role: "user", Content: "Compose an engaging travel blog post about a recent trip to Hawaii."},
	}
	for _, stream := range []bool{false, true} {
		name := map[bool]string{false: "non-streaming", true: "streaming"}[stream]
		body, _ := json.Marshal(map[string]any{
			"model": in.Model, "messages": msgs, "max_tokens": 16, "temperature": 0, "seed": 1, "stream": stream,
		})
		// Prime the cache, so the direct and the gateway call both find
		// the prompt cached and compute only its last token.
		postRaw(t, in.URL+"/v1/chat/completions", body)
		direct := postRaw(t, in.URL+"/v1/chat/completions", body)
		via := postRaw(t, gw.URL+"/v1/chat/completions", body)
		t.Logf("%s, direct:\n%s", name, direct.body)
		if direct.status != http.StatusOK || via.status != http.StatusOK {
			t.Fatalf("%s: status direct %d, via gateway %d: %s", name, direct.status, via.status, via.body)
		}
		if direct.contentType != via.contentType {
			t.Errorf("%s: Content-Type direct %q, via gateway %q", name, direct.contentType, via.contentType)
		}
		if d, g := normalize(direct.body), normalize(via.body); !bytes.Equal(d, g) {
			t.Errorf("%s: body differs (id and created normalised)\ndirect:  %q\ngateway: %q", name, d, g)
		}
		if stream {
			if !bytes.HasSuffix(via.body, []byte("\n\ndata: [DONE]\n\n")) {
				t.Errorf("stream does not end with data: [DONE]: %q", via.body)
			}
			if bytes.Contains(via.body, []byte(`"usage"`)) {
				t.Errorf("gateway stream carries usage the client did not ask for: %q", via.body)
			}
			if n := bytes.Count(via.body, []byte("data: ")); n < 3 {
				t.Errorf("stream has only %d events", n)
			}
		}
	}

	// The same for /v1/completions. Streaming, Ollama answers
	// stream_options.include_usage with a zero "usage" object in every
	// chunk (middleware/openai.go, CompleteWriter) besides the final usage
	// chunk; the gateway strips both, since the client did not ask.
	for _, stream := range []bool{false, true} {
		name := map[bool]string{false: "completions, non-streaming", true: "completions, streaming"}[stream]
		body, _ := json.Marshal(map[string]any{
			"model": in.Model, "prompt": "Shall I compare thee to a summer's day?", "max_tokens": 8,
			"temperature": 0, "seed": 1, "stream": stream,
		})
		postRaw(t, in.URL+"/v1/completions", body)
		direct := postRaw(t, in.URL+"/v1/completions", body)
		via := postRaw(t, gw.URL+"/v1/completions", body)
		if direct.status != http.StatusOK || via.status != http.StatusOK {
			t.Fatalf("%s: status direct %d, via gateway %d: %s", name, direct.status, via.status, via.body)
		}
		d, g := normalize(direct.body), normalize(via.body)
		// The gateway injects stream_options.include_usage upstream (for its
		// token accounting); Ollama then adds a usage member to every
		// chunk, which the gateway strips again: the client must see
		// exactly what Ollama sends without it.
		if !bytes.Equal(d, g) {
			t.Errorf("%s: body differs (id and created normalised)\ndirect:  %q\ngateway: %q", name, d, g)
		}
	}
}
