package main

import (
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestStoppedEngineTimedOut is the attack run's shape with real processes:
// `infergate serve` in front of two `infergate sim` engines, one of them
// SIGSTOPped. The stopped engine's kernel still accepts connections and
// takes the requests, and nothing answers them: each times out
// (first_event_timeout for a stream, response_header_timeout otherwise)
// and completes on the other engine, without waiting for SIGCONT. The
// timeouts are short here so that the test is quick; what it asserts is
// the outcome (every answer complete, the retries counted), not time.
func TestStoppedEngineTimedOut(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	// Probes and scrapes off: the stopped engine stays in rotation, as it
	// did for the attack until requests to it failed.
	base := startWithStoppedEngine(t, "first_event_timeout: 2s\nresponse_header_timeout: 2s\nstream_idle_timeout: 2s\n"+
		"health_check_path: \"-\"\nscrape_interval: -1s\nretry: {budget_percent: 100}\n")

	c := &http.Client{Timeout: 30 * time.Second}
	retried := 0
	for i := range 6 {
		stream := i%3 != 2
		body := `{"model":"m","max_tokens":4,"stream":` + strconv.FormatBool(stream) + `,"messages":[{"role":"user","content":"hello"}]}`
		resp, err := c.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != 200 || strings.Contains(string(b), `"error"`) ||
			(stream && !strings.HasSuffix(string(b), "data: [DONE]\n\n")) || (!stream && !strings.Contains(string(b), `"choices"`)) {
			t.Fatalf("request %d (stream %v): %d %v\n%s", i, stream, resp.StatusCode, err, b)
		}
		if resp.Header.Get("X-Infergate-Attempts") == "2" {
			retried++
		}
	}
	if retried == 0 {
		t.Fatal("no request reached the stopped engine")
	}
	if timeouts := metricValue(t, base, "infergate_retries_total", `reason="timeout"`); int(timeouts) != retried {
		t.Errorf("retries_total{timeout} = %v, want %d", timeouts, retried)
	}
	t.Logf("%d of 6 requests reached the stopped engine, timed out and completed on the other", retried)
}

// TestStoppedEngineAbortedByHealthChecks is the same shape with the
// health checker on and response_header_timeout at its default (10
// minutes): the non-streaming requests the stopped engine took are
// aborted once its probes fail health_check_abort_after times in a row,
// and complete on the other engine without waiting for SIGCONT or the
// timeout. (Round-robin sends half of the requests, sent at once after
// the SIGSTOP, to the stopped engine: its first probe can fail only a
// health_check_timeout later.)
func TestStoppedEngineAbortedByHealthChecks(t *testing.T) {
	base := startWithStoppedEngine(t, "health_check_interval: 200ms\nhealth_check_timeout: 1s\n"+
		"scrape_interval: -1s\nretry: {budget_percent: 100}\n")

	c := &http.Client{Timeout: 2 * time.Minute}
	const n = 4
	type answer struct {
		status   int
		attempts string
		body     string
		err      error
	}
	answers := make(chan answer, n)
	for range n {
		go func() {
			body := `{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hello"}]}`
			resp, err := c.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
			if err != nil {
				answers <- answer{err: err}
				return
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			answers <- answer{resp.StatusCode, resp.Header.Get("X-Infergate-Attempts"), string(b), err}
		}()
	}
	retried := 0
	for range n {
		a := <-answers
		if a.err != nil || a.status != 200 || !strings.Contains(a.body, `"choices"`) {
			t.Fatalf("answer: %d %v\n%s", a.status, a.err, a.body)
		}
		if a.attempts == "2" {
			retried++
		}
	}
	if retried == 0 {
		t.Fatal("no request reached the stopped engine")
	}
	if aborted := metricValue(t, base, "infergate_retries_total", `reason="endpoint_down"`); int(aborted) != retried {
		t.Errorf(`retries_total{reason="endpoint_down"} = %v, want %d`, aborted, retried)
	}
	t.Logf("%d of %d requests reached the stopped engine, were aborted by the health checker and completed on the other", retried, n)
}

// startWithStoppedEngine starts `infergate serve` with the configuration
// yaml, round-robin over two `infergate sim` engines, SIGSTOPs the second
// (continued at cleanup, before the processes are killed) and returns the
// gateway's URL.
func startWithStoppedEngine(t *testing.T, yaml string) string {
	t.Helper()
	addrRe := regexp.MustCompile(`addr=(http://[0-9.:]+)`)
	var sims []*proc
	args := []string{"serve", "--listen", "127.0.0.1:0", "--policy", "round-robin"}
	for range 2 {
		s := start(t, "sim", "--listen", "127.0.0.1:0", "--time-scale", "100", "--model", "m")
		args = append(args, "--endpoint", s.await(t, addrRe)+"=m")
		sims = append(sims, s)
	}
	cfg := filepath.Join(t.TempDir(), "gw.yaml")
	if err := os.WriteFile(cfg, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	g := start(t, append(args, "-c", cfg)...)
	base := g.await(t, addrRe)
	t.Cleanup(func() { g.stop(t); sims[0].stop(t) })
	stopped := sims[1].cmd.Process.Pid
	if err := syscall.Kill(stopped, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(stopped, syscall.SIGCONT) }) // runs first
	return base
}
