package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/simserver"
)

// TestSoakStreaming is a benchmark, not a unit test: it runs only when
// INFERGATE_SOAK is set to a duration, e.g.
//
//	INFERGATE_SOAK=60s go test -run Soak -v ./gateway
//
// It holds a steady streaming load (INFERGATE_SOAK_CLIENTS closed-loop
// clients, default 20) on the gateway in front of an `infergate up`-like
// fleet (4 simulated engines in real time, KV events on, the default
// precise-prefix policy, chat prompts tokenized by the gateway) and samples
// the process's goroutines and heap every second, reporting start, end and
// maximum. The process holds clients, gateway and engines together.
func TestSoakStreaming(t *testing.T) {
	env := os.Getenv("INFERGATE_SOAK")
	if env == "" {
		t.Skip("set INFERGATE_SOAK=60s to run the soak benchmark")
	}
	d, err := time.ParseDuration(env)
	if err != nil || d <= 0 {
		t.Fatalf("INFERGATE_SOAK=%q: want a positive duration", env)
	}
	clients := 20
	if v := os.Getenv("INFERGATE_SOAK_CLIENTS"); v != "" {
		if clients, err = strconv.Atoi(v); err != nil || clients < 1 {
			t.Fatalf("INFERGATE_SOAK_CLIENTS=%q", v)
		}
	}

	f, err := simserver.StartFleet(4, simserver.ServerConfig{Model: "m", TimeScale: 1, KVEvents: kvevents.PublisherConfig{Enable: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	pub, replay := f.KVEventEndpoints()
	var cfg Config
	for i, u := range f.URLs {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: u, Model: "m", KVBlocks: f.KVBlocks(),
			BlockSize: f.BlockSize(), Kind: fleet.Sim, KVEvents: &KVEventsConfig{Endpoint: pub[i], ReplayEndpoint: replay[i]}})
	}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	c.Timeout = 0

	type sample struct {
		goroutines int
		heap       uint64 // HeapAlloc, bytes
	}
	take := func() sample {
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return sample{runtime.NumGoroutine(), ms.HeapAlloc}
	}
	settle := func() sample {
		c.CloseIdleConnections()    // client → gateway keep-alives
		g.up.CloseIdleConnections() // gateway → engine keep-alives (and the transport's)
		time.Sleep(100 * time.Millisecond)
		runtime.GC()
		return take()
	}
	idle := settle()

	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var (
		ok, failed atomic.Int64
		firstErr   atomic.Value
		wg         sync.WaitGroup
	)
	systems := []string{
		strings.Repeat("You are a careful assistant who answers in full sentences. ", 30),
		strings.Repeat("You are a terse code reviewer; point out bugs first. ", 40),
		strings.Repeat("Translate the user's text into French, keeping the tone. ", 20),
	}
	for w := range clients {
		wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 64, "stream": true,
					"messages": []map[string]string{
						{"role": "system", "content": systems[(w+i)%len(systems)]},
						{"role": "user", "content": fmt.Sprintf("Question %d from client %d: what should I check next?", i, w)}}})
				e := streamOutcome(ctx, c, url+pathChat, fmt.Sprintf("soak-%d-%d", w, i), body)
				switch {
				case e.outcome == outCompleted || e.outcome == outRetriedCompleted:
					ok.Add(1)
				case ctx.Err() != nil: // cut by the end of the soak
				default:
					failed.Add(1)
					firstErr.CompareAndSwap(nil, fmt.Sprintf("%s: %s", e.outcome, e.detail))
				}
			}
		})
	}

	// Samples once a second under load, the last a second before the load
	// ends: first, last and maximum.
	start := time.Now()
	var first, last, maxS sample
	tick := time.NewTicker(time.Second)
	for n := range max(1, int(d/time.Second)-1) {
		<-tick.C
		last = take()
		if n == 0 {
			first = last
		}
		maxS.goroutines = max(maxS.goroutines, last.goroutines)
		maxS.heap = max(maxS.heap, last.heap)
	}
	tick.Stop()
	<-ctx.Done()
	wg.Wait()
	elapsed := time.Since(start)

	// After the load, with keep-alive connections closed: back to the idle
	// goroutine count (no leak), give or take the health probes' and
	// scrapes' connections (3 goroutines each, client and server side),
	// which reopen on their own schedule.
	slack := 6 * len(f.URLs)
	deadline := time.Now().Add(10 * time.Second)
	after := settle()
	for after.goroutines > idle.goroutines+slack && time.Now().Before(deadline) {
		after = settle()
	}
	mb := func(b uint64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }
	t.Logf("soak %v, %d streaming clients: %d streams completed (%.1f/s), %d failed",
		elapsed.Round(time.Second), clients, ok.Load(), float64(ok.Load())/elapsed.Seconds(), failed.Load())
	t.Logf("goroutines: idle %d, start %d, end %d, max %d, after (settled) %d",
		idle.goroutines, first.goroutines, last.goroutines, maxS.goroutines, after.goroutines)
	t.Logf("heap in use (HeapAlloc): idle %s, start %s, end %s, max %s, after GC %s",
		mb(idle.heap), mb(first.heap), mb(last.heap), mb(maxS.heap), mb(after.heap))
	if n := failed.Load(); n > 0 {
		t.Errorf("%d streams failed; first: %v", n, firstErr.Load())
	}
	if after.goroutines > idle.goroutines+slack {
		buf := make([]byte, 1<<20)
		t.Errorf("goroutines did not return to idle: %d > %d\n%s", after.goroutines, idle.goroutines, buf[:runtime.Stack(buf, true)])
	}
	for _, ep := range g.state.Load().endpoints {
		if n := ep.ledger.InFlight(); n != 0 {
			t.Errorf("%s: %d in flight after the soak", ep.name, n)
		}
	}
}
