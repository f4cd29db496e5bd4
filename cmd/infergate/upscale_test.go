package main

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/sim"
)

// streamTTFT posts a streaming chat and returns its status, the time to
// its first content event and whether it ended with [DONE].
func streamTTFT(t *testing.T, url, body string) (status int, ttft time.Duration, done bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	t0 := time.Now()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Error(err)
		return 0, 0, false
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		l := sc.Text()
		if ttft == 0 && strings.HasPrefix(l, "data: {") && strings.Contains(l, `"content":"`) && !strings.Contains(l, `"content":""`) {
			ttft = time.Since(t0)
		}
		if l == "data: [DONE]" {
			done = true
		}
	}
	return resp.StatusCode, ttft, done
}

// TestUpScaleFromZero runs `infergate up --engines 0..3 --autoscale
// target=2,...` as a real process: no engine runs; 8 concurrent streaming
// requests are held, the gateway's wake-up hook (the fleet) starts one
// engine through its modelled cold start, and every request is served (none
// lost); the first request's TTFT is the cold start at the time scale plus
// its own prefill (logged, not asserted: wall time). The held requests are
// the pool's queue signal, so the gateway's autoscale.Scaler asks for
// ⌈8 / 2⌉ capped at max 3 engines and the fleet starts more than one (the
// fleet's "engine starting" log for slot 1 and 2: events, not timings).
// Once idle for the rate window and the down window, the policy scales the
// fleet to zero (every engine stops), and the next request starts a new
// cold episode.
func TestUpScaleFromZero(t *testing.T) {
	const scale = 20
	p := start(t, "up", "--engines", "0..3", "--listen", "127.0.0.1:0", "--time-scale", strconv.Itoa(scale),
		"--autoscale", "target=2,interval=100ms,rate_window=2s", "--idle-timeout", "1s", "--access-log=false", "--shutdown-grace", "5s")
	base := p.await(t, apiRe)
	modelled, err := strconv.ParseFloat(p.await(t, regexp.MustCompile(`cold start: ([0-9.]+)s modelled`)), 64)
	if err != nil {
		t.Fatal(err)
	}
	p.await(t, regexp.MustCompile(`autoscaling (min=0,max=3,target=2,down_window=1s)`))
	model := "meta-llama/Llama-3.1-70B-Instruct"
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"Hello!"}],"max_tokens":4,"stream":true}`, model)

	const n = 8
	var wg sync.WaitGroup
	ttfts := make([]time.Duration, n)
	for i := range n {
		wg.Go(func() {
			code, ttft, done := streamTTFT(t, base+"/v1/chat/completions", body)
			if code != http.StatusOK || !done {
				t.Errorf("request %d: status %d, [DONE] %v", i, code, done)
			}
			ttfts[i] = ttft
		})
	}
	// Scale-up beyond one engine, while the requests are held (each
	// start is logged as it happens).
	for _, slot := range []string{"0", "1", "2"} {
		p.await(t, regexp.MustCompile(`(engine starting).* slot=`+slot+` `))
	}
	wg.Wait()
	first := ttfts[0]
	for _, d := range ttfts {
		first = min(first, d)
	}
	prefill := sim.DefaultProfile().PrefillTime(43, 0) // "Hello!" rendered: 43 prompt tokens
	want := time.Duration((modelled*float64(time.Second) + float64(prefill)) / scale)
	t.Logf("first of %d held requests: TTFT %v; modelled cold start %.1fs + prefill %v at %dx = %v (+%v: probe, dispatch, HTTP; load-dependent)",
		n, first.Round(time.Millisecond), modelled, prefill.Round(time.Millisecond), scale, want.Round(time.Millisecond), (first - want).Round(time.Millisecond))
	if v := metricValue(t, base, "infergate_held_requests_total"); v != n {
		t.Errorf("held_requests_total %v, want %d", v, n)
	}
	if v := metricValue(t, base, "infergate_wakeups_total", `result="ok"`); v != 1 {
		t.Errorf("wakeups_total %v, want 1", v)
	}
	if v := metricValue(t, base, "infergate_held_expired_total"); v != 0 {
		t.Errorf("held_expired_total %v", v)
	}

	// Idle for the rate window and then the down window (--idle-timeout):
	// the policy wants 0, every engine drains and stops, and the gateway
	// sees no ready endpoint.
	if v := metricValue(t, base, "infergate_autoscale_desired_replicas"); v < 0 || v > 3 {
		t.Errorf("desired replicas %v outside 0..3", v)
	}
	deadline := time.Now().Add(time.Minute)
	for metricValue(t, base, "infergate_endpoint_ready") != 0 || metricValue(t, base, "infergate_autoscale_desired_replicas") != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the idle engines did not stop")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if code, _, done := streamTTFT(t, base+"/v1/chat/completions", body); code != http.StatusOK || !done {
		t.Errorf("after scaling to zero: %d", code)
	}
	if v := metricValue(t, base, "infergate_wakeups_total", `result="ok"`); v != 2 {
		t.Errorf("wakeups_total %v after a second cold episode, want 2", v)
	}
	p.stop(t)
}

// TestUpElasticFlags: --engines MIN..MAX is parsed and its companions are
// checked before anything starts.
func TestUpElasticFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--engines", "3..1"}, "MIN <= MAX"},
		{[]string{"--engines", "0..99"}, "MAX <= 64"},
		{[]string{"--engines", "x"}, "N or MIN..MAX"},
		{[]string{"--idle-timeout", "5s"}, "needs --engines MIN..MAX"},
		{[]string{"--autoscale", "target=2"}, "needs --engines MIN..MAX"},
		{[]string{"--engines", "0..2", "--autoscale", "max=4"}, "--engines 0..2 sets it"},
		{[]string{"--engines", "0..2", "--autoscale", "bogus=1"}, "unknown keys"},
		{[]string{"--engines", "0..2", "--autoscale", "interval=0s"}, "positive duration"},
		{[]string{"--engines", "0..2", "--startup-source", "tape"}, "want remote, nvme, page_cache or peer"},
		{[]string{"--engines", "0..2", "--policy", "precise-prefix"}, "KV events"},
		{[]string{"--engines", "0..2", "--pd", "1:1"}, "give one"},
	} {
		c := infergateCommand(append([]string{"up", "--listen", "127.0.0.1:0"}, tc.args...)...)
		c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
		out, err := c.CombinedOutput()
		if err == nil || !strings.Contains(string(out), tc.want) {
			t.Errorf("up %v: %v, want an error with %q; output:\n%s", tc.args, err, tc.want, out)
		}
	}
}
