package gateway

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/openai"
)

// TestEngineRenderConcurrencyCap: with render_concurrency calls of a pool
// in flight, the next request is routed on the gateway's own tokens at
// once (no call, fallback reason saturated); once they end, calls are
// made again.
func TestEngineRenderConcurrencyCap(t *testing.T) {
	release := make(chan struct{})
	var held sync.WaitGroup
	e := newRenderEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
		held.Add(1)
		defer held.Done()
		select {
		case <-release:
			_, _ = io.WriteString(w, `{"token_ids":[1,2,3]}`)
		case <-r.Context().Done():
		}
	})
	released := false
	defer func() {
		if !released {
			close(release)
		}
		held.Wait()
	}()
	cfg := renderConfig(e)
	cfg.RenderConcurrency = 2
	g, url := startGateway(t, cfg)
	p := waitReady(t, g, "m")
	ctx := context.Background()
	chat := func(i int) *exchange {
		return chatExchange(t, fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"q%d"}]}`, i))
	}
	done := make(chan bool, 2)
	for i := range 2 {
		go func() {
			_, ok := g.engineTokens(ctx, nil, chat(i), kindChat, p)
			done <- ok
		}()
	}
	for deadline := time.Now().Add(30 * time.Second); len(e.asked()) < 2; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of 2 render calls reached the engine in 30s", len(e.asked()))
		}
	}
	third := make(chan bool, 1)
	go func() {
		_, ok := g.engineTokens(ctx, nil, chat(2), kindChat, p)
		third <- ok
	}()
	select {
	case ok := <-third:
		if ok || len(e.asked()) != 2 {
			t.Fatalf("past the cap: ids %v, %d calls made", ok, len(e.asked()))
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a request past render_concurrency waited for a call slot")
	}
	close(release)
	released = true
	for range 2 {
		select {
		case ok := <-done:
			if !ok {
				t.Fatal("a call within the cap failed")
			}
		case <-time.After(30 * time.Second):
			t.Fatal("released calls did not end in 30s")
		}
	}
	if ids, ok := g.engineTokens(ctx, nil, chat(3), kindChat, p); !ok || len(ids) != 3 || len(e.asked()) != 3 {
		t.Fatalf("after the calls ended: %v %v, %d calls", ids, ok, len(e.asked()))
	}
	if n := p.renderInFlight.Load(); n != 0 {
		t.Fatalf("%d calls counted in flight after all ended", n)
	}
	m := scrape(t, testClient(t), url)
	if m.value("infergate_render_fallbacks_total", `model="m",reason="saturated"`) != 1 {
		t.Errorf("metrics:\n%s", strings.Join(m.grep("infergate_render"), "\n"))
	}
}

// TestEngineRenderSlowRefusalBacksOff: a 4xx refusal that took over half
// of render_timeout backs the endpoint off (it is too slow to answer in
// time), a quick one does not (TestEngineRenderStallAndBackoff). The call
// is timed by the render client's clock, here one that moves a minute a
// reading.
func TestEngineRenderSlowRefusalBacksOff(t *testing.T) {
	e := newRenderEngine(t, func(w http.ResponseWriter, _ *http.Request, _ []byte) {
		openai.WriteError(w, openai.NewError(http.StatusBadRequest, "too long", "", ""))
	})
	g, url := startGateway(t, renderConfig(e))
	g.render.backoff = time.Hour
	var mu sync.Mutex
	now := time.Unix(0, 0)
	g.render.clock = func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		now = now.Add(time.Minute)
		return now
	}
	p := waitReady(t, g, "m")
	for i := range 2 {
		if _, ok := g.engineTokens(context.Background(), nil, chatExchange(t, fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"%d"}]}`, i)), kindChat, p); ok {
			t.Fatal("ids from a refusal")
		}
	}
	if len(e.asked()) != 1 {
		t.Fatalf("a slowly refusing endpoint was asked %d times of 2", len(e.asked()))
	}
	m := scrape(t, testClient(t), url)
	if m.value("infergate_render_fallbacks_total", `model="m",reason="rejected_slow"`) != 1 ||
		m.value("infergate_render_fallbacks_total", `model="m",reason="no_endpoint"`) != 1 {
		t.Errorf("metrics:\n%s", strings.Join(m.grep("infergate_render"), "\n"))
	}
}

// TestRenderResult: the classification of one call's outcome.
func TestRenderResult(t *testing.T) {
	const timeout = 200 * time.Millisecond
	for _, c := range []struct {
		err             error
		canceled, timed bool
		status          int
		took            time.Duration
		want            string
	}{
		{nil, false, false, 200, time.Second, renderOK},
		{context.DeadlineExceeded, true, true, 0, timeout, renderCanceled},
		{context.DeadlineExceeded, false, true, 0, timeout, renderTimeout},
		{errNoRoute, false, false, 404, 0, renderUnsupported},
		{nil, false, false, 405, 0, renderUnsupported},
		{nil, false, false, 503, 0, renderError},
		{nil, false, false, 307, 0, renderError},
		{nil, false, false, 400, timeout / 2, renderRejected},
		{nil, false, false, 400, timeout/2 + 1, renderSlowReject},
		{nil, false, false, 404, 150 * time.Millisecond, renderSlowReject},
	} {
		if got := renderResult(c.err, c.canceled, c.timed, c.status, c.took, timeout); got != c.want {
			t.Errorf("%v %d after %v: %s, want %s", c.err, c.status, c.took, got, c.want)
		}
	}
}

// TestEngineRenderConcurrencyAcrossReload: render calls in flight on a
// pool that a reload replaced count against the new pool's
// render_concurrency (the model's calls share one count). Before, each
// reload started a count from zero: with the old pool's calls still held,
// the new pool made render_concurrency more, and every reload within
// render_timeout let another render_concurrency answers of up to 16 MiB in.
func TestEngineRenderConcurrencyAcrossReload(t *testing.T) {
	release, started := make(chan struct{}), make(chan struct{}, 4)
	var held sync.WaitGroup
	e := newRenderEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
		held.Add(1)
		defer held.Done()
		started <- struct{}{}
		select {
		case <-release:
			_, _ = io.WriteString(w, `{"token_ids":[1,2,3]}`)
		case <-r.Context().Done():
		}
	})
	released := false
	defer func() {
		if !released {
			close(release)
		}
		held.Wait()
	}()
	cfg := renderConfig(e)
	cfg.RenderConcurrency = 1
	g, _ := startGateway(t, cfg)
	p := waitReady(t, g, "m")
	ctx := context.Background()
	chat := func(i int) *exchange {
		return chatExchange(t, fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"q%d"}]}`, i))
	}
	first := make(chan bool, 1)
	go func() {
		_, ok := g.engineTokens(ctx, nil, chat(0), kindChat, p)
		first <- ok
	}()
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("the render call did not reach the engine in 30s")
	}
	if err := g.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	n := g.state.Load().pools["m"]
	if n == p {
		t.Fatal("the reload kept the pool")
	}
	second := make(chan bool, 1)
	go func() {
		_, ok := g.engineTokens(ctx, nil, chat(1), kindChat, n)
		second <- ok
	}()
	select {
	case ok := <-second:
		if ok || len(e.asked()) != 1 {
			t.Fatalf("past the cap after a reload: ids %v, %d calls made", ok, len(e.asked()))
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("the new pool made a second call while the old pool's held the only slot (%d calls)", len(e.asked()))
	}
	close(release)
	released = true
	select {
	case ok := <-first:
		if !ok {
			t.Fatal("the call within the cap failed")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the released call did not end in 30s")
	}
	if n := n.renderInFlight.Load(); n != 0 {
		t.Fatalf("%d calls counted in flight after all ended", n)
	}
}
