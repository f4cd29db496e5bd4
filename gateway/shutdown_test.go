package gateway

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

// Tests of Drain and Abort (shutdown.go). Like the resilience tests they
// assert outcomes and counts, never timings.

// checkShutdownError checks that an answer is the 503 shutting_down error.
func checkShutdownError(t *testing.T, what string, r result) {
	t.Helper()
	if r.err != nil {
		t.Fatalf("%s: %v", what, r.err)
	}
	if r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") != shutdownRetryAfter {
		t.Fatalf("%s: %d Retry-After=%q %s, want 503 with Retry-After %s", what, r.status, r.header.Get("Retry-After"), r.body, shutdownRetryAfter)
	}
	if e := decodeError(t, r.body); codeStr(e.Code) != codeShuttingDown || e.Type != "service_unavailable_error" {
		t.Errorf("%s: error %+v, want code %s", what, e, codeShuttingDown)
	}
}

// Drain answers the requests waiting in the admission queue 503 at once,
// and every request arriving after it (here on a kept-alive connection)
// without queueing it; the request in flight runs to its end.
func TestShutdownDrainAnswersQueued(t *testing.T) {
	q := queueSetup(t, AdmissionConfig{})
	p := q.g.state.Load().pools["m"]
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	queued := sendAsync(ctx, q.c, q.url+pathChat, chatBody, "X-Request-Id", "queued", PriorityHeader, "3")
	waitFor(t, "queued", func() bool { return p.gate.waiting.Load() == 1 })

	q.g.Drain()
	r := await(t, queued)
	checkShutdownError(t, "queued request at Drain", r)
	select {
	case r := <-q.blocker:
		t.Fatalf("the request in flight was ended by Drain: %d %s", r.status, r.body)
	default:
	}
	checkShutdownError(t, "request after Drain", await(t, sendAsync(ctx, q.c, q.url+pathChat, chatBody, "X-Request-Id", "late")))
	// The refusal closes the connection (the client should go elsewhere).
	resp, _ := rawRequest(t, strings.TrimPrefix(q.url, "http://"), "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"+
		"Content-Type: application/json\r\nContent-Length: "+strconv.Itoa(len(chatBody))+"\r\n\r\n"+chatBody)
	if resp.StatusCode != http.StatusServiceUnavailable || !resp.Close {
		t.Errorf("after Drain: %d, Connection: close %v; want 503 and close", resp.StatusCode, resp.Close)
	}
	if n := p.gate.waiting.Load(); n != 0 {
		t.Errorf("%d queued after Drain", n)
	}
	if resp, body := get(t, q.c, q.url+pathReadyz); resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "shutting down") {
		t.Errorf("/readyz while draining: %d %s", resp.StatusCode, body)
	}

	close(q.release)
	if r := await(t, q.blocker); r.status != http.StatusOK {
		t.Errorf("the request in flight: %d %s", r.status, r.body)
	}
	if n := q.e.requests.Load(); n != 1 {
		t.Errorf("the engine saw %d requests, want only the one in flight", n)
	}
	m := scrape(t, q.c, q.url)
	if v := m.value("infergate_admission_rejections_total", `reason="shutdown"`); v != 3 {
		t.Errorf("rejections{shutdown} = %v, want 3", v)
	}
	if v := m.value("infergate_requests_total", `code="503"`); v != 3 {
		t.Errorf("requests_total{503} = %v, want 3", v)
	}
	if a := p.gate; a.active.Load() != 0 || a.pending.Load() != 0 {
		t.Errorf("admission holds %d in flight, %d pending", a.active.Load(), a.pending.Load())
	}
}

// get fetches url.
func get(t *testing.T, c *http.Client, url string) (*http.Response, []byte) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// shutdownEngine answers by X-Request-Id, each time holding the request
// until it is canceled (then sending its id on canceled): "pending" sends
// nothing, "first-event-pending" only an SSE header, "mid-stream" an SSE
// header and one event, "mid-body" a JSON header (Content-Length 1 MiB) and
// the first 16 KiB of the body (which the gateway holds: it writes a
// non-streaming answer at its end).
func shutdownEngine(canceled chan<- string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get("X-Request-Id")
		rc := http.NewResponseController(w)
		switch id {
		case "first-event-pending", "mid-stream":
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			if id == "mid-stream" {
				_, _ = io.WriteString(w, `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}`+"\n\n")
			}
			_ = rc.Flush()
		case "mid-body":
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Content-Length", strconv.Itoa(1<<20))
			_, _ = io.WriteString(w, `{"id":"`+strings.Repeat("x", 16<<10))
			_ = rc.Flush()
		case "pending":
		default:
			okJSON(w, r)
			return
		}
		<-r.Context().Done()
		canceled <- id
	}
}

// serveHandler serves g on loopback: with g's BaseContext, as Server does,
// or (base false) as a plain handler, whose requests Abort reaches one by
// one.
func serveHandler(t testing.TB, g *Gateway, base bool) string {
	t.Helper()
	srv := httptest.NewUnstartedServer(g.Handler())
	if base {
		srv.Config.BaseContext = g.BaseContext
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL
}

// shutdownOutcomes are the answers of the four requests of shutdownEngine
// in flight at Abort.
type shutdownOutcomes struct {
	pending, firstEvent, midBody result
	stream                       string // the whole stream as the client read it
	streamErr                    error
}

// abortInFlight sends the four requests of shutdownEngine through the
// gateway at url, calls g.Abort once all are in flight (the stream's first
// event having reached the client, the body's first bytes the gateway), and
// returns what the clients got.
func abortInFlight(t *testing.T, g *Gateway, e *funcEngine, url string, c *http.Client) shutdownOutcomes {
	t.Helper()
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	pending := sendAsync(ctx, c, url+pathChat, chatBody, "X-Request-Id", "pending")
	firstEvent := sendAsync(ctx, c, url+pathChat, streamBody(false), "X-Request-Id", "first-event-pending")
	midBody := sendAsync(ctx, c, url+pathChat, chatBody, "X-Request-Id", "mid-body")

	started := make(chan struct{}, 1)
	type streamResult struct {
		text string
		err  error
	}
	streamDone := make(chan streamResult, 1)
	do := func(body, id string) (*http.Response, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+pathChat, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Request-Id", id)
		return c.Do(req)
	}
	go func() {
		resp, err := do(streamBody(false), "mid-stream")
		if err != nil {
			started <- struct{}{}
			streamDone <- streamResult{err: err}
			return
		}
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		first, err := br.ReadString('\n') // the relayed event
		started <- struct{}{}
		if err != nil {
			streamDone <- streamResult{text: first, err: err}
			return
		}
		rest, err := io.ReadAll(br)
		streamDone <- streamResult{text: first + string(rest), err: err}
	}()
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the stream did not start in 10s")
	}
	waitFor(t, "four requests at the engine", func() bool { return e.cur.Load() == 4 })

	g.Abort()
	var out shutdownOutcomes
	out.pending, out.firstEvent, out.midBody = await(t, pending), await(t, firstEvent), await(t, midBody)
	select {
	case s := <-streamDone:
		out.stream, out.streamErr = s.text, s.err
	case <-time.After(10 * time.Second):
		t.Fatal("the stream did not end in 10s")
	}
	return out
}

// Abort ends every request in flight explicitly: those still waiting for
// the engine's answer get a 503 JSON error, a started stream an error event
// and [DONE] (a body the engine had begun is held by the gateway, so it is
// a 503 too); each upstream request
// is canceled, the engine is not blamed, and the metrics count 503s.
func TestShutdownAbortInFlight(t *testing.T) {
	for _, base := range []bool{true, false} {
		name := "base-context"
		if !base {
			name = "plain-handler"
		}
		t.Run(name, func(t *testing.T) {
			canceled := make(chan string, 8)
			e := newFuncEngine(t, shutdownEngine(canceled))
			g, err := New(context.Background(), resilienceConfig(sched.RoundRobin, e.URL()), nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(g.Close)
			url := serveHandler(t, g, base)
			c := testClient(t)
			out := abortInFlight(t, g, e, url, c)

			checkShutdownError(t, "header pending", out.pending)
			checkShutdownError(t, "first event pending", out.firstEvent)

			if out.streamErr != nil {
				t.Fatalf("stream: %v (read %q)", out.streamErr, out.stream)
			}
			events := strings.Split(strings.TrimSuffix(out.stream, "\n\n"), "\n\n")
			if len(events) != 3 || !strings.Contains(events[0], `"Hel"`) || events[2] != "data: [DONE]" {
				t.Fatalf("stream: want the event, an error event and [DONE]; got %q", out.stream)
			}
			var ev struct{ Error *openai.Error }
			if err := json.Unmarshal([]byte(strings.TrimPrefix(events[1], "data: ")), &ev); err != nil || ev.Error == nil ||
				codeStr(ev.Error.Code) != codeShuttingDown {
				t.Errorf("stream's error event %q, want code %s", events[1], codeShuttingDown)
			}

			checkShutdownError(t, "body begun at the engine", out.midBody)

			got := map[string]bool{}
			for range 4 {
				select {
				case id := <-canceled:
					got[id] = true
				case <-time.After(10 * time.Second):
					t.Fatalf("the engine saw only %v canceled", got)
				}
			}
			if !g.state.Load().endpoints[0].ready.Load() {
				t.Error("the endpoint was ejected for requests the shutdown ended")
			}
			waitFor(t, "nothing in flight", func() bool {
				return g.state.Load().endpoints[0].ledger.InFlight() == 0 && g.state.Load().pools["m"].gate.active.Load() == 0
			})
			m := scrape(t, c, url)
			if v := m.value("infergate_requests_total", `code="503"`); v != 4 {
				t.Errorf("requests_total{503} = %v, want 4", v)
			}
			for _, code := range []string{"499", "502"} {
				if v := m.value("infergate_requests_total", `code="`+code+`"`); v != 0 {
					t.Errorf("requests_total{%s} = %v, want 0", code, v)
				}
			}
			// After Abort, as after Drain, new requests are refused.
			checkShutdownError(t, "request after Abort", await(t, sendAsync(context.Background(), c, url+pathChat, chatBody)))
		})
	}
}

// Requests served before and ended by Abort leave no goroutine behind, on
// both ways of serving (the plain handler ties each request to Abort).
func TestShutdownNoGoroutineLeak(t *testing.T) {
	before := settledGoroutines()
	for _, base := range []bool{true, false} {
		func() {
			canceled := make(chan string, 8)
			e := &funcEngine{}
			h := shutdownEngine(canceled)
			e.srv = newServerNoCleanup(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				e.cur.Add(1)
				defer e.cur.Add(-1)
				h(w, r)
			}))
			defer e.srv.Close()
			g, err := New(context.Background(), resilienceConfig(sched.RoundRobin, e.URL()), nil)
			if err != nil {
				t.Fatal(err)
			}
			defer g.Close()
			srv := httptest.NewUnstartedServer(g.Handler())
			if base {
				srv.Config.BaseContext = g.BaseContext
			}
			srv.Start()
			defer srv.Close()
			tr := &http.Transport{}
			defer tr.CloseIdleConnections()
			c := &http.Client{Transport: tr}
			for range 3 { // finished before the shutdown
				if resp, body := post(t, c, srv.URL+pathChat, chatBody); resp.StatusCode != 200 {
					t.Fatalf("%d %s", resp.StatusCode, body)
				}
			}
			abortInFlight(t, g, e, srv.URL, c)
			for range 4 {
				<-canceled
			}
		}()
	}
	requireGoroutinesBack(t, before)
}

// X-Priority must be a plain integer: anything else is a 400 naming the
// header, answered before admission (here a valid request would queue
// behind the one holding the only slot).
func TestPriorityHeaderInvalid(t *testing.T) {
	q := queueSetup(t, AdmissionConfig{})
	p := q.g.state.Load().pools["m"]
	send := func(values ...string) <-chan result {
		var hdr []string
		for _, v := range values {
			hdr = append(hdr, PriorityHeader, v)
		}
		return sendAsync(context.Background(), q.c, q.url+pathChat, chatBody, hdr...)
	}
	for _, values := range [][]string{{"abc"}, {"1.5"}, {"99999999999999999999"}, {"1", "2"}, {"1, 2"}, {"0x10"}, {"", "3"}} {
		r := await(t, send(values...))
		if r.status != http.StatusBadRequest {
			t.Errorf("X-Priority %q: %d %s, want 400", values, r.status, r.body)
			continue
		}
		e := decodeError(t, r.body)
		if e.Type != "invalid_request_error" || str(e.Param) != PriorityHeader || codeStr(e.Code) != openai.CodeInvalidValue ||
			!strings.Contains(e.Message, PriorityHeader) {
			t.Errorf("X-Priority %q: error %+v", values, e)
		}
	}
	if n := p.gate.waiting.Load(); n != 0 {
		t.Errorf("%d invalid requests queued", n)
	}
	// Valid: an integer, the same value twice, an empty value (as absent);
	// they queue.
	var valid []<-chan result
	for i, values := range [][]string{{"-7"}, {"+4", "+4"}, {""}} {
		valid = append(valid, send(values...))
		waitFor(t, "queued", func() bool { return p.gate.waiting.Load() == int64(i+1) })
	}
	close(q.release)
	for _, ch := range append(valid, q.blocker) {
		if r := await(t, ch); r.status != http.StatusOK {
			t.Errorf("valid priority: %d %s", r.status, r.body)
		}
	}
	if v := scrape(t, q.c, q.url).value("infergate_requests_total", `code="400"`); v != 7 {
		t.Errorf("requests_total{400} = %v, want 7", v)
	}
}
