// Package epp serves infergate's scheduler as a Gateway API Inference
// Extension endpoint picker: Envoy's external processor
// (envoy.service.ext_proc.v3.ExternalProcessor, go-control-plane's envoy
// module, over gRPC) with the request and response bodies in
// FULL_DUPLEX_STREAMED mode. Each request's body is buffered to its end
// (at most max_body_bytes), the gateway picks its endpoint
// (gateway.Gateway.Pick), the request-headers phase is answered with the
// x-gateway-destination-endpoint header and the same value in the envoy.lb
// dynamic metadata, and the body is echoed in chunks of at most
// MaxChunkBytes; the answer passes through the gateway's accounting
// (gateway.Picked) and is echoed likewise.
//
// Protocol: kubernetes-sigs/gateway-api-inference-extension
// docs/proposals/004-endpoint-picker-protocol/README.md@84436a96 (v1.0.0);
// behaviour as llm-d/llm-d-router pkg/epp/handlers/request.go and
// pkg/common/envoy@ebab6879 (the chunk size, ClearRouteCache, Content-Length
// of a changed body); conformance hooks as GIE pkg/lwepp@84436a96.
package epp

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/infergate/infergate/disagg"
	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/openai"
)

// Names of the endpoint picker protocol (GIE pkg/lwepp/metadata/consts.go
// and docs/proposals/004-endpoint-picker-protocol@84436a96).
const (
	// DestinationHeader and DestinationKey carry the pick, ip:port with
	// fallbacks after commas, in the request header and in the
	// DestinationNamespace dynamic metadata.
	DestinationHeader    = "x-gateway-destination-endpoint"
	DestinationNamespace = "envoy.lb"
	DestinationKey       = DestinationHeader
	// ServedKey is the proxy's report of the endpoint that served the
	// request (response metadata_context, namespace envoy.lb).
	ServedKey = "x-gateway-destination-endpoint-served"
	// SubsetNamespace/SubsetKey are the proxy's subset hint (request
	// metadata_context): the list of ip:port the pick must be among.
	SubsetNamespace = "envoy.lb.subset_hint"
	SubsetKey       = "x-gateway-destination-endpoint-subset"
	// TestSelectionHeader (request) and TestServedHeader,
	// TestSelectedHeader (response) are the conformance hooks
	// (EPPConfig.ConformanceTestHooks).
	TestSelectionHeader = "test-epp-endpoint-selection"
	TestServedHeader    = "x-conformance-test-served-endpoint"
	TestSelectedHeader  = "x-conformance-test-selected-endpoint"
	// ServiceName is the ext_proc service's gRPC name, also a health
	// service name.
	ServiceName = "envoy.service.ext_proc.v3.ExternalProcessor"
)

// MaxChunkBytes bounds one StreamedBodyResponse's body (bytes): llm-d's
// pkg/common/envoy bodyByteLimit, under Envoy's 64 KiB buffer.
const MaxChunkBytes = 62000

// servedMissing is the conformance header's value when the proxy reported
// no served endpoint (lwepp's, so the conformance check fails visibly).
const servedMissing = "fail: missing destination endpoint served metadata"

// Server is the ext_proc service. Each Process stream is one HTTP request
// through Envoy; a stream's state is its own goroutine's, and a panic in
// one ends that stream only.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	g       *gateway.Gateway
	hooks   bool
	maxBody int64
	// bodyTimeout bounds a stream's wait for its request to be routed,
	// from the stream's start (body_read_timeout).
	bodyTimeout time.Duration
	// remove are the request headers the proxy is to remove: a client's
	// own x-prefiller-host-port (gateway.StripsClientPDParams).
	remove []string
	// budget bounds the request bytes all streams buffer together
	// (bytes); over it a request is shed with 429.
	budget   int64
	buffered atomic.Int64
	// open counts the streams in Process; beyond maxStreams a new one is
	// refused with ResourceExhausted.
	open       atomic.Int64
	maxStreams int64
	// writeTimeout bounds one batch of sends the proxy does not read
	// (write_timeout; <= 0: none).
	writeTimeout time.Duration
	// maxHeader bounds a request's headers (max_header_bytes, counted as
	// Gateway.RefuseHeaders counts them); over it: 431.
	maxHeader int
	m         *metrics
}

// Options configures a Server beyond the gateway's own configuration.
type Options struct {
	// MaxBufferedBytes bounds the request bytes, headers and bodies,
	// held by all streams at once (bytes; 0: DefaultMaxBufferedBytes;
	// negative: an error).
	MaxBufferedBytes int64
	// Metrics registers the picker's metrics (nil: none registered).
	Metrics Registerer
	// MaxStreams bounds the ext_proc streams open at once, over all the
	// proxy's connections (0: DefaultMaxStreams, 16,384: there is no
	// unbounded setting; negative: an error); beyond it a new stream
	// ends at once with gRPC status RESOURCE_EXHAUSTED, which the proxy
	// turns into an error for that request (or lets it through to its
	// default cluster under ext_proc's failure_mode_allow). gRPC's own
	// MaxConcurrentStreams bounds one connection only, and Envoy
	// multiplexes every request over a few; GIE's EPP sets no bound
	// (pkg/epp/server/runserver.go).
	MaxStreams int
}

// DefaultMaxBufferedBytes is Options.MaxBufferedBytes's default: 1 GiB.
const DefaultMaxBufferedBytes = 1 << 30

// DefaultMaxStreams is Options.MaxStreams's default: each open stream
// costs three goroutines (Process, serve, receive: a few KiB of stacks)
// besides the bytes it buffers (MaxBufferedBytes bounds those), so 16,384
// streams are ~150 MiB at most.
const DefaultMaxStreams = 16384

// Validate reports a negative bound (a flag's typo, which used to mean
// the default silently).
func (o Options) Validate() error {
	if o.MaxStreams < 0 {
		return fmt.Errorf("max streams %d: must be >= 0 (0: the default, %d)", o.MaxStreams, DefaultMaxStreams)
	}
	if o.MaxBufferedBytes < 0 {
		return fmt.Errorf("max buffered bytes %d: must be >= 0 (0: the default, %d)", o.MaxBufferedBytes, DefaultMaxBufferedBytes)
	}
	return nil
}

// New returns the ext_proc service picking with g; cfg is g's epp section.
// o's zero bounds take their defaults; a negative one is an error.
func New(g *gateway.Gateway, cfg gateway.EPPConfig, o Options) (*Server, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	var remove []string
	if g.StripsClientPDParams() {
		// llm-d's routing sidecar in front of an engine would prefill at
		// the host:port it names, with the request's headers.
		remove = []string{disagg.PrefillerHeader}
	}
	if o.MaxBufferedBytes == 0 {
		o.MaxBufferedBytes = DefaultMaxBufferedBytes
	}
	m, err := newMetrics(o.Metrics)
	if err != nil {
		return nil, err
	}
	if o.MaxStreams == 0 {
		o.MaxStreams = DefaultMaxStreams
	}
	return &Server{g: g, hooks: cfg.ConformanceTestHooks, maxBody: g.MaxBodyBytes(),
		bodyTimeout: g.BodyReadTimeout(), writeTimeout: g.WriteTimeout(), maxHeader: g.MaxHeaderBytes(), remove: remove, budget: o.MaxBufferedBytes, maxStreams: int64(o.MaxStreams), m: m}, nil
}

// Register registers the service on gs.
func (s *Server) Register(gs *grpc.Server) { extprocv3.RegisterExternalProcessorServer(gs, s) }

// Buffered returns the request bytes the streams hold now.
func (s *Server) Buffered() int64 { return s.buffered.Load() }

// Process implements ExternalProcessorServer: one request's phases, in the
// order Envoy sends them. The stream is served on a goroutine of its own
// (serve) so that a send the proxy does not read can be abandoned: past
// write_timeout (the gateway's bound on one write to a client) Process
// returns DeadlineExceeded, which ends the stream and with it the blocked
// Send; serve then releases what the stream held.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	if n := s.open.Add(1); n > s.maxStreams {
		s.open.Add(-1)
		s.m.refused.Inc()
		return status.Errorf(codes.ResourceExhausted, "epp: %d ext_proc streams open already (--max-streams)", s.maxStreams)
	}
	w := newSendWatch(s.writeTimeout)
	done := make(chan error, 1)
	go func() {
		defer s.open.Add(-1)
		done <- s.serve(stream, w)
	}()
	select {
	case err := <-done:
		w.stop()
		return err
	case <-w.stuck:
		s.m.timeouts.WithLabelValues("send").Inc()
		return status.Errorf(codes.DeadlineExceeded, "epp: the proxy read no response for %s (write_timeout)", s.writeTimeout)
	}
}

// serve runs one stream's exchange until it ends.
func (s *Server) serve(stream extprocv3.ExternalProcessor_ProcessServer, w *sendWatch) (err error) {
	x := &exchange{s: s, ctx: stream.Context(), w: w}
	s.m.streams.Inc()
	defer func() {
		if v := recover(); v != nil {
			slog.Error("epp: stream panicked", "panic", v, "stack", string(debug.Stack()))
			s.m.panics.Inc()
			err = status.Error(codes.Internal, "epp: internal error")
		}
		x.end()
		s.m.streams.Dec()
	}()
	// The messages are received on a goroutine of their own, so that a
	// stream that stalls can be ended: before its request is routed it has
	// s.bodyTimeout from its start (serve's body_read_timeout); once routed,
	// each wait for the proxy's next message is bounded as serve bounds
	// the engine's answer (Picked.AnswerTimeout).
	in := make(chan received, 1)
	go receive(stream, in)
	stall := time.NewTimer(s.bodyTimeout)
	defer stall.Stop()
	for {
		var m received
		select {
		case m = <-in:
		case <-x.ctx.Done():
			return nil // the proxy went away (canceled, reset): nothing to answer
		case <-stall.C:
			return x.stalled(stream)
		}
		req, rerr := m.req, m.err
		if rerr == io.EOF {
			return nil
		}
		if rerr != nil {
			return nil // the proxy went away (canceled, reset): nothing to answer
		}
		out, herr := x.handle(req)
		if x.phase == phaseRouted {
			stall.Reset(x.picked.AnswerTimeout())
		}
		if !x.send(stream, out) {
			return nil
		}
		if herr != nil {
			s.m.protocolErrors.Inc()
			return herr
		}
	}
}

// send sends out in order, each Send watched by x.w; false when the stream
// failed (the proxy went away, or Process gave up on a stalled send).
func (x *exchange) send(stream extprocv3.ExternalProcessor_ProcessServer, out []*extprocv3.ProcessingResponse) bool {
	if len(out) == 0 {
		return true
	}
	x.w.arm()
	defer x.w.disarm()
	for _, r := range out {
		if err := stream.Send(r); err != nil {
			return false
		}
	}
	return true
}

// sendWatch bounds a stream's sends: armed around them, it signals stuck
// once they have taken d (d <= 0: never). grpc's Send blocks while the
// proxy's HTTP/2 flow-control window is full and only the end of the
// stream ends that wait.
type sendWatch struct {
	t     *time.Timer
	d     time.Duration
	stuck chan struct{} // a value once a send took d
}

func newSendWatch(d time.Duration) *sendWatch {
	w := &sendWatch{d: d, stuck: make(chan struct{}, 1)}
	if d > 0 {
		w.t = time.AfterFunc(d, func() {
			select {
			case w.stuck <- struct{}{}:
			default:
			}
		})
		w.t.Stop()
	}
	return w
}

func (w *sendWatch) arm() {
	if w.t != nil {
		w.t.Reset(w.d)
	}
}

func (w *sendWatch) disarm() {
	if w.t != nil {
		w.t.Stop()
	}
}

func (w *sendWatch) stop() { w.disarm() }

// received is one stream.Recv's result.
type received struct {
	req *extprocv3.ProcessingRequest
	err error
}

// receive passes stream's messages to in until Recv fails (the stream
// ended, or Process returned and canceled it).
func receive(stream extprocv3.ExternalProcessor_ProcessServer, in chan<- received) {
	for {
		req, err := stream.Recv()
		select {
		case in <- received{req, err}:
		case <-stream.Context().Done():
			return
		}
		if err != nil {
			return
		}
	}
}

// stalled ends a stream that waited too long for the proxy's next
// message. Before its request was routed (s.bodyTimeout from its start):
// one whose body was awaited is answered 408 as serve answers a body not
// received in time; one without headers ends with DeadlineExceeded; one
// already answered (an immediate response the proxy kept the stream open
// after) just ends. A routed one whose answer stopped arriving
// (Picked.AnswerTimeout) ends with DeadlineExceeded, the request counted
// 504; one whose answer had ended just ends.
func (x *exchange) stalled(stream extprocv3.ExternalProcessor_ProcessServer) error {
	switch x.phase {
	case phaseHeaders:
		x.s.m.decisions.WithLabelValues("timeout").Inc()
		return status.Errorf(codes.DeadlineExceeded, "epp: no request headers within %s", x.s.bodyTimeout)
	case phaseBody:
		x.s.m.decisions.WithLabelValues("408").Inc()
		x.send(stream, x.immediate(x.s.g.Refuse(openai.NewError(http.StatusRequestTimeout,
			fmt.Sprintf("The request body was not received within %s.", x.s.bodyTimeout), "", "request_timeout"))))
	case phaseRouted:
		d := x.picked.AnswerTimeout()
		if x.respDone {
			x.s.m.timeouts.WithLabelValues("end").Inc()
			return nil
		}
		x.s.m.timeouts.WithLabelValues("answer").Inc()
		x.picked.Expire()
		return status.Errorf(codes.DeadlineExceeded, "epp: no message of the answer for %s", d)
	}
	return nil
}

// phase is where a stream is.
type phase uint8

const (
	phaseHeaders  phase = iota // waiting for the request headers
	phaseBody                  // buffering the request body
	phaseRouted                // the request was picked (and its body echoed)
	phaseAnswered              // an immediate response was sent
)

// exchange is one stream's state.
type exchange struct {
	s      *Server
	ctx    context.Context
	w      *sendWatch
	phase  phase
	start  time.Time
	method string
	path   string
	header http.Header
	// subset is the proxy's subset hint or the conformance header's list
	// (hasSubset: given).
	subset    []string
	hasSubset bool
	body      []byte
	held      int64 // of the headers and body, reserved in s.buffered
	picked    *gateway.Picked
	// respHeaders: the answer's headers were observed; respDone: its end.
	respHeaders, respDone bool
	served                string
}

// end releases what the stream holds.
func (x *exchange) end() {
	x.release()
	if x.picked != nil {
		x.picked.Done()
		x.picked = nil
	}
}

// release gives back the buffered body's reservation.
func (x *exchange) release() {
	if x.held != 0 {
		x.s.buffered.Add(-x.held)
		x.held = 0
	}
	x.body = nil
}

// handle answers one message of the proxy: the responses to send (none
// while a body is buffered), or an error that ends the stream (a message
// out of order).
func (x *exchange) handle(req *extprocv3.ProcessingRequest) ([]*extprocv3.ProcessingResponse, error) {
	switch r := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		if x.phase != phaseHeaders {
			return nil, status.Error(codes.InvalidArgument, "epp: request headers twice")
		}
		return x.requestHeaders(req, r.RequestHeaders), nil
	case *extprocv3.ProcessingRequest_RequestBody:
		switch x.phase {
		case phaseBody:
			return x.requestBody(r.RequestBody.GetBody(), r.RequestBody.GetEndOfStream()), nil
		case phaseAnswered:
			return nil, nil // the rest of a refused body
		}
		return nil, status.Error(codes.InvalidArgument, "epp: request body out of order")
	case *extprocv3.ProcessingRequest_RequestTrailers:
		var out []*extprocv3.ProcessingResponse
		if x.phase == phaseBody { // the body ends with the trailers
			out = x.route(false)
		}
		if x.phase == phaseAnswered {
			return out, nil
		}
		return append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
			RequestTrailers: &extprocv3.TrailersResponse{}}}), nil
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		if x.phase != phaseRouted {
			return nil, status.Error(codes.InvalidArgument, "epp: response headers before the request was routed")
		}
		if x.respHeaders {
			// Envoy sends them once. A second served endpoint moved the
			// request's accounting again (Picked.Served), each move and the
			// end unpinning the prompt on the slot left: the pick's pin was
			// already released at the first move, so the later unpins took
			// pins that other requests of the same prompt held.
			return nil, status.Error(codes.InvalidArgument, "epp: response headers twice")
		}
		x.respHeaders = true
		return x.responseHeaders(req, r.ResponseHeaders), nil
	case *extprocv3.ProcessingRequest_ResponseBody:
		if x.phase != phaseRouted {
			return nil, status.Error(codes.InvalidArgument, "epp: response body before the request was routed")
		}
		return x.responseBody(r.ResponseBody.GetBody(), r.ResponseBody.GetEndOfStream()), nil
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		var out []*extprocv3.ProcessingResponse
		if x.phase == phaseRouted && !x.respDone {
			out = x.responseBody(nil, true)
		}
		return append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
			ResponseTrailers: &extprocv3.TrailersResponse{}}}), nil
	}
	return nil, status.Error(codes.InvalidArgument, "epp: unknown processing request")
}

// requestHeaders records the request's headers and subset hint; a request
// without body is picked at once.
func (x *exchange) requestHeaders(req *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders) []*extprocv3.ProcessingResponse {
	x.start = time.Now()
	x.phase = phaseBody
	size := 0
	for _, hv := range h.GetHeaders().GetHeaders() {
		size += len(hv.GetKey()) + len(headerValue(hv)) + 4
	}
	if size > x.s.maxHeader { // before a map of them is made
		x.s.m.decisions.WithLabelValues("431").Inc()
		return x.immediate(x.s.g.RefuseHeaders(size, nil))
	}
	x.header = make(http.Header, len(h.GetHeaders().GetHeaders()))
	for _, hv := range h.GetHeaders().GetHeaders() {
		k, v := hv.GetKey(), headerValue(hv)
		switch k {
		case ":method":
			x.method = v
		case ":path":
			x.path = v
		}
		if strings.HasPrefix(k, ":") {
			continue
		}
		x.header.Add(k, v)
	}
	if i := strings.IndexByte(x.path, '?'); i >= 0 {
		x.path = x.path[:i]
	}
	if r := x.s.g.RefuseHeaders(size, x.header); r != nil { // a Content-Encoding: 415 before any body is held
		x.s.m.decisions.WithLabelValues(strconv.Itoa(r.Status)).Inc()
		return x.immediate(r)
	}
	if out := x.reserve(int64(size)); out != nil {
		return out // the headers, held until the stream ends, count as its body does
	}
	x.subset, x.hasSubset = subsetHint(req.GetMetadataContext())
	if x.s.hooks {
		if v := x.header.Get(TestSelectionHeader); v != "" {
			list := strings.Split(v, ",")
			if x.hasSubset { // both: the hint and the hook
				list = intersect(list, x.subset)
			}
			x.subset, x.hasSubset = list, true
		}
	}
	if h.GetEndOfStream() {
		return x.route(true)
	}
	return nil
}

// requestBody buffers one chunk; at the body's end the request is routed.
func (x *exchange) requestBody(chunk []byte, eos bool) []*extprocv3.ProcessingResponse {
	if n := int64(len(x.body) + len(chunk)); n > x.s.maxBody {
		x.s.m.decisions.WithLabelValues("too_large").Inc()
		return x.immediate(x.s.g.Refuse(openai.NewError(http.StatusRequestEntityTooLarge,
			fmt.Sprintf("Request body is larger than the limit of %d bytes.", x.s.maxBody), "", openai.CodeRequestTooLarge)))
	}
	if len(chunk) > 0 {
		if out := x.reserve(int64(len(chunk))); out != nil {
			return out
		}
		x.body = append(x.body, chunk...)
	}
	if !eos {
		return nil
	}
	return x.route(false)
}

// reserve takes n more bytes of the stream's request (headers, body) in
// s.buffered, given back when the stream ends; over the budget the request
// is answered 429 (the responses returned).
func (x *exchange) reserve(n int64) []*extprocv3.ProcessingResponse {
	if x.s.buffered.Add(n) > x.s.budget {
		x.s.buffered.Add(-n)
		x.s.m.decisions.WithLabelValues("buffer_full").Inc()
		r := x.s.g.Refuse(openai.NewError(http.StatusTooManyRequests,
			"The endpoint picker is holding too many request bytes; retry later.", "", "rate_limit_exceeded"))
		r.Header.Set("Retry-After", "1")
		return x.immediate(r)
	}
	x.held += n
	return nil
}

// route picks the request's endpoint and answers the request-headers
// phase with it, then echoes the body (unless headersOnly).
func (x *exchange) route(headersOnly bool) []*extprocv3.ProcessingResponse {
	body := x.body
	if !headersOnly && body == nil {
		body = []byte{} // a body phase that carried no byte
	}
	if headersOnly {
		body = nil
	}
	t := time.Now()
	pk, refusal := x.s.g.Pick(x.ctx, &gateway.PickRequest{Method: x.method, Path: x.path, Header: x.header,
		Body: body, Subset: x.subset, HasSubset: x.hasSubset, Start: x.start})
	x.s.m.decide.Observe(time.Since(t).Seconds())
	if refusal != nil {
		x.s.m.decisions.WithLabelValues(strconv.Itoa(refusal.Status)).Inc()
		return x.immediate(refusal)
	}
	x.s.m.decisions.WithLabelValues("picked").Inc()
	x.picked, x.phase = pk, phaseRouted
	dest := strings.Join(pk.Destinations(), ",")
	set := []*corev3.HeaderValueOption{setHeader(DestinationHeader, dest)}
	out := []*extprocv3.ProcessingResponse{nil}
	if !headersOnly {
		b := pk.Body()
		if pk.BodyChanged() {
			set = append(set, setHeader("content-length", strconv.Itoa(len(b))))
		}
		out = appendChunks(out, b, true, requestBody)
	}
	out[0] = &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{ClearRouteCache: true, HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set, RemoveHeaders: x.s.remove}},
		}},
		DynamicMetadata: destinationMetadata(dest),
	}
	// The body stays reserved until the stream ends: the gateway reads it
	// until the request is done (Picked.Body aliases it).
	return out
}

// immediate ends the request with r as the proxy's answer.
func (x *exchange) immediate(r *gateway.Refusal) []*extprocv3.ProcessingResponse {
	x.phase = phaseAnswered
	x.release()
	if r.Status == 499 { // the client went away while queued: no one to answer
		return nil
	}
	set := []*corev3.HeaderValueOption{setHeader("content-type", "application/json")}
	for _, k := range []string{"Retry-After"} {
		if v := r.Header.Get(k); v != "" {
			set = append(set, setHeader(strings.ToLower(k), v))
		}
	}
	return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{
			Status:  &typev3.HttpStatus{Code: typev3.StatusCode(r.Status)},
			Headers: &extprocv3.HeaderMutation{SetHeaders: set},
			Body:    r.Body,
			Details: "infergate_epp_" + strconv.Itoa(r.Status),
		}}}}
}

// responseHeaders observes the answer's status and headers and the served
// endpoint; with the conformance hooks, it reports the served endpoint.
func (x *exchange) responseHeaders(req *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders) []*extprocv3.ProcessingResponse {
	code := http.StatusOK
	hdr := make(http.Header, 4)
	for _, hv := range h.GetHeaders().GetHeaders() {
		switch k := hv.GetKey(); k {
		case ":status":
			if n, err := strconv.Atoi(headerValue(hv)); err == nil && n >= 100 && n <= 999 {
				code = n
			}
		case "content-type":
			hdr.Set("Content-Type", headerValue(hv))
		}
	}
	x.served = servedEndpoint(req.GetMetadataContext())
	x.picked.Served(x.served)
	x.picked.ResponseHeaders(code, hdr)
	var set []*corev3.HeaderValueOption
	if x.s.hooks {
		v := x.served
		if v == "" {
			v = servedMissing
		}
		set = append(set, setHeader(TestServedHeader, v), setHeader(TestSelectedHeader, x.picked.Destinations()[0]))
	}
	out := []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
			HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}}}}}}
	if h.GetEndOfStream() { // no body
		x.respDone = true
		x.picked.ResponseBody(nil, true)
		x.picked.Done()
	}
	return out
}

// responseBody observes one chunk of the answer and echoes what the
// gateway passes on of it.
func (x *exchange) responseBody(chunk []byte, eos bool) []*extprocv3.ProcessingResponse {
	if x.respDone {
		return appendChunks(nil, chunk, eos, responseBody)
	}
	b := x.picked.ResponseBody(chunk, eos)
	if eos {
		x.respDone = true
	}
	if len(b) == 0 && !eos {
		return nil // an event not complete yet: held until it is
	}
	out := appendChunks(nil, b, eos, responseBody)
	if eos {
		x.picked.Done()
	}
	return out
}

// Body phases a chunk answers.
const (
	requestBody = iota
	responseBody
)

// appendChunks appends to out the StreamedBodyResponses carrying b in
// chunks of at most MaxChunkBytes, end_of_stream on the last when eos (one
// empty chunk for an empty b). The chunks alias b.
func appendChunks(out []*extprocv3.ProcessingResponse, b []byte, eos bool, which int) []*extprocv3.ProcessingResponse {
	for first := true; first || len(b) > 0; first = false {
		n := min(len(b), MaxChunkBytes)
		c := &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
			StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b[:n], EndOfStream: eos && n == len(b)}}}}
		b = b[n:]
		r := &extprocv3.ProcessingResponse{}
		if which == requestBody {
			r.Response = &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: c}}
		} else {
			r.Response = &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{Response: c}}
		}
		out = append(out, r)
	}
	return out
}

// setHeader is a header mutation that replaces any value the request had
// (a client's own x-gateway-destination-endpoint is never kept).
func setHeader(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{
		Header:       &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
	}
}

// headerValue is an Envoy header's value: raw_value, or value when the
// proxy sent that.
func headerValue(h *corev3.HeaderValue) string {
	if len(h.GetRawValue()) > 0 {
		return string(h.GetRawValue())
	}
	return h.GetValue()
}

// destinationMetadata is {"envoy.lb": {"x-gateway-destination-endpoint": dest}}.
func destinationMetadata(dest string) *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		DestinationNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			DestinationKey: structpb.NewStringValue(dest),
		}}),
	}}
}

// subsetHint reads the proxy's subset hint: the list, and whether it was
// given (an empty or malformed one is given and empty).
func subsetHint(md *corev3.Metadata) ([]string, bool) {
	ns := md.GetFilterMetadata()[SubsetNamespace]
	if ns == nil {
		return nil, false
	}
	v, ok := ns.GetFields()[SubsetKey]
	if !ok {
		return nil, false
	}
	var out []string
	for _, e := range v.GetListValue().GetValues() {
		if s := e.GetStringValue(); s != "" && len(out) < maxSubset {
			out = append(out, s)
		}
	}
	if s := v.GetStringValue(); s != "" { // a comma list, as some proxies send it
		for e := range strings.SplitSeq(s, ",") {
			if e = strings.TrimSpace(e); e != "" && len(out) < maxSubset {
				out = append(out, e)
			}
		}
	}
	return out, true
}

// maxSubset bounds the subset entries read (a hostile proxy's list).
const maxSubset = 4096

// servedEndpoint reads the proxy's served endpoint ("" when not reported).
func servedEndpoint(md *corev3.Metadata) string {
	ns := md.GetFilterMetadata()[DestinationNamespace]
	if ns == nil {
		return ""
	}
	return strings.TrimSpace(ns.GetFields()[ServedKey].GetStringValue())
}

// intersect returns the entries of a that b lists (ip or ip:port).
func intersect(a, b []string) []string {
	var out []string
	for _, e := range a {
		e = strings.TrimSpace(e)
		for _, f := range b {
			if e == f || strings.HasPrefix(f, e+":") {
				out = append(out, f)
			}
		}
	}
	return out
}
