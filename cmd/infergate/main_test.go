package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/infergate/infergate/internal/childproc"
)

// TestMain lets the test binary act as the infergate binary, so the tests
// below run real infergate processes without a separate build step.
func TestMain(m *testing.M) {
	if os.Getenv("INFERGATE_TEST_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// proc is a running infergate process whose output is scanned for a line.
type proc struct {
	cmd   *exec.Cmd
	lines chan string
	out   *bytes.Buffer
	all   *syncBuffer // the whole output, complete once the process is waited for
}

func start(t *testing.T, args ...string) *proc {
	t.Helper()
	return startEnv(t, nil, args...)
}

// infergateCommand is the command that runs this test binary as the
// infergate CLI with args (TestMain runs main under INFERGATE_TEST_MAIN,
// which the caller sets): a child killed with the test binary, even when
// that dies without cleanups (go test's -timeout, a panic), so that no
// serve, up or artifacts serve outlives it holding ports and CPU
// (internal/childproc).
func infergateCommand(args ...string) *exec.Cmd {
	c := exec.Command(os.Args[0], args...)
	c.SysProcAttr = childproc.Attr()
	return c
}

// startEnv starts infergate with env ("NAME=value") added to the test's
// environment.
func startEnv(t *testing.T, env []string, args ...string) *proc {
	t.Helper()
	cmd := infergateCommand(args...)
	cmd.Env = append(append(os.Environ(), "INFERGATE_TEST_MAIN=1"), env...)
	pr, pw := io.Pipe()
	all := &syncBuffer{}
	cmd.Stdout = io.MultiWriter(pw, all)
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, lines: make(chan string, 1024), out: &bytes.Buffer{}, all: all}
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			select {
			case p.lines <- sc.Text():
			default:
			}
		}
		close(p.lines)
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		pw.Close()
	})
	return p
}

// await returns the first submatch of re in the process's output.
func (p *proc) await(t *testing.T, re *regexp.Regexp) string {
	t.Helper()
	timeout := time.After(30 * time.Second)
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

// stop sends SIGTERM and requires a clean exit.
func (p *proc) stop(t *testing.T) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	p.exited(t)
}

// exited requires the process to exit cleanly within 20 s (SIGTERM sent).
func (p *proc) exited(t *testing.T) {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		for range p.lines { // drain so the process never blocks on output
		}
	}()
	go func() { done <- p.cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil { // 66: the race detector's report is in the output
			t.Fatalf("exit after SIGTERM: %v; output:\n%s", err, p.all.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("no exit within 20 s of SIGTERM")
	}
}

func postJSON(t *testing.T, url, body string) (int, map[string]any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v map[string]any
	b, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("%s: %v: %s", url, err, b)
	}
	return resp.StatusCode, v
}

func cachedTokens(v map[string]any) float64 {
	u, _ := v["usage"].(map[string]any)
	d, _ := u["prompt_tokens_details"].(map[string]any)
	c, _ := d["cached_tokens"].(float64)
	return c
}

var apiRe = regexp.MustCompile(`OpenAI API at (http://[0-9.:]+)/v1`)

// TestUpEndToEnd runs `infergate up` as a real process: the printed address
// answers a chat, a second turn hits the prefix cache, errors are OpenAI
// errors, and SIGTERM shuts it down cleanly (within --shutdown-grace).
func TestUpEndToEnd(t *testing.T) {
	p := start(t, "up", "--engines", "2", "--listen", "127.0.0.1:0", "--time-scale", "100", "--shutdown-grace", "5s")
	base := p.await(t, apiRe)
	model := "meta-llama/Llama-3.1-70B-Instruct"
	sys := strings.Repeat("You are a careful assistant who answers in full sentences. ", 40)
	turn1 := fmt.Sprintf(`{"model":%q,"messages":[{"role":"system","content":%q},{"role":"user","content":"Hello!"}],"max_tokens":8}`, model, sys)
	code, v := postJSON(t, base+"/v1/chat/completions", turn1)
	if code != 200 {
		t.Fatalf("chat: %d %v", code, v)
	}
	reply := v["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
	turn2 := fmt.Sprintf(`{"model":%q,"messages":[{"role":"system","content":%q},{"role":"user","content":"Hello!"},{"role":"assistant","content":%q},{"role":"user","content":"More, please."}],"max_tokens":8}`, model, sys, reply)
	code, v = postJSON(t, base+"/v1/chat/completions", turn2)
	if code != 200 || cachedTokens(v) < 400 {
		t.Fatalf("turn 2: %d, cached %v (want the ~500-token history cached): %v", code, cachedTokens(v), v)
	}
	code, v = postJSON(t, base+"/v1/chat/completions", `{"model":"nope","messages":[{"role":"user","content":"x"}]}`)
	if e, _ := v["error"].(map[string]any); code != 404 || e["code"] != "model_not_found" {
		t.Fatalf("unknown model: %d %v", code, v)
	}
	if g := p.stopLogging(t, graceRe); g != "5s" {
		t.Errorf("shutdown grace %s, want 5s (--shutdown-grace)", g)
	}
}

// TestServeSimBench runs two `infergate sim` processes, `infergate serve` in
// front of them and `infergate bench --target` through it.
func TestServeSimBench(t *testing.T) {
	addrRe := regexp.MustCompile(`addr=(http://[0-9.:]+)`)
	var eps []string
	for range 2 {
		s := start(t, "sim", "--listen", "127.0.0.1:0", "--time-scale", "100", "--model", "m")
		eps = append(eps, "--endpoint", s.await(t, addrRe)+"=m")
		defer s.stop(t)
	}
	g := start(t, append([]string{"serve", "--listen", "127.0.0.1:0", "--policy", "prefix"}, eps...)...)
	base := g.await(t, addrRe)
	defer g.stop(t)

	// A three-request hash-id trace: the second and third continue the first.
	dir := t.TempDir()
	tr := filepath.Join(dir, "trace.jsonl")
	lines := `{"timestamp": 0, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1, 2]}
{"timestamp": 500, "input_length": 2000, "output_length": 4, "hash_ids": [0, 1, 2, 3]}
{"timestamp": 1000, "input_length": 2500, "output_length": 4, "hash_ids": [0, 1, 2, 3, 4]}
`
	if err := os.WriteFile(tr, []byte(lines), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "r.json")
	// This checks routing, not latency: the client's send lag (×100 in
	// engine time) is accepted whatever the host's load.
	b := infergateCommand("bench", "--target", base, "--model", "m", "--trace", tr, "--speedup", "10", "--time-scale", "100",
		"--max-lag", "1000000h", "--out", out)
	b.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	if msg, err := b.CombinedOutput(); err != nil {
		t.Fatalf("bench: %v\n%s", err, msg)
	}
	var rep struct {
		Runs []struct {
			Requests, Errors int
			HitRate          float64 `json:"hit_rate"`
		}
	}
	raw, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &rep); err != nil || len(rep.Runs) != 1 {
		t.Fatalf("report %s: %v", raw, err)
	}
	r := rep.Runs[0]
	// Requests 2 and 3 reuse 1024 and 1536 (whole 512-token blocks) of the
	// 6000 prompt tokens only if prefix routing kept them together.
	if r.Requests != 3 || r.Errors != 0 || r.HitRate < 0.35 {
		t.Fatalf("bench run %+v: want 3 requests, 0 errors, hit rate >= 0.35", r)
	}
}

func TestHelpAndVersion(t *testing.T) {
	for _, sub := range []string{"up", "serve", "sim", "bench", "version"} {
		c := infergateCommand(sub, "--help")
		c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
		msg, err := c.CombinedOutput()
		if err != nil || !strings.Contains(string(msg), "Usage:") {
			t.Errorf("%s --help: %v\n%s", sub, err, msg)
		}
	}
	c := infergateCommand("version")
	c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	if msg, err := c.CombinedOutput(); err != nil || !strings.HasPrefix(string(msg), "infergate ") {
		t.Errorf("version: %v %s", err, msg)
	}
	c = infergateCommand("serve")
	c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	if msg, err := c.CombinedOutput(); err == nil || !strings.Contains(string(msg), "no endpoints") {
		t.Errorf("serve without endpoints should fail clearly: %v %s", err, msg)
	}
}

// TestBenchCompareVirtual runs `bench --compare --virtual` on a small trace:
// the continuations hit the cache under prefix and the JSON has both runs.
func TestBenchCompareVirtual(t *testing.T) {
	dir := t.TempDir()
	tr := filepath.Join(dir, "trace.jsonl")
	var lines strings.Builder
	for i := range 40 {
		// 10 conversations, 4 turns each, each turn extending the last.
		conv, turn := i%10, i/10
		ids := []string{"0"}
		for k := 0; k <= turn+1; k++ {
			ids = append(ids, fmt.Sprint(1000*(conv+1)+k))
		}
		fmt.Fprintf(&lines, `{"timestamp": %d, "input_length": %d, "output_length": 8, "hash_ids": [%s]}`+"\n",
			i*2000, 512*len(ids), strings.Join(ids, ", "))
	}
	if err := os.WriteFile(tr, []byte(lines.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "r.json")
	c := infergateCommand("bench", "--compare", "round-robin,prefix", "--virtual", "--engines", "4", "--trace", tr, "--out", out)
	c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	if msg, err := c.CombinedOutput(); err != nil {
		t.Fatalf("bench: %v\n%s", err, msg)
	}
	var rep struct {
		Runs []struct {
			Policy           string
			Requests, Errors int
			HitRate          float64 `json:"hit_rate"`
		}
	}
	raw, _ := os.ReadFile(out)
	if err := json.Unmarshal(raw, &rep); err != nil || len(rep.Runs) != 2 {
		t.Fatalf("report %s: %v", raw, err)
	}
	rr, px := rep.Runs[0], rep.Runs[1]
	if rr.Errors+px.Errors != 0 || px.Requests != 40 || px.HitRate <= rr.HitRate || px.HitRate < 0.5 {
		t.Fatalf("round-robin %+v, prefix %+v: want prefix hit rate > round-robin's and >= 0.5", rr, px)
	}
}

// TestBenchWorkloads runs the generated shared-prefix workload through
// `bench --compare --virtual`: requests of a group share their system prompt,
// so most prompt tokens hit under prefix routing.
func TestBenchWorkloads(t *testing.T) {
	out := filepath.Join(t.TempDir(), "r.json")
	c := infergateCommand("bench", "--compare", "prefix", "--virtual", "--engines", "2", "--workload", "shared-prefix",
		"--sp-groups", "4", "--sp-prompts-per-group", "8", "--sp-system-tokens", "2048", "--sp-question-tokens", "128", "--sp-rate", "5", "--out", out)
	c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	if msg, err := c.CombinedOutput(); err != nil {
		t.Fatalf("bench: %v\n%s", err, msg)
	}
	var rep struct {
		Runs []struct {
			Requests, Errors int
			HitRate          float64 `json:"hit_rate"`
		}
	}
	raw, _ := os.ReadFile(out)
	if err := json.Unmarshal(raw, &rep); err != nil || len(rep.Runs) != 1 {
		t.Fatalf("report %s: %v", raw, err)
	}
	// 32 requests of 2176 tokens; 4 groups share 2048 tokens each: ceiling (28×2048)/(32×2176) ≈ 0.82.
	if r := rep.Runs[0]; r.Requests != 32 || r.Errors != 0 || r.HitRate < 0.7 {
		t.Fatalf("shared-prefix run %+v: want 32 requests, 0 errors, hit rate >= 0.7", r)
	}
	c = infergateCommand("bench", "--compare", "prefix", "--virtual", "--workload", "nope")
	c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	if msg, err := c.CombinedOutput(); err == nil || !strings.Contains(string(msg), "--workload") {
		t.Fatalf("unknown workload: %v %s", err, msg)
	}
}

// TestBenchReuseWorkloadsAndPeers runs the agentic, rag and long-tail
// workloads through `bench --compare --virtual` against the peers'
// profiles: every policy serves every request, the JSON carries the
// prompt-length buckets, and rag's questions hit their shared documents.
func TestBenchReuseWorkloadsAndPeers(t *testing.T) {
	for _, tc := range []struct {
		workload string
		args     []string
		minHit   float64
	}{
		{"agentic", []string{"--agentic-sessions", "6", "--agentic-session-rate", "2"}, 0.2},
		{"rag", []string{"--rag-documents", "3", "--rag-document-tokens", "2048", "--rag-rate", "4", "--requests", "30"}, 0.5},
		{"long-tail", []string{"--long-tail-rate", "4", "--long-tail-prob", "0", "--requests", "30"}, 0},
	} {
		t.Run(tc.workload, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "r.json")
			args := append([]string{"bench", "--compare", "cache-aware,llm-d,sglang,dynamo", "--virtual", "--engines", "2",
				"--workload", tc.workload, "--out", out}, tc.args...)
			c := infergateCommand(args...)
			c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
			msg, err := c.CombinedOutput()
			if err != nil {
				t.Fatalf("bench: %v\n%s", err, msg)
			}
			if !strings.Contains(string(msg), "TTFT by prompt length") {
				t.Errorf("no bucket table in\n%s", msg)
			}
			var rep struct {
				Runs []struct {
					Policy           string
					Requests, Errors int
					HitRate          float64 `json:"hit_rate"`
					Buckets          []struct {
						Name     string
						Requests int
					} `json:"ttft_by_prompt_length"`
				}
			}
			raw, _ := os.ReadFile(out)
			if err := json.Unmarshal(raw, &rep); err != nil || len(rep.Runs) != 4 {
				t.Fatalf("report %s: %v", raw, err)
			}
			for _, r := range rep.Runs {
				n := 0
				for _, b := range r.Buckets {
					n += b.Requests
				}
				if r.Requests == 0 || r.Errors != 0 || n != r.Requests || len(r.Buckets) != 4 || r.HitRate < tc.minHit {
					t.Errorf("%s: %+v", r.Policy, r)
				}
			}
		})
	}
}

var engineURLRe = regexp.MustCompile(`engine \d+: (http://[0-9.:]+) `)

// TestUpTiers runs `infergate up` with host tiers and a shared remote store
// and the precise-prefix policy, replays multi-turn conversations that
// overflow the engines' GPU caches, and checks that lower tiers served
// cached tokens (the engines' vllm:external_prefix_cache_hits_total) and
// that the gateway predicted tokens from them
// (infergate_prefix_predicted_tier_tokens_total).
func TestUpTiers(t *testing.T) {
	p := start(t, "up", "--engines", "2", "--listen", "127.0.0.1:0", "--time-scale", "100", "--access-log=false",
		"--num-gpu-blocks", "64", "--kv-host", "4x", "--kv-remote", "8x", "--policy", "precise-prefix")
	base := p.await(t, apiRe)
	engines := []string{p.await(t, engineURLRe), p.await(t, engineURLRe)}
	model := "meta-llama/Llama-3.1-70B-Instruct"
	ss := tierSessions(6)
	for i := range ss {
		ss[i].chat(t, base, model, false)
	}
	// The engines are idle: wait until the gateway has applied their
	// events (its batch counters stop moving).
	last := -1.0
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		n := metricSum(t, http.DefaultClient, base, "infergate_kv_events_batches_total", "")
		if n > 0 && n == last {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("KV-event batches applied: %v, still changing", n)
		}
		last = n
	}
	cached := 0.0
	for i := range ss {
		cached += ss[i].chat(t, base, model, true)
	}
	ext := 0.0
	for _, u := range engines {
		ext += metricSum(t, http.DefaultClient, u, "vllm:external_prefix_cache_hits_total", "")
	}
	lower := metricSum(t, http.DefaultClient, base, "infergate_prefix_predicted_tier_tokens_total", `tier="cpu"`) +
		metricSum(t, http.DefaultClient, base, "infergate_prefix_predicted_tier_tokens_total", `tier="remote"`)
	if cached == 0 || ext == 0 || lower == 0 {
		t.Fatalf("second turns cached %v tokens; engines' external hits %v; gateway's lower-tier predictions %v", cached, ext, lower)
	}
	t.Logf("second turns: %v cached tokens, %v from lower tiers; gateway predicted %v from cpu/remote", cached, ext, lower)
	p.stop(t)
}

// tierSession is a two-turn chat whose system prompt (~30 blocks of 16
// tokens) makes a handful of them overflow small GPU caches, so that their
// second turns are served from lower KV tiers (TestUpTiers,
// TestServeKVStoreTiers).
type tierSession struct{ sys, reply string }

// tierSessions returns n distinct sessions.
func tierSessions(n int) []tierSession {
	ss := make([]tierSession, n)
	for i := range ss {
		ss[i].sys = strings.Repeat(fmt.Sprintf("Session %d: you are a careful assistant. ", i), 60)
	}
	return ss
}

// chat sends the session's first turn, or its second (after the first's
// reply), to the gateway at base and returns the cached tokens reported.
func (s *tierSession) chat(t *testing.T, base, model string, turn2 bool) float64 {
	t.Helper()
	msgs := []map[string]string{{"role": "system", "content": s.sys}, {"role": "user", "content": "Hello!"}}
	if turn2 {
		msgs = append(msgs, map[string]string{"role": "assistant", "content": s.reply}, map[string]string{"role": "user", "content": "More, please."})
	}
	body, _ := json.Marshal(map[string]any{"model": model, "messages": msgs, "max_tokens": 8})
	code, v := postJSON(t, base+"/v1/chat/completions", string(body))
	if code != 200 {
		t.Fatalf("chat: %d %v", code, v)
	}
	s.reply = v["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
	return cachedTokens(v)
}
