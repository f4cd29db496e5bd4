package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/data"
	"github.com/infergate/infergate/gguf"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/virtual"
)

// simProfile is the built-in simulator profile fitted to Ollama serving the
// generated tiny model on this machine's CPU (sim/profiles/<name>.yaml).
const simProfile = "tiny-llama-cpu-ollama"

// ollamaBatch is Ollama's default num_batch: a prompt is prefilled in
// forward passes of at most this many tokens. The simulator replays with
// MaxNumBatchedTokens set to it, so a cold prompt takes as many steps.
const ollamaBatch = 512

// calPoint is one calibration measurement: the time to first token of a
// cold prompt of Tokens tokens (prefill), or the time of one decode step
// at a context of Tokens tokens (decode).
type calPoint struct {
	Kind   string // "prefill" or "decode"
	Tokens int
	Meas   time.Duration
}

// predict is the simulator's time for the point: the prompt prefilled in
// chunks of ollamaBatch tokens, one step each (the first token comes with
// the last chunk), or one decode step of a batch of one.
func (pt calPoint) predict(p sim.GPUProfile) time.Duration {
	if pt.Kind == "decode" {
		return p.DecodeTime(1, pt.Tokens)
	}
	var total time.Duration
	for done := 0; done < pt.Tokens; {
		n := min(ollamaBatch, pt.Tokens-done)
		var c sim.StepCost
		c.Add(n, done)
		total += p.StepTime(c)
		done += n
	}
	return total
}

// calibrationLengths are the system prompt sizes measured cold (tokens).
var calibrationLengths = []int{256, 512, 1024, 2048, 3072}

// nativeChat is the part of Ollama's /api/chat answer the calibration
// reads: the runner's own timings (wall clock, nanoseconds).
type nativeChat struct {
	PromptEvalCount    int   `json:"prompt_eval_count"`
	PromptEvalDuration int64 `json:"prompt_eval_duration"`
	EvalCount          int   `json:"eval_count"`
	EvalDuration       int64 `json:"eval_duration"`
}

// measureCalibration measures prefill and decode on one Ollama instance
// with a single slot, so that each new prompt replaces the last one in the
// KV cache and no other sequence's cells widen the attention range. For
// each of calibrationLengths, twice with different text, it sends through
// the native /api/chat (temperature 0):
//
//	A: the prompt, cold, 1 token      → prefill = CPU(A)
//	C: the same prompt again, 1 token → per-request work and one step
//	B: the same prompt again, 24 tokens → decode step = (CPU(B) − CPU(C)) / (tokens(B) − 1)
//
// where CPU is the instance's on-CPU time during the request (CPUMeter),
// which other processes on a shared machine do not inflate. The smaller
// of the two repetitions is kept. It also logs Ollama's own wall-clock
// prefill rate and decode time per token.
func measureCalibration(t *testing.T, bin, dir string, v *gguf.Vocab) []calPoint {
	t.Helper()
	sonnet, err := data.ReadFile(data.Sonnet)
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for l := range strings.SplitSeq(string(sonnet), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			lines = append(lines, l)
		}
	}
	insts := StartOllamasT(t, bin, dir, 1, Options{NumParallel: 1})
	in := insts[0]
	meter := NewCPUMeter(in)
	client := &http.Client{}
	defer client.CloseIdleConnections()
	call := func(msgs []Message, tokens int) (nativeChat, time.Duration, time.Duration) {
		body, _ := json.Marshal(map[string]any{
			"model": in.Model, "messages": msgs, "stream": false,
			"options": map[string]any{"num_predict": tokens, "temperature": 0, "seed": 1},
		})
		before, start := meter.Read(), time.Now()
		resp, err := client.Post(in.URL+"/api/chat", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var nc nativeChat
		if err := json.NewDecoder(resp.Body).Decode(&nc); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("/api/chat: HTTP %d: %v", resp.StatusCode, err)
		}
		return nc, meter.Read().Run - before.Run, time.Since(start)
	}

	type sample struct {
		tokens int
		d      time.Duration
	}
	prefill, decode := map[int]sample{}, map[int]sample{}
	keep := func(m map[int]sample, key, tokens int, d time.Duration) {
		if s, ok := m[key]; !ok || d < s.d {
			m[key] = sample{tokens, d}
		}
	}
	line := 0
	for range 2 {
		for _, n := range calibrationLengths {
			var b strings.Builder
			for len(v.Encode(b.String())) < n {
				b.WriteString(lines[line%len(lines)])
				b.WriteByte('\n')
				line++
			}
			msgs := []Message{{Role: "system", Content: b.String()}, {Role: "user", Content: "Go on."}}
			// 24 tokens at most: Ollama aborts a generation after 30
			// identical tokens in a row (llm/server.go, "token repeat
			// limit"), which this random-weight model can produce.
			na, cpuA, wallA := call(msgs, 1)
			_, cpuC, _ := call(msgs, 1)
			nb, cpuB, _ := call(msgs, 24)
			step := time.Duration(0)
			if nb.EvalCount >= 9 {
				step = (cpuB - cpuC) / time.Duration(nb.EvalCount-1)
				if cpuB == 0 { // no schedstat: Ollama's own (wall-clock) timings
					step = time.Duration(nb.EvalDuration) / time.Duration(nb.EvalCount)
				}
				keep(decode, n, na.PromptEvalCount+nb.EvalCount/2, step)
			}
			if cpuA == 0 {
				cpuA = wallA
			}
			keep(prefill, n, na.PromptEvalCount, cpuA)
			t.Logf("calibration: prompt %4d tokens: prefill CPU %8v wall %8v (Ollama: %v, %.0f tokens/s); repeat, 1 token: CPU %v; decode step CPU %v (Ollama: %v/token over %d)",
				na.PromptEvalCount, cpuA.Round(100*time.Microsecond), wallA.Round(100*time.Microsecond),
				time.Duration(na.PromptEvalDuration).Round(100*time.Microsecond),
				float64(na.PromptEvalCount)/time.Duration(na.PromptEvalDuration).Seconds(), cpuC.Round(100*time.Microsecond),
				step.Round(10*time.Microsecond), (time.Duration(nb.EvalDuration) / time.Duration(max(nb.EvalCount, 1))).Round(10*time.Microsecond), nb.EvalCount)
		}
	}
	var pts []calPoint
	for _, n := range calibrationLengths {
		pts = append(pts, calPoint{"prefill", prefill[n].tokens, prefill[n].d})
	}
	for _, n := range calibrationLengths {
		if s, ok := decode[n]; ok {
			pts = append(pts, calPoint{"decode", s.tokens, s.d})
		}
	}
	if err := StopAll(insts); err != nil {
		t.Error(err)
	}
	return pts
}

// fitError is the root mean square relative error of p on pts.
func fitError(p sim.GPUProfile, pts []calPoint) float64 {
	var s float64
	for _, pt := range pts {
		e := float64(pt.predict(p))/float64(pt.Meas) - 1
		s += e * e
	}
	return math.Sqrt(s / float64(len(pts)))
}

// fitProfile fits prefill_mfu, decode_bandwidth_efficiency and
// step_overhead of p to pts by least squares on relative error: a
// logarithmic grid, then a few rounds of coordinate refinement.
func fitProfile(p sim.GPUProfile, pts []calPoint) (sim.GPUProfile, float64) {
	best, bestErr := p, fitError(p, pts)
	try := func(q sim.GPUProfile) {
		if e := fitError(q, pts); e < bestErr {
			best, bestErr = q, e
		}
	}
	logGrid := func(lo, hi float64, n int) []float64 {
		out := make([]float64, n)
		for i := range out {
			out[i] = lo * math.Pow(hi/lo, float64(i)/float64(n-1))
		}
		return out
	}
	q := p
	for _, mfu := range logGrid(0.02, 1, 40) {
		for _, eff := range logGrid(0.002, 1, 40) {
			for o := time.Duration(0); o <= 3*time.Millisecond; o += 100 * time.Microsecond {
				q.PrefillMFU, q.DecodeBandwidthEfficiency, q.StepOverhead = mfu, eff, o
				try(q)
			}
		}
	}
	for range 4 {
		for _, f := range logGrid(0.9, 1.1, 21) {
			q = best
			q.PrefillMFU = min(1, best.PrefillMFU*f)
			try(q)
			q = best
			q.DecodeBandwidthEfficiency = min(1, best.DecodeBandwidthEfficiency*f)
			try(q)
			q = best
			q.StepOverhead = time.Duration(float64(best.StepOverhead) * f).Round(time.Microsecond)
			try(q)
		}
	}
	return best, bestErr
}

// slotLoad is one "loading cache slot" debug line of an Ollama runner: how
// many of a request's prompt tokens it found in its cache.
type slotLoad struct{ prompt, used int }

var slotLoadRE = regexp.MustCompile(`msg="loading cache slot".* prompt=(\d+) used=(\d+)`)

// slotLoads parses an instance's debug log (OLLAMA_DEBUG=1), in order.
func slotLoads(in *Instance) []slotLoad {
	var out []slotLoad
	for _, m := range slotLoadRE.FindAllStringSubmatch(in.LogTail(64<<20), -1) {
		p, _ := strconv.Atoi(m[1])
		u, _ := strconv.Atoi(m[2])
		out = append(out, slotLoad{p, u})
	}
	return out
}

// simTurn is the simulator's view of one request.
type simTurn struct {
	engine       int
	ttft         time.Duration
	cachedTokens int
}

// replayInSim sends the turns of a real run through a virtual fleet of two
// engines with profile p, routing with policy, with Ollama's prompt token
// ids (gguf.Vocab.Tokenize), its batch size, its two slots (MaxNumSeqs)
// and its KV capacity (OllamaKVBlocks), each request generating as many
// tokens as the real one did. Requests that overlapped in the real run
// (the pairs of first turns) arrive with the same offsets; the others are
// sent one at a time, each when the fleet is idle, as in the real run.
func replayInSim(p sim.GPUProfile, policy string, v *gguf.Vocab, turns []TurnResult) ([]simTurn, error) {
	f, err := virtual.NewFleet(virtual.Config{
		Engines: 2,
		Engine: sim.Config{Profile: p, BlockSize: 16, NumBlocks: OllamaKVBlocks,
			MaxNumSeqs: 2, MaxNumBatchedTokens: ollamaBatch},
		Model:   "tiny",
		Routing: sched.Config{Policy: policy},
	})
	if err != nil {
		return nil, err
	}
	var out []simTurn
	for i := 0; i < len(turns); {
		j := i + 1
		for j < len(turns) && turns[j].Start < turns[j-1].Start+turns[j-1].Total {
			j++
		}
		reqs := make([]virtual.Request, j-i)
		for k := range reqs {
			r := turns[i+k]
			reqs[k] = virtual.Request{
				Arrival:   f.Now() + r.Start - turns[i].Start,
				Tokens:    PromptTokenIDs(v, r.Messages),
				MaxTokens: max(1, r.CompletionTokens),
			}
		}
		res, err := f.Run(reqs)
		if err != nil {
			return nil, err
		}
		for _, r := range res {
			if r.Err != nil {
				return nil, r.Err
			}
			out = append(out, simTurn{engine: r.Engine, ttft: r.TTFT(), cachedTokens: r.CachedTokens})
		}
		i = j
	}
	return out, nil
}

// TestSimMatchesOllama checks the simulator against the real engine. It
// measures this machine's prefill and decode times on one Ollama instance,
// fits the simulator's latency constants to them and compares with the
// built-in profile fitted earlier on another machine
// (sim/profiles/tiny-llama-cpu-ollama.yaml); then it runs the multi-turn
// chat workload through the gateway in front of two instances (prefix and
// round-robin policies) and through a virtual fleet of two engines with
// the constants fitted now, and compares the time to first token of every
// turn, with Ollama's cached tokens from its debug log. Times are compared
// with the instance's on-CPU time too (CPUMeter): on a shared machine
// other processes inflate wall times 1-4x. It logs the tables (README.md)
// and asserts only loose sanity of the model, not of this machine's speed:
// the fitted prefill within 2x of every calibration point, and the
// simulated TTFT of the turns both Ollama and the simulator recomputed
// within 2x of the real on-CPU TTFT (median ratio). The built-in
// profile's figures are logged beside them: a CPU twice as slow as the
// one it was fitted on is no defect of the simulator.
func TestSimMatchesOllama(t *testing.T) {
	bin := requireE2E(t)
	prof, ok := sim.Profiles()[simProfile]
	if !ok {
		t.Fatalf("profile %q not built in", simProfile)
	}
	dir := t.TempDir()
	model, err := WriteModelDir(dir, gguf.Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	v := model.Vocab
	if a := prof.ArchParams(); math.Abs(a-float64(model.Params())) > 0.001*a {
		t.Errorf("profile has %.0f parameters by its architecture, the generated model %d", a, model.Params())
	}

	// 1. Calibration.
	pts := measureCalibration(t, bin, dir, v)
	fit, fitErr := fitProfile(prof, pts)
	var cal strings.Builder
	fmt.Fprintf(&cal, "\n| point | tokens | measured | profile | error | fitted now | error |\n|---|---|---|---|---|---|---|\n")
	for _, pt := range pts {
		a, b := pt.predict(prof), pt.predict(fit)
		fmt.Fprintf(&cal, "| %s | %d | %v | %v | %+.0f%% | %v | %+.0f%% |\n", pt.Kind, pt.Tokens,
			pt.Meas.Round(10*time.Microsecond), a.Round(10*time.Microsecond), 100*(float64(a)/float64(pt.Meas)-1),
			b.Round(10*time.Microsecond), 100*(float64(b)/float64(pt.Meas)-1))
	}
	t.Logf("calibration (profile: prefill_mfu %.3f, decode_bandwidth_efficiency %.3f, step_overhead %v; rms error %.0f%%; "+
		"fitted now: %.3f, %.3f, %v; rms error %.0f%%):%s",
		prof.PrefillMFU, prof.DecodeBandwidthEfficiency, prof.StepOverhead, 100*fitError(prof, pts),
		fit.PrefillMFU, fit.DecodeBandwidthEfficiency, fit.StepOverhead, 100*fitErr, cal.String())
	for _, pt := range pts {
		if r := float64(pt.predict(fit)) / float64(pt.Meas); pt.Kind == "prefill" && (r < 0.5 || r > 2) {
			t.Errorf("fitted prefill of %d tokens %v is not within 2x of the measured %v", pt.Tokens, pt.predict(fit), pt.Meas)
		}
	}

	// 2. The workload, real and simulated.
	sessions := LoadChatSessions(t, v, SessionOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var bothCold []float64        // sim (fitted now) / real on-CPU TTFT where both recomputed the prompt
	var bothColdProfile []float64 // the same with the built-in profile
	var summary strings.Builder
	fmt.Fprintf(&summary, "\n| policy | turns | real TTFT p50 (wall) | real p50 (on-CPU) | sim p50 | MdAPE vs wall | MdAPE vs on-CPU | median sim/on-CPU |\n|---|---|---|---|---|---|---|---|\n")
	for _, policy := range []string{sched.Prefix, sched.RoundRobin} {
		insts := StartOllamasT(t, bin, dir, 2, Options{Env: []string{"OLLAMA_DEBUG=1"}})
		gw, err := StartGateway(insts, policy)
		if err != nil {
			t.Fatal(err)
		}
		turns, err := RunSessions(ctx, gw, insts[0].Model, sessions, RunOptions{})
		gw.Close()
		loads := [][]slotLoad{slotLoads(insts[0]), slotLoads(insts[1])}
		if serr := StopAll(insts); serr != nil {
			t.Error(serr)
		}
		if err != nil {
			t.Fatal(err)
		}
		simulated, err := replayInSim(fit, policy, v, turns)
		if err != nil {
			t.Fatal(err)
		}
		simProf, err := replayInSim(prof, policy, v, turns)
		if err != nil {
			t.Fatal(err)
		}

		// Ollama's cached tokens per request, from its debug log: each
		// instance's first load is the warm-up request.
		next := []int{1, 1}
		var tab strings.Builder
		fmt.Fprintf(&tab, "\n| turn | instance | prompt | Ollama cached | sim cached | real TTFT | on-CPU | CPU wait | sim TTFT | error vs wall | vs on-CPU | profile's sim TTFT |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
		type group struct {
			wall, cpu, sim  []time.Duration
			errWall, errCPU []float64
			ratioCPU        []float64
		}
		// Turns are grouped by what Ollama and the simulator did with the
		// prompt: "cold" recomputed most of it, "warm" found most of it
		// cached; "cold/warm" is a turn Ollama recomputed and the
		// simulator's cache still held.
		groups := map[string]*group{}
		for i, r := range turns {
			used := -1
			if e := r.Endpoint; e >= 0 && next[e] < len(loads[e]) {
				if l := loads[e][next[e]]; l.prompt == r.PromptTokens {
					used = l.used
				}
				next[e]++
			}
			s := simulated[i]
			realCold := used >= 0 && used < r.PromptTokens/2 || used < 0 && r.Cold()
			simCold := s.cachedTokens < r.PromptTokens/2
			name := map[bool]string{true: "cold", false: "warm"}[realCold]
			if realCold != simCold {
				name += "/" + map[bool]string{true: "cold", false: "warm"}[simCold]
			}
			if r.CPU == 0 { // no schedstat in /proc: compare with wall time
				r.CPU = r.TTFT
			}
			g := groups[name]
			if g == nil {
				g = &group{}
				groups[name] = g
			}
			rw, rc := float64(s.ttft)/float64(r.TTFT), float64(s.ttft)/float64(r.CPU)
			g.wall, g.cpu, g.sim = append(g.wall, r.TTFT), append(g.cpu, r.CPU), append(g.sim, s.ttft)
			g.errWall, g.errCPU, g.ratioCPU = append(g.errWall, math.Abs(rw-1)), append(g.errCPU, math.Abs(rc-1)), append(g.ratioCPU, rc)
			if name == "cold" {
				bothCold = append(bothCold, rc)
				bothColdProfile = append(bothColdProfile, float64(simProf[i].ttft)/float64(r.CPU))
			}
			fmt.Fprintf(&tab, "| s%d t%d (%s) | %d / sim %d | %d | %d | %d | %v | %v | %v | %v | %+.0f%% | %+.0f%% | %v |\n",
				r.Session, r.Turn+1, name, r.Endpoint, s.engine, r.PromptTokens, used, s.cachedTokens,
				r.TTFT.Round(100*time.Microsecond), r.CPU.Round(100*time.Microsecond), r.Wait.Round(100*time.Microsecond),
				s.ttft.Round(100*time.Microsecond), 100*(rw-1), 100*(rc-1), simProf[i].ttft.Round(100*time.Microsecond))
		}
		t.Logf("%s, per turn (Ollama cached = the runner's \"used\" tokens; cold = recomputed most of the prompt, Ollama/sim when they differ; "+
			"on-CPU = the instance's CPU time until the first token, CPU wait = its threads' run-queue wait):%s", policy, tab.String())
		for _, name := range []string{"cold", "warm", "cold/warm", "warm/cold"} {
			g := groups[name]
			if g == nil {
				continue
			}
			fmt.Fprintf(&summary, "| %s | %s (%d) | %v | %v | %v | %.0f%% | %.0f%% | %.2f |\n", policy, name, len(g.wall),
				Percentile(g.wall, 50).Round(100*time.Microsecond), Percentile(g.cpu, 50).Round(100*time.Microsecond),
				Percentile(g.sim, 50).Round(100*time.Microsecond), 100*median(g.errWall), 100*median(g.errCPU), median(g.ratioCPU))
		}
	}
	t.Logf("simulator vs Ollama, time to first token per turn (MdAPE = median absolute percentage error):%s", summary.String())
	t.Logf("turns both recomputed, median sim/on-CPU: %.2f with the constants fitted now, %.2f with the built-in profile %s",
		median(bothCold), median(bothColdProfile), simProfile)
	if m := median(bothCold); !(m >= 0.5 && m <= 2) {
		t.Errorf("simulated TTFT (constants fitted on this machine) of turns both recomputed is %.2fx the real on-CPU time (median of %d), not within 2x",
			m, len(bothCold))
	}
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}
