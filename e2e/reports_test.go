package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"image"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/data"
)

// runInfergate runs the infergate binary with args in dir and returns its
// output; it fails the test unless the exit status is 0.
func runInfergate(t *testing.T, ctx context.Context, bin, dir string, args ...string) string {
	t.Helper()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir, cmd.Env = dir, cleanEnv()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("infergate %s: %v\n%s", strings.Join(args, " "), err, lastLines(string(out), 40))
	}
	return string(out)
}

// domField is the text of the rendered report's key-value row data-field=name.
func domField(t *testing.T, dom, name string) string {
	t.Helper()
	m := regexp.MustCompile(`(?s)<tr data-field="` + regexp.QuoteMeta(name) + `"><th>[^<]*</th><td>(.*?)</td></tr>`).FindStringSubmatch(dom)
	if m == nil {
		t.Errorf("rendered report has no %q row", name)
		return ""
	}
	return htmlText(m[1])
}

// htmlText strips tags and unescapes the entities html/template writes.
func htmlText(s string) string {
	s = regexp.MustCompile(`<[^>]*>`).ReplaceAllString(s, "")
	return strings.NewReplacer("&amp;", "&", "&lt;", "<", "&gt;", ">", "&#34;", `"`, "&#39;", "'", "&quot;", `"`).Replace(s)
}

// figure is the rendered <figure> whose data-chart is key.
func figure(t *testing.T, dom, key string) string {
	t.Helper()
	m := regexp.MustCompile(`(?s)<figure data-chart="` + regexp.QuoteMeta(key) + `">(.*?)</figure>`).FindStringSubmatch(dom)
	if m == nil {
		t.Errorf("rendered report has no %s chart", key)
		return ""
	}
	return m[1]
}

// dataValue is the data-value of the element with data-key=key in scope.
func dataValue(t *testing.T, scope, key string) float64 {
	t.Helper()
	m := regexp.MustCompile(`data-key="` + regexp.QuoteMeta(key) + `" data-value="([^"]+)"`).FindStringSubmatch(scope)
	if m == nil {
		t.Errorf("no element data-key=%q", key)
		return -1
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		t.Errorf("data-key=%q: data-value %q", key, m[1])
	}
	return v
}

// redPixels counts the pixels of an image drawn in the SLO red
// (bench.SLOColor, #c00000, antialiased).
func redPixels(t *testing.T, path string) (int, image.Rectangle) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	n := 0
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y++ {
		for x := b.Min.X; x < b.Max.X; x++ {
			r, g, bl, _ := img.At(x, y).RGBA()
			if r>>8 >= 180 && g>>8 < 60 && bl>>8 < 60 {
				n++
			}
		}
	}
	return n, b
}

// TestReportsChromium runs a real `infergate bench --compare --virtual`
// and a real `infergate plan` (300 requests of the embedded Mooncake trace,
// virtual time), renders their HTML reports in headless Chromium and checks
// from the rendered DOM that each shows what produced it (command, version,
// trace with its SHA-256, profile with its KV numbers, clock, lag) and
// what it must draw: the pooled- and infinite-cache reference lines at the
// JSON's values, the ITL percentiles at the JSON's, the SLO threshold of
// every plan target at its value and the recommended point at the
// recommended size; and from the screenshot that the SLO lines are drawn
// in red. INFERGATE_REPORT_SCREENSHOTS=dir keeps the screenshots.
func TestReportsChromium(t *testing.T) {
	chromium := RequireTool(t, EnvChromium, "chromium", "chromium", "chromium-browser")
	bin := infergateBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := t.TempDir()
	shots := os.Getenv("INFERGATE_REPORT_SCREENSHOTS")
	if shots == "" {
		shots = dir
	}
	version := strings.TrimSpace(strings.TrimPrefix(runInfergate(t, ctx, bin, dir, "version"), "infergate"))
	moon, err := data.ReadFile(data.Mooncake)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(moon)
	traceSHA := hex.EncodeToString(sum[:])

	// bench --compare --virtual.
	runInfergate(t, ctx, bin, dir, "bench", "--compare", "round-robin,prefix,cache-aware", "--virtual", "--engines", "8",
		"--requests", "300", "--out", "bench.json", "--html", "bench.html")
	var rep struct {
		Runs []struct {
			Policy          string
			PooledHitRate   float64            `json:"pooled_hit_rate"`
			InfiniteHitRate float64            `json:"infinite_hit_rate"`
			ITL             map[string]float64 `json:"itl_ms"`
		}
		Provenance struct {
			Workload struct {
				Files []struct{ Path, SHA256 string }
			}
			Profile struct {
				Name      string
				KVBlocks  int `json:"kv_blocks"`
				BlockSize int `json:"block_size"`
			}
		}
	}
	raw, err := os.ReadFile(filepath.Join(dir, "bench.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &rep); err != nil || len(rep.Runs) != 3 {
		t.Fatalf("bench.json: %v\n%s", err, raw)
	}
	shot := filepath.Join(shots, "bench-report.png")
	dom, err := Chromium(ctx, chromium, dir, "file://"+filepath.Join(dir, "bench.html"), 2*time.Second, shot, 1400, 2600)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s", shot)
	if got := domField(t, dom, "command"); !strings.Contains(got, "bench --compare round-robin,prefix,cache-aware --virtual --engines 8 --requests 300") {
		t.Errorf("command %q", got)
	}
	if got := domField(t, dom, "version"); got != version {
		t.Errorf("version %q, want %q (infergate version)", got, version)
	}
	if got := domField(t, dom, "trace"); !strings.Contains(got, data.Embedded+data.Mooncake) || !strings.Contains(got, traceSHA) ||
		len(rep.Provenance.Workload.Files) != 1 || rep.Provenance.Workload.Files[0].SHA256 != traceSHA {
		t.Errorf("trace %q, want %s with sha256 %s", got, data.Embedded+data.Mooncake, traceSHA)
	}
	pr := rep.Provenance.Profile
	if got := domField(t, dom, "profile"); !strings.Contains(got, pr.Name) || pr.KVBlocks == 0 || !strings.Contains(got, strconv.Itoa(pr.KVBlocks)+" blocks × "+strconv.Itoa(pr.BlockSize)+" tokens") {
		t.Errorf("profile %q (JSON %+v)", got, pr)
	}
	if got := domField(t, dom, "clock"); !strings.Contains(got, "virtual time") {
		t.Errorf("clock %q", got)
	}
	if got := domField(t, dom, "lag"); !strings.Contains(got, "not measured") {
		t.Errorf("lag %q", got)
	}
	for _, f := range []string{"workload", "host", "go", "revision", "start", "profile-source"} {
		domField(t, dom, f)
	}
	hit := figure(t, dom, "hit-rate")
	if got := dataValue(t, hit, "pooled"); got != rep.Runs[0].PooledHitRate || got <= 0 {
		t.Errorf("pooled-cache line at %v, JSON %v", got, rep.Runs[0].PooledHitRate)
	}
	if got := dataValue(t, hit, "infinite"); got != rep.Runs[0].InfiniteHitRate || got <= 0 {
		t.Errorf("infinite-cache line at %v, JSON %v", got, rep.Runs[0].InfiniteHitRate)
	}
	if f := figure(t, dom, "hit-rate-time"); !strings.Contains(f, `class="ref"`) {
		t.Errorf("hit rate over time has no reference curves")
	}
	itl := figure(t, dom, "itl-percentiles")
	var bars []float64
	for _, m := range regexp.MustCompile(`<rect [^>]*data-value="([^"]+)"`).FindAllStringSubmatch(itl, -1) {
		v, _ := strconv.ParseFloat(m[1], 64)
		bars = append(bars, v)
	}
	if len(bars) != 9 {
		t.Fatalf("ITL chart: %d bars, want 3 percentiles × 3 runs", len(bars))
	}
	for g, p := range []string{"p50", "p90", "p99"} {
		for i, r := range rep.Runs {
			if got, want := bars[g*3+i], r.ITL[p]; got != want || want <= 0 {
				t.Errorf("ITL %s of %s: bar %v, JSON %v", p, r.Policy, got, want)
			}
		}
	}
	if strings.Count(dom, "<svg") < 9 || !strings.Contains(dom, `<th>pooled-cache hit %</th>`) {
		t.Errorf("bench report: %d charts, table head %v", strings.Count(dom, "<svg"), strings.Contains(dom, "pooled-cache"))
	}
	if _, b := redPixels(t, shot); b.Dx() != 1400 {
		t.Errorf("screenshot %v", b)
	}

	// plan.
	out := runInfergate(t, ctx, bin, dir, "plan", "--requests", "300", "--engines", "2..12/2", "--policy", "cache-aware,round-robin",
		"--slo", "ttft_p90=8s,itl_p99=1500ms", "--out", "plan.json", "--html", "plan.html")
	var res struct {
		Rows []struct {
			Checks []struct {
				Target     string
				LimitMs    float64 `json:"limit_ms"`
				ObservedMs float64 `json:"observed_ms"`
			}
		}
		Recommendation *struct {
			Engines int
			Policy  string
			Row     int
		}
	}
	raw, err = os.ReadFile(filepath.Join(dir, "plan.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &res); err != nil || res.Recommendation == nil {
		t.Fatalf("plan.json: %v\n%s\n%s", err, raw, out)
	}
	shot = filepath.Join(shots, "plan-report.png")
	dom, err = Chromium(ctx, chromium, dir, "file://"+filepath.Join(dir, "plan.html"), 2*time.Second, shot, 1400, 2000)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s", shot)
	if got := domField(t, dom, "command"); !strings.Contains(got, "plan --requests 300 --engines 2..12/2") {
		t.Errorf("command %q", got)
	}
	if got := domField(t, dom, "version"); got != version {
		t.Errorf("version %q, want %q", got, version)
	}
	if got := domField(t, dom, "trace"); !strings.Contains(got, traceSHA) {
		t.Errorf("trace %q", got)
	}
	domField(t, dom, "profile")
	rec := res.Rows[res.Recommendation.Row]
	for _, c := range rec.Checks {
		fig := figure(t, dom, "slo-"+c.Target)
		if got := dataValue(t, fig, "slo"); got != c.LimitMs {
			t.Errorf("%s: SLO line at %v, want %v", c.Target, got, c.LimitMs)
		}
		m := regexp.MustCompile(`data-key="recommended" data-x="([^"]+)" data-y="([^"]+)"`).FindStringSubmatch(fig)
		if m == nil || m[1] != strconv.Itoa(res.Recommendation.Engines) {
			t.Errorf("%s: recommended mark %v, want at %d engines", c.Target, m, res.Recommendation.Engines)
		} else if y, _ := strconv.ParseFloat(m[2], 64); y != c.ObservedMs {
			t.Errorf("%s: recommended mark at %v, want the run's %v", c.Target, y, c.ObservedMs)
		}
	}
	if !strings.Contains(dom, `<tr class="recommended">`) || !strings.HasPrefix(strings.TrimSpace(htmlText(domField(t, dom, "recommendation"))), strconv.Itoa(res.Recommendation.Engines)+" engines, policy "+res.Recommendation.Policy) {
		t.Error("the recommendation is not shown")
	}
	hitFig := figure(t, dom, "hit-rate")
	if !strings.Contains(hitFig, `data-key="pooled"`) || !strings.Contains(hitFig, `data-key="infinite"`) {
		t.Error("plan hit-rate chart lacks its references")
	}
	// Two dashed SLO lines of 550 px, at least half drawn in #c00000.
	if n, _ := redPixels(t, shot); n < 550 {
		t.Errorf("plan screenshot: %d red pixels, want the SLO lines drawn (≥ 550)", n)
	}
	if t.Failed() {
		t.Logf("rendered plan DOM:\n%s", lastLines(dom, 200))
	}
}
