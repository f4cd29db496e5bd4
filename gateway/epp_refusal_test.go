package gateway

import (
	"bytes"
	"context"
	"net/http"
	"testing"

	"github.com/infergate/infergate/sched"
)

// TestPickRefusalOutlivesExchange: a refusal is recorded in the pooled
// exchange (no allocation for picks that are not refused), so the
// Refusal's header and body must be its own: picks and refusals that
// reuse the exchange afterwards leave them as they were.
func TestPickRefusalOutlivesExchange(t *testing.T) {
	g, err := New(context.Background(), eppBenchConfig(sched.CacheAware, 4, 1), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	ctx := context.Background()
	pick := func(body string) (*Picked, *Refusal) {
		return g.Pick(ctx, &PickRequest{Method: http.MethodPost, Path: pathChat, Header: http.Header{}, Body: []byte(body)})
	}
	_, ref := pick(`{"model":"nope","messages":[{"role":"user","content":"hi"}]}`)
	if ref == nil || ref.Status != http.StatusNotFound || !bytes.Contains(ref.Body, []byte("nope")) {
		t.Fatalf("unknown model: %+v", ref)
	}
	body, hdr := bytes.Clone(ref.Body), ref.Header.Clone()
	for range 8 {
		pk, r := pick(`{"model":"m0","messages":[{"role":"user","content":"hello there"}]}`)
		if r != nil {
			t.Fatalf("refused: %d %s", r.Status, r.Body)
		}
		pk.Done()
		if _, r = pick(`{"model":"m0","messages":[]}`); r == nil || r.Status != http.StatusBadRequest {
			t.Fatalf("empty messages: %+v", r)
		}
		r.Header.Set("X-Other", "1")
	}
	if !bytes.Equal(ref.Body, body) || len(ref.Header) != len(hdr) || ref.Header.Get("X-Other") != "" {
		t.Fatalf("the first refusal changed: %s %v, was %s %v", ref.Body, ref.Header, body, hdr)
	}
	if _, r := pick(`{"model":"m0","messages":[]}`); r == nil || r.Header == nil {
		t.Fatalf("refusal without a header: %+v", r)
	}
}
