package e2e

// Helpers for the gateway end-to-end tests: the multi-turn chat workload
// (MT-bench questions under long sonnet system prompts), a fleet of Ollama
// instances behind an in-process gateway, and a closed-loop driver that
// sends the turns and measures time to first token at the client.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/data"
	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/gguf"
	"github.com/infergate/infergate/trace"
)

// SessionOptions parameterises ChatSessions. Zero fields take the defaults.
type SessionOptions struct {
	// Sessions is the number of conversations (default 3).
	Sessions int
	// Turns is the number of user turns per session (default 4). MT-bench
	// questions have two turns; a session asks consecutive questions until
	// it has Turns.
	Turns int
	// SystemTokens is the least length of each session's system prompt in
	// tokens of the model's vocabulary (default 1800).
	SystemTokens int
	// MaxTurnTokens skips questions with a longer turn (tokens; default
	// 160), which keeps every session well inside num_ctx.
	MaxTurnTokens int
}

func (o SessionOptions) withDefaults() SessionOptions {
	def := func(p *int, v int) {
		if *p == 0 {
			*p = v
		}
	}
	def(&o.Sessions, 3)
	def(&o.Turns, 4)
	def(&o.SystemTokens, 1800)
	def(&o.MaxTurnTokens, 160)
	return o
}

// ChatSession is one conversation of the workload: a long system prompt of
// its own and the user turns, sent one at a time with the model's answers
// spliced in between (see RunSessions).
type ChatSession struct {
	System    string
	Turns     []string
	Questions []int // MT-bench question ids asked, in order
}

// ChatSessions builds o.Sessions conversations from MT-bench questions and
// the sonnet text (vLLM's benchmarks/sonnet.txt), measuring lengths with v.
//
// Session s's system prompt is a window of whole sonnet lines of at least
// o.SystemTokens tokens, starting at line s·len(lines)/o.Sessions, so the
// sessions share no text (their prompts differ from the first line on; only
// the chat template's header is common). Its turns are the turns of
// consecutive eligible questions (every turn at most o.MaxTurnTokens), the
// sessions' questions spread evenly over the file.
func ChatSessions(questions []trace.Question, sonnet string, v *gguf.Vocab, o SessionOptions) ([]ChatSession, error) {
	o = o.withDefaults()
	if o.Sessions < 1 || o.Turns < 1 || o.SystemTokens < 1 || o.MaxTurnTokens < 1 {
		return nil, fmt.Errorf("e2e: chat sessions: invalid options %+v", o)
	}
	var lines []string
	for l := range strings.SplitSeq(sonnet, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			lines = append(lines, l)
		}
	}
	if len(lines) == 0 {
		return nil, errors.New("e2e: chat sessions: empty sonnet text")
	}
	var eligible []trace.Question
	for _, q := range questions {
		ok := len(q.Turns) > 0
		for _, t := range q.Turns {
			ok = ok && len(v.Encode(t)) <= o.MaxTurnTokens
		}
		if ok {
			eligible = append(eligible, q)
		}
	}
	perSession := 0
	for n, k := 0, 0; n < o.Turns; k++ {
		if len(eligible) == 0 {
			break
		}
		n += len(eligible[k%len(eligible)].Turns)
		perSession++
	}
	if perSession == 0 || perSession*o.Sessions > len(eligible) {
		return nil, fmt.Errorf("e2e: chat sessions: %d eligible questions, need %d", len(eligible), perSession*o.Sessions)
	}
	stride := len(eligible) / o.Sessions

	sessions := make([]ChatSession, o.Sessions)
	for s := range sessions {
		start := s * len(lines) / o.Sessions
		var b strings.Builder
		for i := start; ; i++ {
			if i-start >= len(lines) {
				return nil, fmt.Errorf("e2e: chat sessions: sonnet text has fewer than %d tokens", o.SystemTokens)
			}
			b.WriteString(lines[i%len(lines)])
			b.WriteByte('\n')
			if len(v.Encode(b.String())) >= o.SystemTokens {
				break
			}
		}
		cs := ChatSession{System: b.String()}
		for k := 0; len(cs.Turns) < o.Turns; k++ {
			q := eligible[(s*stride+k)%len(eligible)]
			cs.Questions = append(cs.Questions, q.ID)
			for _, t := range q.Turns {
				if len(cs.Turns) < o.Turns {
					cs.Turns = append(cs.Turns, t)
				}
			}
		}
		sessions[s] = cs
	}
	return sessions, nil
}

// LoadChatSessions reads the MT-bench questions and the sonnet text (the
// copies in package data) and builds sessions with ChatSessions.
func LoadChatSessions(t testing.TB, v *gguf.Vocab, o SessionOptions) []ChatSession {
	t.Helper()
	qs, err := trace.LoadMTBench(data.Embedded + data.MTBench)
	if err != nil {
		t.Fatal(err)
	}
	sonnet, err := data.ReadFile(data.Sonnet)
	if err != nil {
		t.Fatal(err)
	}
	sessions, err := ChatSessions(qs, string(sonnet), v, o)
	if err != nil {
		t.Fatal(err)
	}
	return sessions
}

// StartOllamas starts n instances concurrently (StartOllama); on any error
// it stops those that started and returns the errors.
func StartOllamas(ctx context.Context, binary, modelDir string, n int, opts Options) ([]*Instance, error) {
	insts := make([]*Instance, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range insts {
		wg.Go(func() { insts[i], errs[i] = StartOllama(ctx, binary, modelDir, opts) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, errors.Join(err, StopAll(insts))
	}
	return insts, nil
}

// StopAll stops every instance (nil entries skipped), concurrently, and
// checks that no process of theirs is left.
func StopAll(insts []*Instance) error {
	errs := make([]error, len(insts))
	var wg sync.WaitGroup
	for i, in := range insts {
		if in == nil {
			continue
		}
		wg.Go(func() {
			errs[i] = in.Stop()
			if errs[i] == nil {
				if left := GroupAlive(in.Pid()); len(left) > 0 {
					errs[i] = fmt.Errorf("e2e: instance %s: processes left: %v", in.Addr, left)
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// StartOllamasT is StartOllamas for a test: it fails the test on error and
// stops the instances in t.Cleanup (logging their log tails if the test
// failed). Stopping earlier with StopAll is fine: Stop is idempotent.
func StartOllamasT(t testing.TB, binary, modelDir string, n int, opts Options) []*Instance {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	insts, err := StartOllamas(ctx, binary, modelDir, n, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, in := range insts {
				t.Logf("ollama %s log tail:\n%s", in.Addr, in.LogTail(3000))
			}
		}
		if err := StopAll(insts); err != nil {
			t.Error(err)
		}
	})
	return insts
}

// Gateway is an in-process infergate gateway in front of Ollama instances,
// served on a loopback port.
type Gateway struct {
	*gateway.Gateway
	URL       string               // http://127.0.0.1:PORT
	Registry  *prometheus.Registry // the gateway's metrics
	Endpoints []string             // endpoint label of each instance, in instance order
	Instances []*Instance
	srv       *httptest.Server
}

// OllamaKVBlocks is an Ollama instance's KV capacity in 16-token blocks as
// StartOllama configures it: num_ctx 4096 per slot × 2 slots = 8192 cells.
const OllamaKVBlocks = gguf.DefaultNumCtx * 2 / 16

// StartGateway builds a gateway with routing policy policy ("" = the
// gateway's default) in front of insts, each an endpoint of kind ollama
// serving its model with OllamaKVBlocks blocks of 16 tokens.
func StartGateway(insts []*Instance, policy string) (*Gateway, error) {
	cfg := gateway.Config{Listen: "127.0.0.1:0"}
	cfg.Routing.Policy = policy
	g := &Gateway{Registry: prometheus.NewRegistry(), Instances: insts}
	for _, in := range insts {
		cfg.Endpoints = append(cfg.Endpoints, gateway.EndpointConfig{
			URL: in.URL, Model: in.Model, Kind: fleet.Ollama, KVBlocks: OllamaKVBlocks, BlockSize: 16,
		})
		g.Endpoints = append(g.Endpoints, in.URL)
	}
	gw, err := gateway.New(context.Background(), cfg, g.Registry)
	if err != nil {
		return nil, err
	}
	g.Gateway = gw
	g.srv = httptest.NewServer(gw.Handler())
	g.URL = g.srv.URL
	return g, nil
}

// Close shuts the server and the gateway down.
func (g *Gateway) Close() {
	g.srv.Close()
	g.Gateway.Close()
}

// endpointGauge sums a metric family's samples by their endpoint label;
// with code set, only samples with that code label count.
func (g *Gateway) endpointGauge(name, code string) ([]float64, error) {
	mfs, err := g.Registry.Gather()
	if err != nil {
		return nil, err
	}
	out := make([]float64, len(g.Endpoints))
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			var ep, c string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "endpoint":
					ep = l.GetValue()
				case "code":
					c = l.GetValue()
				}
			}
			i := slices.Index(g.Endpoints, ep)
			if i < 0 || (code != "" && c != code) {
				continue
			}
			if m.Gauge != nil {
				out[i] += m.GetGauge().GetValue()
			} else {
				out[i] += m.GetCounter().GetValue()
			}
		}
	}
	return out, nil
}

// InFlight returns the gateway's in-flight request count per instance.
func (g *Gateway) InFlight() ([]float64, error) {
	return g.endpointGauge("infergate_endpoint_in_flight_requests", "")
}

// Served returns the successful requests per instance so far.
func (g *Gateway) Served() ([]float64, error) {
	return g.endpointGauge("infergate_requests_total", "200")
}

// StreamResult is a streamed chat completion as the client saw it.
type StreamResult struct {
	Text             string
	FinishReason     string
	PromptTokens     int // from the usage chunk, if any
	CompletionTokens int
	Events           int           // data events before [DONE]
	TTFT             time.Duration // to the first event with non-empty content
	Total            time.Duration
}

// StreamChat posts body (a streaming chat completion request) to
// baseURL/v1/chat/completions and reads the SSE answer, measuring the time
// to the first event carrying content and reading usage if sent. If
// onFirst is not nil it is called when that first content arrives.
func StreamChat(ctx context.Context, client *http.Client, baseURL string, body []byte, onFirst func()) (*StreamResult, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return nil, fmt.Errorf("e2e: chat: HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
	}
	res, _, err := readChatStream(resp.Body, start, onFirst)
	return res, err
}

// readChatStream reads a streamed chat completion's SSE body until [DONE]:
// the text, finish reason and usage, the data events, the time from start to
// the first event with content (TTFT; the whole stream when none has any;
// onFirst, if not nil, is called then) and to the first data event of any
// kind (firstEvent). An error event, bad JSON or a stream without [DONE] is
// an error.
func readChatStream(body io.Reader, start time.Time, onFirst func()) (res *StreamResult, firstEvent time.Duration, err error) {
	res = &StreamResult{}
	var text strings.Builder
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	done := false
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data:")
		if !ok {
			continue
		}
		data = strings.TrimSpace(data)
		if firstEvent == 0 {
			firstEvent = time.Since(start)
		}
		if data == "[DONE]" {
			done = true
			break
		}
		res.Events++
		var ev struct {
			Choices []struct {
				Delta        Message `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens     int `json:"prompt_tokens"`
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return nil, 0, fmt.Errorf("e2e: chat: bad event %q: %w", data, err)
		}
		if ev.Error != nil {
			return nil, 0, fmt.Errorf("e2e: chat: stream error: %s", ev.Error.Message)
		}
		for _, c := range ev.Choices {
			if c.Delta.Content != "" && res.TTFT == 0 {
				res.TTFT = time.Since(start)
				if onFirst != nil {
					onFirst()
				}
			}
			text.WriteString(c.Delta.Content)
			if c.FinishReason != nil && *c.FinishReason != "" {
				res.FinishReason = *c.FinishReason
			}
		}
		if ev.Usage != nil {
			res.PromptTokens, res.CompletionTokens = ev.Usage.PromptTokens, ev.Usage.CompletionTokens
		}
	}
	if err := sc.Err(); err != nil {
		return nil, 0, fmt.Errorf("e2e: chat: stream: %w", err)
	}
	if !done {
		return nil, 0, errors.New("e2e: chat: stream ended without [DONE]")
	}
	res.Total = time.Since(start)
	if res.TTFT == 0 { // no content at all (the model stopped at once)
		res.TTFT = res.Total
	}
	res.Text = text.String()
	return res, firstEvent, nil
}

// RunOptions parameterises RunSessions. Zero fields take the defaults.
type RunOptions struct {
	// MaxTokens is every turn's max_tokens (default 12).
	MaxTokens int
	// Seed is every request's seed (default 1); temperature is always 0.
	Seed int
	// Stagger is how long after the first of a pair of first turns the
	// second is sent at the latest (default 2s); it is sent as soon as the
	// gateway has routed the first.
	Stagger time.Duration
	// SequentialStarts sends the first turns one at a time too, on an idle
	// fleet (README.md: the cache-aware policies then stack every session
	// on one instance).
	SequentialStarts bool
}

// TurnResult is one request of a RunSessions run.
type TurnResult struct {
	Session, Turn    int
	Endpoint         int       // index of the instance that served it
	Messages         []Message // the conversation sent
	PromptTokens     int       // usage.prompt_tokens
	CompletionTokens int
	Text             string        // the answer, sent back in the next turn
	Start            time.Duration // when it was sent, from the start of the run
	TTFT, Total      time.Duration
	// CPU is the time the serving instance's processes ran on a CPU
	// between the request's send and its first content at the client
	// (CPUMeter): its TTFT without the time it waited for a CPU, which
	// other processes on a shared machine add. Wait is the time its
	// threads were runnable but waiting in that interval.
	CPU, Wait time.Duration

	cpu0, cpu1 []CPUSample // all instances at send and at first content
}

// Cold reports whether the turn is a session's first (no earlier turn of it
// can be cached anywhere).
func (r TurnResult) Cold() bool { return r.Turn == 0 }

// setEndpoint records the serving instance and its CPU times.
func (r *TurnResult) setEndpoint(e int) {
	r.Endpoint = e
	if e >= 0 && e < len(r.cpu0) && e < len(r.cpu1) {
		r.CPU = r.cpu1[e].Run - r.cpu0[e].Run
		r.Wait = r.cpu1[e].Wait - r.cpu0[e].Wait
	}
	r.cpu0, r.cpu1 = nil, nil
}

// CPUSample is the CPU time of a set of processes' threads so far.
type CPUSample struct {
	Run  time.Duration // on a CPU
	Wait time.Duration // runnable, waiting for a CPU
}

// CPUMeter reads the CPU time of an instance's processes (the server and
// its runner) from /proc/PID/task/TID/schedstat (Linux: nanoseconds on a
// CPU and waiting on a run queue, per thread). The process list is taken
// when the meter is made, so make it after the model is loaded. Threads
// that exit take their time with them (Go rarely ends threads).
type CPUMeter struct{ pids []int }

// NewCPUMeter returns a meter for in's process group as it is now.
func NewCPUMeter(in *Instance) *CPUMeter { return &CPUMeter{pids: GroupAlive(in.Pid())} }

// Read returns the processes' CPU time so far (zero where /proc has none).
func (m *CPUMeter) Read() CPUSample {
	var s CPUSample
	for _, pid := range m.pids {
		dir := "/proc/" + strconv.Itoa(pid) + "/task"
		ents, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range ents {
			b, err := os.ReadFile(dir + "/" + e.Name() + "/schedstat")
			if err != nil {
				continue
			}
			f := strings.Fields(string(b))
			if len(f) < 2 {
				continue
			}
			run, _ := strconv.ParseInt(f[0], 10, 64)
			wait, _ := strconv.ParseInt(f[1], 10, 64)
			s.Run += time.Duration(run)
			s.Wait += time.Duration(wait)
		}
	}
	return s
}

func readAll(ms []*CPUMeter) []CPUSample {
	out := make([]CPUSample, len(ms))
	for i, m := range ms {
		out[i] = m.Read()
	}
	return out
}

// RunSessions sends the sessions' turns through gw, closed loop: each turn
// carries the session's earlier turns with the model's actual answers.
// First turns go in pairs (sessions 0 and 1, then 2 and 3, ...; one at a
// time with o.SequentialStarts): the second is sent once the gateway has
// routed the first, so that both run at once and a load-aware policy
// spreads them. Later turns go one at a time in interleaved order (s0t2,
// s1t2, ..., s0t3, ...), which keeps timings clean on 2 cores. Requests
// stream with temperature 0, a fixed seed and stream_options.include_usage.
// Results are in send order, each with the instance that served it (from
// the gateway's metrics) and its TTFT and on-CPU TTFT.
func RunSessions(ctx context.Context, gw *Gateway, model string, sessions []ChatSession, o RunOptions) ([]TurnResult, error) {
	if o.MaxTokens == 0 {
		o.MaxTokens = 12
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.Stagger == 0 {
		o.Stagger = 2 * time.Second
	}
	run := &sessionRun{ctx: ctx, gw: gw, model: model, sessions: sessions, o: o, client: &http.Client{},
		convs: make([][]Message, len(sessions)), meters: make([]*CPUMeter, len(gw.Instances))}
	defer run.client.CloseIdleConnections()
	for s, cs := range sessions {
		run.convs[s] = []Message{{Role: "system", Content: cs.System}}
	}
	for i, in := range gw.Instances {
		run.meters[i] = NewCPUMeter(in)
	}
	run.start = time.Now()

	before, err := run.gw.Served()
	if err != nil {
		return nil, err
	}
	// First turns.
	for s := 0; s < len(run.sessions); {
		if run.o.SequentialStarts || s+1 == len(run.sessions) {
			before, err = run.one(s, 0, before)
			s++
		} else {
			before, err = run.pair(s, before)
			s += 2
		}
		if err != nil {
			return nil, err
		}
	}
	for _, r := range run.out {
		run.convs[r.Session] = append(run.convs[r.Session], Message{Role: "assistant", Content: r.Text})
	}
	// Later turns, interleaved, one at a time.
	for k := 1; ; k++ {
		sent := false
		for s := range run.sessions {
			if k >= len(run.sessions[s].Turns) {
				continue
			}
			sent = true
			if before, err = run.one(s, k, before); err != nil {
				return nil, err
			}
			r := run.out[len(run.out)-1]
			run.convs[s] = append(run.convs[s], Message{Role: "assistant", Content: r.Text})
		}
		if !sent {
			break
		}
	}
	return run.out, nil
}

// sessionRun is one RunSessions: its inputs, the conversations so far, the
// instances' CPU meters and the results.
type sessionRun struct {
	ctx      context.Context
	gw       *Gateway
	model    string
	sessions []ChatSession
	o        RunOptions
	client   *http.Client
	convs    [][]Message // each session's messages so far
	meters   []*CPUMeter
	start    time.Time
	out      []TurnResult
}

func (run *sessionRun) send(s, k int) (*TurnResult, error) {
	run.convs[s] = append(run.convs[s], Message{Role: "user", Content: run.sessions[s].Turns[k]})
	msgs := slices.Clone(run.convs[s])
	body, err := json.Marshal(map[string]any{
		"model": run.model, "messages": msgs, "max_tokens": run.o.MaxTokens, "temperature": 0, "seed": run.o.Seed,
		"stream": true, "stream_options": map[string]any{"include_usage": true},
	})
	if err != nil {
		return nil, err
	}
	r := &TurnResult{Session: s, Turn: k, Endpoint: -1, Messages: msgs, Start: time.Since(run.start), cpu0: readAll(run.meters)}
	res, err := StreamChat(run.ctx, run.client, run.gw.URL, body, func() { r.cpu1 = readAll(run.meters) })
	if err != nil {
		return nil, fmt.Errorf("session %d turn %d: %w", s, k, err)
	}
	if r.cpu1 == nil {
		r.cpu1 = readAll(run.meters)
	}
	r.PromptTokens, r.CompletionTokens, r.Text = res.PromptTokens, res.CompletionTokens, res.Text
	r.TTFT, r.Total = res.TTFT, res.Total
	return r, nil
}

// servedAfter waits until the gateway has accounted n more requests
// than before (it counts a request after relaying its last byte, so
// just after the client has read it) and returns the new counts.
func (run *sessionRun) servedAfter(before []float64, n int) ([]float64, error) {
	deadline := time.Now().Add(5 * time.Second)
	for {
		now, err := run.gw.Served()
		if err != nil {
			return nil, err
		}
		var sum float64
		for i := range now {
			sum += now[i] - before[i]
		}
		if sum >= float64(n) {
			return now, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("e2e: the gateway accounted %v of %d requests", sum, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// served waits for r to be accounted and records the instance whose
// served count grew since before.
func (run *sessionRun) served(r *TurnResult, before []float64) ([]float64, error) {
	now, err := run.servedAfter(before, 1)
	if err != nil {
		return nil, err
	}
	for i := range now {
		if now[i] > before[i] {
			r.setEndpoint(i)
			return now, nil
		}
	}
	return nil, errors.New("e2e: no instance's served count grew")
}

// one sends turn k of session s alone.
func (run *sessionRun) one(s, k int, before []float64) ([]float64, error) {
	r, err := run.send(s, k)
	if err != nil {
		return nil, err
	}
	if before, err = run.served(r, before); err != nil {
		return nil, err
	}
	run.out = append(run.out, *r)
	return before, nil
}

// pair sends the first turns of sessions s and s+1, the second as soon
// as the gateway shows the first in flight (so it has been routed).
func (run *sessionRun) pair(s int, before []float64) ([]float64, error) {
	var (
		ra, rb     *TurnResult
		errA, errB error
		wg         sync.WaitGroup
	)
	wg.Go(func() { ra, errA = run.send(s, 0) })
	first := -1
	for deadline := time.Now().Add(run.o.Stagger); first < 0 && time.Now().Before(deadline); {
		inf, err := run.gw.InFlight()
		if err != nil {
			wg.Wait()
			return nil, err
		}
		for i, n := range inf {
			if n > 0 {
				first = i
			}
		}
		if first < 0 {
			time.Sleep(2 * time.Millisecond)
		}
	}
	if first >= 0 {
		wg.Go(func() { rb, errB = run.send(s+1, 0) })
	}
	wg.Wait()
	if first < 0 && errA == nil {
		errA = fmt.Errorf("e2e: the gateway did not show session %d's first turn in flight within %v", s, run.o.Stagger)
	}
	if err := errors.Join(errA, errB); err != nil {
		return nil, err
	}
	now, err := run.servedAfter(before, 2)
	if err != nil {
		return nil, err
	}
	// The first went where the gateway showed it in flight; the second
	// to the instance whose count grew otherwise (the same one if it
	// got both).
	ra.setEndpoint(first)
	for i := range now {
		grew := int(math.Round(now[i] - before[i]))
		if i == first {
			grew--
		}
		if grew > 0 {
			rb.setEndpoint(i)
		}
	}
	run.out = append(run.out, *ra, *rb)
	return now, nil
}

// PromptTokenIDs returns the token ids the engine sees for msgs (the chat
// template rendered by RenderPrompt, tokenized with BOS).
func PromptTokenIDs(v *gguf.Vocab, msgs []Message) []uint32 {
	ids := v.Tokenize(RenderPrompt(msgs), true)
	out := make([]uint32, len(ids))
	for i, id := range ids {
		out[i] = uint32(id)
	}
	return out
}

// Percentile returns the nearest-rank p-th percentile (0 < p ≤ 100) of ds;
// 0 for none.
func Percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	k := int(math.Ceil(p / 100 * float64(len(s))))
	return s[min(max(k, 1), len(s))-1]
}

// Shares returns each instance's share of the results, in [0, 1].
func Shares(rs []TurnResult, instances int) []float64 {
	out := make([]float64, instances)
	for _, r := range rs {
		if r.Endpoint >= 0 && r.Endpoint < instances {
			out[r.Endpoint]++
		}
	}
	for i := range out {
		out[i] /= float64(max(len(rs), 1))
	}
	return out
}
