package gateway

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/infergate/infergate/sched"
)

// Tracing (README "Observability"). With tracing.otlp_endpoint set, every
// inference request is a trace (or joins the client's, W3C traceparent):
//
//	POST /v1/chat/completions        server span: the request as the client saw it
//	└─ chat <model>                  client span per upstream attempt (GenAI semantic conventions)
//
// and the attempt's span context is what the engine receives as its
// traceparent (vLLM parents its own llm_request span on it when started
// with --otlp-traces-endpoint). The pick's result is on the attempt span
// (endpoint, policy, matched blocks): a pick takes microseconds, a span of
// its own would cost more than it shows. Without tracing, the client's
// traceparent and tracestate reach the engine untouched like any
// end-to-end header, and nothing here runs.

// tracerName is the instrumentation scope of the gateway's spans.
const tracerName = "github.com/infergate/infergate/gateway"

// tracingShutdownWait bounds the export of the last spans at Close.
const tracingShutdownWait = 5 * time.Second

// Span attributes of the gateway's own (infergate.*); the others are
// OpenTelemetry semantic conventions (semconv v1.40.0: HTTP, GenAI).
const (
	attrEndpoint      = attribute.Key("infergate.endpoint")
	attrPolicy        = attribute.Key("infergate.policy")
	attrAttempt       = attribute.Key("infergate.attempt")
	attrAttempts      = attribute.Key("infergate.attempts")
	attrMatchedBlocks = attribute.Key("infergate.prefix.matched_blocks")
	attrMatchedTokens = attribute.Key("infergate.prefix.matched_tokens")
	attrRequestID     = attribute.Key("infergate.request_id")
	attrKey           = attribute.Key("infergate.key")
	attrStream        = attribute.Key("infergate.stream")
	attrTTFT          = attribute.Key("infergate.ttft_seconds")
)

// tracing is the gateway's tracer provider (batching spans to the OTLP
// exporter) and the W3C Trace Context propagator.
type tracing struct {
	tp     *sdktrace.TracerProvider
	tracer trace.Tracer
	prop   propagation.TraceContext
}

// newTracing builds the tracer: spans batched to exp (nil: the OTLP/HTTP
// exporter for cfg.OTLPEndpoint), sampled parent-based with
// cfg.SampleRatio for new traces.
func newTracing(cfg TracingConfig, exp sdktrace.SpanExporter) (*tracing, error) {
	if exp == nil {
		u, err := otlpTracesURL(cfg.OTLPEndpoint)
		if err != nil {
			return nil, fmt.Errorf("tracing.otlp_endpoint: %w", err)
		}
		if exp, err = otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(u)); err != nil {
			return nil, fmt.Errorf("tracing: %w", err)
		}
	}
	opts := []resource.Option{resource.WithAttributes(semconv.ServiceName(DefaultServiceName)),
		resource.WithFromEnv(), resource.WithTelemetrySDK()}
	if cfg.ServiceName != "" {
		opts = append(opts, resource.WithAttributes(semconv.ServiceName(cfg.ServiceName)))
	}
	res, err := resource.New(context.Background(), opts...)
	if err != nil {
		// A malformed OTEL_RESOURCE_ATTRIBUTES: keep what was read.
		slog.Warn("gateway: tracing resource", "err", err)
		if res == nil {
			res = resource.Default()
		}
	}
	ratio := 1.0
	if cfg.SampleRatio != nil {
		ratio = *cfg.SampleRatio
	}
	installOTelErrorHandler()
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(ratio))))
	return &tracing{tp: tp, tracer: tp.Tracer(tracerName)}, nil
}

// shutdown exports the spans still queued, within tracingShutdownWait.
// Safe on nil.
func (t *tracing) shutdown() {
	if t == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), tracingShutdownWait)
	defer cancel()
	if err := t.tp.Shutdown(ctx); err != nil {
		slog.Warn("gateway: tracing shutdown: spans may be lost", "err", err)
	}
}

var otelErrorHandler sync.Once

// installOTelErrorHandler sends the OpenTelemetry SDK's errors (a failed
// export: the collector is down) to the log as warnings, at most one a
// minute, instead of the SDK's default of one line per failure.
func installOTelErrorHandler() {
	otelErrorHandler.Do(func() {
		var last atomic.Int64
		otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
			if now := time.Now().UnixNano(); now-last.Load() > int64(time.Minute) {
				last.Store(now)
				slog.Warn("gateway: tracing: " + err.Error() + " (repeats are not logged for a minute)")
			}
		}))
	})
}

// requestTrace is one request's spans, in its obsWriter.
type requestTrace struct {
	t       *tracing
	ctx     context.Context // holds server: the attempts' parent
	server  trace.Span
	attempt trace.Span // the attempt in progress (nil: none)
	op      attribute.KeyValue
	opName  string
}

// on reports whether the request is traced.
func (rt *requestTrace) on() bool { return rt.server != nil }

// startRequest starts the request's server span, the child of the
// client's traceparent when it sent a valid one.
func (t *tracing) startRequest(rt *requestTrace, r *http.Request, start time.Time) {
	ctx := t.prop.Extract(context.Background(), propagation.HeaderCarrier(r.Header))
	rt.op, rt.opName = semconv.GenAIOperationNameChat, "chat"
	if r.URL.Path == pathCompletions {
		rt.op, rt.opName = semconv.GenAIOperationNameTextCompletion, "text_completion"
	}
	rt.t = t
	rt.ctx, rt.server = t.tracer.Start(ctx, r.Method+" "+r.URL.Path, trace.WithSpanKind(trace.SpanKindServer),
		trace.WithTimestamp(start), trace.WithAttributes(
			semconv.HTTPRequestMethodKey.String(r.Method), semconv.HTTPRoute(r.URL.Path), semconv.URLPath(r.URL.Path),
			rt.op))
}

// startAttempt starts the span of attempt n at endpoint ep of p, as the
// policy decided d.
func (t *tracing) startAttempt(rt *requestTrace, ep *endpoint, p *pool, x *exchange, n int, d sched.Decision) {
	if rt.attempt != nil { // not ended by attemptFailed: cannot happen, but never leak a span
		rt.attempt.End()
	}
	attrs := make([]attribute.KeyValue, 0, 14)
	attrs = append(attrs, rt.op, semconv.GenAIProviderNameKey.String(string(ep.spec.Load().kind)),
		semconv.GenAIRequestModel(x.model), attrEndpoint.String(ep.name), attrPolicy.String(p.policy.Name()),
		attrAttempt.Int(n), attrMatchedBlocks.Int(d.MatchedBlocks), attrMatchedTokens.Int(d.MatchedBlocks*p.blockSize),
		attrStream.Bool(x.stream))
	if u := ep.urls[kindChat]; u != nil {
		attrs = append(attrs, semconv.ServerAddress(u.Hostname()))
		if port, err := strconv.Atoi(u.Port()); err == nil {
			attrs = append(attrs, semconv.ServerPort(port))
		} else if u.Scheme == "https" {
			attrs = append(attrs, semconv.ServerPort(443))
		} else {
			attrs = append(attrs, semconv.ServerPort(80))
		}
	}
	if mt := requestMaxTokens(x, rt.opName == "chat"); mt > 0 {
		attrs = append(attrs, semconv.GenAIRequestMaxTokens(mt))
	}
	_, rt.attempt = t.tracer.Start(rt.ctx, rt.opName+" "+x.model, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attrs...))
}

// requestMaxTokens is the request's output limit (0: not given).
func requestMaxTokens(x *exchange, chat bool) int {
	mt := x.comp.MaxTokens
	if chat {
		mt = x.chat.MaxTokens
		if x.chat.MaxCompletionTokens != nil {
			mt = x.chat.MaxCompletionTokens
		}
	}
	if mt == nil {
		return 0
	}
	return *mt
}

// inject sets the attempt's traceparent (and the trace's tracestate) on
// the upstream request's headers h, replacing the client's: the engine's
// spans become the attempt's children. A no-op when the request is not
// traced (the client's headers then pass through as they came).
func (w *obsWriter) inject(h http.Header) {
	if w == nil || w.trace.attempt == nil {
		return
	}
	delete(h, "Traceparent")
	delete(h, "Tracestate")
	w.trace.t.prop.Inject(trace.ContextWithSpan(w.trace.ctx, w.trace.attempt), propagation.HeaderCarrier(h))
}

// attemptFailed ends the attempt's span with the failure f: its reason
// (retry reason, e.g. connect_failure, 5xx, timeout) as error.type.
func (rt *requestTrace) attemptFailed(f *failure) {
	if rt.attempt == nil {
		return
	}
	status, msg := f.status, f.reason
	if f.body == nil && f.err != nil {
		status, msg = f.err.Status, f.err.Message
	}
	attrs := []attribute.KeyValue{semconv.ErrorTypeKey.String(f.reason)}
	if f.reason == reason5xx && f.status != 0 {
		attrs = append(attrs, semconv.HTTPResponseStatusCode(status))
	}
	rt.attempt.SetAttributes(attrs...)
	rt.attempt.SetStatus(codes.Error, msg)
	rt.attempt.End()
	rt.attempt = nil
}

// endRequest ends the request's spans at end: the answering attempt's
// (if any) and the server span, with the status the metrics counted
// (code), usage and the request's identity.
func (t *tracing) endRequest(ow *obsWriter, r *http.Request, code int, end time.Time, trusted []netip.Prefix) {
	rt := &ow.trace
	// One SetAttributes per span: each call grows the span's slice.
	attrs := make([]attribute.KeyValue, 0, 20)
	attrs = append(attrs, semconv.HTTPResponseStatusCode(code))
	if ow.usage {
		attrs = append(attrs, semconv.GenAIUsageInputTokens(ow.prompt), semconv.GenAIUsageOutputTokens(ow.output),
			semconv.GenAIUsageCacheReadInputTokens(ow.cached))
	}
	if code >= 400 && code != codeClientClosed {
		attrs = append(attrs, semconv.ErrorTypeKey.String(strconv.Itoa(code)))
	}
	if a := rt.attempt; a != nil {
		a.SetAttributes(attrs...)
		if code >= 400 && code != codeClientClosed {
			a.SetStatus(codes.Error, ow.errCode)
		}
		a.End(trace.WithTimestamp(end))
		rt.attempt = nil
	}
	if code < 500 && code >= 400 && code != codeClientClosed {
		attrs = attrs[:len(attrs)-1] // a 4xx is not the server span's error
	}
	s := rt.server
	attrs = append(attrs, semconv.ClientAddress(clientAddr(r, trusted)))
	if id := requestIDOf(ow, r); id != "" {
		attrs = append(attrs, attrRequestID.String(id))
	}
	if ua := r.Header["User-Agent"]; len(ua) > 0 {
		attrs = append(attrs, semconv.UserAgentOriginal(truncateUTF8(ua[0], maxLoggedValue)))
	}
	if ow.key != nil {
		attrs = append(attrs, attrKey.String(ow.key.Name))
	}
	if ow.decoded {
		attrs = append(attrs, semconv.GenAIRequestModel(truncateUTF8(ow.model, maxLoggedValue)), attrStream.Bool(ow.stream))
	}
	if ow.rm != nil && ow.rm.labels[1] != "" {
		attrs = append(attrs, attrEndpoint.String(ow.rm.labels[1]), attrPolicy.String(ow.rm.labels[2]))
	}
	if ow.attempts > 0 {
		attrs = append(attrs, attrAttempts.Int(ow.attempts))
	}
	if ow.ttft > 0 {
		attrs = append(attrs, attrTTFT.Float64(ow.ttft.Seconds()))
	}
	s.SetAttributes(attrs...)
	if code >= 500 {
		s.SetStatus(codes.Error, ow.errCode)
	}
	s.End(trace.WithTimestamp(end))
}
