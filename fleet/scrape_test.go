package fleet

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/simserver"
)

func readPage(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "metrics", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// pageCases are the recorded pages and the Load each must give.
var pageCases = []struct {
	file string
	kind Kind
	want Load
	// loraUpdated is the LoRA sample's value (Unix seconds), 0 for none.
	loraUpdated float64
}{
	{"vllm.txt", VLLM, Load{
		Waiting: 4, Running: 4, KVUtil: 0.0595703125, BlockSize: 16, NumBlocks: 2048,
		PrefixQueries: 2712, PrefixHits: 1584, Engines: 1, HasQueue: true, HasKVUtil: true,
		LoRA: LoRAState{Known: true, Running: []string{"sql-lora"}, Waiting: []string{"chat-lora", "sql-lora"}, Max: 1},
	}, 1.7960067010960388e+09},
	{"vllm.txt", Sim, Load{
		Waiting: 4, Running: 4, KVUtil: 0.0595703125, BlockSize: 16, NumBlocks: 2048,
		PrefixQueries: 2712, PrefixHits: 1584, Engines: 1, HasQueue: true, HasKVUtil: true,
		LoRA: LoRAState{Known: true, Running: []string{"sql-lora"}, Waiting: []string{"chat-lora", "sql-lora"}, Max: 1},
	}, 1.7960067010960388e+09},
	// Two DP engines: counts summed, KV usage averaged, num_gpu_blocks
	// taken once (every engine's sample carries the front end's total).
	{"vllm-dp.txt", VLLM, Load{
		Waiting: 3, Running: 8, KVUtil: 0.375, BlockSize: 16, NumBlocks: 58000,
		PrefixQueries: 40000, PrefixHits: 12000, Engines: 2, HasQueue: true, HasKVUtil: true,
	}, 0},
	{"vllm-old.txt", VLLM, Load{
		Waiting: 0, Running: 2, KVUtil: 0.42, BlockSize: 16, NumBlocks: 27000,
		PrefixQueries: 5000, PrefixHits: 1500, Engines: 1, HasQueue: true, HasKVUtil: true,
	}, 0},
	// Hits: the device tier only (host-tier hits are not in the GPU cache).
	{"sglang.txt", SGLang, Load{
		Waiting: 3, Running: 12, KVUtil: 0.61, BlockSize: 1, NumBlocks: 480000,
		PrefixQueries: 250000, PrefixHits: 98000, Engines: 1, HasQueue: true, HasKVUtil: true,
	}, 0},
	{"tgi.txt", TGI, Load{
		Waiting: 7, Running: 24, KVUtil: -1, PrefixQueries: -1, PrefixHits: -1, Engines: 1, HasQueue: true,
	}, 0},
	// prompt_tokens_total excludes cached tokens: queries = 6886 + 4096.
	{"llamacpp.txt", LlamaCpp, Load{
		Waiting: 1, Running: 2, KVUtil: -1, PrefixQueries: 10982, PrefixHits: 4096, Engines: 1, HasQueue: true,
	}, 0},
	{"llamacpp-old.txt", LlamaCpp, Load{
		Waiting: 0, Running: 1, KVUtil: 0.3125, PrefixQueries: -1, PrefixHits: -1, Engines: 1, HasQueue: true, HasKVUtil: true,
	}, 0},
}

func TestParseMetricsPages(t *testing.T) {
	for _, tc := range pageCases {
		t.Run(string(tc.kind)+"/"+tc.file, func(t *testing.T) {
			got, err := ParseMetrics(tc.kind, bytes.NewReader(readPage(t, tc.file)))
			if err != nil {
				t.Fatal(err)
			}
			checkLoad(t, got, tc.want, tc.loraUpdated)
		})
	}
}

// checkLoad compares a Load with want, LoRA.Updated with the sample value
// loraUpdated (to the microsecond).
func checkLoad(t *testing.T, got, want Load, loraUpdated float64) {
	t.Helper()
	upd := got.LoRA.Updated
	got.LoRA.Updated = time.Time{}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Load\n got %+v\nwant %+v", got, want)
	}
	if loraUpdated == 0 {
		if !upd.IsZero() {
			t.Errorf("LoRA.Updated = %v, want zero", upd)
		}
		return
	}
	if d := float64(upd.UnixNano())/1e9 - loraUpdated; math.Abs(d) > 1e-6 {
		t.Errorf("LoRA.Updated = %v (%.6f), want %.6f", upd, float64(upd.UnixNano())/1e9, loraUpdated)
	}
}

// TestPagesAreValid checks that every recorded page, whole, is valid text
// exposition format: the tests must not lean on the line filter.
func TestPagesAreValid(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "metrics", "*.txt"))
	if err != nil || len(files) < 7 {
		t.Fatalf("pages: %v, %v", files, err)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		p := expfmt.NewTextParser(model.UTF8Validation)
		fams, err := p.TextToMetricFamilies(bytes.NewReader(b))
		if err != nil || len(fams) == 0 {
			t.Errorf("%s: %d families, %v", f, len(fams), err)
		}
	}
}

// TestParseMetricsLiveSim reads the page of a running simulator, so the
// parser and what package sim exports cannot drift apart.
func TestParseMetricsLiveSim(t *testing.T) {
	f, err := simserver.StartFleet(1, simserver.ServerConfig{TimeScale: 1000, Engine: sim.Config{NumBlocks: 700, BlockSize: 32}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	resp, err := http.Get(f.URLs[0] + Sim.Info().MetricsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got, err := ParseMetrics(Sim, resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	want := Load{BlockSize: 32, NumBlocks: 700, Engines: 1, HasQueue: true, HasKVUtil: true}
	checkLoad(t, got, want, 0)
	if f.BlockSize() != 32 || f.KVBlocks() != 700 {
		t.Errorf("fleet reports %d blocks of %d", f.KVBlocks(), f.BlockSize())
	}
}

func TestParseMetricsErrors(t *testing.T) {
	vllm := readPage(t, "vllm.txt")
	cut := bytes.Index(vllm, []byte(`vllm:num_requests_running{engine="0",model_`)) + 30
	for _, tc := range []struct {
		name, page string
		kind       Kind
		want       string
	}{
		{"empty", "", VLLM, "no vllm load metric"},
		{"garbage", "\x00\xff not a metrics page }{\n", VLLM, "no vllm load metric"},
		{"wrong kind", string(readPage(t, "tgi.txt")), VLLM, "wrong engine kind"},
		{"truncated in a label", string(vllm[:cut]), VLLM, "parse metrics"},
		{"bad value", "vllm:num_requests_waiting{engine=\"0\"} twelve\n", VLLM, "parse metrics"},
		{"bad label", "vllm:num_requests_waiting{engine=0} 1\n", VLLM, "parse metrics"},
		{"sample without newline", "tgi_queue_size 3", TGI, "parse metrics"},
		{"two TYPE lines", "# TYPE tgi_queue_size gauge\n# TYPE tgi_queue_size counter\ntgi_queue_size 1\n", TGI, "parse metrics"},
		{"ollama", "", Ollama, ErrNoMetrics.Error()},
		{"unknown kind", "", Kind("trtllm"), "unknown engine kind"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := ParseMetrics(tc.kind, strings.NewReader(tc.page))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
			checkLoad(t, l, UnknownLoad(), 0)
		})
	}
	if _, err := ParseMetrics(Ollama, nil); !errors.Is(err, ErrNoMetrics) {
		t.Errorf("ollama: %v is not ErrNoMetrics", err)
	}
}

// TestParseMetricsErrorLine checks that a parse error names the line of the
// page, not of the filtered text.
func TestParseMetricsErrorLine(t *testing.T) {
	page := "# HELP other A metric not read.\n# TYPE other gauge\nother 1\n\ntgi_queue_size{a=\"1\" 2\n"
	_, err := ParseMetrics(TGI, strings.NewReader(page))
	if err == nil || !strings.Contains(err.Error(), "line 5") {
		t.Fatalf("err = %v, want line 5", err)
	}
}

func TestParseMetricsUnreadLinesIgnored(t *testing.T) {
	long := "# HELP junk " + strings.Repeat("x", 3<<20) + "\njunk{a=\"" + strings.Repeat("y", 2<<20) + "\"} 1\n"
	page := long + "this line is { not valid\n" + string(readPage(t, "tgi.txt"))
	l, err := ParseMetrics(TGI, strings.NewReader(page))
	if err != nil || l.Waiting != 7 || l.Running != 24 {
		t.Fatalf("got %+v, %v", l, err)
	}
	tooLong := "tgi_queue_size{a=\"" + strings.Repeat("z", maxLine) + "\"} 1\n"
	if _, err := ParseMetrics(TGI, strings.NewReader(tooLong)); err == nil || !strings.Contains(err.Error(), "longer than") {
		t.Fatalf("over-long kept line: %v", err)
	}
}

func TestParseMetricsClamps(t *testing.T) {
	for _, tc := range []struct {
		name, page string
		kind       Kind
		want       Load
	}{
		{"NaN and Inf ignored", `vllm:num_requests_waiting{engine="0"} NaN
vllm:num_requests_waiting{engine="1"} 2
vllm:num_requests_running{engine="0"} +Inf
vllm:num_requests_running{engine="1"} 3
vllm:kv_cache_usage_perc{engine="0"} NaN
vllm:kv_cache_usage_perc{engine="1"} 0.5
vllm:prefix_cache_queries_total{engine="0"} -Inf
vllm:prefix_cache_queries_total{engine="1"} 10
vllm:prefix_cache_hits_total{engine="0"} 4
`, VLLM, Load{Waiting: 2, Running: 3, KVUtil: 0.5, PrefixQueries: 10, PrefixHits: 4, Engines: 1, HasQueue: true, HasKVUtil: true}},
		{"negatives and overflow", `vllm:num_requests_waiting -5
vllm:num_requests_running 1e300
vllm:kv_cache_usage_perc{engine="0"} -0.5
vllm:kv_cache_usage_perc{engine="1"} 7
vllm:prefix_cache_queries_total -3
vllm:prefix_cache_hits_total -1
`, VLLM, Load{Waiting: 0, Running: maxCount, KVUtil: 0.5, PrefixQueries: 0, PrefixHits: 0, Engines: 1, HasQueue: true, HasKVUtil: true}},
		{"all NaN is unknown", `sglang:num_queue_reqs NaN
sglang:num_running_reqs 1
sglang:token_usage NaN
`, SGLang, Load{Running: 1, KVUtil: -1, PrefixQueries: -1, PrefixHits: -1, Engines: 1}},
		{"bad cache config labels", `vllm:cache_config_info{block_size="16",num_gpu_blocks="None",engine="0"} 1
vllm:cache_config_info{block_size="-16",num_gpu_blocks="100",engine="1"} 1
vllm:cache_config_info{block_size="16",num_gpu_blocks="99999999999999999999",engine="2"} 1
`, VLLM, Load{KVUtil: -1, PrefixQueries: -1, PrefixHits: -1}},
		{"only one prefix counter", `llamacpp:prompt_tokens_total 100
llamacpp:requests_processing 0
llamacpp:requests_deferred 0
`, LlamaCpp, Load{KVUtil: -1, PrefixQueries: -1, PrefixHits: -1, Engines: 1, HasQueue: true}},
		{"untyped and counter types read alike", `# TYPE tgi_queue_size counter
tgi_queue_size 2
tgi_batch_current_size 5
`, TGI, Load{Waiting: 2, Running: 5, KVUtil: -1, PrefixQueries: -1, PrefixHits: -1, Engines: 1, HasQueue: true}},
		{"histogram under a read name ignored", `# TYPE tgi_queue_size histogram
tgi_queue_size_bucket{le="+Inf"} 3
tgi_queue_size_sum 1
tgi_queue_size_count 3
tgi_batch_current_size 5
`, TGI, Load{Running: 5, KVUtil: -1, PrefixQueries: -1, PrefixHits: -1, Engines: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseMetrics(tc.kind, strings.NewReader(tc.page))
			if err != nil {
				t.Fatal(err)
			}
			checkLoad(t, got, tc.want, 0)
		})
	}
}

func TestParseMetricsSGLangCacheConfigInfo(t *testing.T) {
	// Older pages (as read by the GIE/llm-d EPP): page size and count as
	// labels of sglang:cache_config_info; no cache_source label on hits.
	page := `sglang:num_queue_reqs{model_name="m"} 0
sglang:num_running_reqs{model_name="m"} 1
sglang:cache_config_info{model_name="m",page_size="64",num_pages="2000"} 1
sglang:prompt_tokens_total{model_name="m"} 900
sglang:cached_tokens_total{model_name="m"} 300
`
	got, err := ParseMetrics(SGLang, strings.NewReader(page))
	if err != nil {
		t.Fatal(err)
	}
	checkLoad(t, got, Load{Running: 1, KVUtil: -1, BlockSize: 64, NumBlocks: 2000, PrefixQueries: 900, PrefixHits: 300, Engines: 1, HasQueue: true}, 0)

	// The gauges win over the info labels when both are present; with DP
	// ranks, queues add up and the largest pool is kept.
	page = `sglang:num_queue_reqs{dp_rank="0"} 1
sglang:num_queue_reqs{dp_rank="1"} 2
sglang:num_running_reqs{dp_rank="0"} 3
sglang:num_running_reqs{dp_rank="1"} 4
sglang:token_usage{dp_rank="0"} 0.2
sglang:token_usage{dp_rank="1"} 0.4
sglang:page_size{dp_rank="0"} 16
sglang:page_size{dp_rank="1"} 16
sglang:num_pages{dp_rank="0"} 1000
sglang:num_pages{dp_rank="1"} 1000
sglang:cache_config_info{page_size="64",num_pages="2000"} 1
`
	got, err = ParseMetrics(SGLang, strings.NewReader(page))
	if err != nil {
		t.Fatal(err)
	}
	checkLoad(t, got, Load{Waiting: 3, Running: 7, KVUtil: 0.30000000000000004, BlockSize: 16, NumBlocks: 1000, PrefixQueries: -1, PrefixHits: -1, Engines: 2, HasQueue: true, HasKVUtil: true}, 0)
}

func TestParseMetricsLoRA(t *testing.T) {
	page := `# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a, b",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters="c"} 1.8e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="x",waiting_lora_adapters="y"} NaN
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a",waiting_lora_adapters=""} 1.75e9
`
	got, err := ParseMetrics(VLLM, strings.NewReader(page))
	if err != nil {
		t.Fatal(err)
	}
	checkLoad(t, got, Load{KVUtil: -1, PrefixQueries: -1, PrefixHits: -1,
		LoRA: LoRAState{Known: true, Waiting: []string{"c"}, Max: 4}}, 1.8e9)

	got, err = ParseMetrics(VLLM, strings.NewReader(`vllm:lora_requests_info{max_lora="x",running_lora_adapters=",a,,b,"} NaN`+"\n"))
	if err != nil {
		t.Fatal(err)
	}
	checkLoad(t, got, Load{KVUtil: -1, PrefixQueries: -1, PrefixHits: -1,
		LoRA: LoRAState{Known: true, Running: []string{"a", "b"}}}, 0)
}

func BenchmarkParseMetrics(b *testing.B) {
	for _, f := range []string{"vllm.txt", "vllm-dp.txt", "sglang.txt"} {
		page := readPage(b, f)
		kind := VLLM
		if f == "sglang.txt" {
			kind = SGLang
		}
		b.Run(f, func(b *testing.B) {
			b.SetBytes(int64(len(page)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := ParseMetrics(kind, bytes.NewReader(page)); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	// For comparison: expfmt on the whole page, as without the line filter.
	page := readPage(b, "vllm.txt")
	b.Run("whole-page/vllm.txt", func(b *testing.B) {
		b.SetBytes(int64(len(page)))
		b.ReportAllocs()
		for b.Loop() {
			p := expfmt.NewTextParser(model.UTF8Validation)
			if _, err := p.TextToMetricFamilies(bytes.NewReader(page)); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func FuzzParseMetrics(f *testing.F) {
	files, _ := filepath.Glob(filepath.Join("testdata", "metrics", "*.txt"))
	for _, name := range files {
		b, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
		f.Add(b[:len(b)/2])
	}
	f.Add([]byte("vllm:num_requests_waiting NaN\nvllm:num_requests_running -1e400\n"))
	f.Add([]byte("vllm:lora_requests_info{running_lora_adapters=\"a,b\",max_lora=\"2\"} 1e30\n"))
	f.Add([]byte("sglang:cached_tokens_total{cache_source=\"host\"} 1\nsglang:prompt_tokens_total 2\n"))
	f.Fuzz(func(t *testing.T, page []byte) {
		for _, k := range Kinds() {
			l, err := ParseMetrics(k, bytes.NewReader(page))
			if err != nil {
				continue
			}
			if l.Waiting < 0 || l.Running < 0 || l.Waiting > maxCount || l.Running > maxCount || l.Engines < 0 {
				t.Fatalf("%s: counts %+v", k, l)
			}
			if l.HasKVUtil != (l.KVUtil >= 0) || l.KVUtil > 1 || (l.KVUtil < 0 && l.KVUtil != -1) || math.IsNaN(l.KVUtil) {
				t.Fatalf("%s: KV util %v (has %v)", k, l.KVUtil, l.HasKVUtil)
			}
			if l.BlockSize < 0 || l.NumBlocks < 0 || (l.BlockSize == 0) != (l.NumBlocks == 0) {
				t.Fatalf("%s: blocks %d × %d", k, l.NumBlocks, l.BlockSize)
			}
			for _, c := range []float64{l.PrefixQueries, l.PrefixHits} {
				if math.IsNaN(c) || math.IsInf(c, 0) || (c < 0 && c != -1) {
					t.Fatalf("%s: prefix counters %v / %v", k, l.PrefixHits, l.PrefixQueries)
				}
			}
			if (l.PrefixQueries < 0) != (l.PrefixHits < 0) {
				t.Fatalf("%s: one prefix counter known: %v / %v", k, l.PrefixHits, l.PrefixQueries)
			}
			if l.LoRA.Max < 0 {
				t.Fatalf("%s: max_lora %d", k, l.LoRA.Max)
			}
		}
	})
}

// pageServer serves a fixed page at /metrics and counts requests.
func pageServer(t *testing.T, page []byte) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		_, _ = w.Write(page)
	}))
	t.Cleanup(srv.Close)
	return srv, &n
}

func TestScraperPages(t *testing.T) {
	var eps []Target
	for _, tc := range pageCases {
		srv, _ := pageServer(t, readPage(t, tc.file))
		eps = append(eps, Target{URL: srv.URL + "/", Kind: tc.kind})
	}
	s, err := NewScraper(eps, ScrapeConfig{Interval: time.Minute, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if l, _, ok := s.Latest(0); ok || l.KVUtil != -1 {
		t.Fatalf("before any scrape: %+v, %v", l, ok)
	}
	before := time.Now()
	s.ScrapeOnce(context.Background())
	for i, tc := range pageCases {
		l, at, ok := s.Latest(i)
		if !ok || at.Before(before) || s.Err(i) != nil {
			t.Errorf("%s: ok %v at %v err %v", tc.file, ok, at, s.Err(i))
			continue
		}
		checkLoad(t, l, tc.want, tc.loraUpdated)
	}
	if _, _, ok := s.Latest(len(pageCases)); ok {
		t.Error("Latest out of range reads ok")
	}
	if s.Len() != len(pageCases) {
		t.Errorf("Len = %d", s.Len())
	}
}

func TestScraperErrors(t *testing.T) {
	good, _ := pageServer(t, readPage(t, "tgi.txt"))
	release := make(chan struct{})
	hang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	defer hang.Close()
	defer close(release) // before hang.Close, which waits for handlers
	fail := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "engine dead", http.StatusInternalServerError)
	}))
	defer fail.Close()
	huge := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		line := []byte("# " + strings.Repeat("padding ", 127) + "\n")
		for i := 0; i < (8<<20)/len(line); i++ {
			if _, err := w.Write(line); err != nil {
				return
			}
		}
	}))
	defer huge.Close()
	page := readPage(t, "tgi.txt")
	exact, _ := pageServer(t, page)

	eps := []Target{
		{URL: good.URL, Kind: TGI},
		{URL: hang.URL, Kind: TGI},
		{URL: fail.URL, Kind: TGI},
		{URL: huge.URL, Kind: TGI},
		{URL: good.URL, Kind: Ollama},
		{URL: exact.URL, Kind: TGI},
		{URL: good.URL + "/nothing", Kind: TGI},
	}
	s, err := NewScraper(eps, ScrapeConfig{Interval: time.Minute, Timeout: 300 * time.Millisecond, MaxBytes: int64(len(page))})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	s.ScrapeOnce(context.Background())
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("round took %v with a 300ms timeout", d)
	}
	for i, want := range []string{"", "deadline exceeded", "status 500", "too large", "no metrics endpoint", "", "status 404"} {
		err := s.Err(i)
		_, _, ok := s.Latest(i)
		if want == "" {
			if err != nil || !ok {
				t.Errorf("endpoint %d: %v, ok %v", i, err, ok)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), want) || ok {
			t.Errorf("endpoint %d: err %v (want %q), ok %v", i, err, want, ok)
		}
	}
	if !errors.Is(s.Err(3), ErrTooLarge) || !strings.Contains(s.Err(3).Error(), fmt.Sprint(len(page))) {
		t.Errorf("huge: %v", s.Err(3))
	}
	if !errors.Is(s.Err(4), ErrNoMetrics) {
		t.Errorf("ollama: %v", s.Err(4))
	}
	if s.Err(99) == nil {
		t.Error("Err out of range is nil")
	}
}

func TestScraperStaleness(t *testing.T) {
	var failing atomic.Bool
	page := readPage(t, "llamacpp.txt")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if failing.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write(page)
	}))
	defer srv.Close()
	s, err := NewScraper([]Target{{URL: srv.URL, Kind: LlamaCpp}}, ScrapeConfig{Interval: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	now := time.Unix(1_800_000_000, 0)
	s.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }

	s.ScrapeOnce(context.Background())
	t0 := s.now()
	failing.Store(true)
	advance(time.Second)
	s.ScrapeOnce(context.Background())
	l, at, ok := s.Latest(0)
	if !ok || !at.Equal(t0) || l.Running != 2 || s.Err(0) == nil {
		t.Fatalf("after one failure: %+v at %v ok %v err %v; want the previous Load", l, at, ok, s.Err(0))
	}
	advance(2 * time.Second) // 3 intervals: still fresh
	if _, _, ok := s.Latest(0); !ok {
		t.Fatal("stale at exactly 3 intervals")
	}
	advance(time.Millisecond)
	if l, at, ok := s.Latest(0); ok || !at.Equal(t0) || l.HasQueue || l.KVUtil != -1 {
		t.Fatalf("after 3 intervals: %+v at %v ok %v; want unknown", l, at, ok)
	}
	failing.Store(false)
	s.ScrapeOnce(context.Background())
	if _, at, ok := s.Latest(0); !ok || !at.Equal(s.now()) || s.Err(0) != nil {
		t.Fatalf("after recovery: at %v ok %v err %v", at, ok, s.Err(0))
	}
}

func TestScraperMetricsURL(t *testing.T) {
	page := readPage(t, "llamacpp.txt")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" || r.URL.Query().Get("model") != "qwen" {
			http.Error(w, "model required", http.StatusBadRequest)
			return
		}
		if !strings.HasPrefix(r.Header.Get("Accept"), "text/plain") {
			http.Error(w, "want text", http.StatusNotAcceptable)
			return
		}
		// The engine is not asked to compress the page every second
		// (its own CPU, the API server's event loop).
		if ae := r.Header.Get("Accept-Encoding"); ae != "" {
			http.Error(w, "asked for "+ae, http.StatusNotAcceptable)
			return
		}
		_, _ = w.Write(page)
	}))
	defer srv.Close()
	s, err := NewScraper([]Target{
		{URL: srv.URL, Kind: LlamaCpp, MetricsURL: srv.URL + "/metrics?model=qwen"},
		{URL: srv.URL, Kind: LlamaCpp},
	}, ScrapeConfig{})
	if err != nil {
		t.Fatal(err)
	}
	s.ScrapeOnce(context.Background())
	if _, _, ok := s.Latest(0); !ok {
		t.Errorf("MetricsURL: %v", s.Err(0))
	}
	if err := s.Err(1); err == nil || !strings.Contains(err.Error(), "status 400") {
		t.Errorf("without ?model: %v", err)
	}
}

func TestNewScraperErrors(t *testing.T) {
	for _, ep := range []Target{
		{URL: "http://a:1", Kind: "trtllm"},
		{URL: "", Kind: VLLM},
		{URL: "localhost:8000", Kind: VLLM},
		{URL: "ftp://a/", Kind: VLLM},
		{URL: "http://a:1", Kind: VLLM, MetricsURL: "http://%zz"},
	} {
		if _, err := NewScraper([]Target{ep}, ScrapeConfig{}); err == nil {
			t.Errorf("%+v accepted", ep)
		}
	}
	// An Ollama endpoint needs no URL that parses: it is never scraped.
	if _, err := NewScraper([]Target{{URL: "", Kind: Ollama}}, ScrapeConfig{}); err != nil {
		t.Error(err)
	}
}

func TestScraperConcurrency(t *testing.T) {
	var cur, peak atomic.Int64
	page := readPage(t, "tgi.txt")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := cur.Add(1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		time.Sleep(30 * time.Millisecond)
		cur.Add(-1)
		_, _ = w.Write(page)
	}))
	defer srv.Close()
	eps := make([]Target, 8)
	for i := range eps {
		eps[i] = Target{URL: srv.URL, Kind: TGI}
	}
	s, err := NewScraper(eps, ScrapeConfig{Concurrency: 2})
	if err != nil {
		t.Fatal(err)
	}
	s.ScrapeOnce(context.Background())
	if p := peak.Load(); p > 2 || p < 1 {
		t.Errorf("peak concurrency %d, want 1..2", p)
	}
	for i := range eps {
		if _, _, ok := s.Latest(i); !ok {
			t.Errorf("endpoint %d: %v", i, s.Err(i))
		}
	}
}

// TestScraperRunStops runs a Scraper against live and hanging endpoints
// with a reader racing it, cancels it mid-request, and checks that Run
// returns promptly, records no error for the cancelled scrape, and leaves
// no goroutine behind.
func TestScraperRunStops(t *testing.T) {
	before := runtime.NumGoroutine()
	func() {
		good, hits := pageServer(t, readPage(t, "vllm-dp.txt"))
		hang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			<-r.Context().Done()
		}))
		defer hang.Close()
		s, err := NewScraper([]Target{
			{URL: good.URL, Kind: VLLM},
			{URL: hang.URL, Kind: VLLM},
			{URL: good.URL, Kind: Ollama},
		}, ScrapeConfig{Interval: 20 * time.Millisecond, Timeout: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { s.Run(ctx); close(done) }()
		stopRead := make(chan struct{})
		var readers sync.WaitGroup
		readers.Add(1)
		go func() { // a scheduler reading concurrently
			defer readers.Done()
			for {
				select {
				case <-stopRead:
					return
				default:
				}
				for i := range s.Len() {
					s.Latest(i)
					_ = s.Err(i)
				}
				runtime.Gosched()
			}
		}()
		deadline := time.Now().Add(5 * time.Second)
		for {
			if _, _, ok := s.Latest(0); ok && hits.Load() >= 1 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("no scrape: %v", s.Err(0))
			}
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(50 * time.Millisecond) // a round is stuck on the hanging endpoint
		cancel()
		select {
		case <-done:
		case <-time.After(2 * time.Second):
			t.Fatal("Run did not return after cancel")
		}
		close(stopRead)
		readers.Wait()
		if err := s.Err(1); err != nil {
			t.Errorf("a cancelled scrape was recorded as an error: %v", err)
		}
		if n := hits.Load(); n > 1 {
			// The hanging endpoint blocks the first round until cancel.
			t.Errorf("good endpoint scraped %d times while a round hung", n)
		}
		good.Close()
	}()
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("goroutines: %d before, %d after\n%s", before, runtime.NumGoroutine(), buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestScraperFollowsNoRedirect: an engine that answers its metrics page
// with a redirect to another server fails the scrape; the other server
// never sees the request, nor the engine's credentials sent with it.
func TestScraperFollowsNoRedirect(t *testing.T) {
	var leaked atomic.Int64
	thief := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		leaked.Add(1)
		_, _ = w.Write(readPage(t, "vllm.txt"))
	}))
	defer thief.Close()
	for _, code := range []int{http.StatusMovedPermanently, http.StatusFound, http.StatusTemporaryRedirect, http.StatusPermanentRedirect} {
		hostile := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, thief.URL+"/metrics", code)
		}))
		s, err := NewScraper([]Target{{URL: hostile.URL, Kind: VLLM, Header: http.Header{"Api-Key": {"engine-secret"}}}},
			ScrapeConfig{Interval: time.Minute, Timeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		s.ScrapeOnce(context.Background())
		if err := s.Err(0); err == nil || !strings.Contains(err.Error(), "redirects are not followed") {
			t.Errorf("%d: scrape error %v, want the redirect refused", code, err)
		}
		hostile.Close()
	}
	if n := leaked.Load(); n != 0 {
		t.Errorf("the redirect target received %d scrapes", n)
	}
}

// TestParseMetricsSleepState reads vLLM's sleep mode from
// vllm:engine_sleep_state: asleep when the awake sample is 0 (any DP
// engine's), awake when it is 1 or the metric is absent.
func TestParseMetricsSleepState(t *testing.T) {
	const head = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 0\n" +
		"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\"} 0\n# TYPE vllm:engine_sleep_state gauge\n"
	for _, tc := range []struct {
		page string
		want bool
	}{
		{head + "vllm:engine_sleep_state{engine=\"0\",sleep_state=\"awake\"} 1\nvllm:engine_sleep_state{engine=\"0\",sleep_state=\"weights_offloaded\"} 0\n", false},
		{head + "vllm:engine_sleep_state{engine=\"0\",sleep_state=\"awake\"} 0\nvllm:engine_sleep_state{engine=\"0\",sleep_state=\"weights_offloaded\"} 1\n", true},
		{head + "vllm:engine_sleep_state{engine=\"0\",sleep_state=\"awake\"} 1\nvllm:engine_sleep_state{engine=\"1\",sleep_state=\"awake\"} 0\n", true},
		{head, false},
	} {
		l, err := ParseMetrics(VLLM, strings.NewReader(tc.page))
		if err != nil {
			t.Fatal(err)
		}
		if l.Asleep != tc.want {
			t.Errorf("Asleep %v, want %v, for:\n%s", l.Asleep, tc.want, tc.page)
		}
	}
}
