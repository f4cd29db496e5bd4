package bench

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/sim"
)

func ptr[T any](v T) *T { return &v }

// TestCheckLag: a run is behind when the fleet's or the client's p99 lag
// exceeds the margin; a run with neither (virtual) never is.
func TestCheckLag(t *testing.T) {
	for _, tc := range []struct {
		name         string
		fleet, send  *Lag
		margin       time.Duration
		behind       bool
		marginMs     float64
		cell         string
		warningParts []string
	}{
		{name: "virtual", margin: 0, marginMs: 100, cell: "-"},
		{name: "kept up", fleet: &Lag{Samples: 10, P50: 1, P99: 40, Max: 120}, send: &Lag{Samples: 3, P99: 60}, marginMs: 100, cell: "60.0"},
		{name: "fleet behind", fleet: &Lag{Samples: 10, P50: 5, P99: 1342, Max: 5211}, send: &Lag{Samples: 3, P99: 60}, marginMs: 100, behind: true,
			cell: "1342 BEHIND", warningParts: []string{"fleet step lag p50 5.0, p99 1342, max 5211 ms", "client send lag", "more than 100 ms"}},
		{name: "client behind", send: &Lag{Samples: 3, P99: 300, Max: 400}, margin: 250 * time.Millisecond, marginMs: 250, behind: true,
			cell: "300 BEHIND", warningParts: []string{"client send lag p50 0.0, p99 300, max 400 ms", "more than 250 ms"}},
		{name: "wide margin", fleet: &Lag{Samples: 10, P99: 1342}, margin: time.Hour, marginMs: 3.6e6, cell: "1342.0"},
	} {
		s := Summary{Policy: tc.name, FleetLag: tc.fleet, SendLag: tc.send}
		s.CheckLag(tc.margin)
		if s.Behind != tc.behind || s.MaxLagMs != tc.marginMs || s.lagCell() != tc.cell {
			t.Errorf("%s: behind %v margin %v cell %q; want %v %v %q", tc.name, s.Behind, s.MaxLagMs, s.lagCell(), tc.behind, tc.marginMs, tc.cell)
		}
		var w bytes.Buffer
		n, err := Report{Runs: []Summary{s}}.WriteLagWarnings(&w)
		if err != nil || (n == 1) != tc.behind || strings.Count(w.String(), "\n") != n {
			t.Errorf("%s: %d warnings %q, %v", tc.name, n, w.String(), err)
		}
		for _, part := range tc.warningParts {
			if !strings.Contains(w.String(), part) {
				t.Errorf("%s: warning %q lacks %q", tc.name, w.String(), part)
			}
		}
	}
}

// TestSendLagSummary: send lags are summarised over the records that have
// one; a closed loop (none) has no SendLag.
func TestSendLagSummary(t *testing.T) {
	recs := syntheticRecords()
	if s := Summarize("closed", recs); s.SendLag != nil {
		t.Errorf("no schedule: SendLag %+v", s.SendLag)
	}
	for i := range recs {
		recs[i].SendLagMs = ptr(float64(10 * i))
	}
	s := Summarize("open", recs)
	if l := s.SendLag; l == nil || l.Samples != int64(len(recs)) || l.Max != float64(10*(len(recs)-1)) || l.P50 != 15 {
		t.Errorf("SendLag %+v over %d records", l, len(recs))
	}
	if l := FleetLag(sim.LagStats{}); l != nil {
		t.Errorf("no steps: FleetLag %+v", l)
	}
	l := FleetLag(sim.LagStats{Steps: 7, P50: 1500 * time.Microsecond, P99: 2 * time.Second, Max: 3 * time.Second})
	if *l != (Lag{Samples: 7, P50: 1.5, P99: 2000, Max: 3000}) {
		t.Errorf("FleetLag %+v", *l)
	}
}
