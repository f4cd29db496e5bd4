package bench

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"
)

// synthRun makes n synthetic records for policy, served round-robin by
// engines engines.
func synthRun(policy string, n, engines int, seed uint64) HTMLRun {
	rng := rand.New(rand.NewPCG(seed, 1))
	recs := make([]Record, n)
	eng := make([]int, n)
	for i := range recs {
		itl := make([]float64, 20)
		for k := range itl {
			itl[k] = 5 + rng.ExpFloat64()*20
		}
		recs[i] = Record{Policy: policy, Index: i, ArrivalMs: float64(i) * 50, TTFTMs: 50 + rng.ExpFloat64()*500,
			ITLMs: itl, E2EMs: 2000 + rng.Float64()*3000, PromptTokens: 4000, CachedTokens: rng.IntN(4000), OutputTokens: 21, Status: 200}
		eng[i] = i % engines
	}
	recs[3].Error = "boom"
	return HTMLRun{Summary: Summarize(policy, recs), Records: recs, Engine: eng}
}

func TestWriteHTML(t *testing.T) {
	runs := []HTMLRun{synthRun("round-robin", 12000, 8, 1), synthRun("prefix<&>", 12000, 8, 2)}
	var b bytes.Buffer
	if err := WriteHTML(&b, `bench <script>alert(1)</script>`, runs); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	if b.Len() > 2<<20 {
		t.Errorf("report of 2×12k requests is %d bytes, want < 2 MiB", b.Len())
	}
	for _, want := range []string{"<!DOCTYPE html>", "</html>", "<table>", "<td>round-robin</td>", "<td>prefix&lt;&amp;&gt;</td>",
		"TTFT CDF", "ITL CDF", "hit rate over time", "TTFT p50 over time", "in flight", "Per-endpoint request share", "share of requests"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if strings.Contains(out, "<script>") {
		t.Error("title not escaped")
	}
	if got := strings.Count(out, "<svg"); got != 6 {
		t.Errorf("%d <svg>, want 6", got)
	}
	// 5 line charts × 2 policies.
	if got := len(regexp.MustCompile(`<path d="M[0-9.]+ [0-9.]+ L`).FindAllString(out, -1)); got != 10 {
		t.Errorf("%d non-empty paths, want 10", got)
	}
	if got := strings.Count(out, "<rect x="); got < 16 {
		t.Errorf("%d rects, want ≥ 16 bars", got)
	}
	for _, bad := range []string{"http://", "https://", "<script", "<link", " src="} {
		if strings.Contains(out, bad) {
			t.Errorf("report contains %q", bad)
		}
	}
	// Each CDF line has at most cdfPoints points.
	for _, m := range regexp.MustCompile(`<path d="([^"]*)"`).FindAllStringSubmatch(out, -1) {
		if n := strings.Count(m[1], "L") + 1; n > cdfPoints {
			t.Errorf("path with %d points, want ≤ %d", n, cdfPoints)
		}
	}
}

func TestWriteHTMLEngineUnknown(t *testing.T) {
	r := synthRun("target", 100, 4, 3)
	r.Engine = nil
	var b bytes.Buffer
	if err := WriteHTML(&b, "t", []HTMLRun{r, {Summary: Summarize("empty", nil)}}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "Not known for this run") {
		t.Error("no note for unknown engines")
	}
	r.EnginePromptTokens = []int64{10, 20, 30, 40}
	b.Reset()
	if err := WriteHTML(&b, "t", []HTMLRun{r}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "share of prompt tokens") {
		t.Error("no prompt-token share chart")
	}
}

func TestCDF(t *testing.T) {
	xs := make([]float64, 10000)
	for i := range xs {
		xs[i] = float64(len(xs) - i)
	}
	x, y := CDF(xs)
	if len(x) != cdfPoints || x[0] != 1 || x[len(x)-1] != 10000 || y[len(y)-1] != 1 {
		t.Errorf("CDF: %d points, first %v, last %v/%v", len(x), x[0], x[len(x)-1], y[len(y)-1])
	}
	if x, _ := CDF([]float64{3}); fmt.Sprint(x) != "[3]" {
		t.Errorf("CDF of one: %v", x)
	}
}

// TestWriteHTMLBehind: a run that fell behind its time scale says so in
// the report, beside its row.
func TestWriteHTMLBehind(t *testing.T) {
	r := synthRun("prefix", 100, 4, 3)
	r.Summary.FleetLag = &Lag{Samples: 10, P50: 5, P99: 1342, Max: 5211}
	r.Summary.CheckLag(0)
	var b bytes.Buffer
	if err := WriteHTML(&b, "t", []HTMLRun{r, synthRun("round-robin", 100, 4, 4)}); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"<th>lag p99 ms</th>", "<td>1342 BEHIND</td>", "WARNING: prefix fell behind its time scale"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if strings.Contains(out, "round-robin fell behind") {
		t.Error("a run without lag reported behind")
	}
}
