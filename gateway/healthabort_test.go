package gateway

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
)

// frozenEngine freezes when a completion request reaches it, as a
// SIGSTOPped engine does: its kernel took the request, nothing answers it,
// and its health probes time out from then on.
type frozenEngine struct {
	srv     *httptest.Server
	frozen  atomic.Bool
	arrived chan struct{} // a completion request reached it
}

func newFrozenEngine(t *testing.T) *frozenEngine {
	e := &frozenEngine{arrived: make(chan struct{}, 16)}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
			if e.frozen.Load() {
				<-r.Context().Done() // the probe times out
			}
		case "/v1/chat/completions", "/v1/completions":
			_, _ = io.ReadAll(r.Body) // then the server notices the client leave
			e.frozen.Store(true)
			e.arrived <- struct{}{}
			<-r.Context().Done()
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(e.srv.Close)
	return e
}

// TestFrozenEngineRequestsAborted: requests waiting for the response
// headers of an engine that froze (non-streaming: the headers come with
// the whole answer, bounded only by response_header_timeout's 10 minutes;
// a stream before its headers) are aborted once its health probes fail
// health_check_abort_after times in a row, and complete on the other
// engine. Without the abort each waits the whole response_header_timeout
// (or first_event_timeout), far beyond await's 10 s.
func TestFrozenEngineRequestsAborted(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(map[bool]string{false: "non-streaming", true: "stream"}[stream], func(t *testing.T) {
			frozen, good := newFrozenEngine(t), newFakeEngine(t, "good")
			cfg := testConfig(sched.RoundRobin)
			cfg.HealthCheckTimeout = time.Second // the healthy engine must pass its probes on a loaded machine
			cfg.Endpoints = []EndpointConfig{{URL: frozen.srv.URL, Model: "m", KVBlocks: 1000}, {URL: good.URL(), Model: "m", KVBlocks: 1000}}
			cfg.Retry.BudgetPercent = 100
			_, url := startGateway(t, cfg)
			c := testClient(t)
			body := chatBody
			if stream {
				body = streamBody(false)
			}
			// Round-robin sends one of the first two requests to the engine
			// that then freezes.
			for i := 0; ; i++ {
				if i == 2 {
					t.Fatal("no request reached the frozen engine")
				}
				ch := sendAsync(context.Background(), c, url+pathChat, body)
				select {
				case <-frozen.arrived:
				case r := <-ch:
					if r.err != nil || r.status != 200 {
						t.Fatalf("request %d: %d %v %s", i, r.status, r.err, r.body)
					}
					continue
				}
				r := await(t, ch)
				if r.err != nil || r.status != 200 || !strings.Contains(string(r.body), "Hel") {
					t.Fatalf("request on the frozen engine: %d %v %s", r.status, r.err, r.body)
				}
				if a := r.header.Get(AttemptsHeader); a != "2" {
					t.Errorf("%s = %q, want 2", AttemptsHeader, a)
				}
				break
			}
			m := scrape(t, c, url)
			if v := m.value("infergate_retries_total", `reason="endpoint_down"`); v != 1 {
				t.Errorf(`infergate_retries_total{reason="endpoint_down"} = %v, want 1`, v)
			}
		})
	}
}

// TestFrozenEngineBurstRetried: a frozen engine's waiting requests are
// aborted together, more of them than the retry budget's minimum (3) and
// 20 %: all are retried on the healthy engine (the budget does not apply
// to an endpoint that left rotation; before, the excess got 502).
func TestFrozenEngineBurstRetried(t *testing.T) {
	const hung = 6 // requests the engine takes before it freezes
	var arrived atomic.Int64
	frozen := atomic.Bool{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
			if frozen.Load() {
				<-r.Context().Done()
			}
		case "/v1/chat/completions":
			_, _ = io.ReadAll(r.Body)
			if arrived.Add(1) >= hung {
				frozen.Store(true)
			}
			<-r.Context().Done()
		}
	}))
	defer srv.Close()
	good := newFakeEngine(t, "good")
	cfg := testConfig(sched.RoundRobin)
	cfg.HealthCheckTimeout = time.Second // the healthy engine must pass its probes on a loaded machine
	cfg.Endpoints = []EndpointConfig{{URL: srv.URL, Model: "m", KVBlocks: 1000}, {URL: good.URL(), Model: "m", KVBlocks: 1000}}
	_, url := startGateway(t, cfg)
	c := testClient(t)
	// Round-robin: every other request to the engine that freezes, until
	// it has taken hung of them.
	var chs []<-chan result
	for arrived.Load() < hung {
		chs = append(chs, sendAsync(context.Background(), c, url+pathChat, chatBody))
		for wait := time.Now().Add(10 * time.Second); len(chs) > int(arrived.Load())*2+2; { // paced with its arrivals
			if time.Now().After(wait) {
				t.Fatalf("%d sent, %d arrived", len(chs), arrived.Load())
			}
			time.Sleep(time.Millisecond)
		}
		if len(chs) > 100 {
			t.Fatal("the engine does not take its requests")
		}
	}
	retried := 0
	for i, ch := range chs {
		r := await(t, ch)
		if r.err != nil || r.status != 200 {
			t.Errorf("request %d: %d %v %s", i, r.status, r.err, r.body)
		}
		if r.header.Get(AttemptsHeader) == "2" {
			retried++
		}
	}
	if retried < hung {
		t.Errorf("%d requests retried, want at least %d", retried, hung)
	}
}
