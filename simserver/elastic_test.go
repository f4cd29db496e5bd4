package simserver

import (
	"context"
	"fmt"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/sim"
)

// slotHealth GETs url's /health and returns the status.
func slotHealth(t *testing.T, url string) int {
	t.Helper()
	r, err := http.Get(url + "/health")
	if err != nil {
		t.Fatal(err)
	}
	r.Body.Close()
	return r.StatusCode
}

// TestElasticFleet: a fleet of 0..2 starts with no engine (its slots
// answer 503), Wake starts one through its modelled cold start, SetDesired
// starts several and drains idle ones, ScaleTo takes the most of the pools'
// decisions, and Close leaves no goroutine.
func TestElasticFleet(t *testing.T) {
	before := runtime.NumGoroutine()
	func() {
		cfg := ServerConfig{TimeScale: 10000, Startup: &StartupConfig{Source: sim.SourcePageCache, ImageCached: true}}
		f, err := StartElasticFleet(cfg, ElasticConfig{Min: 0, Max: 2, Drain: 100 * time.Millisecond, Tick: 10 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		defer http.DefaultClient.CloseIdleConnections()
		if len(f.URLs) != 2 || f.Desired() != 0 {
			t.Fatalf("URLs %v, desired %d", f.URLs, f.Desired())
		}
		for _, u := range f.URLs {
			if code := slotHealth(t, u); code != http.StatusServiceUnavailable {
				t.Errorf("stopped slot /health: %d", code)
			}
		}
		r, err := http.Post(f.URLs[0]+"/v1/completions", "application/json", strings.NewReader(`{"model":"`+testModel+`","prompt":"x","max_tokens":2}`))
		if err != nil {
			t.Fatal(err)
		}
		r.Body.Close()
		if r.StatusCode != http.StatusServiceUnavailable {
			t.Errorf("request to a stopped slot: %d", r.StatusCode)
		}

		if err := f.Wake(context.Background(), testModel); err != nil {
			t.Fatal(err)
		}
		if f.Desired() != 1 {
			t.Fatalf("desired %d after Wake", f.Desired())
		}
		s := f.Servers()[0]
		if s == nil {
			t.Fatal("Wake started no engine in slot 0")
		}
		select {
		case <-s.Ready():
		case <-time.After(10 * time.Second):
			t.Fatal("the engine did not finish its start-up")
		}
		waitFor(t, "slot 0 healthy", func() bool { return slotHealth(t, f.URLs[0]) == http.StatusOK })
		r, err = http.Post(f.URLs[0]+"/v1/completions", "application/json", strings.NewReader(`{"model":"`+testModel+`","prompt":"x","max_tokens":2}`))
		if err != nil {
			t.Fatal(err)
		}
		r.Body.Close()
		if r.StatusCode != http.StatusOK {
			t.Errorf("request once ready: %d", r.StatusCode)
		}
		f.SetDesired(5) // clamped to max 2
		if f.Desired() != 2 {
			t.Errorf("desired %d, want 2 (max)", f.Desired())
		}
		waitFor(t, "two engines ready", func() bool { _, ready := f.Running(); return ready == 2 })
		f.SetDesired(0) // both idle: they drain, then stop
		waitFor(t, "both engines stopped", func() bool { started, _ := f.Running(); return started == 0 })
		for _, u := range f.URLs {
			if code := slotHealth(t, u); code != http.StatusServiceUnavailable {
				t.Errorf("stopped slot /health: %d", code)
			}
		}

		// ScaleTo: per-pool decisions; the fleet runs the most any pool
		// wants, and a woken pool counts one until its next decision.
		// StartingEngines counts the engines in their start-up.
		g, err := StartElasticFleet(ServerConfig{TimeScale: 1, Startup: cfg.Startup},
			ElasticConfig{Max: 3, Drain: 20 * time.Millisecond, Tick: 10 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		defer g.Close()
		_ = g.Wake(context.Background(), "a")
		g.ScaleTo("b", 0)
		if g.Desired() != 1 || g.StartingEngines("a") != 1 {
			t.Fatalf("after Wake(a), ScaleTo(b, 0): desired %d, starting %d; want 1, 1", g.Desired(), g.StartingEngines("a"))
		}
		g.ScaleTo("b", 3)
		g.ScaleTo("a", 0)
		if g.Desired() != 3 || g.StartingEngines("b") != 3 {
			t.Fatalf("ScaleTo(b, 3): desired %d, starting %d; want 3, 3 (a 63.5 s start at 1x: still loading)", g.Desired(), g.StartingEngines("b"))
		}
		g.ScaleTo("b", 9) // clamped to max
		g.ScaleTo("b", 0)
		if g.Desired() != 0 {
			t.Errorf("desired %d after every pool asked for 0", g.Desired())
		}
		if _, err := StartElasticFleet(cfg, ElasticConfig{Min: 3, Max: 2}); err == nil {
			t.Error("min > max: want an error")
		}
	}()
	waitFor(t, fmt.Sprintf("goroutines back to %d", before), func() bool { return runtime.NumGoroutine() <= before })
}
