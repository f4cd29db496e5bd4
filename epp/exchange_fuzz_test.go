package epp

import (
	"context"
	"sync"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/sched"
)

var (
	fuzzOnce   sync.Once
	fuzzServer *Server
)

// fuzzPicker is one picker for every input: two endpoints never dialled
// (health checks off), never ejected, a 64 KiB body limit.
func fuzzPicker(t *testing.T) *Server {
	fuzzOnce.Do(func() {
		cfg := testConfig(sched.CacheAware, "http://10.0.0.1:8000", "http://10.0.0.2:8000")
		cfg.HealthCheckPath = "-"
		cfg.MaxBodyBytes = 64 << 10
		cfg.Outlier.ConsecutiveErrors = 1 << 30
		cfg.EPP.ConformanceTestHooks = true
		g, err := gateway.New(context.Background(), cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		s, err := New(g, cfg.EPP.WithDefaults(), Options{MaxBufferedBytes: 1 << 20})
		if err != nil {
			t.Fatal(err)
		}
		fuzzServer = s
	})
	return fuzzServer
}

// FuzzExchange drives one stream's state machine with the messages ops
// spells (one byte each: the phase, end_of_stream, how much of data it
// carries, metadata), data giving the bodies and header values: no panic;
// every response's chunks within MaxChunkBytes; once the stream ends,
// nothing is left buffered or in flight.
func FuzzExchange(f *testing.F) {
	chat := []byte(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}`)
	f.Add([]byte{0x00, 0x11, 0x22, 0x33}, append(chat, "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: [DONE]\n\n"...))
	f.Add([]byte{0x08, 0x31}, chat)
	f.Add([]byte{0x00, 0x01, 0x01, 0x11, 0x04, 0x05}, chat)
	f.Add([]byte{0x40, 0x11, 0x22, 0x23, 0x33, 0x35}, chat)
	f.Add([]byte{0x02, 0x03, 0x00, 0x00, 0x07}, []byte("garbage"))
	f.Fuzz(func(t *testing.T, ops, data []byte) {
		s := fuzzPicker(t)
		x := &exchange{s: s, ctx: context.Background()}
		off := 0
		take := func(n int) []byte {
			n = min(n, len(data)-off)
			b := data[off : off+n]
			off += n
			return b
		}
		for _, op := range ops {
			eos := op&0x08 != 0
			var md *corev3.Metadata
			if op&0x40 != 0 {
				md = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
					SubsetNamespace:      {Fields: map[string]*structpb.Value{SubsetKey: structpb.NewStringValue(string(take(20)))}},
					DestinationNamespace: {Fields: map[string]*structpb.Value{ServedKey: structpb.NewStringValue("10.0.0.2:8000")}}}}
			}
			n := int(op>>4&0x3) * 40
			if op>>4&0x3 == 3 {
				n = len(data)
			}
			req := &extprocv3.ProcessingRequest{MetadataContext: md}
			switch op & 0x7 {
			case 0:
				req.Request = &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{EndOfStream: eos,
					Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":method", RawValue: []byte("POST")},
						{Key: ":path", RawValue: []byte("/v1/chat/completions")}, {Key: TestSelectionHeader, Value: string(take(8))}}}}}
			case 1:
				req.Request = &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: take(n), EndOfStream: eos}}
			case 2:
				req.Request = &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}
			case 3:
				req.Request = &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{EndOfStream: eos,
					Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: take(3)},
						{Key: "content-type", RawValue: []byte("text/event-stream")}}}}}
			case 4, 5:
				req.Request = &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: take(n), EndOfStream: eos}}
			case 6:
				req.Request = &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}
			}
			out, err := x.handle(req)
			for _, r := range out {
				var sr *extprocv3.StreamedBodyResponse
				if b := r.GetRequestBody(); b != nil {
					sr = b.GetResponse().GetBodyMutation().GetStreamedResponse()
				} else if b := r.GetResponseBody(); b != nil {
					sr = b.GetResponse().GetBodyMutation().GetStreamedResponse()
				}
				if len(sr.GetBody()) > MaxChunkBytes {
					t.Fatalf("chunk of %d bytes", len(sr.GetBody()))
				}
			}
			if err != nil {
				break
			}
		}
		x.end()
		if b := s.Buffered(); b != 0 {
			t.Fatalf("%d bytes buffered after the stream ended", b)
		}
		if r, _, _ := s.g.ReadyEndpoints(); r != 2 {
			t.Fatalf("%d endpoints ready", r)
		}
	})
}
