package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/simserver"
	"github.com/infergate/infergate/trace"
)

const mooncakeTrace = "../data/mooncake_conversation_trace.jsonl"

// Outcomes of a request in the chaos ledger.
const (
	outCompleted        = "completed"           // 200, whole stream, first attempt
	outRetriedCompleted = "retried+completed"   // 200, whole stream, after a retry
	outExplicitError    = "explicit error"      // an OpenAI error: status ≥ 400, or an error event then [DONE]
	outBroken           = "broken"              // anything else: a hang, a cut stream, a transport error
	outMissing          = "missing from ledger" // never recorded
)

// ledgerEntry is one request's fate.
type ledgerEntry struct {
	outcome    string
	status     int
	attempts   int
	detail     string
	start, end time.Time
	output     bool // output events reached the client
}

// ledger records the outcome of every request id exactly once.
type ledger struct {
	mu      sync.Mutex
	entries map[string]ledgerEntry
	dup     []string
}

func (l *ledger) record(id string, e ledgerEntry) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.entries[id]; ok {
		l.dup = append(l.dup, id)
	}
	l.entries[id] = e
}

// streamOutcome sends one streaming completion and classifies its answer.
func streamOutcome(ctx context.Context, c *http.Client, url, id string, body []byte) ledgerEntry {
	e := ledgerEntry{start: time.Now(), attempts: 1}
	defer func() { e.end = time.Now() }()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	resp, err := c.Do(req)
	if err != nil {
		e.outcome, e.detail, e.end = outBroken, err.Error(), time.Now()
		return e
	}
	defer resp.Body.Close()
	e.status = resp.StatusCode
	if n, err := strconv.Atoi(resp.Header.Get(AttemptsHeader)); err == nil {
		e.attempts = n
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		var er openai.ErrorResponse
		if json.Unmarshal(b, &er) == nil && er.Error != nil {
			e.outcome, e.detail = outExplicitError, er.Error.Message
		} else {
			e.outcome, e.detail = outBroken, fmt.Sprintf("status %d, not an OpenAI error: %q", resp.StatusCode, b)
		}
		e.end = time.Now()
		return e
	}
	er := openai.NewEventReader(resp.Body, 0)
	var chunk openai.StreamChunk
	failed := false
	for {
		data, err := er.Next()
		if err != nil {
			e.end = time.Now()
			switch {
			case !errors.Is(err, io.EOF) || !er.Done():
				e.outcome, e.detail = outBroken, fmt.Sprintf("stream cut without [DONE]: %v", err)
			case failed:
				e.outcome = outExplicitError
			case e.attempts > 1:
				e.outcome = outRetriedCompleted
			default:
				e.outcome = outCompleted
			}
			return e
		}
		chunk.Reset()
		_ = json.Unmarshal(data, &chunk)
		if chunk.IsError() {
			failed, e.detail = true, string(data)
		}
		if chunk.HasOutput() {
			e.output = true
		}
	}
}

// TestChaosKillEngine replays 500 Mooncake requests through the gateway in
// front of 4 simulated engines (100× real time) with 32 clients, and kills
// one engine halfway. Every request must end in success or an explicit
// error: only requests already streaming from the killed engine may fail
// (with an error event and [DONE]); the others, including those the dead
// engine had accepted but not started answering, complete elsewhere.
func TestChaosKillEngine(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos test in -short mode")
	}
	const (
		requests  = 500
		clients   = 32
		maxOutput = 200 // tokens per request: enough for streams to be mid-way at the kill
		// maxBlocks caps prompts at 4 Mooncake blocks (2,048 tokens), the
		// trace's prefix sharing kept: full prompts (~8k tokens of JSON
		// ids each) make the race-enabled run CPU-bound on 2 cores.
		maxBlocks = 4
		killAfter = requests / 2
		victim    = 1
	)
	recs, err := trace.LoadMooncake(mooncakeTrace)
	if err != nil {
		t.Fatal(err)
	}
	recs = recs[:requests]
	// The gateway's warnings, to explain a failed request by its id.
	lc := &logCapture{}
	prev := slog.Default()
	slog.SetDefault(slog.New(lc))
	defer slog.SetDefault(prev)
	for i := range recs {
		if len(recs[i].HashIDs) > maxBlocks {
			recs[i].HashIDs = recs[i].HashIDs[:maxBlocks]
			recs[i].InputLength = maxBlocks * trace.MooncakeBlockTokens
		}
	}
	f, err := simserver.StartFleet(4, simserver.ServerConfig{Model: "m", TimeScale: 50})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// No active health checks: requests, arriving every few milliseconds,
	// find the dead engine first (passive detection), and probes only add
	// false ejections of live engines when a saturated host makes them
	// time out (every engine ejected at load average 11). The ejection
	// (outlier.max_ejection_time's default, 5 minutes) outlasts the test.
	cfg := Config{EjectDuration: 5 * time.Minute, HealthCheckPath: "-"}
	// A quarter of the requests in flight fail at once when one engine of
	// four dies; the default budget (20%) would answer some of them 502
	// rather than retry them (README "Retries"). Those that fail once the
	// engine is ejected are outside the budget (TestRetryBudgetLostEndpoint),
	// the first few of the outage are not; at 50% one of them was denied on a
	// loaded host, where fewer requests were in flight at the kill. At 100%
	// a retry is never denied (each retrying request is itself admitted), so
	// the ledger does not depend on the host's load.
	cfg.Retry.BudgetPercent = 100
	for _, u := range f.URLs {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: u, Model: "m", KVBlocks: f.KVBlocks(),
			BlockSize: f.BlockSize(), Kind: fleet.Sim})
	}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	c.Timeout = 0 // the per-request deadline below bounds every request

	// A generous bound (the run takes ~10 s on a quiet host, over a
	// minute on a saturated one under the race detector).
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	l := &ledger{entries: map[string]ledgerEntry{}}
	var (
		next, done         atomic.Int64
		killStart, killEnd atomic.Pointer[time.Time]
		kill               = make(chan struct{})
		wg                 sync.WaitGroup
	)
	wg.Go(func() {
		select {
		case <-kill:
			t0 := time.Now()
			killStart.Store(&t0)
			f.Kill(victim)
			t1 := time.Now()
			killEnd.Store(&t1)
		case <-ctx.Done():
		}
	})
	for range clients {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= requests {
					return
				}
				rec := recs[i]
				rec.OutputLength = min(max(rec.OutputLength, 1), maxOutput)
				rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
				id := fmt.Sprintf("chaos-%03d", i)
				e := streamOutcome(rctx, c, url+pathCompletions, id, chaosBody(rec))
				rcancel()
				l.record(id, e)
				if done.Add(1) == killAfter {
					close(kill)
				}
			}
		})
	}
	wg.Wait()
	k0, k1 := killStart.Load(), killEnd.Load()
	if k0 == nil || k1 == nil {
		t.Fatal("the engine was never killed")
	}

	// Totals.
	counts := map[string]int{}
	var inFlightAtKill, startedAfter int
	for i := range requests {
		id := fmt.Sprintf("chaos-%03d", i)
		e, ok := l.entries[id]
		if !ok {
			e.outcome = outMissing
		}
		counts[e.outcome]++
		// In flight at the kill: started before it ended, ended after it
		// began.
		straddles := e.start.Before(*k1) && e.end.After(*k0)
		if straddles {
			inFlightAtKill++
		}
		if e.start.After(*k1) {
			startedAfter++
		}
		switch {
		case e.outcome == outBroken || e.outcome == outMissing:
			t.Errorf("%s: %s (status %d): %s", id, e.outcome, e.status, e.detail)
		case e.outcome == outExplicitError && !straddles:
			t.Errorf("%s: error though not in flight at the kill: %s", id, e.detail)
		case e.outcome == outExplicitError && (e.status != 200 || !e.output):
			t.Errorf("%s: failed before any output reached the client (status %d, %d attempts): should have been retried: %s\n%s",
				id, e.status, e.attempts, e.detail, lc.lines("request_id="+id))
		}
	}
	if len(l.dup) > 0 {
		t.Errorf("requests recorded twice: %v", l.dup)
	}
	total := counts[outCompleted] + counts[outRetriedCompleted] + counts[outExplicitError]
	if total != requests || len(l.entries) != requests {
		t.Errorf("ledger totals %v (%d entries) do not add up to %d sent", counts, len(l.entries), requests)
	}
	// Whether any request reaches the dead engine before it is ejected
	// (and is then retried) depends on timing: when the in-flight streams
	// break first, their consecutive errors eject it before a new pick. The
	// retry path itself is covered deterministically in resilience_test.go;
	// here every pre-first-byte failure must have been retried (above).
	m := scrape(t, c, url)
	retries := m.value("infergate_retries_total", "")
	if retries < float64(counts[outRetriedCompleted]) {
		t.Errorf("retries_total %v < %d retried requests", retries, counts[outRetriedCompleted])
	}
	if g.state.Load().endpoints[victim].ready.Load() {
		t.Error("the killed engine is still in rotation")
	}
	t.Logf("ledger: %d sent: %d completed, %d retried+completed, %d explicit errors (mid-stream); "+
		"%d in flight at the kill, %d started after it; retries_total %v, denied %v (budget) %v (no endpoint), ejections %v",
		requests, counts[outCompleted], counts[outRetriedCompleted], counts[outExplicitError],
		inFlightAtKill, startedAfter, retries, m.value("infergate_retries_denied_total", `reason="budget"`),
		m.value("infergate_retries_denied_total", `reason="no_endpoint"`), m.value("infergate_endpoint_ejections_total", ""))
}

// chaosBody renders rec as a streaming token-id completion (bench's request
// shape).
func chaosBody(rec trace.Record) []byte {
	tokens := rec.Tokens(make([]uint32, 0, rec.InputLength))
	b := make([]byte, 0, 7*len(tokens)+128)
	b = append(b, `{"model":"m","prompt":[`...)
	for i, tok := range tokens {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(tok), 10)
	}
	b = append(b, `],"max_tokens":`...)
	b = strconv.AppendInt(b, int64(rec.OutputLength), 10)
	return append(b, `,"stream":true,"stream_options":{"include_usage":true},"ignore_eos":true}`...)
}
