package epp

import (
	"bytes"
	"context"
	"encoding/json"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/sched"
)

// TestStreamedBodySplits drives requests whose bodies arrive split at odd
// offsets (1 byte, around the chunk size, random): the pick is answered in
// the header and the metadata with the same value, one of the endpoints,
// and the body is echoed byte for byte in chunks of at most 62,000 bytes.
func TestStreamedBodySplits(t *testing.T) {
	urls := startEngines(t, 3)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{})
	addrs := make([]string, len(urls))
	for i, u := range urls {
		addrs[i] = addrOf(u)
	}
	big := chatBody(200_000, "big")
	small := chatBody(600, "small")
	rng := rand.New(rand.NewPCG(1, 2))
	random := func(n, k int) []int {
		cuts := make([]int, k)
		for i := range cuts {
			cuts[i] = rng.IntN(n)
		}
		slices.Sort(cuts)
		return cuts
	}
	every := func(n int) []int {
		cuts := make([]int, n)
		for i := range cuts {
			cuts[i] = i
		}
		return cuts
	}
	cases := []struct {
		name string
		body []byte
		cuts []int
	}{
		{"whole", big, nil},
		{"1-byte-pieces", small, every(len(small))},
		{"at-61999", big, []int{61999}},
		{"at-62000", big, []int{62000}},
		{"at-62001", big, []int{62001, 124002}},
		{"first-byte", big, []int{1}},
		{"random", big, random(len(big), 17)},
		{"empty-last-piece", big, []int{len(big)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := tp.open(t)
			s.headers("POST", "/v1/chat/completions", false, nil)
			s.body(tc.body, true, tc.cuts...)
			h, md, cl, body := s.routed(true)
			if h == "" || h != md {
				t.Fatalf("header %q, metadata %q: want the same non-empty value", h, md)
			}
			if !slices.Contains(addrs, h) {
				t.Fatalf("destination %q is none of %v", h, addrs)
			}
			if cl != "" {
				t.Errorf("Content-Length set (%s) for an unchanged body", cl)
			}
			if !bytes.Equal(body, tc.body) {
				t.Fatalf("body echoed: %d bytes, want the %d sent", len(body), len(tc.body))
			}
			s.responseHeaders("200", "application/json", h, false)
			if r := s.recv(); r.GetResponseHeaders() == nil {
				t.Fatalf("want a response-headers response, got %v", r)
			}
			usage := []byte(`{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":100,"completion_tokens":2,"total_tokens":102}}`)
			s.responseBody(usage, true, 7, 8, 50)
			var got []byte
			for len(got) < len(usage) {
				r := s.recv()
				sr := r.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
				if sr == nil {
					t.Fatalf("want a response body chunk, got %v", r)
				}
				got = append(got, sr.GetBody()...)
			}
			if !bytes.Equal(got, usage) {
				t.Fatalf("response echoed %q, want %q", got, usage)
			}
			waitFor(t, "in-flight back to 0", func() bool { return tp.inFlight(t) == 0 })
		})
	}
	if n := tp.gauge(t, "infergate_prompt_tokens_total"); n < 100 {
		t.Errorf("prompt tokens accounted: %v, want the usage's", n)
	}
}

// TestHeadersOnly picks a request without body at once.
func TestHeadersOnly(t *testing.T) {
	urls := startEngines(t, 2)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{})
	s := tp.open(t)
	s.headers("GET", "/v1/models", true, nil)
	h, md, _, _ := s.routed(false)
	if h == "" || h != md || (h != addrOf(urls[0]) && h != addrOf(urls[1])) {
		t.Fatalf("header %q metadata %q", h, md)
	}
	s.responseHeaders("200", "application/json", h, false)
	s.recv()
	s.responseBody([]byte(`{"data":[]}`), true)
	if b := s.bodyChunks(func(r *extprocv3.ProcessingResponse) *extprocv3.BodyResponse { return r.GetResponseBody() }); string(b) != `{"data":[]}` {
		t.Fatalf("echo %q", b)
	}
}

// subsetMD is the proxy's subset hint.
func subsetMD(list ...string) *corev3.Metadata {
	vals := make([]*structpb.Value, len(list))
	for i, s := range list {
		vals[i] = structpb.NewStringValue(s)
	}
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{SubsetNamespace: {Fields: map[string]*structpb.Value{
		SubsetKey: structpb.NewListValue(&structpb.ListValue{Values: vals})}}}}
}

// TestSubsetHint: the pick is within the hint; an empty hint, or one of
// no known endpoint, is a 503.
func TestSubsetHint(t *testing.T) {
	urls := startEngines(t, 4)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{})
	for i := range 8 {
		want := addrOf(urls[i%4])
		s := tp.open(t)
		s.headers("POST", "/v1/chat/completions", false, subsetMD(want, "10.255.255.1:80"))
		s.body(chatBody(100, "subset"), true)
		if h, md, _, _ := s.routed(true); h != want || md != want {
			t.Fatalf("subset {%s}: picked %q / %q", want, h, md)
		}
	}
	for name, md := range map[string]*corev3.Metadata{"empty": subsetMD(), "ineligible": subsetMD("10.255.255.1:8000", "192.0.2.1:80")} {
		s := tp.open(t)
		s.headers("POST", "/v1/chat/completions", false, md)
		s.body(chatBody(100, "subset"), true)
		code, body := s.immediate()
		if code != 503 || !strings.Contains(body, `"code":"no_endpoint_available"`) {
			t.Errorf("%s subset: %d %s, want 503 no_endpoint_available", name, code, body)
		}
	}
	// A headers-only request honours the hint as well.
	s := tp.open(t)
	s.headers("GET", "/v1/models", true, subsetMD(addrOf(urls[2])))
	if h, _, _, _ := s.routed(false); h != addrOf(urls[2]) {
		t.Fatalf("headers-only with a subset: %q", h)
	}
}

// TestNoEndpoint503: engines down, every request is a 503 in OpenAI's
// error format.
func TestNoEndpoint503(t *testing.T) {
	cfg := testConfig(sched.Prefix, deadURL)
	tp := startPicker(t, cfg, Options{})
	s := tp.open(t)
	s.headers("POST", "/v1/chat/completions", false, nil)
	s.body(chatBody(50, "x"), true)
	code, body := s.immediate()
	var e struct {
		Error struct{ Code, Message string }
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil || code != 503 || e.Error.Code != "no_endpoint_available" {
		t.Fatalf("%d %s (%v)", code, body, err)
	}
}

// TestShed429: admission with no queue and one slot: a second request
// while the first is in flight is shed with 429; once the first ends, a
// third is picked.
func TestShed429(t *testing.T) {
	urls := startEngines(t, 1)
	cfg := testConfig(sched.Prefix, urls...)
	cfg.Admission.MaxInFlight, cfg.Admission.MaxQueue = 1, -1
	tp := startPicker(t, cfg, Options{})
	first := tp.open(t)
	first.headers("POST", "/v1/chat/completions", false, nil)
	first.body(chatBody(50, "a"), true)
	first.routed(true)
	second := tp.open(t)
	second.headers("POST", "/v1/chat/completions", false, nil)
	second.body(chatBody(50, "b"), true)
	if code, body := second.immediate(); code != 429 || !strings.Contains(body, "rate_limit_exceeded") {
		t.Fatalf("second: %d %s, want 429", code, body)
	}
	first.responseHeaders("200", "application/json", "", false)
	first.recv()
	first.responseBody([]byte(`{"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`), true)
	first.bodyChunks(func(r *extprocv3.ProcessingResponse) *extprocv3.BodyResponse { return r.GetResponseBody() })
	waitFor(t, "in-flight back to 0", func() bool { return tp.inFlight(t) == 0 })
	third := tp.open(t)
	third.headers("POST", "/v1/chat/completions", false, nil)
	third.body(chatBody(50, "c"), true)
	third.routed(true)
}

// TestBodyTooLarge413: a body over max_body_bytes is answered 413 as soon
// as it is over, whatever the proxy sends after.
func TestBodyTooLarge413(t *testing.T) {
	urls := startEngines(t, 1)
	cfg := testConfig(sched.Prefix, urls...)
	cfg.MaxBodyBytes = 4096
	tp := startPicker(t, cfg, Options{})
	s := tp.open(t)
	s.headers("POST", "/v1/chat/completions", false, nil)
	b := chatBody(10_000, "x")
	s.body(b[:3000], false)
	s.body(b[3000:6000], false)
	code, body := s.immediate()
	if code != 413 || !strings.Contains(body, "request_too_large") {
		t.Fatalf("%d %s", code, body)
	}
	s.body(b[6000:], true) // the rest, ignored
	if tp.srv.Buffered() != 0 {
		t.Fatalf("buffered %d after a refusal", tp.srv.Buffered())
	}
}

// TestStreamUsage: a streaming request without include_usage gets it
// (Content-Length set for the changed body); the engine's SSE answer,
// split at odd offsets, is echoed without the usage-only chunk the client
// did not ask for, and its usage, TTFT and ITL are accounted.
func TestStreamUsage(t *testing.T) {
	urls := startEngines(t, 2)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{})
	s := tp.open(t)
	s.headers("POST", "/v1/chat/completions", false, nil)
	req := []byte(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hello there"}]}`)
	s.body(req, true, 5)
	h, _, cl, body := s.routed(true)
	if !bytes.Contains(body, []byte(`"include_usage":true`)) || cl != strconv.Itoa(len(body)) {
		t.Fatalf("body %s, Content-Length %q", body, cl)
	}
	s.responseHeaders("200", "text/event-stream", h, false)
	s.recv()
	chunk := func(c string) string {
		return `data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"` + c + `"}}]}` + "\n\n"
	}
	usage := `data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":11,"completion_tokens":3,"total_tokens":14}}` + "\n\n"
	sse := chunk("a") + chunk("b") + chunk("c") + usage + "data: [DONE]\n\n"
	s.responseBody([]byte(sse), true, 1, 30, 131, 132, len(sse)-3)
	got := s.bodyChunks(func(r *extprocv3.ProcessingResponse) *extprocv3.BodyResponse { return r.GetResponseBody() })
	if want := chunk("a") + chunk("b") + chunk("c") + "data: [DONE]\n\n"; string(got) != want {
		t.Fatalf("echoed\n%q\nwant\n%q", got, want)
	}
	waitFor(t, "in-flight back to 0", func() bool { return tp.inFlight(t) == 0 })
	if n := tp.gauge(t, "infergate_generation_tokens_total"); n != 3 {
		t.Errorf("generated tokens %v, want 3", n)
	}
	if n := tp.gauge(t, "infergate_time_to_first_token_seconds"); n != 1 {
		t.Errorf("TTFT observations %v, want 1", n)
	}
	if n := tp.gauge(t, "infergate_inter_token_latency_seconds"); n != 2 {
		t.Errorf("ITL observations %v, want 2", n)
	}
}

// TestClientGoesAway: streams that end mid-body, after the pick, and
// mid-answer release what they took; no goroutine is left behind.
func TestClientGoesAway(t *testing.T) {
	urls := startEngines(t, 2)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{})
	warm := tp.open(t) // the connection's goroutines are there before the count
	warm.headers("GET", "/v1/models", true, nil)
	warm.routed(false)
	warm.cancel()
	waitFor(t, "the warm-up stream ended", func() bool { return tp.gauge(t, "infergate_epp_streams") == 0 })
	before := liveGoroutines()
	for _, stage := range []string{"mid-body", "after-pick", "mid-answer"} {
		s := tp.open(t)
		s.headers("POST", "/v1/chat/completions", false, nil)
		b := chatBody(100_000, stage)
		if stage == "mid-body" {
			s.body(b[:70_000], false)
		} else {
			s.body(b, true)
			s.routed(true)
			if tp.inFlight(t) != 1 {
				t.Fatalf("%s: in flight %v, want 1", stage, tp.inFlight(t))
			}
		}
		if stage == "mid-answer" {
			s.responseHeaders("200", "text/event-stream", "", false)
			s.recv()
			s.responseBody([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: {\"cho"), false)
		}
		s.cancel()
		waitFor(t, stage+": in-flight and buffers released", func() bool {
			return tp.inFlight(t) == 0 && tp.srv.Buffered() == 0 && tp.gauge(t, "infergate_epp_streams") == 0
		})
	}
	requireGoroutinesBack(t, before, 2)
}

// TestHealth: the gRPC health services.
func TestHealth(t *testing.T) {
	urls := startEngines(t, 1)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{})
	conn, err := grpc.NewClient(tp.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	for _, svc := range []string{"", LivenessService, ReadinessService, ServiceName} {
		r, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("service %q: %v %v", svc, r, err)
		}
	}
	// No endpoint ready: not ready, still live.
	down := startPicker(t, testConfig(sched.Prefix, deadURL), Options{})
	h := NewHealth(down.g)
	if h.Ready() {
		t.Fatal("ready without endpoints")
	}
	r, _ := h.srv.Check(context.Background(), &healthpb.HealthCheckRequest{Service: ReadinessService})
	l, _ := h.srv.Check(context.Background(), &healthpb.HealthCheckRequest{Service: LivenessService})
	if r.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING || l.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("readiness %v, liveness %v", r.GetStatus(), l.GetStatus())
	}
}

// TestConformanceHooks: test-epp-endpoint-selection steers the pick and
// the served endpoint is reported in x-conformance-test-served-endpoint;
// without the hooks the header is ignored.
func TestConformanceHooks(t *testing.T) {
	urls := startEngines(t, 3)
	cfg := testConfig(sched.Prefix, urls...)
	cfg.EPP.ConformanceTestHooks = true
	tp := startPicker(t, cfg, Options{})
	want := addrOf(urls[1])
	ip := strings.Split(want, ":")[0]
	for _, sel := range []string{want, want + ",192.0.2.9"} {
		s := tp.open(t)
		s.headers("POST", "/v1/chat/completions", false, nil, TestSelectionHeader, sel)
		s.body(chatBody(100, sel), true)
		if h, _, _, _ := s.routed(true); h != want {
			t.Fatalf("selection %q: picked %q", sel, h)
		}
		s.responseHeaders("200", "application/json", want, false)
		rh := s.recv().GetResponseHeaders()
		got := map[string]string{}
		for _, h := range rh.GetResponse().GetHeaderMutation().GetSetHeaders() {
			got[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
		}
		if got[TestServedHeader] != want || got[TestSelectedHeader] != want {
			t.Fatalf("response headers %v", got)
		}
	}
	_ = ip // an IP alone selects every port of it: all three engines share 127.0.0.1
	// Served metadata missing: the conformance header says so.
	s := tp.open(t)
	s.headers("GET", "/v1/models", true, nil)
	s.routed(false)
	s.responseHeaders("200", "application/json", "", false)
	for _, h := range s.recv().GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == TestServedHeader && !strings.HasPrefix(string(h.GetHeader().GetRawValue()), "fail:") {
			t.Fatalf("missing served metadata reported as %q", h.GetHeader().GetRawValue())
		}
	}

	off := startPicker(t, testConfig(sched.RoundRobin, urls...), Options{})
	seen := map[string]bool{}
	for i := range 6 {
		s := off.open(t)
		s.headers("POST", "/v1/chat/completions", false, nil, TestSelectionHeader, want)
		s.body(chatBody(100, strconv.Itoa(i)), true)
		h, _, _, _ := s.routed(true)
		seen[h] = true
	}
	if len(seen) < 2 {
		t.Fatalf("hooks off: the selection header steered every pick (%v)", seen)
	}
}

// TestServedFallback: the proxy reports a fallback as served; the
// request's in-flight slot moves there and is released at its end.
func TestServedFallback(t *testing.T) {
	urls := startEngines(t, 3)
	cfg := testConfig(sched.Prefix, urls...)
	cfg.EPP.Fallbacks = 2
	tp := startPicker(t, cfg, Options{})
	s := tp.open(t)
	s.headers("POST", "/v1/chat/completions", false, nil)
	s.body(chatBody(100, "fb"), true)
	h, md, _, _ := s.routed(true)
	list := strings.Split(h, ",")
	if h != md || len(list) != 3 || list[0] == list[1] || list[1] == list[2] {
		t.Fatalf("destinations %q / %q: want the pick and 2 distinct fallbacks", h, md)
	}
	s.responseHeaders("200", "application/json", list[2], false)
	s.recv()
	s.responseBody([]byte(`{"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`), true)
	s.bodyChunks(func(r *extprocv3.ProcessingResponse) *extprocv3.BodyResponse { return r.GetResponseBody() })
	waitFor(t, "in-flight back to 0", func() bool { return tp.inFlight(t) == 0 })
}

// TestProtocolErrors: messages out of order end the stream with an error;
// the server serves the next stream.
func TestProtocolErrors(t *testing.T) {
	urls := startEngines(t, 1)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{})
	for name, send := range map[string]func(*stream){
		"body-first":     func(s *stream) { s.body([]byte("x"), true) },
		"response-first": func(s *stream) { s.responseHeaders("200", "application/json", "", false) },
		"headers-twice": func(s *stream) {
			s.headers("POST", "/v1/completions", false, nil)
			s.headers("POST", "/v1/completions", false, nil)
		},
		"empty":                  func(s *stream) { s.send(&extprocv3.ProcessingRequest{}) },
		"response-body-unrouted": func(s *stream) { s.responseBody([]byte("x"), true) },
		"response-headers-twice": func(s *stream) {
			s.headers("POST", "/v1/completions", false, nil)
			s.body([]byte(`{"model":"m","prompt":"twice"}`), true)
			s.routed(true)
			s.responseHeaders("200", "application/json", "", false)
			s.recv()
			s.responseHeaders("200", "application/json", "", false)
		},
	} {
		s := tp.open(t)
		send(s)
		if _, err := s.s.Recv(); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	waitFor(t, "in-flight back to 0", func() bool { return tp.inFlight(t) == 0 })
	s := tp.open(t)
	s.headers("POST", "/v1/completions", false, nil)
	s.body([]byte(`{"model":"m","prompt":"hello"}`), true)
	s.routed(true)
}

// TestGarbageFrames: frames that are not ProcessingRequests (raw bytes on
// the stream) end that stream only.
func TestGarbageFrames(t *testing.T) {
	urls := startEngines(t, 1)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{})
	conn, err := grpc.NewClient(tp.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 50 {
		ctx, cancel := context.WithCancel(context.Background())
		cs, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true},
			"/envoy.service.ext_proc.v3.ExternalProcessor/Process", grpc.ForceCodecV2(rawCodec{}))
		if err != nil {
			t.Fatal(err)
		}
		b := make([]byte, rng.IntN(4096))
		for j := range b {
			b[j] = byte(rng.Uint32())
		}
		_ = cs.SendMsg(b)
		if i%2 == 0 {
			_ = cs.CloseSend()
		}
		var out []byte
		_ = cs.RecvMsg(&out)
		cancel()
	}
	s := tp.open(t)
	s.headers("POST", "/v1/completions", false, nil)
	s.body([]byte(`{"model":"m","prompt":"hello"}`), true)
	s.routed(true)
	if n := tp.gauge(t, "infergate_epp_stream_panics_total"); n != 0 {
		t.Fatalf("%v panics", n)
	}
}

// TestManyStreams: thousands of concurrent streams, each buffering part
// of a body and going away, or completing: bounded buffers, everything
// released, no goroutine left.
func TestManyStreams(t *testing.T) {
	urls := startEngines(t, 4)
	cfg := testConfig(sched.Prefix, urls...)
	// 2,000 streams on a loaded machine: a stream's second body message
	// may come later than the default 30 s body_read_timeout (a 408, 15 of
	// 2,000 at load 35); the test is about the streams, not that bound.
	cfg.BodyReadTimeout = 10 * time.Minute
	tp := startPicker(t, cfg, Options{MaxBufferedBytes: 8 << 20})
	warm := tp.open(t)
	warm.headers("GET", "/v1/models", true, nil)
	warm.routed(false)
	warm.cancel()
	waitFor(t, "the warm-up stream ended", func() bool { return tp.gauge(t, "infergate_epp_streams") == 0 })
	before := liveGoroutines()
	const n = 2000
	var wg sync.WaitGroup
	var mu sync.Mutex
	codes := map[string]int{}
	body := chatBody(10_000, "many")
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			s, err := tp.c.Process(ctx)
			if err != nil {
				return
			}
			hs := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
				Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":method", RawValue: []byte("POST")},
					{Key: ":path", RawValue: []byte("/v1/chat/completions")}}}}}}
			_ = s.Send(hs)
			piece := body[:len(body)/2]
			_ = s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: piece}}})
			if i%2 == 0 {
				return // gone mid-body
			}
			_ = s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
				Body: body[len(body)/2:], EndOfStream: true}}})
			r, err := s.Recv()
			key := "error"
			switch {
			case err != nil:
				// The code says which bound or failure it was (the
				// 730 errors once seen at load 41 were not kept).
				key = "error " + status.Code(err).String()
			case r.GetImmediateResponse() != nil:
				key = strconv.Itoa(int(r.GetImmediateResponse().GetStatus().GetCode()))
			case r.GetRequestHeaders() != nil:
				key = "picked"
			}
			mu.Lock()
			codes[key]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	waitFor(t, "every stream released", func() bool {
		return tp.inFlight(t) == 0 && tp.srv.Buffered() == 0 && tp.gauge(t, "infergate_epp_streams") == 0
	})
	if codes["picked"] == 0 {
		t.Fatalf("outcomes %v", codes)
	}
	for k := range codes {
		if k != "picked" && k != "429" && k != "503" {
			t.Fatalf("outcomes %v", codes)
		}
	}
	requireGoroutinesBack(t, before, 4)
}

// TestUnknownModelAndBadBody: 404 and 400 in OpenAI's format.
func TestUnknownModelAndBadBody(t *testing.T) {
	urls := startEngines(t, 1)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{})
	for body, want := range map[string]string{
		`{"model":"nope","messages":[{"role":"user","content":"x"}]}`: "404 model_not_found",
		`{"model":"m","messages":[`:                                   "400 invalid_json",
		`not json`:                                                    "400 invalid_json",
	} {
		s := tp.open(t)
		s.headers("POST", "/v1/chat/completions", false, nil)
		s.body([]byte(body), true)
		code, b := s.immediate()
		var e struct{ Error struct{ Code string } }
		_ = json.Unmarshal([]byte(b), &e)
		if got := strconv.Itoa(code) + " " + e.Error.Code; got != want {
			t.Errorf("%s: %s (%s), want %s", body, got, b, want)
		}
	}
}

// rawCodec sends and receives raw bytes (garbage frames).
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(v.([]byte))}, nil
}
func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	*(v.(*[]byte)) = data.Materialize()
	return nil
}
func (rawCodec) Name() string { return "proto" }

// TestPDPoolPicksDecode: in a P/D pool the picker sends requests whole to
// the decode endpoints, never to a prefill-only one.
func TestPDPoolPicksDecode(t *testing.T) {
	urls := startEngines(t, 4)
	cfg := testConfig("least-request")
	cfg.PD.Connector = "llm-d"
	for i, u := range urls {
		role := "decode"
		if i < 2 {
			role = "prefill"
		}
		cfg.Endpoints = append(cfg.Endpoints, gateway.EndpointConfig{URL: u, Model: "m", KVBlocks: 1000, MaxModelLen: 4096, Role: role})
	}
	tp := startPicker(t, cfg, Options{})
	decode := map[string]bool{addrOf(urls[2]): true, addrOf(urls[3]): true}
	for i := range 8 {
		s := tp.open(t)
		s.headers("POST", "/v1/chat/completions", false, nil)
		s.body(chatBody(2000, strconv.Itoa(i)), true)
		if h, _, _, _ := s.routed(true); !decode[h] {
			t.Fatalf("request %d sent to %s, not a decode endpoint", i, h)
		}
	}
}

// TestRequestTrailers: a body that ends with trailers (no end_of_stream on
// its last chunk) is routed at the trailers, which are answered too.
func TestRequestTrailers(t *testing.T) {
	urls := startEngines(t, 1)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{})
	s := tp.open(t)
	s.headers("POST", "/v1/chat/completions", false, nil)
	b := chatBody(70_000, "trailers")
	s.body(b, false, 33_333)
	s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}})
	if h, _, _, body := s.routed(true); h != addrOf(urls[0]) || !bytes.Equal(body, b) {
		t.Fatalf("routed to %q, %d bytes echoed of %d", h, len(body), len(b))
	}
	if r := s.recv(); r.GetRequestTrailers() == nil {
		t.Fatalf("want a trailers response, got %v", r)
	}
	s.responseHeaders("200", "application/json", "", true) // an answer without body
	if r := s.recv(); r.GetResponseHeaders() == nil {
		t.Fatalf("want a response-headers response, got %v", r)
	}
	waitFor(t, "in-flight back to 0", func() bool { return tp.inFlight(t) == 0 })
}

// TestMaxStreams: with MaxStreams open streams, the next one ends at once
// with RESOURCE_EXHAUSTED (counted); once one ends, a new stream routes.
func TestMaxStreams(t *testing.T) {
	urls := startEngines(t, 2)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{MaxStreams: 2})
	held := []*stream{tp.open(t), tp.open(t)}
	for _, s := range held { // in Process: their headers are being buffered
		s.headers("POST", "/v1/chat/completions", false, nil, "content-type", "application/json")
	}
	waitFor(t, "two streams open", func() bool { return tp.gauge(t, "infergate_epp_streams") == 2 })
	over := tp.open(t)
	stop := time.AfterFunc(time.Minute, over.cancel) // a stream let in would wait for its headers
	defer stop.Stop()
	if _, err := over.s.Recv(); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("third stream: %v, want ResourceExhausted", err)
	}
	if n := tp.gauge(t, "infergate_epp_streams_refused_total"); n != 1 {
		t.Fatalf("refused streams counted: %v", n)
	}
	held[0].cancel()
	waitFor(t, "one stream open", func() bool { return tp.gauge(t, "infergate_epp_streams") == 1 })
	s := tp.open(t)
	s.headers("POST", "/v1/chat/completions", false, nil, "content-type", "application/json")
	s.body(chatBody(600, "after"), true)
	if h, _, _, _ := s.routed(true); h == "" {
		t.Fatal("no destination after a stream ended")
	}
}

// TestOptionsValidate: negative bounds are errors (New refuses them), zero
// ones take their defaults.
func TestOptionsValidate(t *testing.T) {
	for _, o := range []Options{{MaxStreams: -1}, {MaxBufferedBytes: -1}} {
		if err := o.Validate(); err == nil {
			t.Errorf("%+v: no error", o)
		}
	}
	if err := (Options{}).Validate(); err != nil {
		t.Fatalf("zero options: %v", err)
	}
}
