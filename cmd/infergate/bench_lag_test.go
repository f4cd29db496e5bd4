package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestBenchRefusesLaggingRun runs `bench --compare` with a fleet asked to
// run a million times faster than the hardware it models, which no host
// keeps up with: the run is marked BEHIND in the table and the JSON, a
// warning explains it, and bench exits non-zero after writing its outputs.
// With --max-lag wide enough the same run is accepted.
func TestBenchRefusesLaggingRun(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "r.json")
	args := []string{"bench", "--compare", "prefix", "--engines", "1", "--workload", "shared-prefix",
		"--sp-groups", "1", "--sp-prompts-per-group", "4", "--sp-system-tokens", "256", "--sp-question-tokens", "16",
		"--sp-output-tokens", "4", "--speedup", "1000000", "--out", out}
	c := infergateCommand(args...)
	c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	msg, err := c.CombinedOutput()
	if err == nil {
		t.Fatalf("a run 10⁶× faster than real time was accepted:\n%s", msg)
	}
	for _, want := range []string{"BEHIND", "WARNING: prefix fell behind its time scale", "fleet step lag", "1 of 1 runs fell behind"} {
		if !strings.Contains(string(msg), want) {
			t.Errorf("output lacks %q:\n%s", want, msg)
		}
	}
	var rep struct {
		Runs []struct {
			Requests int
			Behind   bool    `json:"behind"`
			MaxLagMs float64 `json:"max_lag_ms"`
			FleetLag *struct {
				P99 float64 `json:"p99_ms"`
			} `json:"fleet_lag"`
		}
	}
	raw, _ := os.ReadFile(out)
	if err := json.Unmarshal(raw, &rep); err != nil || len(rep.Runs) != 1 {
		t.Fatalf("report %s: %v", raw, err)
	}
	if r := rep.Runs[0]; r.Requests != 4 || !r.Behind || r.MaxLagMs != 100 || r.FleetLag == nil || r.FleetLag.P99 <= 100 {
		t.Errorf("run %+v: want 4 requests, behind, margin 100 ms, fleet lag p99 over it", r)
	}

	c = infergateCommand(append(args, "--max-lag", "1000000h")...)
	c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	if msg, err := c.CombinedOutput(); err != nil || strings.Contains(string(msg), "BEHIND") {
		t.Errorf("--max-lag 1000000h: %v\n%s", err, msg)
	}
}
