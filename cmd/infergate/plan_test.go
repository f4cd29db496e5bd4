package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// burstTraceFile writes 64 requests of 4,096 unshared tokens and 16 output
// tokens, 100 ms apart: TTFT p90 falls from about 23 s on 1 engine to 0.69 s
// on 8 and 0.49 s (no queueing) on 16 with the default profile; ITL p99 is
// 985 ms on 4 engines (decode steps stall behind prefills), 494 ms on 8.
func burstTraceFile(t *testing.T) string {
	t.Helper()
	var b strings.Builder
	for i := range 64 {
		ids := make([]string, 8)
		for k := range ids {
			ids[k] = fmt.Sprint(i*8 + k)
		}
		fmt.Fprintf(&b, `{"timestamp": %d, "input_length": 4096, "output_length": 16, "hash_ids": [%s]}`+"\n", i*100, strings.Join(ids, ", "))
	}
	path := filepath.Join(t.TempDir(), "burst.jsonl")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func runMain(args ...string) (string, error) {
	c := infergateCommand(args...)
	c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	out, err := c.CombinedOutput()
	return string(out), err
}

// TestPlan runs `plan` end to end: the recommendation is the smallest fleet
// meeting the SLO, the JSON has every run, and an impossible SLO exits
// non-zero with "no fleet in range meets the SLO" (after writing the JSON).
func TestPlan(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	tr := burstTraceFile(t)
	out := filepath.Join(t.TempDir(), "plan.json")
	msg, err := runMain("plan", "--trace", tr, "--engines", "1..16", "--policy", "prefix,least-request",
		"--slo", "ttft_p90=1s,itl_p99=600ms", "--out", out)
	if err != nil {
		t.Fatalf("plan: %v\n%s", err, msg)
	}
	if !strings.Contains(msg, "recommendation: 8 engines, policy prefix") || !strings.Contains(msg, "goodput %") {
		t.Errorf("output:\n%s", msg)
	}
	var res struct {
		SLO  string
		Rows []struct {
			Engines  int
			Policy   string
			MeetsSLO bool `json:"meets_slo"`
			Summary  struct {
				Goodput struct{ Share float64 }
			}
		}
		Recommendation *struct {
			Engines int
			Policy  string
		}
	}
	raw, _ := os.ReadFile(out)
	if err := json.Unmarshal(raw, &res); err != nil || len(res.Rows) != 10 || res.Recommendation == nil {
		t.Fatalf("plan.json: %v\n%s", err, raw)
	}
	if r := res.Recommendation; r.Engines != 8 || r.Policy != "prefix" || res.SLO != "ttft_p90=1s,itl_p99=600ms" {
		t.Errorf("recommendation %+v, slo %q", r, res.SLO)
	}
	for _, r := range res.Rows {
		if r.MeetsSLO != (r.Engines >= 8) {
			t.Errorf("%d engines, %s: meets_slo %v", r.Engines, r.Policy, r.MeetsSLO)
		}
	}

	msg, err = runMain("plan", "--trace", tr, "--engines", "1,4,16", "--policy", "least-request",
		"--slo", "ttft_p90=100ms", "--out", out)
	if err == nil || !strings.Contains(msg, "no fleet in range meets the SLO") {
		t.Fatalf("impossible SLO: %v\n%s", err, msg)
	}
	raw, _ = os.ReadFile(out)
	if err := json.Unmarshal(raw, &res); err != nil || len(res.Rows) != 3 || res.Recommendation != nil {
		t.Errorf("plan.json for an impossible SLO: %v\n%s", err, raw)
	}
}

func TestPlanBadInput(t *testing.T) {
	tr := burstTraceFile(t)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--trace", tr}, "--slo is required"},
		{[]string{"--trace", tr, "--slo", "ttft_p90=1"}, "--slo: SLO item"},
		{[]string{"--trace", tr, "--slo", "ttft_p90=1s", "--engines", "8..4"}, "--engines: engine range"},
		{[]string{"--trace", tr, "--slo", "ttft_p90=1s", "--policy", "prefix,nope"}, "--policy: unknown routing policy"},
		{[]string{"--trace", tr, "--slo", "ttft_p90=1s", "--profile", "nope"}, "unknown profile"},
		{[]string{"--trace", filepath.Join(t.TempDir(), "missing.jsonl"), "--slo", "ttft_p90=1s"}, "no such file"},
		{[]string{"--trace", tr, "--slo", "ttft_p90=1s", "--pd-busy", "cost"}, "need --pd"},
		{[]string{"--trace", tr, "--slo", "ttft_p90=1s", "--pd", "1", "--pd-busy", "soon"}, "--pd-busy \"soon\""},
		{[]string{"--trace", tr, "--slo", "ttft_p90=1s", "--pd", "1", "--pd-decode-budget", "-5"}, "--pd-decode-budget \"-5\""},
		{[]string{"--trace", tr, "--slo", "ttft_p90=1s", "--max-num-batched-tokens", "-1"}, "--max-num-batched-tokens -1"},
		{[]string{"--trace", tr, "--slo", "ttft_p90=1s", "--autoscale", "min=1"}, "--autoscale: autoscale: max is required"},
		{[]string{"--trace", tr, "--slo", "ttft_p90=1s", "--autoscale", "max=4,hold=1s"}, "unknown key \"hold\""},
		// NaN compares false with any bound: it reached the library as
		// int64(NaN), MinInt64 on amd64 and 0 (the default) on arm64.
		{[]string{"--trace", tr, "--slo", "ttft_p90=1s", "--max-memory-gib", "NaN"}, "--max-memory-gib NaN"},
		{[]string{"--trace", tr, "--slo", "ttft_p90=1s", "--max-memory-gib", "-1"}, "--max-memory-gib -1"},
	} {
		msg, err := runMain(append([]string{"plan"}, tc.args...)...)
		if err == nil || !strings.Contains(msg, tc.want) {
			t.Errorf("plan %v: %v, want an error containing %q:\n%s", tc.args, err, tc.want, msg)
		}
	}
	msg, err := runMain("plan", "--help")
	if err != nil || !strings.Contains(msg, "Usage:") || !strings.Contains(msg, "--slo") || !strings.Contains(msg, "4..32") {
		t.Errorf("plan --help: %v\n%s", err, msg)
	}
}

// --pd-busy and --pd-decode-budget multiply the P/D variants; the
// aggregated fleet is swept once.
func TestPlanPDVariants(t *testing.T) {
	fl := planFlags{pd: "0,2", pdThreshold: "4096", pdBusy: "queue,cost", pdBudget: "0,384"}
	vs, err := fl.pdVariants(8)
	if err != nil {
		t.Fatal(err)
	}
	var labels []string
	for _, v := range vs {
		labels = append(labels, v.Label())
	}
	want := []string{"", "2P t4096 busy=queue", "2P t4096 busy=queue Db384", "2P t4096 busy=cost", "2P t4096 busy=cost Db384"}
	if strings.Join(labels, "|") != strings.Join(want, "|") {
		t.Fatalf("variants %q, want %q", labels, want)
	}
}
