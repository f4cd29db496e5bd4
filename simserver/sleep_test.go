package simserver

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/sim"
)

// sleepGauge returns vllm:engine_sleep_state's value for sleep_state st.
func sleepGauge(t *testing.T, s *Server, st string) float64 {
	t.Helper()
	for _, m := range gatherOne(t, s, "vllm:engine_sleep_state").GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "sleep_state" && l.GetValue() == st {
				return m.GetGauge().GetValue()
			}
		}
	}
	t.Fatalf("no vllm:engine_sleep_state{sleep_state=%q}", st)
	return 0
}

// get GETs path and returns its status and body.
func get(t *testing.T, ts *httptest.Server, path string) (int, string) {
	t.Helper()
	r, err := http.Get(ts.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	b, _ := io.ReadAll(r.Body)
	return r.StatusCode, string(b)
}

// status POSTs body to path and returns the answer's status and body.
func status(t *testing.T, ts *httptest.Server, path, body string) (int, string) {
	t.Helper()
	r := post(t, ts, path, body)
	defer r.Body.Close()
	b, _ := io.ReadAll(r.Body)
	return r.StatusCode, string(b)
}

// TestStartupLoading checks a server with a start-up model: unready
// (/health 503, requests 503, the phase exposed) while it loads, then
// ready once Ready is closed.
func TestStartupLoading(t *testing.T) {
	// At time scale 1 the 70B default's start-up from the page cache is
	// 63.5 s of wall time: the server is certainly still loading.
	s, ts := newTestServer(t, ServerConfig{TimeScale: 1, Startup: &StartupConfig{Source: sim.SourcePageCache, ImageCached: true}})
	if got := s.State(); got != StateLoading {
		t.Fatalf("state %q right after Start, want loading", got)
	}
	if code, _ := get(t, ts, "/health"); code != http.StatusServiceUnavailable {
		t.Errorf("/health while loading: %d, want 503", code)
	}
	if code, body := status(t, ts, "/v1/completions", `{"model":"`+testModel+`","prompt":"hi","max_tokens":2}`); code != http.StatusServiceUnavailable ||
		!strings.Contains(body, "starting up") {
		t.Errorf("request while loading: %d %s, want 503 starting up", code, body)
	}
	ph := s.StartupPhases()
	if ph.WeightsLoad <= 0 || ph.WarmUp != 60*time.Second || ph.ImagePull != 0 {
		t.Errorf("phases %+v", ph)
	}
	waitFor(t, "a start-up phase exposed", func() bool {
		for _, m := range gatherOne(t, s, "infergate_sim_startup_phase").GetMetric() {
			if m.GetGauge().GetValue() == 1 {
				return true
			}
		}
		return false
	})

	// The same start-up 10,000× faster: 6.4 ms, then ready.
	s2, ts2 := newTestServer(t, ServerConfig{TimeScale: 10000, Startup: &StartupConfig{Source: sim.SourcePageCache, ImageCached: true}})
	select {
	case <-s2.Ready():
	case <-time.After(10 * time.Second):
		t.Fatal("the server did not become ready")
	}
	waitFor(t, "state ready", func() bool { return s2.State() == StateReady })
	if code, _ := get(t, ts2, "/health"); code != http.StatusOK {
		t.Errorf("/health once ready: %d", code)
	}
	if code, body := status(t, ts2, "/v1/completions", `{"model":"`+testModel+`","prompt":"hi","max_tokens":2}`); code != http.StatusOK {
		t.Errorf("request once ready: %d %s", code, body)
	}
	for _, m := range gatherOne(t, s2, "infergate_sim_startup_phase").GetMetric() {
		if m.GetGauge().GetValue() != 0 {
			t.Errorf("a start-up phase still set once ready: %v", m)
		}
	}

	// A profile without a start-up model is refused, not started instantly.
	cfg := ServerConfig{Startup: &StartupConfig{}}
	cfg.Engine.Profile = sim.DefaultProfile()
	cfg.Engine.Profile.Startup = sim.StartupProfile{}
	if _, err := NewServer(cfg); err == nil {
		t.Error("a start-up without a start-up model: want an error")
	}

	// Closed while loading: no goroutine is left behind.
	before := runtime.NumGoroutine()
	s3, err := NewServer(ServerConfig{TimeScale: 1, Startup: &StartupConfig{Source: sim.SourceRemote}})
	if err != nil {
		t.Fatal(err)
	}
	s3.Start()
	s3.Close()
	if got := s3.State(); got != StateStopped {
		t.Errorf("state after Close %q", got)
	}
	waitFor(t, fmt.Sprintf("goroutines back to %d", before), func() bool { return runtime.NumGoroutine() <= before })
}

// TestSleepWakeUp checks vLLM's sleep endpoints: /sleep aborts the
// requests in flight and pauses the engine, /is_sleeping and
// vllm:engine_sleep_state follow, a request sent while asleep waits and is
// served after /wake_up, partial wake-ups by tag, level 2, bad parameters.
func TestSleepWakeUp(t *testing.T) {
	s, ts := newTestServer(t, ServerConfig{TimeScale: 1000, EnableSleepMode: true})
	if code, body := get(t, ts, "/is_sleeping"); code != http.StatusOK || body != `{"is_sleeping":false}` {
		t.Fatalf("/is_sleeping awake: %d %s", code, body)
	}
	if sleepGauge(t, s, "awake") != 1 || sleepGauge(t, s, "weights_offloaded") != 0 {
		t.Fatal("sleep gauge awake: want awake 1")
	}

	// A long request in flight is aborted by the sleep.
	inflight := make(chan int, 1)
	go func() {
		r, err := http.Post(ts.URL+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"`+testModel+`","prompt":"x","max_tokens":100000}`))
		if err != nil {
			inflight <- -1
			return
		}
		r.Body.Close()
		inflight <- r.StatusCode
	}()
	waitFor(t, "the request running", func() bool { return s.Stats().Running == 1 })
	if code, body := status(t, ts, "/sleep?level=1", ""); code != http.StatusOK {
		t.Fatalf("/sleep: %d %s", code, body)
	}
	if code := <-inflight; code != http.StatusServiceUnavailable {
		t.Errorf("request in flight at the sleep: %d, want 503 (aborted)", code)
	}
	if code, body := get(t, ts, "/is_sleeping"); body != `{"is_sleeping":true}` {
		t.Errorf("/is_sleeping asleep: %d %s", code, body)
	}
	if sleepGauge(t, s, "awake") != 0 || sleepGauge(t, s, "weights_offloaded") != 1 || sleepGauge(t, s, "discard_all") != 0 {
		t.Error("sleep gauge at level 1: want awake 0, weights_offloaded 1")
	}
	if code, _ := get(t, ts, "/health"); code != http.StatusOK {
		t.Errorf("/health asleep: %d, want 200 (vLLM's: alive)", code)
	}
	if st := s.State(); st != StateSleeping {
		t.Errorf("state %q", st)
	}
	if code, _ := status(t, ts, "/sleep?level=2", ""); code != http.StatusOK {
		t.Errorf("/sleep again: %d (a no-op)", code)
	}

	// A request sent while asleep waits, unscheduled, until the wake-up.
	queued := make(chan string, 1)
	go func() {
		r, err := http.Post(ts.URL+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"`+testModel+`","prompt":"x","max_tokens":3}`))
		if err != nil {
			queued <- err.Error()
			return
		}
		b, _ := io.ReadAll(r.Body)
		r.Body.Close()
		queued <- fmt.Sprint(r.StatusCode, " ", string(b))
	}()
	waitFor(t, "the request queued", func() bool { return s.Stats().Waiting == 1 })
	if st := s.Stats(); st.Running != 0 {
		t.Errorf("asleep, %d requests run", st.Running)
	}
	// Weights first: still asleep (the KV cache's tag sleeps).
	if code, _ := status(t, ts, "/wake_up?tags=weights", ""); code != http.StatusOK {
		t.Fatalf("/wake_up?tags=weights: %d", code)
	}
	if _, body := get(t, ts, "/is_sleeping"); body != `{"is_sleeping":true}` {
		t.Errorf("after waking the weights only: %s", body)
	}
	select {
	case got := <-queued:
		t.Fatalf("the queued request was answered before the wake-up: %s", got)
	default:
	}
	if code, _ := status(t, ts, "/wake_up?tags=kv_cache", ""); code != http.StatusOK {
		t.Fatalf("/wake_up?tags=kv_cache: %d", code)
	}
	if _, body := get(t, ts, "/is_sleeping"); body != `{"is_sleeping":false}` {
		t.Errorf("after waking every tag: %s", body)
	}
	select {
	case got := <-queued:
		if !strings.HasPrefix(got, "200 ") {
			t.Errorf("the request queued while asleep: %s", got)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the request queued while asleep was not served after the wake-up")
	}
	if sleepGauge(t, s, "awake") != 1 {
		t.Error("sleep gauge after the wake-up: want awake 1")
	}

	// Level 2: discard_all; a bare /wake_up wakes everything.
	if code, _ := status(t, ts, "/sleep?level=2", ""); code != http.StatusOK {
		t.Fatal("/sleep?level=2")
	}
	if sleepGauge(t, s, "discard_all") != 1 || sleepGauge(t, s, "weights_offloaded") != 0 {
		t.Error("sleep gauge at level 2: want discard_all 1")
	}
	if code, _ := status(t, ts, "/wake_up", ""); code != http.StatusOK {
		t.Fatal("/wake_up")
	}
	if code, body := status(t, ts, "/v1/completions", `{"model":"`+testModel+`","prompt":"x","max_tokens":2}`); code != http.StatusOK {
		t.Errorf("request after waking from level 2: %d %s", code, body)
	}
	if code, _ := status(t, ts, "/wake_up", ""); code != http.StatusOK {
		t.Error("/wake_up awake: want 200 (a no-op)")
	}

	for _, bad := range []string{"/sleep?level=3", "/sleep?level=x", "/sleep?mode=wait", "/wake_up?tags=gpu"} {
		if code, body := status(t, ts, bad, ""); code != http.StatusBadRequest || !strings.Contains(body, `"error"`) {
			t.Errorf("%s: %d %s, want a 400 OpenAI error", bad, code, body)
		}
	}

	// Without --enable-sleep-mode the routes do not exist, as in vLLM.
	_, ts2 := newTestServer(t, ServerConfig{})
	if code, _ := status(t, ts2, "/sleep", ""); code != http.StatusNotFound {
		t.Errorf("/sleep without sleep mode: %d, want 404", code)
	}
	if code, _ := get(t, ts2, "/is_sleeping"); code != http.StatusNotFound {
		t.Errorf("/is_sleeping without sleep mode: %d, want 404", code)
	}
}

// TestSleepCallersLeave: sleeps and wake-ups take turns (one engine call
// at a time, each waiting its modelled copy time); a call waiting for its
// turn leaves when its client does. Before, a storm of /wake_up calls
// behind a long /sleep kept every handler (50 here) waiting for the sleep,
// and each then ran for a client long gone.
func TestSleepCallersLeave(t *testing.T) {
	// At time scale 0.001 the level-1 offload takes hours of wall time:
	// the sleep holds the turn for the whole test.
	s, ts := newTestServer(t, ServerConfig{TimeScale: 0.001, EnableSleepMode: true})
	go func() {
		r, err := http.Post(ts.URL+"/sleep?level=1", "", nil)
		if err == nil {
			r.Body.Close()
		}
	}()
	waitFor(t, "the sleep under way", func() bool { return s.State() == StateSleeping })
	base := runtime.NumGoroutine()
	const n = 50
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{}, n)
	for range n {
		go func() {
			defer func() { done <- struct{}{} }()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, ts.URL+"/wake_up", nil)
			if r, err := http.DefaultClient.Do(req); err == nil {
				r.Body.Close()
			}
		}()
	}
	waitFor(t, "the wake-ups waiting", func() bool { return runtime.NumGoroutine() >= base+2*n })
	cancel()
	for range n {
		<-done
	}
	http.DefaultClient.CloseIdleConnections()
	waitFor(t, "the wake-ups' handlers gone", func() bool { return runtime.NumGoroutine() <= base+5 })
	if got := s.State(); got != StateSleeping {
		t.Errorf("state %q after the wake-ups left, want sleeping", got)
	}
}
