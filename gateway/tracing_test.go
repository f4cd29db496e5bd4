package gateway

import (
	"context"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/infergate/infergate/sched"
)

// discardSpans is an exporter that drops every span (benchmarks).
type discardSpans struct{}

func (discardSpans) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardSpans) Shutdown(context.Context) error                             { return nil }

// keptSpans is an in-memory exporter that keeps its spans at shutdown
// (the SDK's forgets them).
type keptSpans struct{ *tracetest.InMemoryExporter }

func (keptSpans) Shutdown(context.Context) error { return nil }

// useSpanExporter makes g's tracer export to exp instead of its OTLP
// endpoint (g was built with tracing on and has served nothing yet).
func useSpanExporter(t testing.TB, g *Gateway, exp sdktrace.SpanExporter) {
	t.Helper()
	tr, err := newTracing(g.cfg.Tracing, exp)
	if err != nil {
		t.Fatal(err)
	}
	g.obs.tracing.shutdown()
	g.obs.tracing = tr
}

// tracedGateway serves a gateway over a dead endpoint (listed first: it is
// in rotation until it refuses a connection, then out for the test) and
// e, with tracing to an in-memory exporter at ratio.
func tracedGateway(t *testing.T, e *fakeEngine, ratio float64) (*Gateway, string, *tracetest.InMemoryExporter) {
	t.Helper()
	cfg := testConfig(sched.RoundRobin, e)
	cfg.HealthCheckPath = healthCheckOff
	cfg.EjectDuration, cfg.Outlier.MaxEjectionTime = time.Hour, time.Hour
	cfg.Endpoints = append([]EndpointConfig{{URL: closedURL(t), Model: "m", KVBlocks: 1000}}, cfg.Endpoints...)
	cfg.Tracing = TracingConfig{OTLPEndpoint: "http://127.0.0.1:4318", SampleRatio: &ratio}
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	exp := tracetest.NewInMemoryExporter()
	useSpanExporter(t, g, keptSpans{exp})
	srv := httptest.NewServer(g.Handler())
	t.Cleanup(func() {
		srv.Close()
		g.Close()
	})
	return g, srv.URL, exp
}

// spanAttrs is a span's attributes by key.
func spanAttrs(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes {
		m[kv.Key] = kv.Value
	}
	return m
}

// TestTracingSpans: a request carrying a client's traceparent becomes a
// server span parented on it, with one client span per attempt (a failed
// one for the endpoint that refused, with its reason); the engine receives
// the answering attempt's traceparent and the client's tracestate; the
// spans carry the GenAI and HTTP attributes. A request without one starts
// a trace of its own.
func TestTracingSpans(t *testing.T) {
	e := newFakeEngine(t, "e1")
	g, url, exp := tracedGateway(t, e, 1)
	c := testClient(t)
	const clientTrace, clientSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	type sent struct {
		id          string
		attempts    string
		traceparent string
		tracestate  string
	}
	var reqs []sent
	for i, body := range []string{
		`{"model":"m","messages":[{"role":"user","content":"Hi"}],"max_tokens":3}`,
		`{"model":"m","messages":[{"role":"user","content":"Hi"}],"max_tokens":3,"stream":true}`,
	} {
		id := "tr-" + strconv.Itoa(i)
		resp, b := post(t, c, url+pathChat, body, "X-Request-Id", id,
			"Traceparent", "00-"+clientTrace+"-"+clientSpan+"-01", "Tracestate", "vendor=opaque")
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", id, resp.StatusCode, b)
		}
		h, _ := e.last()
		reqs = append(reqs, sent{id, resp.Header.Get(AttemptsHeader), h.Get("Traceparent"), h.Get("Tracestate")})
	}
	resp, _ := post(t, c, url+pathCompletions, `{"model":"m","prompt":"x"}`, "X-Request-Id", "tr-root")
	if resp.StatusCode != 200 {
		t.Fatalf("tr-root: %d", resp.StatusCode)
	}
	h, _ := e.last()
	reqs = append(reqs, sent{"tr-root", resp.Header.Get(AttemptsHeader), h.Get("Traceparent"), h.Get("Tracestate")})
	g.Close() // exports the last spans

	spans := exp.GetSpans()
	byID := map[string]tracetest.SpanStub{} // span id → span
	for _, s := range spans {
		byID[s.SpanContext.SpanID().String()] = s
	}
	servers := map[string]tracetest.SpanStub{} // request id → server span
	for _, s := range spans {
		if s.SpanKind == trace.SpanKindServer {
			servers[spanAttrs(s)[attrRequestID].AsString()] = s
		}
	}
	retried := 0
	for _, r := range reqs {
		srv, ok := servers[r.id]
		if !ok {
			t.Fatalf("%s: no server span among %d spans", r.id, len(spans))
		}
		a := spanAttrs(srv)
		wantName := "POST " + pathChat
		if r.id == "tr-root" {
			wantName = "POST " + pathCompletions
		}
		if srv.Name != wantName || a[semconv.HTTPResponseStatusCodeKey].AsInt64() != 200 || a[semconv.GenAIRequestModelKey].AsString() != "m" ||
			a[semconv.GenAIUsageInputTokensKey].AsInt64() != 40 || a[semconv.GenAIUsageOutputTokensKey].AsInt64() != 3 ||
			a[semconv.GenAIUsageCacheReadInputTokensKey].AsInt64() != 32 || a[attrEndpoint].AsString() != e.URL() ||
			a[semconv.ClientAddressKey].AsString() != "127.0.0.1" {
			t.Errorf("%s: server span %q attributes %v", r.id, srv.Name, a)
		}
		if r.id == "tr-root" {
			if srv.Parent.IsValid() {
				t.Errorf("tr-root: server span has parent %v, want a new trace", srv.Parent)
			}
		} else if srv.Parent.TraceID().String() != clientTrace || srv.Parent.SpanID().String() != clientSpan || !srv.Parent.IsRemote() {
			t.Errorf("%s: server span's parent %v, want the client's %s-%s", r.id, srv.Parent, clientTrace, clientSpan)
		}
		// Its attempts, in order of start.
		var attempts []tracetest.SpanStub
		for _, s := range spans {
			if s.Parent.SpanID() == srv.SpanContext.SpanID() {
				attempts = append(attempts, s)
			}
		}
		slices.SortFunc(attempts, func(x, y tracetest.SpanStub) int { return x.StartTime.Compare(y.StartTime) })
		want := 1
		if r.attempts == "2" {
			want = 2
			retried++
		}
		if len(attempts) != want || a[attrAttempts].AsInt64() != int64(want) {
			t.Fatalf("%s: %d attempt spans, infergate.attempts %v, want %d", r.id, len(attempts), a[attrAttempts], want)
		}
		if want == 2 {
			f := spanAttrs(attempts[0])
			if attempts[0].Status.Code != codes.Error || f[semconv.ErrorTypeKey].AsString() != reasonConnect || f[attrEndpoint].AsString() == e.URL() {
				t.Errorf("%s: failed attempt %v %v", r.id, attempts[0].Status, f)
			}
		}
		ok1 := attempts[len(attempts)-1]
		oa := spanAttrs(ok1)
		op := "chat"
		if r.id == "tr-root" {
			op = "text_completion"
		}
		if ok1.Name != op+" m" || ok1.SpanKind != trace.SpanKindClient || ok1.Status.Code == codes.Error ||
			oa[semconv.GenAIOperationNameKey].AsString() != op || oa[semconv.GenAIProviderNameKey].AsString() != "vllm" ||
			oa[attrEndpoint].AsString() != e.URL() || oa[semconv.ServerAddressKey].AsString() != "127.0.0.1" ||
			oa[semconv.HTTPResponseStatusCodeKey].AsInt64() != 200 || oa[semconv.GenAIUsageInputTokensKey].AsInt64() != 40 ||
			oa[attrAttempt].AsInt64() != int64(want) || oa[attrPolicy].AsString() != sched.RoundRobin {
			t.Errorf("%s: answering attempt %q %v %v", r.id, ok1.Name, ok1.Status, oa)
		}
		if r.id != "tr-root" && oa[semconv.GenAIRequestMaxTokensKey].AsInt64() != 3 {
			t.Errorf("%s: gen_ai.request.max_tokens %v", r.id, oa[semconv.GenAIRequestMaxTokensKey])
		}
		// The engine's traceparent is the answering attempt's span context.
		wantTP := "00-" + ok1.SpanContext.TraceID().String() + "-" + ok1.SpanContext.SpanID().String() + "-01"
		if r.traceparent != wantTP {
			t.Errorf("%s: engine got traceparent %q, want %q", r.id, r.traceparent, wantTP)
		}
		wantTS := "vendor=opaque"
		if r.id == "tr-root" {
			wantTS = ""
		}
		if r.tracestate != wantTS {
			t.Errorf("%s: engine got tracestate %q, want %q", r.id, r.tracestate, wantTS)
		}
	}
	if retried != 1 {
		t.Errorf("%d requests retried, want 1 (the dead endpoint refuses once, then is ejected)", retried)
	}
}

// TestTracingSampling: with sample_ratio 0 a new trace is not recorded,
// but the engine still gets a traceparent (sampled flag 0) so that it does
// not record either; a client's sampled traceparent is followed.
func TestTracingSampling(t *testing.T) {
	e := newFakeEngine(t, "e1")
	g, url, exp := tracedGateway(t, e, 0)
	c := testClient(t)
	body := `{"model":"m","messages":[{"role":"user","content":"Hi"}]}`
	post(t, c, url+pathChat, body) // to the dead endpoint or not: either way unrecorded
	post(t, c, url+pathChat, body)
	h, _ := e.last()
	if tp := h.Get("Traceparent"); !strings.HasPrefix(tp, "00-") || !strings.HasSuffix(tp, "-00") {
		t.Errorf("unsampled: engine got traceparent %q, want one with flags 00", tp)
	}
	const parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	post(t, c, url+pathChat, body, "Traceparent", parent)
	g.Close()
	spans := exp.GetSpans()
	if len(spans) != 2 {
		t.Fatalf("%d spans recorded, want 2 (the sampled request's server and attempt spans)", len(spans))
	}
	for _, s := range spans {
		if s.SpanContext.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" {
			t.Errorf("span %q in trace %s", s.Name, s.SpanContext.TraceID())
		}
	}
}

// TestTraceContextPassesThrough: without tracing, the client's traceparent
// and tracestate reach the engine untouched.
func TestTraceContextPassesThrough(t *testing.T) {
	e := newFakeEngine(t, "e1")
	_, url := startGateway(t, testConfig(sched.RoundRobin, e))
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	post(t, testClient(t), url+pathChat, `{"model":"m","messages":[{"role":"user","content":"Hi"}]}`,
		"Traceparent", tp, "Tracestate", "a=b")
	h, _ := e.last()
	if h.Get("Traceparent") != tp || h.Get("Tracestate") != "a=b" {
		t.Errorf("engine got traceparent %q tracestate %q", h.Get("Traceparent"), h.Get("Tracestate"))
	}
}

// TestTracingNoGoroutineLeak: Close stops the span processor and the access
// log's writer.
func TestTracingNoGoroutineLeak(t *testing.T) {
	before := settledGoroutines()
	func() {
		e := newEngineNoCleanup(t, "e0")
		defer e.srv.Close()
		cfg := testConfig(sched.Prefix, e)
		cfg.Tracing.OTLPEndpoint = "http://127.0.0.1:4318"
		withAccessLog(t, &cfg, LogFormatJSON)
		g, err := New(context.Background(), cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		useSpanExporter(t, g, discardSpans{})
		srv := newServerNoCleanup(g.Handler())
		post(t, testClient(t), srv.URL+pathChat, `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":true}`)
		srv.Close()
		g.Close()
	}()
	requireGoroutinesBack(t, before)
}
