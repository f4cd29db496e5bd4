package simserver

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sim"
)

// completeTokens sends a completion of a token prompt to base and returns
// its usage.
func completeTokens(t *testing.T, ctx context.Context, base string, tokens []uint32, maxTokens int) (openai.Usage, error) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": testModel, "prompt": tokens, "max_tokens": maxTokens})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return openai.Usage{}, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	c := decodeJSON[openai.Completion](t, b)
	return *c.Usage, nil
}

// eventLog is a kvevents.Handler that keeps every event it is given.
type eventLog struct {
	mu  sync.Mutex
	evs []kvevents.Event
}

func (l *eventLog) KVBatch(_ uint64, b *kvevents.Batch) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, ev := range b.Events {
		ev.BlockHashes = append([]uint64(nil), ev.BlockHashes...)
		ev.TokenIDs = append([]uint32(nil), ev.TokenIDs...)
		l.evs = append(l.evs, ev)
	}
}

func (l *eventLog) KVReset(kvevents.ResetReason) {}

// find returns the events f accepts.
func (l *eventLog) find(f func(kvevents.Event) bool) []kvevents.Event {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []kvevents.Event
	for _, ev := range l.evs {
		if f(ev) {
			out = append(out, ev)
		}
	}
	return out
}

// subscribeLog runs a kvevents.Subscriber of pub (replay) until the test ends.
func subscribeLog(t *testing.T, pub, replay, topic string) *eventLog {
	t.Helper()
	sub, err := kvevents.NewSubscriber(kvevents.SubscriberConfig{Endpoint: pub, ReplayEndpoint: replay, Topic: topic})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	l := &eventLog{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = sub.Run(ctx, l)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return l
}

// TestTieredServerHostHit: an engine with a host tier serves a prompt whose
// blocks the GPU evicted from the host tier, over HTTP (cached_tokens
// counts them, and vLLM's connector counters), and publishes the
// write-through as CPU events without token ids.
func TestTieredServerHostHit(t *testing.T) {
	eng := sim.Config{NumBlocks: 8, MaxNumBatchedTokens: 64}
	eng.Tiers.Host = sim.TierSize{Multiple: 4}
	s, ts := newTestServer(t, ServerConfig{Engine: eng, KVEvents: kvevents.PublisherConfig{Enable: true,
		Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Bind: true}})
	pub, replay := "", ""
	if p := s.KVEventPublisher(); p != nil {
		pub, replay = dialAddr(p.Addr().(*net.TCPAddr)), dialAddr(p.ReplayAddr().(*net.TCPAddr))
	}
	log := subscribeLog(t, pub, replay, "")
	ctx := context.Background()
	a := vocabTokens(1000, 64) // 4 blocks
	if u, err := completeTokens(t, ctx, ts.URL, a, 1); err != nil || u.Cached() != 0 {
		t.Fatalf("first: %+v %v", u, err)
	}
	// b takes all 8 GPU blocks: a's are evicted there, kept in the host tier.
	if _, err := completeTokens(t, ctx, ts.URL, vocabTokens(5000, 128), 1); err != nil {
		t.Fatal(err)
	}
	u, err := completeTokens(t, ctx, ts.URL, a, 1)
	if err != nil || u.Cached() != 48 {
		t.Fatalf("a again: cached %d of %d (%v), want 48 from the host tier", u.Cached(), u.PromptTokens, err)
	}
	st := s.Stats()
	if st.TierHits[sim.TierHost] != 48 || st.ExternalHits != 48 {
		t.Fatalf("stats: tier hits %v, external hits %d", st.TierHits, st.ExternalHits)
	}
	for name, want := range map[string]float64{
		"vllm:external_prefix_cache_hits_total":    48,
		"vllm:external_prefix_cache_queries_total": float64(64 + 128 + 64),
	} {
		if got := gatherOne(t, s, name).Metric[0].GetCounter().GetValue(); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	byTier := map[string]float64{}
	for _, m := range gatherOne(t, s, "infergate_sim_kv_tier_capacity_blocks").Metric {
		for _, l := range m.Label {
			if l.GetName() == "tier" {
				byTier[l.GetValue()] = m.GetGauge().GetValue()
			}
		}
	}
	if byTier["gpu"] != 8 || byTier["host"] != 32 || len(byTier) != 2 {
		t.Errorf("tier capacities %v", byTier)
	}
	// The host tier's stores: medium CPU, no token ids, no parent.
	waitFor(t, "CPU events", func() bool {
		return len(log.find(func(ev kvevents.Event) bool { return ev.Medium == "CPU" && ev.Type == kvevents.BlockStored })) >= 3
	})
	for _, ev := range log.find(func(ev kvevents.Event) bool { return ev.Medium == "CPU" }) {
		if len(ev.TokenIDs) != 0 || ev.HasParent {
			t.Fatalf("CPU event with tokens or parent: %+v", ev)
		}
	}
}

// TestLoadWaitIsInterruptible: while an engine waits for a remote load that
// takes an hour of simulated time, a request submitted meanwhile is served
// at once (the driver wakes at the submission, as the virtual fleet's
// engine does at an arrival) and the load is still in flight after it.
// Ordering only: no durations are asserted.
func TestLoadWaitIsInterruptible(t *testing.T) {
	prof := sim.DefaultProfile()
	prof.NetworkLatency = time.Hour
	eng := sim.Config{Profile: prof, NumBlocks: 64}
	f, err := StartFleet(2, ServerConfig{Engine: eng, TimeScale: 1, KVRemote: sim.TierSize{Multiple: 4}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx := context.Background()
	p := vocabTokens(1000, 160)
	// Engine 0 computes p and writes it through to the shared store.
	if _, err := completeTokens(t, ctx, f.URLs[0], p, 1); err != nil {
		t.Fatal(err)
	}
	if f.Remote.Len() < 9 {
		t.Fatalf("remote store holds %d blocks", f.Remote.Len())
	}
	// Engine 1 finds p in the store: a load of an hour.
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	aDone := make(chan struct{})
	go func() {
		defer close(aDone)
		_, _ = completeTokens(t, actx, f.URLs[1], p, 1)
	}()
	e1 := f.Servers[1]
	waitFor(t, "the remote load to start", func() bool { return e1.Stats().Loading == 1 })
	u, err := completeTokens(t, ctx, f.URLs[1], vocabTokens(9000, 40), 2)
	if err != nil || u.CompletionTokens != 2 {
		t.Fatalf("request during the load: %+v %v", u, err)
	}
	select {
	case <-aDone:
		t.Fatal("the loading request ended first")
	default:
	}
	if st := e1.Stats(); st.Loading != 1 {
		t.Fatalf("after the other request: loading %d", st.Loading)
	}
	// The engine slept through the load: it did not step in a loop (a
	// driver that steps again at once after a step of no time spins).
	if n := gatherOne(t, e1, "infergate_sim_step_lag_seconds").Metric[0].GetHistogram().GetSampleCount(); n > 50 {
		t.Fatalf("%d steps while loading: the driver spins", n)
	}
	cancel() // the loading request's client gives up
	<-aDone
	waitFor(t, "the abort", func() bool { st := e1.Stats(); return st.Loading == 0 && st.Waiting == 0 })
}

// TestFleetSharedRemoteEvents: a fleet's engines share one remote store,
// whose events (medium REMOTE, with token ids) a kvevents.Subscriber
// receives on the store's own endpoint and topic; another engine then
// loads the prompt from it.
func TestFleetSharedRemoteEvents(t *testing.T) {
	f, err := StartFleet(2, ServerConfig{Engine: sim.Config{NumBlocks: 64}, TimeScale: 1000,
		KVRemote: sim.TierSize{Multiple: 4}, KVEvents: kvevents.PublisherConfig{Enable: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	pub, replay := f.Remote.KVEventEndpoints()
	if pub == "" || replay == "" || f.Servers[1].RemoteStore() != f.Remote {
		t.Fatalf("remote endpoints %q %q", pub, replay)
	}
	log := subscribeLog(t, pub, replay, DefaultRemoteTopic(testModel))
	ctx := context.Background()
	p := vocabTokens(1000, 96) // 6 blocks
	if _, err := completeTokens(t, ctx, f.URLs[0], p, 1); err != nil {
		t.Fatal(err)
	}
	remote := func(ev kvevents.Event) bool {
		return ev.Type == kvevents.BlockStored && ev.Medium == "REMOTE"
	}
	waitFor(t, "REMOTE events", func() bool {
		n := 0
		for _, ev := range log.find(remote) {
			n += len(ev.BlockHashes)
		}
		return n >= 6
	})
	for _, ev := range log.find(remote) {
		if len(ev.TokenIDs) != len(ev.BlockHashes)*16 {
			t.Fatalf("REMOTE event without its tokens: %+v", ev)
		}
	}
	u, err := completeTokens(t, ctx, f.URLs[1], p, 1)
	if err != nil || u.Cached() != 80 {
		t.Fatalf("engine 1: cached %d (%v), want 80 from the shared store", u.Cached(), err)
	}
	if st := f.Servers[1].Stats(); st.TierHits[sim.TierRemote] != 80 {
		t.Fatalf("engine 1 tier hits %v", st.TierHits)
	}
}
