package main

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
)

// benchJSON is the part of bench --out's report these tests read.
type benchJSON struct {
	Runs []struct {
		Policy          string
		HitRate         float64  `json:"hit_rate"`
		PooledHitRate   *float64 `json:"pooled_hit_rate"`
		InfiniteHitRate *float64 `json:"infinite_hit_rate"`
	}
	PooledHitRate   *float64            `json:"pooled_hit_rate"`
	InfiniteHitRate *float64            `json:"infinite_hit_rate"`
	Provenance      *measure.Provenance `json:"provenance"`
}

// TestBenchReportProvenance: a real `bench --compare --virtual` records
// its command line, version, clock, workload (with the trace file's
// SHA-256) and profile in its JSON and HTML, and every run's pooled and
// infinite references equal measure.PooledCacheHitRate and
// trace.InfiniteCacheHitRate of the replayed records.
func TestBenchReportProvenance(t *testing.T) {
	dir := t.TempDir()
	tr := burstTraceFile(t)
	out, html := filepath.Join(dir, "r.json"), filepath.Join(dir, "r.html")
	args := []string{"bench", "--compare", "round-robin,prefix", "--virtual", "--engines", "2", "--trace", tr, "--requests", "48", "--out", out, "--html", html}
	if msg, err := runMain(args...); err != nil {
		t.Fatalf("bench: %v\n%s", err, msg)
	}
	var rep benchJSON
	raw, _ := os.ReadFile(out)
	if err := json.Unmarshal(raw, &rep); err != nil || len(rep.Runs) != 2 || rep.Provenance == nil {
		t.Fatalf("report: %v\n%s", err, raw)
	}
	p := rep.Provenance
	if !slices.Equal(p.Command[1:], args) || p.Version != buildVersion() || p.Clock != "virtual" || p.Engines != 2 || p.GoVersion == "" || p.Start == "" || p.WallS <= 0 {
		t.Errorf("provenance %+v", p)
	}
	b, _ := os.ReadFile(tr)
	sum := sha256.Sum256(b)
	if w := p.Workload; w == nil || w.Kind != "mooncake" || w.Records != 64 || w.Replayed != 48 || len(w.Files) != 1 || w.Files[0].Path != tr || w.Files[0].SHA256 != hex.EncodeToString(sum[:]) {
		t.Errorf("workload %+v", p.Workload)
	}
	ec := sim.Config{Profile: sim.DefaultProfile()}.WithDefaults()
	if pr := p.Profile; pr == nil || pr.Name != sim.DefaultProfileName || pr.KVBlocks != ec.NumBlocks || pr.BlockSize != ec.BlockSize {
		t.Errorf("profile %+v", p.Profile)
	}
	recs, err := trace.LoadMooncake(tr)
	if err != nil {
		t.Fatal(err)
	}
	wantPooled := measure.PooledCacheHitRate(recs[:48], 2*ec.NumBlocks, ec.BlockSize)
	wantInf := trace.InfiniteCacheHitRate(recs[:48])
	for _, r := range rep.Runs {
		if r.PooledHitRate == nil || *r.PooledHitRate != wantPooled || r.InfiniteHitRate == nil || *r.InfiniteHitRate != wantInf {
			t.Errorf("%s: references %v %v, want %v %v", r.Policy, r.PooledHitRate, r.InfiniteHitRate, wantPooled, wantInf)
		}
	}
	if rep.PooledHitRate == nil || *rep.PooledHitRate != wantPooled {
		t.Errorf("report-level pooled %v, want %v", rep.PooledHitRate, wantPooled)
	}
	page, _ := os.ReadFile(html)
	for _, want := range []string{`data-field="command"`, "bench --compare round-robin,prefix --virtual", `data-field="trace"`, hex.EncodeToString(sum[:]),
		`data-field="profile"`, sim.DefaultProfileName, `data-key="pooled"`, `data-chart="itl-percentiles"`} {
		if !strings.Contains(string(page), want) {
			t.Errorf("HTML lacks %q", want)
		}
	}
}

// TestBenchReportRedacts: secrets on the command line (a URL's password, a
// key in its query) are in neither output, which still say where the run
// went; the references of a --target run are the infinite cache's only.
func TestBenchReportRedacts(t *testing.T) {
	dir := t.TempDir()
	out, html := filepath.Join(dir, "r.json"), filepath.Join(dir, "r.html")
	target := "http://ops:hunter2-pw@127.0.0.1:1/v1?api_key=sk-abcdefghijklmnop"
	msg, err := runMain("bench", "--target", target, "--trace", burstTraceFile(t), "--requests", "2", "--out", out, "--html", html)
	if err == nil || !strings.Contains(msg, "every request of a run failed") {
		t.Fatalf("bench against a closed port: %v\n%s", err, msg)
	}
	for _, f := range []string{out, html} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(b), "hunter2-pw") || strings.Contains(string(b), "sk-abcdefghijklmnop") {
			t.Errorf("%s holds a secret:\n%s", f, b)
		}
		if !strings.Contains(string(b), "127.0.0.1:1") {
			t.Errorf("%s does not say where the run went", f)
		}
	}
	var rep benchJSON
	raw, _ := os.ReadFile(out)
	if err := json.Unmarshal(raw, &rep); err != nil || rep.Provenance == nil || rep.Provenance.Target == "" || rep.Provenance.Clock != "real" {
		t.Fatalf("report: %v\n%s", err, raw)
	}
	if rep.PooledHitRate != nil || rep.Provenance.Profile != nil {
		t.Errorf("a target run has a pooled reference %v or a profile %+v", rep.PooledHitRate, rep.Provenance.Profile)
	}
}

// TestPlanReportProvenance: plan's JSON and HTML record the command and the
// profile; its rows the pooled reference of their size; its HTML the SLO
// line of each target.
func TestPlanReportProvenance(t *testing.T) {
	dir := t.TempDir()
	out, html := filepath.Join(dir, "plan.json"), filepath.Join(dir, "plan.html")
	args := []string{"plan", "--trace", burstTraceFile(t), "--engines", "4,8", "--policy", "prefix", "--slo", "ttft_p90=1s,itl_p99=600ms", "--out", out, "--html", html}
	if msg, err := runMain(args...); err != nil {
		t.Fatalf("plan: %v\n%s", err, msg)
	}
	var res struct {
		Rows []struct {
			Engines int
			Summary struct {
				PooledHitRate *float64 `json:"pooled_hit_rate"`
			}
		}
		Provenance *measure.Provenance `json:"provenance"`
	}
	raw, _ := os.ReadFile(out)
	if err := json.Unmarshal(raw, &res); err != nil || res.Provenance == nil || len(res.Rows) != 2 {
		t.Fatalf("plan.json: %v\n%s", err, raw)
	}
	if p := res.Provenance; !slices.Equal(p.Command[1:], args) || p.Clock != "virtual" || p.Profile == nil || p.Workload == nil || p.Workload.Replayed != 64 {
		t.Errorf("provenance %+v", p)
	}
	for _, r := range res.Rows {
		if r.Summary.PooledHitRate == nil {
			t.Errorf("%d engines: no pooled reference", r.Engines)
		}
	}
	page, _ := os.ReadFile(html)
	for _, want := range []string{`data-field="command"`, `data-chart="slo-ttft_p90"`, `data-key="slo" data-value="1000"`, `data-key="slo" data-value="600"`} {
		if !strings.Contains(string(page), want) {
			t.Errorf("HTML lacks %q", want)
		}
	}
}
