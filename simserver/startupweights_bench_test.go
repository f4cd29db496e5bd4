package simserver

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"testing"
	"time"

	"github.com/infergate/infergate/artifact"
	"github.com/infergate/infergate/gguf"
	"github.com/infergate/infergate/internal/throttle"
)

// BenchmarkStartupThroughCache measures the real part of a simulated
// engine's start-up through the node's artifact cache — locate, fetch what
// is missing (verified), read and hash every byte — for a generated GGUF
// served by a loopback file server, cold and warm, side by side in each
// iteration, next to the modelled start-up of the profile's full-size
// model from the tier the cache found (issue 20: warm at least 2× faster):
//
//	cold     a fresh node cache: every blob fetched from the origin
//	warm_disk the cache holds the model, its page cache dropped
//	         (posix_fadvise DONTNEED): read from the disk
//	warm_page the cache holds the model and the page cache its bytes
//
// The time scale is 1e9, so the modelled phases add microseconds: the
// figure is the real work. Metrics are medians (seconds; ranges on
// stderr). INFERGATE_SIM_BENCH_LAYERS sets the model's size (layers of
// width 1024, F16; 4 by default, about 110 MB); INFERGATE_SIM_BENCH_ORIGIN_MBPS
// limits the origin's bandwidth (MB/s; 0, the default: loopback, unlimited).
//
//	go test -run '^$' -bench StartupThroughCache -benchtime 5x ./simserver
func BenchmarkStartupThroughCache(b *testing.B) {
	layers, _ := strconv.Atoi(os.Getenv("INFERGATE_SIM_BENCH_LAYERS"))
	if layers <= 0 {
		layers = 4
	}
	mbps, _ := strconv.ParseFloat(os.Getenv("INFERGATE_SIM_BENCH_ORIGIN_MBPS"), 64)
	dir := b.TempDir()
	file := filepath.Join(b.TempDir(), "model.gguf")
	if _, err := gguf.WriteFile(file, gguf.Options{Seed: 7, EmbeddingLength: 1024, BlockCount: layers, FeedForwardLength: 2816,
		HeadCount: 16, F16: true}); err != nil {
		b.Fatal(err)
	}
	ref, _ := artifact.ParseRef("local/bench:1")
	oc, err := artifact.Open(artifact.Config{Dir: dir})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	m, err := oc.Add(ctx, ref, []artifact.File{{Path: file, MediaType: artifact.MediaTypeOllamaModel}})
	oc.Close()
	if err != nil {
		b.Fatal(err)
	}
	fsrv := http.FileServer(http.Dir(dir))
	origin := httptest.NewServer(throttle.Handler(fsrv, mbps*1e6))
	defer origin.Close()
	src, err := artifact.NewHTTP(origin.URL, artifact.LayoutOllamaDir, false)
	if err != nil {
		b.Fatal(err)
	}

	obs := map[string][]float64{}
	add := func(k string, v float64) { obs[k] = append(obs[k], v) }
	start := func(name string, c *artifact.Cache) {
		s, err := NewServer(ServerConfig{TimeScale: 1e9, Startup: &StartupConfig{ImageCached: true, Weights: &Weights{Cache: c, Ref: ref}}})
		if err != nil {
			b.Fatal(err)
		}
		t0 := time.Now()
		s.Start()
		select {
		case <-s.Ready():
		case <-ctx.Done():
			b.Fatal("not ready")
		}
		wall := time.Since(t0)
		rep, ph := s.WeightsReport(), s.StartupPhases()
		s.Close()
		add(name+"_s", wall.Seconds())
		add(name+"_modelled_s", ph.Total().Seconds())
		fmt.Fprintf(os.Stderr, "%-9s real %6.3fs (locate %6.3fs, acquire %6.3fs, read+hash %6.3fs of %d bytes: %4.0f MB/s); modelled %5.1fs from %s\n",
			name, wall.Seconds(), rep.Locate.Seconds(), rep.Fetch.Seconds(), rep.Read.Seconds(), rep.Bytes,
			float64(rep.Bytes)/rep.Read.Seconds()/1e6, ph.Total().Seconds(), ph.Source)
	}
	for b.Loop() {
		c, err := artifact.Open(artifact.Config{Dir: b.TempDir(), Origins: []artifact.Source{src}})
		if err != nil {
			b.Fatal(err)
		}
		start("cold", c)
		for _, bl := range m.Blobs() {
			if err := artifact.DropPageCache(c.BlobPath(bl.Digest)); err != nil {
				b.Fatal(err)
			}
		}
		start("warm_disk", c)
		start("warm_page", c)
		c.Close()
	}
	add("model_bytes", float64(m.Size()))
	med := map[string]float64{}
	keys := make([]string, 0, len(obs))
	for k := range obs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := append([]float64(nil), obs[k]...)
		sort.Float64s(v)
		med[k] = v[len(v)/2]
		if len(v)%2 == 0 {
			med[k] = (v[len(v)/2-1] + v[len(v)/2]) / 2
		}
		b.ReportMetric(med[k], k)
		fmt.Fprintf(os.Stderr, "%-22s median %8.3f range %8.3f–%8.3f\n", k, med[k], v[0], v[len(v)-1])
	}
	for _, w := range []string{"warm_disk", "warm_page"} {
		b.ReportMetric(med["cold_s"]/med[w+"_s"], "cold/"+w)
		b.ReportMetric(med["cold_modelled_s"]/med[w+"_modelled_s"], "modelled_cold/"+w)
	}
}
