package gateway

import (
	"bytes"
	"context"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
)

var (
	eppFuzzOnce sync.Once
	eppFuzzGW   *Gateway
)

// eppFuzzGateway is one gateway for every fuzz input: two endpoints that
// are never dialled and never ejected.
func eppFuzzGateway(t *testing.T) *Gateway {
	eppFuzzOnce.Do(func() {
		cfg := eppBenchConfig("cache-aware", 2, 1)
		cfg.Outlier.ConsecutiveErrors = 1 << 30 // broken answers never eject the endpoints
		g, err := New(context.Background(), cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		eppFuzzGW = g // lives as long as the fuzz process
	})
	return eppFuzzGW
}

// FuzzEPPResponseBody feeds an answer, split at the offsets cuts names,
// through a picked request's response phase (Picked.ResponseHeaders,
// ResponseBody: the SSE event splitter, the usage reading, the usage-only
// chunk's stripping, a whole answer's held prefix): no panic; a stream the
// gateway does not edit (the client asked for usage) and every whole
// answer are passed on byte for byte; the gateway sees [DONE] when a
// client's parser does (internal/ssetest: lone CRs end lines); the
// request's slot is released.
func FuzzEPPResponseBody(f *testing.F) {
	chunk := `data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"}}]}` + "\n\n"
	usage := `data: {"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}` + "\n\n"
	f.Add([]byte(chunk+usage+"data: [DONE]\n\n"), []byte{3, 50, 1}, true, true, "text/event-stream")
	f.Add([]byte(chunk+chunk+"data: [DONE]\n\n"), []byte{0}, true, false, "text/event-stream")
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":{\"prompt_tokens\":1}}\r\n\r\nevent: x\ndata: y\n\n:c\n\n"), []byte{7, 7}, true, true, "text/event-stream")
	f.Add([]byte(`{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`), []byte{10}, false, false, "application/json")
	f.Add([]byte("data: "+string(bytes.Repeat([]byte("a"), 300))+"\n"), []byte{1, 2, 3}, true, false, "text/event-stream")
	f.Add([]byte(crStream), []byte{byte(strings.Index(crStream, "\r\r") + 1)}, true, false, "text/event-stream")
	f.Add([]byte(strings.ReplaceAll(chunk+usage, "\n", "\r")+"data: [DONE]\r\r"), []byte{40, 40, 40}, true, true, "text/event-stream")
	f.Add([]byte("\xEF\xBB\xBF"+usage+"data: [DONE]\r\n\r"), []byte{1, 1, 1}, true, true, "text/event-stream")
	f.Fuzz(func(t *testing.T, answer, cuts []byte, stream, strip bool, contentType string) {
		g := eppFuzzGateway(t)
		body := `{"model":"m0","messages":[{"role":"user","content":"hi"}]}`
		if stream {
			body = `{"model":"m0","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`
			if strip {
				body = `{"model":"m0","stream":true,"messages":[{"role":"user","content":"hi"}]}`
			}
		}
		pk, ref := g.Pick(context.Background(), &PickRequest{Method: http.MethodPost, Path: pathChat, Header: http.Header{}, Body: []byte(body)})
		if ref != nil {
			t.Fatalf("refused: %d %s", ref.Status, ref.Body)
		}
		ep := pk.ep
		pk.ResponseHeaders(http.StatusOK, http.Header{"Content-Type": {contentType}})
		var out []byte
		prev := 0
		for _, c := range cuts {
			at := prev + int(c)
			if at >= len(answer) {
				break
			}
			out = append(out, pk.ResponseBody(answer[prev:at], false)...)
			prev = at
		}
		out = append(out, pk.ResponseBody(answer[prev:], true)...)
		if r := &pk.resp; r.sse && !r.pass {
			// Each event the splitter read is the one a client reads
			// there: [DONE] is seen by both or neither.
			if client := slices.Contains(clientEvents(out), "[DONE]"); client != r.sawDone {
				t.Fatalf("%q: [DONE] seen by the gateway %v, by a client %v", out, r.sawDone, client)
			}
		}
		pk.Done()
		if !(stream && strip) && !bytes.Equal(out, answer) {
			t.Fatalf("passed on %q, want %q", out, answer)
		}
		if n := ep.ledger.InFlight(); n != 0 {
			t.Fatalf("in flight %d after Done", n)
		}
	})
}
