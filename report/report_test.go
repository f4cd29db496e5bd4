package report

import (
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/measure"
)

// syntheticRecords are measure's TestSummarize records: three successes
// and a failure.
func syntheticRecords() []measure.Record {
	return []measure.Record{
		{Index: 0, ArrivalMs: 0, TTFTMs: 100, ITLMs: []float64{10, 20}, E2EMs: 130, PromptTokens: 1000, CachedTokens: 0, OutputTokens: 3, Status: 200},
		{Index: 1, ArrivalMs: 500, TTFTMs: 300, ITLMs: []float64{30}, E2EMs: 330, PromptTokens: 1000, CachedTokens: 800, OutputTokens: 2, Status: 200},
		{Index: 2, ArrivalMs: 1000, TTFTMs: 200, ITLMs: []float64{40, 50, 60}, E2EMs: 350, PromptTokens: 2000, CachedTokens: 1000, OutputTokens: 4, Status: 200},
		// A failure counts in requests, errors and duration only.
		{Index: 3, ArrivalMs: 1500, E2EMs: 2500, Status: 503, Error: "HTTP 503: overloaded"},
	}
}

// TestSummaryJSONKeys pins the JSON schema the README documents.
func TestSummaryJSONKeys(t *testing.T) {
	u := 0.5
	s := measure.Summarize("round-robin", syntheticRecords())
	s.MeanEngineUtilization = &u
	b, err := json.Marshal(Report{Runs: []measure.Summary{s}})
	if err != nil {
		t.Fatal(err)
	}
	var m map[string][]map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	run := m["runs"][0]
	var keys []string
	for k, v := range run {
		if sub, ok := v.(map[string]any); ok {
			for sk := range sub {
				keys = append(keys, k+"."+sk)
			}
		} else {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	want := []string{
		"cached_tokens", "duration_s",
		"e2e_ms.mean", "e2e_ms.p50", "e2e_ms.p90", "e2e_ms.p99",
		"errors", "first_error", "hit_rate",
		"itl_ms.mean", "itl_ms.p50", "itl_ms.p90", "itl_ms.p99",
		"mean_engine_utilization", "output_tok_per_s", "output_tokens",
		"policy", "prefill_tokens_computed", "prompt_tokens", "requests",
		"ttft_by_prompt_length", "ttft_ms.mean", "ttft_ms.p50", "ttft_ms.p90", "ttft_ms.p99",
	}
	if !slices.Equal(keys, want) {
		t.Errorf("JSON keys\n got %v\nwant %v", keys, want)
	}
	if run["policy"] != "round-robin" || run["mean_engine_utilization"] != 0.5 {
		t.Errorf("values: %v", run)
	}
	// Unknown utilisation is omitted, not reported as 0.
	s.MeanEngineUtilization = nil
	b, _ = json.Marshal(s)
	if strings.Contains(string(b), "mean_engine_utilization") {
		t.Error("nil utilisation marshalled")
	}
}

func TestWriteTable(t *testing.T) {
	u := 0.734
	a := measure.Summarize("prefix", syntheticRecords())
	a.MeanEngineUtilization = &u
	b := measure.Summarize("round-robin", syntheticRecords()[:1])
	var buf bytes.Buffer
	if err := (Report{Runs: []measure.Summary{a, b}}).WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	main, buckets, ok := strings.Cut(strings.TrimRight(buf.String(), "\n"), "\n\n")
	lines := strings.Split(main, "\n")
	if len(lines) != 3 || !ok {
		t.Fatalf("table:\n%s", buf.String())
	}
	// The TTFT-by-prompt-length table: a title, a header, a row per run;
	// syntheticRecords' prompts are all under 8k (3 successful of 4).
	bl := strings.Split(buckets, "\n")
	if len(bl) != 4 || !strings.HasPrefix(bl[0], "TTFT by prompt length") {
		t.Fatalf("bucket table:\n%s", buckets)
	}
	if f := strings.Fields(bl[2]); len(f) != 9 || f[0] != "prefix" || f[1] != "3" || f[2] != "200/280/298" || f[3] != "0" || f[4] != "-" {
		t.Errorf("prefix bucket row %q", bl[2])
	}
	for _, l := range lines[1:] {
		if len(l) != len(lines[0]) {
			t.Errorf("ragged table:\n%s", buf.String())
			break
		}
	}
	for _, want := range []string{"policy", "hit %", "TTFT p90 ms", "ITL p99 ms", "out tok/s", "prefill tok", "util %", "lag p99 ms"} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("header lacks %q: %s", want, lines[0])
		}
	}
	if f := strings.Fields(lines[1]); f[0] != "prefix" || f[3] != "45.0" || f[len(f)-3] != "73.4" || f[len(f)-4] != "2200" || f[len(f)-2] != "-" || f[len(f)-1] != "-" {
		t.Errorf("prefix row %q", lines[1])
	}
	if f := strings.Fields(lines[2]); f[0] != "round-robin" || f[len(f)-3] != "-" {
		t.Errorf("round-robin row %q", lines[2])
	}
	buf.Reset()
	if err := (Report{Runs: []measure.Summary{a}}).WriteJSON(&buf); err != nil || !strings.HasPrefix(buf.String(), "{\n  \"runs\": [") {
		t.Errorf("WriteJSON: %v %q", err, buf.String())
	}
}

// TestCheckLag: a run is behind when the fleet's or the client's p99 lag
// exceeds the margin; a run with neither (virtual) never is.
func TestCheckLag(t *testing.T) {
	for _, tc := range []struct {
		name         string
		fleet, send  *measure.Lag
		margin       time.Duration
		behind       bool
		marginMs     float64
		cell         string
		warningParts []string
	}{
		{name: "virtual", margin: 0, marginMs: 100, cell: "-"},
		{name: "kept up", fleet: &measure.Lag{Samples: 10, P50: 1, P99: 40, Max: 120}, send: &measure.Lag{Samples: 3, P99: 60}, marginMs: 100, cell: "60.0"},
		{name: "fleet behind", fleet: &measure.Lag{Samples: 10, P50: 5, P99: 1342, Max: 5211}, send: &measure.Lag{Samples: 3, P99: 60}, marginMs: 100, behind: true,
			cell: "1342 BEHIND", warningParts: []string{"fleet step lag p50 5.0, p99 1342, max 5211 ms", "client send lag", "more than 100 ms"}},
		{name: "client behind", send: &measure.Lag{Samples: 3, P99: 300, Max: 400}, margin: 250 * time.Millisecond, marginMs: 250, behind: true,
			cell: "300 BEHIND", warningParts: []string{"client send lag p50 0.0, p99 300, max 400 ms", "more than 250 ms"}},
		{name: "wide margin", fleet: &measure.Lag{Samples: 10, P99: 1342}, margin: time.Hour, marginMs: 3.6e6, cell: "1342.0"},
	} {
		s := measure.Summary{Policy: tc.name, FleetLag: tc.fleet, SendLag: tc.send}
		s.CheckLag(tc.margin)
		if s.Behind != tc.behind || s.MaxLagMs != tc.marginMs || lagCell(s) != tc.cell {
			t.Errorf("%s: behind %v margin %v cell %q; want %v %v %q", tc.name, s.Behind, s.MaxLagMs, lagCell(s), tc.behind, tc.marginMs, tc.cell)
		}
		var w bytes.Buffer
		n, err := Report{Runs: []measure.Summary{s}}.WriteLagWarnings(&w)
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
