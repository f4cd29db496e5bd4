package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/plan"
)

// writeTableRun writes one scripts/policy-table.sh result file: dir/
// <workload>-s<seed>-<policy>.json with one row of policy at hit rate hit
// (pooled 0.17) and TTFT p50/p90/p99 (ms), one bucket (<8k) at p90.
func writeTableRun(t *testing.T, dir, workload string, seed int, policy string, hit, p50, p90, p99 float64) {
	t.Helper()
	pooled := 0.17
	s := measure.Summary{Policy: policy, HitRate: hit, PooledHitRate: &pooled,
		TTFT:               measure.Latency{P50: p50, P90: p90, P99: p99},
		TTFTByPromptLength: []measure.BucketLatency{{PromptBucket: measure.PromptBuckets[0], Requests: 5, TTFT: measure.Latency{P90: p90}}}}
	res := plan.Result{Policies: []string{policy}, Engines: []int{8}, Rows: []plan.Row{{Engines: 8, Policy: policy, Summary: s}}}
	b, err := json.Marshal(res)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("%s-s%d-%s.json", workload, seed, policy)), b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestPlanJudge(t *testing.T) {
	dir := t.TempDir()
	base, lof := filepath.Join(dir, "base"), filepath.Join(dir, "lof")
	for seed := range 2 {
		for _, w := range []string{"mooncake", "long-tail"} {
			writeTableRun(t, base, w, seed, "least-request", 0.05, 4000, 18000, 36000)
			writeTableRun(t, base, w, seed, "llm-d", 0.162, 6000, 22000, 46000)
			writeTableRun(t, base, w, seed, "sglang", 0.165, 2400, 14000, 29000)
			writeTableRun(t, base, w, seed, "dynamo", 0.09, 3100, 8600, 22000)
			// cache-aware: below llm-d's and sglang's hits, p99 above dynamo's.
			writeTableRun(t, base, w, seed, "cache-aware", 0.159, 2000, 6600, 24000)
		}
	}
	// With learn_on_finish: the hits fixed; p99 fixed but in long-tail s1.
	for seed := range 2 {
		writeTableRun(t, lof, "mooncake", seed, "cache-aware", 0.17, 2000, 6500, 21000)
	}
	writeTableRun(t, lof, "long-tail", 0, "cache-aware", 0.17, 2000, 6500, 21000)
	writeTableRun(t, lof, "long-tail", 1, "cache-aware", 0.17, 2000, 6500, 23000)

	out, err := runRoot(t, "", "plan", "judge", "--workloads", "mooncake,long-tail", "--seeds", "0,1",
		"--incumbent", "ca", "ca="+filepath.Join(base, "cache-aware"), "lof="+filepath.Join(lof, "cache-aware"))
	if !errors.Is(err, errJudgeLost) {
		t.Fatalf("err %v, want errJudgeLost; output:\n%s", err, out)
	}
	for _, want := range []string{
		"== ca: 16 of 32 cells lost (4 cases)", // hit/pooled, hit>=llm-d, hit>=sglang, ttft_p99 in each case
		"== lof: 1 of 32 cells lost (4 cases)",
		"long-tail s1       ttft_p99         23.000s  want <=   22.000s (dynamo)",
		"== lof against ca: 15 cells gained, 0 given up: qualifies",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}

	// Every cell won: exit 0.
	out, err = runRoot(t, "", "plan", "judge", "--workloads", "mooncake", "--seeds", "0,1", "--refs", base,
		filepath.Join(lof, "cache-aware"))
	if err != nil || !strings.Contains(out, "0 of 16 cells lost (2 cases)") {
		t.Errorf("all won: %v\n%s", err, out)
	}

	// A missing run is a lost cell, not a pass.
	out, err = runRoot(t, "", "plan", "judge", "--workloads", "mooncake", "--seeds", "0,1,2", "--refs", base,
		filepath.Join(lof, "cache-aware"))
	if !errors.Is(err, errJudgeLost) || !strings.Contains(out, "mooncake s2        run            missing run") {
		t.Errorf("missing run: %v\n%s", err, out)
	}
}

func TestPlanJudgeBadInput(t *testing.T) {
	dir := t.TempDir()
	writeTableRun(t, dir, "mooncake", 0, "llm-d", 0.17, 1, 2, 3)
	if err := os.WriteFile(filepath.Join(dir, "mooncake-s0-sglang.json"), []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"cache-aware"},                                                  // no DIR
		{"x=" + dir + "/"},                                               // no POLICY
		{"a=" + dir + "/p", "a=" + dir + "/q"},                           // a label twice
		{"--seeds", "0,x", dir + "/cache-aware"},                         // a bad seed
		{"--workloads", ",", dir + "/cache-aware"},                       // an empty workload
		{"--incumbent", "nope", "--references", "llm-d", dir + "/llm-d"}, // not a label
		{"--references", "sglang", dir + "/llm-d"},                       // a corrupt file
		{"--references", "", "--baseline", "llm-d", dir + "/llm-d", "--workloads", "mooncake", "--seeds", "0"}, // fine
	} {
		_, err := runRoot(t, "", append([]string{"plan", "judge"}, args...)...)
		fine := args[0] == "--references" && args[1] == ""
		if fine {
			if err != nil {
				t.Errorf("%v: %v", args, err)
			}
			continue
		}
		if err == nil || errors.Is(err, errJudgeLost) {
			t.Errorf("%v: err %v, want an input error", args, err)
		}
	}
}

// TestPlanJudgeLeague: with --league the peers are judged against each
// other and the candidate, never themselves, and ranked by cells lost.
func TestPlanJudgeLeague(t *testing.T) {
	base := filepath.Join(t.TempDir(), "base")
	writeTableRun(t, base, "mooncake", 0, "least-request", 0.05, 4000, 18000, 36000)
	writeTableRun(t, base, "mooncake", 0, "sglang", 0.165, 2400, 14000, 29000)     // loses p50, p90, p99 to cache-aware / dynamo
	writeTableRun(t, base, "mooncake", 0, "dynamo", 0.09, 3100, 8600, 22000)       // loses hit/pooled, both hits, p50, p90
	writeTableRun(t, base, "mooncake", 0, "cache-aware", 0.162, 2000, 6600, 24000) // loses hit>=sglang, p99
	args := []string{"plan", "judge", "--league", "--workloads", "mooncake", "--seeds", "0"}
	for _, p := range []string{"sglang", "dynamo", "cache-aware"} {
		args = append(args, p+"="+filepath.Join(base, p))
	}
	out, err := runRoot(t, "", args...)
	if !errors.Is(err, errJudgeLost) {
		t.Fatalf("err %v, want errJudgeLost; output:\n%s", err, out)
	}
	// hit/pooled, 2 rivals' hits, 3 percentiles, 1 bucket: 7 cells each.
	for _, want := range []string{
		"== cache-aware: 2 of 7 cells lost (1 cases; against the other candidates)",
		"mooncake s0        hit>=sglang       16.20%  want >=    16.50% (sglang)",
		" 1. cache-aware                     2 of 7 cells lost\n 2. sglang                          3 of 7 cells lost\n 3. dynamo                          5 of 7 cells lost\n",
		// Margins, by hand: cache-aware's ratios to the best 0.165/0.162
		// (hit), 1, 1, 24/22 (p99), 1 (bucket): excess (1.0185·1.0909)^(1/5)
		// − 1 = 2.1%, ranks 2, 1, 1, 2, 1; dynamo's 1.833, 1.55, 1.303, 1,
		// 1.303: 37.0%; sglang's 1, 1.2, 2.121, 1.318, 2.121: 48.1%.
		"== margins (5 cells each",
		" 1. cache-aware                       1.40      3    2.1%    1.9%    0.0%    0.0%    9.1%    0.0%\n",
		" 2. dynamo                            2.20      1   37.0%   83.3%   55.0%   30.3%    0.0%   30.3%\n",
		" 3. sglang                            2.40      1   48.1%    0.0%   20.0%  112.1%   31.8%  112.1%\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	// sglang's section (up to dynamo's): its cells against the others only.
	if i, j := strings.Index(out, "== sglang"), strings.Index(out, "== dynamo"); i < 0 || j < i || strings.Contains(out[i:j], "(sglang)") {
		t.Errorf("sglang's section missing or judged against itself:\n%s", out)
	}
	for _, extra := range [][]string{{"--incumbent", "sglang"}, {"--references", "llm-d"}} {
		if _, err := runRoot(t, "", append(append([]string{}, args...), extra...)...); err == nil || errors.Is(err, errJudgeLost) {
			t.Errorf("--league with %v: err %v, want an input error", extra, err)
		}
	}
	if _, err := runRoot(t, "", "plan", "judge", "--league", filepath.Join(base, "sglang")); err == nil || errors.Is(err, errJudgeLost) {
		t.Errorf("--league with one candidate: err %v, want an input error", err)
	}
	// A --refs without the baseline's runs (by default the first
	// candidate's directory) is refused, not judged without it.
	other := filepath.Join(filepath.Dir(base), "other")
	writeTableRun(t, other, "mooncake", 0, "sglang", 0.165, 2400, 14000, 29000)
	if _, err := runRoot(t, "", "plan", "judge", "--league", "--workloads", "mooncake", "--seeds", "0", filepath.Join(other, "sglang"), filepath.Join(base, "dynamo")); err == nil || errors.Is(err, errJudgeLost) || !strings.Contains(err.Error(), "the baseline least-request has no run of mooncake s0") {
		t.Errorf("--league with --refs lacking the baseline: err %v, want an input error naming it", err)
	}
	// A candidate without runs (a typo) is refused, not ranked first.
	if _, err := runRoot(t, "", append(append([]string{}, args...), "typo="+filepath.Join(base, "sglangg"))...); err == nil || errors.Is(err, errJudgeLost) || !strings.Contains(err.Error(), "typo has no run") {
		t.Errorf("--league with a candidate without runs: err %v, want an input error naming it", err)
	}
}
