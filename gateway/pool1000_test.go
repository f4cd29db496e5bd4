package gateway

import (
	"context"
	"fmt"
	"net/http"
	"testing"

	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
)

// TestLargePoolKeepsAffinity: a cache-aware pool of 200 endpoints (more
// than the 64 of one group of the approximate index) is accepted, and
// every conversation's next turn goes to the endpoint of its first, the
// endpoints of slots 64 and above included. (A precise-prefix pool of as
// many is accepted too since the precise index keeps groups of 64:
// TestPrecisePoolOver64Endpoints.)
func TestLargePoolKeepsAffinity(t *testing.T) {
	const n = 200
	cfg := eppBenchConfig(sched.CacheAware, n, 1)
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	pick := func(body []byte) string {
		t.Helper()
		pk, ref := g.Pick(context.Background(), &PickRequest{Method: http.MethodPost, Path: pathCompletions, Header: http.Header{}, Body: body})
		if ref != nil {
			t.Fatalf("refused: %d %s", ref.Status, ref.Body)
		}
		defer pk.Done()
		return pk.Destinations()[0]
	}
	high := 0
	for s := range 120 {
		first := pick(withModel(eppTokens(s, 10_000+s, 512, 512), 0, 1)) // 512 ids of the session's own
		if next := pick(withModel(eppTokens(s+1000, 10_000+s, 512, 600), 0, 1)); next != first {
			t.Fatalf("session %d: first turn on %s, next on %s", s, first, next)
		}
		// Endpoint i listens on 10.(i>>16).(i>>8&255).(i&255) and keeps
		// slot i (configuration order).
		var a, b, c int
		if _, err := fmt.Sscanf(first, "10.%d.%d.%d:8000", &a, &b, &c); err != nil {
			t.Fatalf("destination %q: %v", first, err)
		}
		if a<<16|b<<8|c >= prefix.MaxEndpoints {
			high++
		}
	}
	if high == 0 {
		t.Fatalf("no session went to an endpoint past slot %d", prefix.MaxEndpoints-1)
	}
}
