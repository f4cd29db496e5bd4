package virtual

import (
	"errors"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
)

// virtualTrace returns n requests with shared prefixes: arrivals a random
// 0-400 ms apart (some simultaneous), prompts of a 256-token system prompt,
// one of 8 "conversation" blocks and a unique tail, 4-40 output tokens.
func virtualTrace(n int, seed uint64) []Request {
	rng := rand.New(rand.NewPCG(seed, 1))
	system := seqTokens(0, 256)
	reqs := make([]Request, n)
	var at time.Duration
	for i := range reqs {
		if rng.IntN(4) > 0 {
			at += time.Duration(rng.IntN(400)) * time.Millisecond
		}
		toks := slices.Concat(system, seqTokens(1+rng.IntN(8), 512+rng.IntN(2048)), seqTokens(100+i, 1+rng.IntN(300)))
		reqs[i] = Request{Arrival: at, Tokens: toks, MaxTokens: 4 + rng.IntN(37)}
	}
	return reqs
}

// referenceRun drives one engine through reqs as the real-time Server
// driver does, written as a plain loop: idle, it takes the next arrival and
// steps at once; after each step it adds the requests that arrived during
// the step or at its end, then delivers the step's outputs at its end.
func referenceRun(t *testing.T, cfg sim.Config, reqs []Request) []Result {
	t.Helper()
	e := sim.NewEngine(cfg)
	res := make([]Result, len(reqs))
	add := func(i int, at time.Duration) {
		res[i].Arrival = at
		if err := e.Add(&sim.Request{ID: strconv.Itoa(i), Tokens: reqs[i].Tokens, MaxTokens: reqs[i].MaxTokens}, at); err != nil {
			t.Fatal(err)
		}
	}
	var now time.Duration
	next := 0
	for next < len(reqs) || e.HasWork() {
		if !e.HasWork() {
			now = max(now, reqs[next].Arrival)
			add(next, now)
			next++
		}
		r := e.Step(now)
		end := now + r.Duration
		for next < len(reqs) && reqs[next].Arrival <= end {
			add(next, reqs[next].Arrival)
			next++
		}
		for _, o := range r.Outputs {
			i, _ := strconv.Atoi(o.ID)
			v := &res[i]
			if o.FirstToken {
				v.FirstToken, v.PromptTokens, v.CachedTokens = end, o.PromptTokens, o.CachedTokens
			} else {
				v.ITL = append(v.ITL, end-v.Finish)
			}
			v.Finish, v.OutputTokens = end, o.OutputTokens
		}
		now = end
	}
	return res
}

func sameTiming(t *testing.T, label string, got, want Result) {
	t.Helper()
	if got.Arrival != want.Arrival || got.FirstToken != want.FirstToken || got.Finish != want.Finish ||
		got.PromptTokens != want.PromptTokens || got.CachedTokens != want.CachedTokens ||
		got.OutputTokens != want.OutputTokens || !slices.Equal(got.ITL, want.ITL) || got.Err != nil {
		t.Fatalf("%s: got arrival %v first %v finish %v prompt %d cached %d out %d itl %d err %v\nwant arrival %v first %v finish %v prompt %d cached %d out %d itl %d",
			label, got.Arrival, got.FirstToken, got.Finish, got.PromptTokens, got.CachedTokens, got.OutputTokens, len(got.ITL), got.Err,
			want.Arrival, want.FirstToken, want.Finish, want.PromptTokens, want.CachedTokens, want.OutputTokens, len(want.ITL))
	}
}

// Round-robin makes engine i serve requests i, i+n, ...: each engine's
// results must be exactly those of the reference driver loop on its share.
func TestVirtualMatchesReferenceDriver(t *testing.T) {
	cfg := sim.Config{Profile: sim.Llama8BH100(), NumBlocks: 2000}
	reqs := virtualTrace(300, 7)
	for _, n := range []int{1, 3} {
		f, err := NewFleet(Config{Engines: n, Engine: cfg, Routing: sched.Config{Policy: sched.RoundRobin}})
		if err != nil {
			t.Fatal(err)
		}
		got, err := f.Run(reqs)
		if err != nil {
			t.Fatal(err)
		}
		for k := range n {
			var share []Request
			var idx []int
			for i := k; i < len(reqs); i += n {
				share = append(share, reqs[i])
				idx = append(idx, i)
			}
			want := referenceRun(t, cfg, share)
			for j, i := range idx {
				if got[i].Engine != k {
					t.Fatalf("n=%d: request %d on engine %d, want %d", n, i, got[i].Engine, k)
				}
				sameTiming(t, "n="+strconv.Itoa(n)+" request "+strconv.Itoa(i), got[i], want[j])
			}
		}
		var hits int
		for i := range got {
			hits += got[i].CachedTokens
			if got[i].TTFT() <= 0 || got[i].Finish < got[i].FirstToken || len(got[i].ITL) != got[i].OutputTokens-1 {
				t.Fatalf("n=%d: request %d: ttft %v, first %v finish %v, %d gaps for %d tokens",
					n, i, got[i].TTFT(), got[i].FirstToken, got[i].Finish, len(got[i].ITL), got[i].OutputTokens)
			}
		}
		if hits == 0 {
			t.Fatalf("n=%d: no prefix-cache hits on a trace with shared prefixes", n)
		}
		for i := range n {
			if f.InFlight(i) != 0 {
				t.Errorf("n=%d: engine %d still has %d in flight", n, i, f.InFlight(i))
			}
		}
		if u := f.Utilization(); !(u > 0 && u <= 1) {
			t.Errorf("n=%d: utilization %v", n, u)
		}
	}
}

// The event semantics, on step durations computed independently.
func TestVirtualEventSemantics(t *testing.T) {
	cfg := sim.Config{Profile: sim.Llama8BH100(), NumBlocks: 1000}
	a, b := seqTokens(1, 1000), seqTokens(2, 800)
	reqs := []Request{
		{Arrival: 100 * time.Millisecond, Tokens: a, MaxTokens: 3},
		{Arrival: 110 * time.Millisecond, Tokens: b, MaxTokens: 2}, // mid-step
	}
	f, err := NewFleet(Config{Engines: 1, Engine: cfg, Routing: sched.Config{Policy: sched.RoundRobin}})
	if err != nil {
		t.Fatal(err)
	}
	got, err := f.Run(reqs)
	if err != nil {
		t.Fatal(err)
	}
	// Replay by hand: A alone starts at its arrival; B joins the second step.
	e := sim.NewEngine(cfg)
	must(t, e.Add(&sim.Request{ID: "a", Tokens: a, MaxTokens: 3}, 0))
	s1 := e.Step(0).Duration // prefill A → A's first token
	must(t, e.Add(&sim.Request{ID: "b", Tokens: b, MaxTokens: 2}, 0))
	s2 := e.Step(0).Duration // decode A + prefill B → A's 2nd, B's 1st
	s3 := e.Step(0).Duration // A's 3rd, B's 2nd
	t1 := 100*time.Millisecond + s1
	if got[0].FirstToken != t1 || got[0].TTFT() != s1 {
		t.Errorf("A first token at %v (TTFT %v), want %v (%v)", got[0].FirstToken, got[0].TTFT(), t1, s1)
	}
	if got[1].FirstToken != t1+s2 || got[1].TTFT() != t1+s2-110*time.Millisecond {
		t.Errorf("B first token at %v, want %v (end of the step after its arrival)", got[1].FirstToken, t1+s2)
	}
	if !slices.Equal(got[0].ITL, []time.Duration{s2, s3}) || got[0].Finish != t1+s2+s3 {
		t.Errorf("A gaps %v finish %v, want [%v %v] %v", got[0].ITL, got[0].Finish, s2, s3, t1+s2+s3)
	}
	if f.Now() != t1+s2+s3 {
		t.Errorf("Now %v, want %v", f.Now(), t1+s2+s3)
	}
	if bt := f.Stats()[0].BusyTime; bt != s1+s2+s3 {
		t.Errorf("busy %v, want %v", bt, s1+s2+s3)
	}

	// Simultaneous arrivals at an idle engine: the first steps alone.
	f, _ = NewFleet(Config{Engines: 1, Engine: cfg, Routing: sched.Config{Policy: sched.RoundRobin}})
	got, err = f.Run([]Request{{Tokens: a, MaxTokens: 1}, {Tokens: b, MaxTokens: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if got[0].FirstToken != s1 || got[1].FirstToken <= s1 {
		t.Errorf("simultaneous arrivals: first tokens at %v and %v, want %v and later", got[0].FirstToken, got[1].FirstToken, s1)
	}

	// An arrival exactly at a step's end joins the next step, which starts then.
	f, _ = NewFleet(Config{Engines: 1, Engine: cfg, Routing: sched.Config{Policy: sched.RoundRobin}})
	got, err = f.Run([]Request{{Tokens: a, MaxTokens: 2}, {Arrival: s1, Tokens: b, MaxTokens: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if got[0].Finish != got[1].FirstToken {
		t.Errorf("arrival at a step end: A finishes at %v, B's first token at %v; want one step", got[0].Finish, got[1].FirstToken)
	}
}

// recordingPolicy is round-robin that records what it was shown.
type recordingPolicy struct {
	sched.Policy
	hashes   [][]uint64
	inFlight [][]int
}

func (p *recordingPolicy) NeedsHashes() bool { return true }

func (p *recordingPolicy) Pick(r *sched.Request, eps []sched.Endpoint) sched.Decision {
	p.hashes = append(p.hashes, slices.Clone(r.Hashes))
	fl := make([]int, len(eps))
	for i, ep := range eps {
		fl[i] = ep.InFlight
	}
	p.inFlight = append(p.inFlight, fl)
	return p.Policy.Pick(r, eps)
}

// Routing sees the gateway's hashes and in-flight counts: incremented when a
// request is routed, decremented when its last token is delivered.
func TestVirtualRoutingView(t *testing.T) {
	rr, _ := sched.New(sched.Config{Policy: sched.RoundRobin}, nil)
	p := &recordingPolicy{Policy: rr}
	cfg := sim.Config{Profile: sim.Llama8BH100(), NumBlocks: 1000}
	long, short := seqTokens(1, 300), seqTokens(2, 40)
	calls := 0
	reqs := []Request{
		{Arrival: 0, Tokens: long, MaxTokens: 500},
		{Arrival: 0, Tokens: short, MaxTokens: 1},
		{Arrival: time.Millisecond, Prompt: func(dst []uint32) []uint32 { calls++; return append(dst, short...) }, MaxTokens: 1},
		{Arrival: 3 * time.Second, Tokens: short, MaxTokens: 1},
	}
	f, err := NewFleet(Config{Engines: 2, Engine: cfg, Model: "m", Policy: p})
	if err != nil {
		t.Fatal(err)
	}
	got, err := f.Run(reqs)
	if err != nil {
		t.Fatal(err)
	}
	want := [][]int{{0, 0}, {1, 0}, {1, 1}, {1, 0}}
	for i := range want {
		if !slices.Equal(p.inFlight[i], want[i]) {
			t.Errorf("request %d saw in-flight %v, want %v", i, p.inFlight[i], want[i])
		}
	}
	if calls != 1 {
		t.Errorf("Prompt called %d times", calls)
	}
	if h := prefix.Hashes(nil, long, 16, prefix.Seed("m\x00")); !slices.Equal(p.hashes[0], h) {
		t.Errorf("routing hashes differ from the gateway's")
	}
	if got[2].Engine != 0 || got[3].Engine != 1 {
		t.Errorf("engines %d %d", got[2].Engine, got[3].Engine)
	}
	if got[0].Finish < 3*time.Second {
		t.Fatalf("request 0 finished at %v; the test needs it in flight at 3s", got[0].Finish)
	}
}

// metricsPolicy records the engine-reported load routing saw.
type metricsPolicy struct {
	sched.Policy
	seen []sched.Endpoint
}

func (p *metricsPolicy) Pick(r *sched.Request, eps []sched.Endpoint) sched.Decision {
	p.seen = append(p.seen, eps[0])
	return p.Policy.Pick(r, eps)
}

// Routing sees the engines' own queues as the gateway's scraper reads them:
// the state at the last scrape tick, not at the arrival; nothing with
// scraping off.
func TestVirtualScrapedLoad(t *testing.T) {
	cfg := sim.Config{Profile: sim.Llama8BH100(), NumBlocks: 1000, MaxNumSeqs: 1}
	reqs := []Request{ // one engine running one request at a time
		{Arrival: 0, Tokens: seqTokens(1, 100), MaxTokens: 2000},
		{Arrival: 0, Tokens: seqTokens(2, 100), MaxTokens: 1},
		{Arrival: 0, Tokens: seqTokens(3, 100), MaxTokens: 1},
		{Arrival: 50 * time.Millisecond, Tokens: seqTokens(4, 100), MaxTokens: 1},  // before the 100 ms scrape
		{Arrival: 150 * time.Millisecond, Tokens: seqTokens(5, 100), MaxTokens: 1}, // after it: 3 waiting
	}
	for _, iv := range []time.Duration{100 * time.Millisecond, -1} {
		rr, _ := sched.New(sched.Config{Policy: sched.RoundRobin}, nil)
		p := &metricsPolicy{Policy: rr}
		f, err := NewFleet(Config{Engines: 1, Engine: cfg, Policy: p, ScrapeInterval: iv})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Run(reqs); err != nil {
			t.Fatal(err)
		}
		if iv < 0 {
			for i, e := range p.seen {
				if e.Metrics || e.Waiting != 0 || e.Running != 0 || e.KVUtil != 0 {
					t.Errorf("scraping off: request %d saw engine load %+v", i, e)
				}
			}
			continue
		}
		// The scrape at 0 saw an idle engine (it runs before the arrivals
		// of its instant); the one at 100 ms, one running and 3 waiting.
		for i := 0; i < 4; i++ {
			if e := p.seen[i]; !e.Metrics || e.Waiting != 0 || e.Running != 0 {
				t.Errorf("request %d (before the 100 ms scrape) saw %+v, want the idle engine of the scrape at 0", i, e)
			}
		}
		if e := p.seen[4]; !e.Metrics || e.Waiting != 3 || e.Running != 1 || !(e.KVUtil > 0) {
			t.Errorf("request 4 saw metrics %v waiting %d running %d kv %v, want 3 waiting and 1 running", e.Metrics, e.Waiting, e.Running, e.KVUtil)
		}
	}
}

func TestVirtualErrorsAndDeterminism(t *testing.T) {
	cfg := sim.Config{Profile: sim.Llama8BH100(), NumBlocks: 1000}
	if _, err := NewFleet(Config{Engines: 0}); err == nil {
		t.Error("0 engines accepted")
	}
	if _, err := NewFleet(Config{Engines: 1, Routing: sched.Config{Policy: "nope"}}); err == nil {
		t.Error("unknown policy accepted")
	}
	f, _ := NewFleet(Config{Engines: 2, Engine: cfg})
	if _, err := f.Run([]Request{{Arrival: 2, Tokens: []uint32{1}, MaxTokens: 1}, {Arrival: 1, Tokens: []uint32{1}, MaxTokens: 1}}); err == nil {
		t.Error("out-of-order arrivals accepted")
	}
	got, err := f.Run([]Request{
		{Tokens: seqTokens(1, 20000), MaxTokens: 1}, // over the 16k-token cache
		{Tokens: seqTokens(2, 20), MaxTokens: 0},
		{Tokens: seqTokens(3, 20), MaxTokens: 2},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !errors.Is(got[0].Err, sim.ErrNoCapacity) || !errors.Is(got[1].Err, sim.ErrBadMaxTokens) || got[2].Err != nil || got[2].OutputTokens != 2 {
		t.Errorf("errors %v, %v, %v", got[0].Err, got[1].Err, got[2].Err)
	}
	if f.InFlight(0)+f.InFlight(1) != 0 {
		t.Error("rejected requests left in flight")
	}
	if _, err := f.Run([]Request{{Arrival: 0, Tokens: []uint32{1}, MaxTokens: 1}}); err == nil && f.Now() > 0 {
		t.Error("a request before the fleet's time accepted")
	}

	// The prefix policy, with its random tie-breaking, is deterministic.
	run := func() []Result {
		f, err := NewFleet(Config{Engines: 4, Engine: cfg, Routing: sched.Config{Policy: sched.Prefix, Seed: 3}})
		if err != nil {
			t.Fatal(err)
		}
		res, err := f.Run(virtualTrace(200, 11))
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	r1, r2 := run(), run()
	for i := range r1 {
		if r1[i].Engine != r2[i].Engine || r1[i].FirstToken != r2[i].FirstToken || r1[i].Finish != r2[i].Finish {
			t.Fatalf("request %d differs between identical runs", i)
		}
	}
}

// BenchmarkFleet measures the virtual driver on a synthetic trace of
// 1,000 requests on 4 engines (one op = one whole run).
func BenchmarkFleet(b *testing.B) {
	reqs := virtualTrace(1000, 5)
	cfg := sim.Config{Profile: sim.Llama8BH100()}
	b.ReportAllocs()
	for b.Loop() {
		f, err := NewFleet(Config{Engines: 4, Engine: cfg})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := f.Run(reqs); err != nil {
			b.Fatal(err)
		}
	}
}

// seqTokens returns n distinct tokens starting at base*1_000_000 (as sim's
// tests build prompts).
func seqTokens(base, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(base*1_000_000 + i)
	}
	return t
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestVirtualTiers: a fleet with host tiers and a shared remote store
// serves lower-tier hits, reports them by tier, and the precise index (fed
// by every medium's events and the store's) predicts what each engine
// takes from each tier; a precise policy prices them.
func TestVirtualTiers(t *testing.T) {
	eng := sim.Config{NumBlocks: 400}
	eng.Tiers.Host = sim.TierSize{Multiple: 2}
	reqs := virtualTrace(300, 7)
	for _, policy := range []string{sched.CacheAware, sched.PrecisePrefix, sched.LLMDTiered} {
		f, err := NewFleet(Config{Engines: 3, Engine: eng, Remote: sim.TierSize{Multiple: 4}, TrackPrecise: true,
			Routing: sched.Config{Policy: policy}})
		must(t, err)
		res, err := f.Run(reqs)
		must(t, err)
		var tier, predicted [sim.NumTiers]int
		exact, served := 0, 0
		for i := range res {
			r := &res[i]
			if r.Err != nil {
				t.Fatalf("%s: request %d: %v", policy, i, r.Err)
			}
			sum := 0
			for k, v := range r.TierTokens {
				tier[k] += v
				sum += v
				predicted[k] += r.PredictedTierBlocks[k] * 16
			}
			if sum != r.CachedTokens {
				t.Fatalf("%s: request %d: tiers %v do not add up to %d cached", policy, i, r.TierTokens, r.CachedTokens)
			}
			served++
			if r.PredictedTierBlocks[0]*16 == r.TierTokens[0] && r.PredictedTierBlocks[1]*16 == r.TierTokens[1] && r.PredictedTierBlocks[3]*16 == r.TierTokens[3] {
				exact++
			}
		}
		var cumPred, cumServed int
		for _, k := range []sim.Tier{sim.TierGPU, sim.TierHost, sim.TierDisk, sim.TierRemote} {
			if k != sim.TierDisk && tier[k] == 0 {
				t.Errorf("%s: tier %s: no token served", policy, k)
			}
			// The router must not promise what the engines do not serve:
			// a hit predicted in a tier is served from it or from a faster
			// one (a block cached again meanwhile), and the engines may
			// serve more (a block stored after the decision).
			cumPred, cumServed = cumPred+predicted[k], cumServed+tier[k]
			if cumPred > cumServed+cumServed/50+160 {
				t.Errorf("%s: tiers up to %s: %d tokens predicted, %d served (predicted %v, served %v)", policy, k, cumPred, cumServed, predicted, tier)
			}
		}
		if predicted[sim.TierGPU] == 0 || predicted[sim.TierHost] == 0 {
			t.Errorf("%s: predicted %v", policy, predicted)
		}
		// Predictions are made at routing time, before the engine's step
		// (and the events of steps still running), so a few differ.
		if exact < served*8/10 {
			t.Errorf("%s: %d of %d predictions exact per tier (tiers %v, predicted %v)", policy, exact, served, tier, predicted)
		}
		var st [sim.NumTiers]int64
		for _, s := range f.Stats() {
			for k := range st {
				st[k] += s.TierHits[k]
			}
		}
		if int(st[sim.TierHost]) != tier[sim.TierHost] || int(st[sim.TierRemote]) != tier[sim.TierRemote] {
			t.Errorf("%s: engine stats %v, results %v", policy, st, tier)
		}
	}
}

// TestVirtualSleepWake: an engine waiting for a load with nothing to run
// sleeps until it ends, and an arrival meanwhile runs at once.
func TestVirtualSleepWake(t *testing.T) {
	eng := sim.Config{NumBlocks: 64}
	eng.Profile = sim.DefaultProfile()
	eng.Profile.NetworkLatency = time.Second // a slow remote load
	f, err := NewFleet(Config{Engines: 1, Engine: eng, Remote: sim.TierSize{Multiple: 4}, Routing: sched.Config{Policy: sched.RoundRobin}})
	must(t, err)
	a := seqTokens(1, 640)
	_, err = f.Run([]Request{{Arrival: 0, Tokens: a, MaxTokens: 1}, {Arrival: 0, Tokens: seqTokens(5000, 1024), MaxTokens: 1}})
	must(t, err)
	start := f.Now() + time.Second
	// a's blocks left the GPU (1024 + 640 > 64 blocks of 16); the remote
	// store has them: a loads for over a second, and b, arriving 10 ms
	// later, does not wait for that load.
	res, err := f.Run([]Request{{Arrival: start, Tokens: a, MaxTokens: 1}, {Arrival: start + 10*time.Millisecond, Tokens: seqTokens(9000, 32), MaxTokens: 1}})
	must(t, err)
	if res[0].TierTokens[sim.TierRemote] == 0 || res[0].TTFT() < time.Second {
		t.Fatalf("a: %+v", res[0])
	}
	if res[1].TTFT() > 200*time.Millisecond {
		t.Fatalf("b waited %v behind a's load", res[1].TTFT())
	}
}

// finishRecorder is a round-robin policy that records the fleet's
// sched.Finisher calls.
type finishRecorder struct {
	sched.Policy
	on    bool
	calls map[string]int // engine and hashes of each call → count
}

var _ sched.Finisher = (*finishRecorder)(nil) // a signature change must not make it silently no Finisher

func (r *finishRecorder) NeedsHashes() bool    { return true }
func (r *finishRecorder) LearnsOnFinish() bool { return r.on }
func (r *finishRecorder) Finished(i int, hashes []uint64, _ bool) {
	r.calls[finishKey(i, hashes)]++
}

func finishKey(i int, hashes []uint64) string {
	b := strconv.AppendInt(nil, int64(i), 10)
	for _, h := range hashes {
		b = strconv.AppendUint(append(b, ' '), h, 16)
	}
	return string(b)
}

// TestFleetTellsFinisher: a policy that learns on finish hears of every
// request once, when its engine ends it, with the engine and the hashes it
// was routed with; one that does not hears of none.
func TestFleetTellsFinisher(t *testing.T) {
	cfg := sim.Config{Profile: sim.Llama8BH100(), NumBlocks: 2000}
	reqs := virtualTrace(60, 3)
	for _, on := range []bool{false, true} {
		rr, err := sched.NewPolicy(sched.Config{Policy: sched.RoundRobin}, sched.Pool{Capacity: []int{1, 1, 1}})
		if err != nil {
			t.Fatal(err)
		}
		rec := &finishRecorder{Policy: rr, on: on, calls: map[string]int{}}
		f, err := NewFleet(Config{Engines: 3, Engine: cfg, Policy: rec})
		if err != nil {
			t.Fatal(err)
		}
		got, err := f.Run(reqs)
		if err != nil {
			t.Fatal(err)
		}
		if !on {
			if len(rec.calls) != 0 {
				t.Fatalf("learn on finish off: %d calls", len(rec.calls))
			}
			continue
		}
		want := map[string]int{}
		for k := range reqs {
			if got[k].Err != nil {
				t.Fatalf("request %d: %v", k, got[k].Err)
			}
			want[finishKey(got[k].Engine, prefix.Hashes(nil, reqs[k].Tokens, f.BlockSize(), f.seed))]++
		}
		if len(rec.calls) != len(want) {
			t.Fatalf("%d distinct finish calls, want %d", len(rec.calls), len(want))
		}
		for key, n := range want {
			if rec.calls[key] != n {
				t.Fatalf("finish call %.40s...: %d times, want %d", key, rec.calls[key], n)
			}
		}
	}
}
