package gateway

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/infergate/infergate/internal/ssetest"
	"github.com/infergate/infergate/sched"
)

// crStream is an engine's stream whose second half ends its lines with lone
// CRs (WHATWG HTML §9.2.5: a line end, as LF and CRLF): a token chunk, then
// a second token, the usage chunk (7 completion tokens) and [DONE], all of
// which an EventSource client reads as separate events.
const crStream = `data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}` + "\n\n" +
	`data: {"id":"c","choices":[{"index":0,"delta":{"content":"b"}}]}` + "\r\r" +
	`data: {"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}` + "\r\r" +
	"data: [DONE]\r\r\n\n"

// clientEvents is the data of the events an EventSource client reads of
// stream.
func clientEvents(stream []byte) []string {
	var out []string
	for _, e := range ssetest.Events(stream) {
		out = append(out, e.Data)
	}
	return out
}

// TestStreamLoneCR: the relay reads an engine's lone-CR line ends as a
// client does, so that what it accounts is what the client gets. Before,
// the three CR-ended events were one line to the gateway: relayed as one
// event whose lines a client split again into the second token, the usage
// chunk and [DONE] (a successful stream to the client), while the gateway
// saw no [DONE], appended an error event the client never read, accounted
// a 502 and none of the 7 completion tokens.
func TestStreamLoneCR(t *testing.T) {
	cfg := testConfig(sched.RoundRobin)
	cfg.HealthCheckPath, cfg.ScrapeInterval = healthCheckOff, -1
	cfg.Retry.MaxAttempts = 1
	cfg.Endpoints = []EndpointConfig{{URL: "http://10.0.0.1:8000", Model: "m", KVBlocks: 1000, MaxModelLen: 4096}}
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	g.rt = &bodyEngine{contentType: "text/event-stream", body: []byte(crStream)}
	req := httptest.NewRequest(http.MethodPost, pathChat, strings.NewReader(streamBody(true)))
	req.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	g.Handler().ServeHTTP(w, req)
	got := clientEvents(w.Body.Bytes())
	want := clientEvents([]byte(crStream))
	if w.Code != http.StatusOK || !slices.Equal(got, want) || !strings.HasSuffix(w.Body.String(), "data: [DONE]\n\n") {
		t.Errorf("status %d, the client reads %q; want 200 and %q", w.Code, got, want)
	}
	m := httptest.NewRecorder()
	g.Handler().ServeHTTP(m, httptest.NewRequest(http.MethodGet, pathMetrics, nil))
	metrics := scraped(strings.Split(m.Body.String(), "\n"))
	if v := metrics.value("infergate_generation_tokens_total", ""); v != 7 {
		t.Errorf("generation_tokens_total %v, want the 7 the client was told", v)
	}
	if v := metrics.value("infergate_requests_total", `code="200"`); v != 1 {
		t.Errorf("requests_total{code=200} %v, want 1", v)
	}
}

// TestEPPStreamLoneCR: a picked request's stream passes through the EPP's
// event splitter byte for byte; each piece it reads must be the one event a
// client reads there, so that [DONE] and the usage are the client's. Before,
// the CR-ended events were one block to the splitter: [DONE] unseen (the
// stream accounted 502) and the usage lost.
func TestEPPStreamLoneCR(t *testing.T) {
	g := eppFuzzGateway(t)
	for _, cut := range []int{0, 1, strings.Index(crStream, "\r\r") + 1, len(crStream) - 3} {
		body := `{"model":"m0","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`
		pk, ref := g.Pick(context.Background(), &PickRequest{Method: http.MethodPost, Path: pathChat, Header: http.Header{}, Body: []byte(body)})
		if ref != nil {
			t.Fatalf("refused: %d %s", ref.Status, ref.Body)
		}
		pk.ResponseHeaders(http.StatusOK, http.Header{"Content-Type": {"text/event-stream"}})
		out := append([]byte(nil), pk.ResponseBody([]byte(crStream[:cut]), false)...)
		out = append(out, pk.ResponseBody([]byte(crStream[cut:]), true)...)
		r := &pk.resp
		if string(out) != crStream || !r.sawDone || r.usage == nil || r.usage.CompletionTokens != 7 {
			t.Errorf("cut %d: passed on %q, [DONE] seen %v, usage %+v", cut, out, r.sawDone, r.usage)
		}
		pk.Done()
	}
}
