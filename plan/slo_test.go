package plan

import (
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/measure"
)

func TestParseSLO(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want SLO
		str  string // String(); "" = in
	}{
		{in: "ttft_p90=2s", want: SLO{Targets: []Target{{TTFT, 90, 2 * time.Second}}}},
		{in: " ttft_p99=5s , itl_p99=100ms,goodput>=0.9", str: "ttft_p99=5s,itl_p99=100ms,goodput>=0.9",
			want: SLO{Targets: []Target{{TTFT, 99, 5 * time.Second}, {ITL, 99, 100 * time.Millisecond}}, MinGoodput: 0.9}},
		{in: "goodput>=90%,tpot_p50=40ms", str: "tpot_p50=40ms,goodput>=0.9",
			want: SLO{Targets: []Target{{TPOT, 50, 40 * time.Millisecond}}, MinGoodput: 0.9}},
		{in: "e2e_max=1m30s", str: "e2e_p100=1m30s", want: SLO{Targets: []Target{{E2E, 100, 90 * time.Second}}}},
		{in: "itl_p99.9=50ms,goodput >= 1", str: "itl_p99.9=50ms,goodput>=1",
			want: SLO{Targets: []Target{{ITL, 99.9, 50 * time.Millisecond}}, MinGoodput: 1}},
		{in: "ttft_p50=1.5s,ttft_p99=4s", want: SLO{Targets: []Target{{TTFT, 50, 1500 * time.Millisecond}, {TTFT, 99, 4 * time.Second}}}},
	} {
		got, err := ParseSLO(tc.in)
		if err != nil {
			t.Errorf("ParseSLO(%q): %v", tc.in, err)
			continue
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseSLO(%q) = %+v, want %+v", tc.in, got, tc.want)
		}
		str := tc.str
		if str == "" {
			str = tc.in
		}
		if got.String() != str {
			t.Errorf("ParseSLO(%q).String() = %q, want %q", tc.in, got.String(), str)
		}
		if again, err := ParseSLO(got.String()); err != nil || !reflect.DeepEqual(again, got) {
			t.Errorf("round trip of %q: %+v, %v", got.String(), again, err)
		}
	}
}

func TestParseSLOErrors(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"", "empty SLO"},
		{"   ", "empty SLO"},
		{"ttft_p90", "want metric_pXX=duration"},
		{"ttft=2s", "want metric_pXX"},
		{"foo_p90=2s", `unknown metric "foo"`},
		{"TTFT_p90=2s", `unknown metric "TTFT"`},
		{"ttft_p0=2s", "must be in (0, 100]"},
		{"ttft_p101=2s", "must be in (0, 100]"},
		{"ttft_p=2s", "want pXX"},
		{"ttft_px=2s", "want pXX"},
		{"ttft_90=2s", "want pXX"},
		{"ttft_p1e1=2s", "want pXX"},
		{"ttft_pinf=2s", "want pXX"},
		{"ttft_p90=2", "has no unit"},
		{"ttft_p90=", "missing duration"},
		{"ttft_p90=abc", "bad duration"},
		{"ttft_p90=-1s", "must be positive"},
		{"ttft_p90=0s", "must be positive"},
		{"ttft_p90=2s,,itl_p99=1s", "empty item"},
		{"ttft_p90=2s,", "empty item"},
		{"ttft_p90=2s,ttft_p90=3s", "ttft_p90 given twice"},
		{"ttft_max=2s,ttft_p100=3s", "ttft_p100 given twice"},
		{"goodput>=0.9", "no latency target"},
		{"ttft_p90=2s,goodput>=0", "must be in (0, 1]"},
		{"ttft_p90=2s,goodput>=1.5", "must be in (0, 1]"},
		{"ttft_p90=2s,goodput>=150%", "must be in (0, 1]"},
		{"ttft_p90=2s,goodput=0.9", "want goodput>=X"},
		{"ttft_p90=2s,goodput>0.9", "want goodput>=X"},
		{"ttft_p90=2s,goodput>=abc", "want a share"},
		{"ttft_p90=2s,goodput>=NaN", "want a share"},
		{"ttft_p90=2s,goodput>=", "want a share"},
		{"ttft_p90=2s,goodput>=0.9,goodput>=0.8", "goodput given twice"},
	} {
		_, err := ParseSLO(tc.in)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseSLO(%q) = %v, want an error containing %q", tc.in, err, tc.want)
		}
	}
}

// goodputRecords are five requests (ms) with known per-request values:
//
//	    TTFT  E2E   out  ITL gaps          TPOT  own ITL p50  own max gap
//	a   100   500   5    100,100,100,100   100   100          100
//	b   300   400   3    10,90             50    50           90
//	c   failed
//	d   50    2000  2    1950              1950  1950         1950
//	e   200   200   1    -                 0     -            -
func goodputRecords() []measure.Record {
	return []measure.Record{
		{TTFTMs: 100, E2EMs: 500, OutputTokens: 5, ITLMs: []float64{100, 100, 100, 100}},
		{TTFTMs: 300, E2EMs: 400, OutputTokens: 3, ITLMs: []float64{90, 10}},
		{Error: "rejected", Status: 400},
		{TTFTMs: 50, E2EMs: 2000, OutputTokens: 2, ITLMs: []float64{1950}},
		{TTFTMs: 200, E2EMs: 200, OutputTokens: 1},
	}
}

func TestEvaluateGoodput(t *testing.T) {
	recs := goodputRecords()
	for _, tc := range []struct {
		slo  string
		good int    // requests meeting every target
		met  string // which of a..e meet it
	}{
		{"ttft_p50=250ms", 3, "ade"},
		{"ttft_p99=250ms,itl_max=100ms", 2, "ae"},        // d's 1950 ms gap
		{"ttft_p99=1s,itl_p50=60ms", 2, "be"},            // own median gaps 100, 50, 1950
		{"tpot_p90=100ms", 3, "abe"},                     // TPOT 100, 50, 1950, 0
		{"e2e_p90=450ms", 2, "be"},                       // E2E 500, 400, 2000, 200
		{"ttft_p90=1h,e2e_p90=1h,itl_max=1h", 4, "abde"}, // everything but the failure
	} {
		slo := mustSLO(t, tc.slo)
		_, g := Evaluate(slo, recs, 10)
		if g.Requests != tc.good || g.Share != float64(tc.good)/5 || g.PerS != float64(tc.good)/10 || g.SLO != slo.String() {
			t.Errorf("%s: goodput %+v, want %d of 5 over 10 s", tc.slo, g, tc.good)
		}
		var met string
		for i := range recs {
			if Meets(slo.Targets, &recs[i]) {
				met += string(rune('a' + i))
			}
		}
		if met != tc.met {
			t.Errorf("%s: met by %q, want %q", tc.slo, met, tc.met)
		}
	}
	if _, g := Evaluate(mustSLO(t, "ttft_p50=1s"), nil, 0); g.Requests != 0 || g.Share != 0 || g.PerS != 0 {
		t.Errorf("no records: %+v", g)
	}
}

func TestEvaluateFleetChecks(t *testing.T) {
	recs := goodputRecords()
	// TTFT over requests, the failure as +Inf: 50, 100, 200, 300, +Inf.
	// TPOT: 0, 50, 100, 1950, +Inf. E2E: 200, 400, 500, 2000, +Inf.
	// ITL pooled over successful requests: 10, 90, 100×4, 1950.
	for _, tc := range []struct {
		slo      string
		observed float64
		ok       bool
	}{
		{"ttft_p50=200ms", 200, true},
		{"ttft_p50=199ms", 200, false},
		{"ttft_p25=1s", 100, true},
		{"ttft_p75=300ms", 300, true},           // h = 3 exactly: the last finite sample
		{"ttft_p90=1h", math.MaxFloat64, false}, // interpolates towards the failure
		{"tpot_p50=100ms", 100, true},
		{"e2e_p37.5=450ms", 450, true}, // h = 1.5: halfway from 400 to 500
		{"itl_p50=100ms", 100, true},
		{"itl_max=1s", 1950, false},
		{"itl_p0.001=10ms", 10.0048, false}, // h = 6e-5: 10 + 6e-5·80
	} {
		checks, _ := Evaluate(mustSLO(t, tc.slo), recs, 10)
		if len(checks) != 1 {
			t.Fatalf("%s: %d checks", tc.slo, len(checks))
		}
		c := checks[0]
		if math.Abs(c.ObservedMs-tc.observed) > 1e-9*max(1, tc.observed) || c.OK != tc.ok || c.Target != mustSLO(t, tc.slo).Targets[0].Name() {
			t.Errorf("%s: %+v, want observed %v ok %v", tc.slo, c, tc.observed, tc.ok)
		}
	}
}

func TestPercentileWithFailures(t *testing.T) {
	inf := math.Inf(1)
	for _, tc := range []struct {
		xs   []float64
		p    float64
		want float64
	}{
		{nil, 50, 0},
		{[]float64{inf}, 50, inf},
		{[]float64{1, inf}, 0, 1},
		{[]float64{1, inf}, 50, inf},
		{[]float64{1, 3, inf, inf}, 100 / 3.0, 3},
		{[]float64{1, 3, inf, inf}, 50, inf},
		{[]float64{1, 3, 5}, 25, 2},
	} {
		if got := percentile(tc.xs, tc.p); got != tc.want && !(math.Abs(got-tc.want) < 1e-9) {
			t.Errorf("percentile(%v, %v) = %v, want %v", tc.xs, tc.p, got, tc.want)
		}
	}
}
