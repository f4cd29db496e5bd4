package main

import (
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestUpPD runs `infergate up --pd 1:1` (P busy by cost, a decode
// budget): the banner names the engines' roles, and a long chat is split
// across them, an idle P never being busy (P's prefill leg holds its KV,
// D reads it and answers, P's hold is released); a short one is served
// whole on D.
func TestUpPD(t *testing.T) {
	p := start(t, "up", "--pd", "1:1", "--pd-threshold", "64", "--listen", "127.0.0.1:0", "--time-scale", "100",
		"--access-log=false", "--shutdown-grace", "5s", "--pd-busy", "cost", "--pd-decode-budget", "384")
	base := p.await(t, apiRe)
	if c := p.await(t, regexp.MustCompile(`P/D: 1 prefill \+ 1 decode engines, connector (\S+),.*--pd-busy cost`)); c != "nixl" {
		t.Fatalf("connector %s, want nixl (the default)", c)
	}
	P := p.await(t, regexp.MustCompile(`engine 0 prefill: (http://[0-9.:]+) `))
	D := p.await(t, regexp.MustCompile(`engine 1 decode: (http://[0-9.:]+) `))
	model := "meta-llama/Llama-3.1-70B-Instruct"
	sys := strings.Repeat("You are a careful assistant who answers in full sentences. ", 20)
	code, v := postJSON(t, base+"/v1/chat/completions",
		fmt.Sprintf(`{"model":%q,"messages":[{"role":"system","content":%q},{"role":"user","content":"Hello!"}],"max_tokens":8}`, model, sys))
	if code != 200 || cachedTokens(v) != 0 {
		t.Fatalf("chat: %d, cached %v (P's: none): %v", code, cachedTokens(v), v)
	}
	if n := metricValue(t, base, "infergate_pd_decisions_total", `outcome="split"`); n != 1 {
		t.Fatalf("split decisions %v", n)
	}
	if n := metricValue(t, D, "infergate_sim_pd_kv_transfers_total"); n != 1 {
		t.Fatalf("D's remote prefills %v", n)
	}
	deadline := time.Now().Add(time.Minute)
	for metricValue(t, P, "infergate_sim_pd_held_released_total") != 1 || metricValue(t, P, "infergate_sim_pd_held_blocks") != 0 {
		if time.Now().After(deadline) {
			t.Fatal("P's hold was not released")
		}
		time.Sleep(10 * time.Millisecond)
	}
	code, v = postJSON(t, base+"/v1/chat/completions", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"Hi"}],"max_tokens":4}`, model))
	if code != 200 || metricValue(t, base, "infergate_pd_decisions_total", `reason="below-threshold"`) != 1 {
		t.Fatalf("short chat: %d %v", code, v)
	}
	p.stop(t)
}

// TestUpPDFlags: --pd and its companions are checked before anything starts.
func TestUpPDFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--pd", "0:2"}, "at least one prefill and one decode"},
		{[]string{"--pd", "2"}, "want P:D"},
		{[]string{"--pd", "a:b"}, "want P:D"},
		{[]string{"--pd", "40:40"}, "at most 64"},
		{[]string{"--pd", "1:1", "--engines", "3"}, "give one"},
		{[]string{"--pd", "1:1", "--pd-connector", "rdma"}, `--pd-connector "rdma": want nixl, mooncake or sglang`},
		{[]string{"--pd", "1:1", "--pd-connector", "llm-d"}, "sidecar"},
		{[]string{"--pd", "1:1", "--pd-threshold", "-5"}, "--pd-threshold -5"},
		{[]string{"--pd-connector", "mooncake"}, "needs --pd"},
		{[]string{"--pd", "1:1", "--pd-busy", "soon"}, `--pd-busy "soon"`},
		{[]string{"--pd", "1:1", "--pd-decode-budget", "-1"}, "--pd-decode-budget -1"},
		{[]string{"--pd-decode-budget", "384"}, "needs --pd"},
	} {
		c := infergateCommand(append([]string{"up", "--listen", "127.0.0.1:0"}, tc.args...)...)
		c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
		out, err := c.CombinedOutput()
		if err == nil || !strings.Contains(string(out), tc.want) {
			t.Errorf("up %v: %v, want an error with %q; output:\n%s", tc.args, err, tc.want, out)
		}
	}
}
