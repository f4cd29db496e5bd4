package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// benchChat is a ~2 KB chat body, the request path benchmark's size.
func benchChat() string {
	msgs := []map[string]string{{"role": "system", "content": strings.Repeat("You are a helpful assistant. ", 30)}}
	for i := range 6 {
		msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("Question %d about rivers and mountains?", i)},
			map[string]string{"role": "assistant", "content": fmt.Sprintf("Answer %d: the Nile, the Amazon and K2.", i)})
	}
	b, _ := json.Marshal(map[string]any{"model": "m", "messages": msgs, "max_tokens": 64, "temperature": 0.7, "stream": true})
	return string(b)
}

// BenchmarkRenderKey: the render cache key of a 2 KB chat (one walk of the
// body's top-level members, xxhash).
func BenchmarkRenderKey(b *testing.B) {
	body := []byte(benchChat())
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		renderKey("m", kindChat, body)
	}
}

// BenchmarkEngineTokensCached: a render: engine pool's routing ids for a
// 2 KB chat answered from the render cache (no call): the cost a repeated
// request pays instead of a round trip.
func BenchmarkEngineTokensCached(b *testing.B) {
	ids := make([]uint32, 600)
	for i := range ids {
		ids[i] = uint32(1000 + i)
	}
	answer, _ := json.Marshal(map[string]any{"token_ids": ids})
	e := newRenderEngine(b, func(w http.ResponseWriter, _ *http.Request, _ []byte) { _, _ = w.Write(answer) })
	g, _ := startGateway(b, renderConfig(e))
	p := waitReady(b, g, "m")
	x := chatExchange(b, benchChat())
	dst, ok := g.engineTokens(context.Background(), nil, x, kindChat, p)
	if !ok || len(dst) != len(ids) {
		b.Fatalf("first call: %v, %d ids", ok, len(dst))
	}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		dst, _ = g.engineTokens(ctx, dst[:0], x, kindChat, p)
	}
	if len(e.asked()) != 1 {
		b.Fatalf("%d calls: the cache was missed", len(e.asked()))
	}
}

// BenchmarkParseRenderIDs: a chat render answer of 4,096 ids (vLLM's
// GenerateRequest with its sampling_params).
func BenchmarkParseRenderIDs(b *testing.B) {
	ids := make([]uint32, 4096)
	for i := range ids {
		ids[i] = uint32(i * 37 % 128256)
	}
	raw, _ := json.Marshal(map[string]any{"request_id": "chatcmpl-1", "token_ids": ids, "features": nil,
		"sampling_params": map[string]any{"max_tokens": 128, "temperature": 0.7, "stop": []string{}, "logit_bias": map[string]float64{"1": -1}},
		"model":           "m", "stream": false})
	dst := make([]uint32, 0, len(ids))
	b.SetBytes(int64(len(raw)))
	b.ReportAllocs()
	for b.Loop() {
		var err error
		if dst, err = parseRenderIDs(dst[:0], raw, maxRenderIDs); err != nil || len(dst) != len(ids) {
			b.Fatal(err)
		}
	}
}
