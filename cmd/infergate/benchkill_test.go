package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/infergate/infergate/bench"
	"github.com/infergate/infergate/measure"
)

// TestKillReportCountsStalledAsHung: after a --kill-pid run, a request
// on the killed target that stalled (no answer within bench's bounds) is
// listed as hung, not as one that ended with an explicit error, as a
// cancelled one is.
func TestKillReportCountsStalledAsHung(t *testing.T) {
	targets := []string{"http://a:1", "http://b:1"}
	recs := []measure.Record{
		{Index: 0, Target: targets[1], Error: "target stalled: no response header within 10m0s (bench's header bound)"},
		{Index: 1, Target: targets[1], Error: "read: connection reset by peer", Status: 0},
		{Index: 2, Target: targets[0]},
	}
	r := &benchRun{fl: &benchFlags{killPID: 42, killTarget: 1}}
	var w bytes.Buffer
	tr := targetRun{label: "t", outcomes: bench.TargetOutcomes(targets, recs), recs: recs, killAt: 2}
	if err := r.writeTargetRun(&w, tr); err != nil {
		t.Fatal(err)
	}
	out := w.String()
	if !strings.Contains(out, "ended with an explicit error: 1 [1]") || !strings.Contains(out, "(lost; want 0): 1 [0] (hung: 1)") {
		t.Fatalf("report:\n%s", out)
	}
}
