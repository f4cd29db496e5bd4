package epp

import (
	"bytes"
	"context"
	"flag"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/internal/polltest"
)

// TestMain silences the gateway's warnings unless -v.
func TestMain(m *testing.M) {
	flag.Parse()
	if !testing.Verbose() {
		slog.SetDefault(slog.New(slog.NewTextHandler(io.Discard, nil)))
	}
	os.Exit(m.Run())
}

// startEngines starts n loopback engines that pass health checks (the
// picker never sends them a request: Envoy would) and returns their URLs.
func startEngines(t testing.TB, n int) []string {
	t.Helper()
	urls := make([]string, n)
	for i := range urls {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, "{}")
		}))
		t.Cleanup(srv.Close)
		urls[i] = srv.URL
	}
	return urls
}

// testConfig is a gateway configuration over urls serving model "m".
func testConfig(policy string, urls ...string) gateway.Config {
	cfg := gateway.Config{
		Listen:              "127.0.0.1:0",
		EjectDuration:       100 * time.Millisecond,
		HealthCheckInterval: 20 * time.Millisecond,
		HealthCheckTimeout:  time.Second,
		ScrapeInterval:      -1,
	}
	cfg.Routing.Policy = policy
	for _, u := range urls {
		cfg.Endpoints = append(cfg.Endpoints, gateway.EndpointConfig{URL: u, Model: "m", KVBlocks: 10000, MaxModelLen: 32768})
	}
	return cfg
}

// testPicker is a gateway and its picker served on loopback.
type testPicker struct {
	g    *gateway.Gateway
	srv  *Server
	reg  *prometheus.Registry
	addr string
	c    extprocv3.ExternalProcessorClient
}

// startPicker builds the gateway for cfg and serves its picker on a
// loopback port, with a client connected to it.
func startPicker(t testing.TB, cfg gateway.Config, o Options) *testPicker {
	t.Helper()
	reg := prometheus.NewRegistry()
	g, err := gateway.New(context.Background(), cfg, reg)
	if err != nil {
		t.Fatalf("gateway.New: %v", err)
	}
	t.Cleanup(g.Close)
	o.Metrics = reg
	srv, err := New(g, cfg.EPP.WithDefaults(), o)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	srv.Register(gs)
	NewHealth(g).Register(gs)
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	tp := &testPicker{g: g, srv: srv, reg: reg, addr: ln.Addr().String(), c: extprocv3.NewExternalProcessorClient(conn)}
	down := 0
	for _, e := range cfg.Endpoints {
		if e.URL == deadURL {
			down++
		}
	}
	waitFor(t, "the endpoints ready", func() bool { r, _, _ := g.ReadyEndpoints(); return r == len(cfg.Endpoints)-down })
	return tp
}

// gauge sums the samples of the metric family name in tp's registry
// whose labels include all of want (name=value pairs).
func (tp *testPicker) gauge(t testing.TB, name string, want ...string) float64 {
	t.Helper()
	mfs, err := tp.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(want); i += 2 {
				found := false
				for _, l := range m.GetLabel() {
					found = found || (l.GetName() == want[i] && l.GetValue() == want[i+1])
				}
				if !found {
					continue metric
				}
			}
			switch {
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Histogram != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return sum
}

// inFlight is the gateway's in-flight count over all endpoints.
func (tp *testPicker) inFlight(t testing.TB) float64 {
	return tp.gauge(t, "infergate_endpoint_in_flight_requests")
}

// stream is one ext_proc stream, driven as Envoy drives it.
type stream struct {
	t      testing.TB
	s      extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
}

func (tp *testPicker) open(t testing.TB) *stream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s, err := tp.c.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return &stream{t: t, s: s, cancel: cancel}
}

func (s *stream) send(r *extprocv3.ProcessingRequest) {
	s.t.Helper()
	if err := s.s.Send(r); err != nil {
		s.t.Fatalf("send: %v", err)
	}
}

// headers sends the request headers (pairs of key, value) with metadata md.
func (s *stream) headers(method, path string, eos bool, md *corev3.Metadata, kv ...string) {
	s.t.Helper()
	hs := []*corev3.HeaderValue{{Key: ":method", RawValue: []byte(method)}, {Key: ":path", RawValue: []byte(path)},
		{Key: ":authority", RawValue: []byte("gw")}, {Key: "content-type", RawValue: []byte("application/json")}}
	for i := 0; i+1 < len(kv); i += 2 {
		hs = append(hs, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	s.send(&extprocv3.ProcessingRequest{MetadataContext: md, Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: hs}, EndOfStream: eos}}})
}

// body sends b split at the offsets cuts (ascending), end_of_stream on the
// last piece when eos.
func (s *stream) body(b []byte, eos bool, cuts ...int) {
	s.t.Helper()
	prev := 0
	for _, c := range append(cuts, len(b)) {
		if c < prev || c > len(b) {
			continue
		}
		last := c == len(b)
		s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: b[prev:c], EndOfStream: eos && last}}})
		prev = c
		if last {
			break
		}
	}
}

// responseHeaders sends the answer's headers with the served endpoint (""
// none).
func (s *stream) responseHeaders(status, contentType, served string, eos bool) {
	s.t.Helper()
	var md *corev3.Metadata
	if served != "" {
		md = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{DestinationNamespace: {Fields: map[string]*structpb.Value{
			ServedKey: structpb.NewStringValue(served)}}}}
	}
	s.send(&extprocv3.ProcessingRequest{MetadataContext: md, Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: ":status", RawValue: []byte(status)}, {Key: "content-type", RawValue: []byte(contentType)}}}, EndOfStream: eos}}})
}

// responseBody sends b split at cuts.
func (s *stream) responseBody(b []byte, eos bool, cuts ...int) {
	s.t.Helper()
	prev := 0
	for _, c := range append(cuts, len(b)) {
		if c < prev || c > len(b) {
			continue
		}
		last := c == len(b)
		s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
			ResponseBody: &extprocv3.HttpBody{Body: b[prev:c], EndOfStream: eos && last}}})
		prev = c
		if last {
			break
		}
	}
}

func (s *stream) recv() *extprocv3.ProcessingResponse {
	s.t.Helper()
	r, err := s.s.Recv()
	if err != nil {
		s.t.Fatalf("recv: %v", err)
	}
	return r
}

// routed reads the request-headers answer and the echoed body chunks: the
// destination header and metadata values, whether Content-Length was set,
// and the body. It fails on an immediate response.
func (s *stream) routed(withBody bool) (header, metadata, contentLength string, body []byte) {
	s.t.Helper()
	r := s.recv()
	rh := r.GetRequestHeaders()
	if rh == nil {
		s.t.Fatalf("want a request-headers response, got %v", r)
	}
	if !rh.GetResponse().GetClearRouteCache() {
		s.t.Error("clear_route_cache not set")
	}
	for _, h := range rh.GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetAppendAction() != corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD {
			s.t.Errorf("header %s: append action %v", h.GetHeader().GetKey(), h.GetAppendAction())
		}
		switch h.GetHeader().GetKey() {
		case DestinationHeader:
			header = string(h.GetHeader().GetRawValue())
		case "content-length":
			contentLength = string(h.GetHeader().GetRawValue())
		}
	}
	metadata = r.GetDynamicMetadata().GetFields()[DestinationNamespace].GetStructValue().GetFields()[DestinationKey].GetStringValue()
	if !withBody {
		return
	}
	body = s.bodyChunks(func(r *extprocv3.ProcessingResponse) *extprocv3.BodyResponse { return r.GetRequestBody() })
	return
}

// bodyChunks reads StreamedBodyResponses (of the phase get returns) until
// end_of_stream and returns their bytes, each checked ≤ MaxChunkBytes.
func (s *stream) bodyChunks(get func(*extprocv3.ProcessingResponse) *extprocv3.BodyResponse) []byte {
	s.t.Helper()
	var out []byte
	for {
		r := s.recv()
		br := get(r)
		if br == nil {
			s.t.Fatalf("want a body response, got %v", r)
		}
		sr := br.GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			s.t.Fatalf("body response without streamed_response: %v", r)
		}
		if len(sr.GetBody()) > MaxChunkBytes {
			s.t.Fatalf("chunk of %d bytes, over %d", len(sr.GetBody()), MaxChunkBytes)
		}
		out = append(out, sr.GetBody()...)
		if sr.GetEndOfStream() {
			return out
		}
	}
}

// immediate reads an immediate response and returns its status and body.
func (s *stream) immediate() (int, string) {
	s.t.Helper()
	r := s.recv()
	ir := r.GetImmediateResponse()
	if ir == nil {
		s.t.Fatalf("want an immediate response, got %v", r)
	}
	return int(ir.GetStatus().GetCode()), string(ir.GetBody())
}

// waitFor waits until cond holds (polltest.Until: a minute at most).
var waitFor = polltest.Until

// requireGoroutinesBack fails unless the goroutine count (liveGoroutines)
// returns to at most before+slack (polling; the bound, not the time, is
// asserted).
func requireGoroutinesBack(t *testing.T, before, slack int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	n := liveGoroutines()
	for n > before+slack && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
		runtime.GC()
		n = liveGoroutines()
	}
	if n > before+slack {
		buf := make([]byte, 1<<20)
		t.Fatalf("goroutines: %d before, %d after\n%s", before, n, buf[:runtime.Stack(buf, true)])
	}
}

// liveGoroutines counts the goroutines, leaving out HTTP keep-alive
// connections: those the gateway's transport keeps to the test engines
// (created by net/http.(*Transport).dialConn) and the engines' side of
// them (created by net/http.(*Server).Serve). How many are idle depends on
// how many scrapes and probes overlapped, i.e. on the host's load (a CI
// run at load 28 kept 12 more than at rest); the transport bounds them and
// Gateway.Close closes them. ext_proc streams are gRPC and still count.
func liveGoroutines() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	live := 0
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		if len(bytes.TrimSpace(g)) == 0 ||
			bytes.Contains(g, []byte("created by net/http.(*Transport).dialConn")) ||
			bytes.Contains(g, []byte("created by net/http.(*Server).Serve")) {
			continue
		}
		live++
	}
	return live
}

// deadURL is an engine that never answers (nothing listens on port 1).
const deadURL = "http://127.0.0.1:1"

// addrOf is a URL's host:port.
func addrOf(u string) string { return strings.TrimPrefix(u, "http://") }

// chatBody is a non-streaming chat request of about n bytes.
func chatBody(n int, seed string) []byte {
	pad := strings.Repeat("lorem ipsum dolor sit amet ", max(1, n/27))
	return []byte(`{"model":"m","max_tokens":8,"messages":[{"role":"system","content":"` + seed + pad + `"},{"role":"user","content":"hi"}]}`)
}
