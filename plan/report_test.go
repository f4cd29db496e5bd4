package plan

import (
	"bytes"
	"strings"
	"testing"

	"github.com/infergate/infergate/bench"
)

func TestResultWriteHTML(t *testing.T) {
	res := Result{SLO: "ttft_p90=2s", Requests: 100, Engines: []int{4, 8}, Policies: []string{"prefix", "least-request"}}
	for _, n := range res.Engines {
		for _, p := range res.Policies {
			s := bench.Summary{Policy: p, Requests: 100, Goodput: &bench.Goodput{SLO: res.SLO, Requests: 10 * n, Share: float64(n) / 10}}
			s.TTFT.P90 = 8000 / float64(n)
			res.Rows = append(res.Rows, Row{Engines: n, Policy: p, Summary: s, MeetsSLO: n == 8})
		}
	}
	res.Recommendation = &Recommendation{Engines: 8, Policy: "prefix", Row: 2}
	var b bytes.Buffer
	if err := res.WriteHTML(&b); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"recommendation: 8 engines, policy prefix", "<td>least-request</td>", "TTFT p90 vs fleet size", "Goodput vs fleet size"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if got := strings.Count(out, `<path d="M`); got != 4 {
		t.Errorf("%d paths, want 4", got)
	}
	if strings.Contains(out, "http") {
		t.Error("external reference")
	}
}
