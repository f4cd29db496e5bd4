package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestBenchRateSweepWarmup runs `bench --compare --virtual --rate --warmup`
// on a generated workload: one row per rate and policy, a rate column, and
// warm-up requests marked in the records but not summarised.
func TestBenchRateSweepWarmup(t *testing.T) {
	dir := t.TempDir()
	out, recs := filepath.Join(dir, "r.json"), filepath.Join(dir, "r.jsonl")
	c := infergateCommand("bench", "--compare", "prefix,round-robin", "--virtual", "--engines", "2", "--workload", "shared-prefix",
		"--sp-groups", "2", "--sp-prompts-per-group", "6", "--sp-system-tokens", "1024", "--sp-question-tokens", "64", "--sp-output-tokens", "8",
		"--rate", "2,20", "--warmup", "4", "--out", out, "--records", recs)
	c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	msg, err := c.CombinedOutput()
	if err != nil {
		t.Fatalf("bench: %v\n%s", err, msg)
	}
	if !strings.Contains(string(msg), "rate") {
		t.Errorf("no rate column:\n%s", msg)
	}
	var rep struct {
		Runs []struct {
			Policy         string
			Rate           float64 `json:"rate_rps"`
			Requests       int
			WarmupRequests int `json:"warmup_requests"`
		}
	}
	raw, _ := os.ReadFile(out)
	if err := json.Unmarshal(raw, &rep); err != nil || len(rep.Runs) != 4 {
		t.Fatalf("report %s: %v", raw, err)
	}
	for i, r := range rep.Runs {
		want := []float64{2, 2, 20, 20}[i]
		if r.Rate != want || r.Requests != 8 || r.WarmupRequests != 4 {
			t.Errorf("run %d: %+v, want rate %v, 8 measured, 4 warm-up", i, r, want)
		}
	}
	lines, _ := os.ReadFile(recs)
	if n, w := strings.Count(string(lines), "\n"), strings.Count(string(lines), `"warmup":true`); n != 48 || w != 16 {
		t.Errorf("%d records, %d warm-up; want 48, 16", n, w)
	}

	for _, bad := range [][]string{
		{"--concurrency", "2", "--virtual"},
		{"--concurrency", "2", "--rate", "1"},
		{"--rate", "0"},
		{"--warmup", "-1"},
		{"--kv-event-delay", "1s"},               // real time
		{"--kv-event-delay", "-1s", "--virtual"}, // negative
	} {
		args := append([]string{"bench", "--compare", "prefix", "--workload", "shared-prefix", "--sp-groups", "1", "--sp-prompts-per-group", "2"}, bad...)
		c := infergateCommand(args...)
		c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
		if msg, err := c.CombinedOutput(); err == nil {
			t.Errorf("%v accepted:\n%s", bad, msg)
		}
	}
}
