package artifact_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/artifact"
	"github.com/infergate/infergate/e2e"
	"github.com/infergate/infergate/gguf"
	"github.com/infergate/infergate/internal/realpart"
	"github.com/infergate/infergate/internal/throttle"
)

// BenchmarkOllamaStartup measures an Ollama engine's start-up — from asking
// for the model to its first generated token — with the model's bytes coming
// from each tier the simulator's start-up model distinguishes, side by side
// in each iteration (issue 20: warm start-up at least 2× faster than cold):
//
//	cold_remote   the cache is empty: blobs fetched from an HTTP origin (a
//	              file server over an Ollama store, on loopback, its files
//	              in the page cache), verified, installed, hard-linked into
//	              a fresh engine store; then ollama serve starts and loads
//	cold_peer     the same, the blobs fetched from a peer node's cache
//	              (`artifacts serve`, loopback)
//	warm_disk     the cache holds the model; its blobs dropped from the page
//	              cache first (posix_fadvise DONTNEED), so Ollama reads them
//	              from the disk
//	warm_page     the cache holds the model and the page cache its bytes
//	reload        Ollama's own reload: the model unloaded (keep_alive 0) and
//	              loaded again by the same warm server
//
// and, when asked:
//
//	cold_dropped  INFERGATE_ARTIFACT_BENCH_DROP_CACHES=1: cold_remote after
//	              the host's whole page cache was dropped (sync; echo 3 >
//	              /proc/sys/vm/drop_caches: root only), so the origin's
//	              files, the Ollama binary and its libraries come from disk
//	warm_dropped  then the same cache warm, the page cache dropped again: a
//	              node whose disk holds the model after a reboot
//	cold_throttled INFERGATE_ARTIFACT_BENCH_ORIGIN_MBPS=N: cold_remote from
//	              an origin limited to N MB/s (one connection per blob, as
//	              the cache fetches)
//
// Metrics are medians over the iterations (ranges on stderr, with one line
// per scenario and iteration), in seconds per scenario (startup = acquire +
// link + server ready + load + first token; load = Ollama's load_duration,
// split into its alloc and weights phases, loadPhases), the model's bytes and
// the bandwidths seen: HTTP and peer fetch (fetch + sha256 + write + fsync),
// a sequential read of the GGUF from the disk after DONTNEED and from the
// page cache. Not a test: nothing is asserted about time.
//
//	go test -run '^$' -bench OllamaStartup -benchtime 3x ./artifact
//
// INFERGATE_ARTIFACT_BENCH_LAYERS sets the model's size: layers of width
// 1024 (F16, 16 heads, FFN 2816), 16 by default (~0.42 GB);
// INFERGATE_ARTIFACT_BENCH_LOG=DIR writes each scenario's Ollama server log
// to DIR/<scenario>.log.
func BenchmarkOllamaStartup(b *testing.B) {
	realpart.SkipShort(b, "the Ollama start-up benchmark")
	bin := e2e.RequireOllama(b)
	opts := gguf.Options{Seed: 7, EmbeddingLength: 1024, BlockCount: envInt("INFERGATE_ARTIFACT_BENCH_LAYERS", 16),
		FeedForwardLength: 2816, HeadCount: 16, F16: true}
	store, origin := ollamaOrigin(b, bin, opts)
	dropCaches := os.Getenv("INFERGATE_ARTIFACT_BENCH_DROP_CACHES") == "1"
	var throttledSrc artifact.Source
	if mbps, _ := strconv.ParseFloat(os.Getenv("INFERGATE_ARTIFACT_BENCH_ORIGIN_MBPS"), 64); mbps > 0 {
		fsrv := http.FileServer(http.Dir(store))
		slow := httptest.NewServer(throttle.Handler(fsrv, mbps*1e6))
		defer slow.Close()
		throttledSrc, _ = artifact.NewHTTP(slow.URL, artifact.LayoutOllamaDir, false)
	}
	src, err := artifact.NewHTTP(origin.URL, artifact.LayoutOllamaDir, false)
	if err != nil {
		b.Fatal(err)
	}
	ref, _ := artifact.ParseRef("tiny")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()

	// obs holds every iteration's value of each metric; the benchmark
	// reports medians (other tenants of a shared host make means noisy)
	// and prints the ranges.
	obs := map[string][]float64{}
	add := func(k string, v float64) { obs[k] = append(obs[k], v) }

	// start runs one start-up: acquire through c, link into a fresh
	// engine store, start ollama serve, generate one token. The instance
	// is left running for the caller to stop.
	start := func(name string, c *artifact.Cache) (*e2e.Instance, *artifact.Lease, time.Duration) {
		t0 := time.Now()
		lease, err := c.Acquire(ctx, ref, artifact.AcquireOptions{Offline: !strings.HasPrefix(name, "cold_")})
		if err != nil {
			b.Fatal(name, err)
		}
		fetched := time.Since(t0)
		eng := b.TempDir()
		if err := c.Link(ref, filepath.Join(eng, "models")); err != nil {
			b.Fatal(err)
		}
		inst, err := e2e.StartOllama(ctx, bin, "", e2e.Options{Dir: eng, NoCreate: true, NoWarm: true, NumParallel: 1})
		if err != nil {
			b.Fatal(err)
		}
		g, err := generate(ctx, inst.URL, "tiny", 1, "")
		if err != nil {
			inst.Stop()
			b.Fatal(err)
		}
		ph := loadPhases(inst.LogTail(1 << 20))
		add(name+"_startup_s", time.Since(t0).Seconds())
		add(name+"_load_s", time.Duration(g.LoadDuration).Seconds())
		add(name+"_alloc_s", ph.alloc.Seconds())
		add(name+"_weights_s", ph.weights.Seconds())
		if dir := os.Getenv("INFERGATE_ARTIFACT_BENCH_LOG"); dir != "" {
			if err := os.WriteFile(filepath.Join(dir, name+".log"), []byte(inst.LogTail(1<<20)), 0o644); err != nil {
				b.Fatal(err)
			}
		}
		fmt.Fprintf(os.Stderr, "%-11s startup %6.2fs: acquire %6.2fs (%d hits, %d misses), server ready %5.2fs, load_duration %6.2fs (alloc %5.2fs, weights %5.2fs)",
			name, time.Since(t0).Seconds(), fetched.Seconds(), lease.Report.Hits, lease.Report.Misses,
			inst.StartupTime.Seconds(), time.Duration(g.LoadDuration).Seconds(), ph.alloc.Seconds(), ph.weights.Seconds())
		fmt.Fprintln(os.Stderr)
		return inst, lease, fetched
	}
	stop := func(inst *e2e.Instance, l *artifact.Lease) {
		l.Release()
		if err := inst.Stop(); err != nil {
			b.Fatal(err)
		}
	}

	for b.Loop() {
		a, err := artifact.Open(artifact.Config{Dir: b.TempDir(), Origins: []artifact.Source{src}})
		if err != nil {
			b.Fatal(err)
		}
		inst, l, fetched := start("cold_remote", a)
		stop(inst, l)
		m := a.Manifest(ref)
		var gg artifact.Blob
		for _, bl := range m.Blobs() {
			if bl.MediaType == artifact.MediaTypeOllamaModel {
				gg = bl
			}
		}
		add("model_bytes", float64(m.Size()))
		add("http_fetch_MB/s", float64(m.Size())/fetched.Seconds()/1e6)

		peerSrv := httptest.NewServer(artifact.NewServer(a, artifact.ServerConfig{}))
		peer, _ := artifact.NewHTTP(peerSrv.URL, artifact.LayoutRegistry, true)
		p, err := artifact.Open(artifact.Config{Dir: b.TempDir(), Peers: []artifact.Source{peer}})
		if err != nil {
			b.Fatal(err)
		}
		inst, l, fetched = start("cold_peer", p)
		stop(inst, l)
		peerSrv.Close()
		p.Close()
		add("peer_fetch_MB/s", float64(m.Size())/fetched.Seconds()/1e6)

		// The disk and the page cache, read directly.
		for _, bl := range m.Blobs() {
			if err := artifact.DropPageCache(a.BlobPath(bl.Digest)); err != nil {
				b.Fatal(err)
			}
		}
		add("disk_read_MB/s", readMBps(b, a.BlobPath(gg.Digest)))
		add("pagecache_read_MB/s", readMBps(b, a.BlobPath(gg.Digest)))

		for _, bl := range m.Blobs() {
			if err := artifact.DropPageCache(a.BlobPath(bl.Digest)); err != nil {
				b.Fatal(err)
			}
		}
		plan, err := a.Locate(ctx, ref)
		if err != nil {
			b.Fatal(err)
		}
		add("warm_disk_resident_frac", float64(plan.ResidentBytes())/float64(m.Size()))
		inst, l, _ = start("warm_disk", a)
		stop(inst, l)

		plan, _ = a.Locate(ctx, ref)
		add("warm_page_resident_frac", float64(plan.ResidentBytes())/float64(m.Size()))
		inst, l, _ = start("warm_page", a)
		if err := unload(ctx, inst.URL, "tiny"); err != nil {
			b.Fatal(err)
		}
		g, err := generate(ctx, inst.URL, "tiny", 1, "")
		if err != nil {
			b.Fatal(err)
		}
		add("reload_load_s", time.Duration(g.LoadDuration).Seconds())
		add("reload_startup_s", time.Duration(g.TotalDuration).Seconds())
		fmt.Fprintf(os.Stderr, "%-11s load_duration %6.2fs (total %6.2fs)\n", "reload", time.Duration(g.LoadDuration).Seconds(), time.Duration(g.TotalDuration).Seconds())
		stop(inst, l)
		a.Close()

		if dropCaches {
			d, err := artifact.Open(artifact.Config{Dir: b.TempDir(), Origins: []artifact.Source{src}})
			if err != nil {
				b.Fatal(err)
			}
			dropAll(b)
			inst, l, fetched = start("cold_dropped", d)
			stop(inst, l)
			add("dropped_fetch_MB/s", float64(m.Size())/fetched.Seconds()/1e6)
			dropAll(b)
			inst, l, _ = start("warm_dropped", d)
			stop(inst, l)
			d.Close()
		}
		if throttledSrc != nil {
			d, err := artifact.Open(artifact.Config{Dir: b.TempDir(), Origins: []artifact.Source{throttledSrc}})
			if err != nil {
				b.Fatal(err)
			}
			inst, l, fetched = start("cold_throttled", d)
			stop(inst, l)
			add("throttled_fetch_MB/s", float64(m.Size())/fetched.Seconds()/1e6)
			d.Close()
		}
	}
	keys := make([]string, 0, len(obs))
	for k := range obs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	med := map[string]float64{}
	for _, k := range keys {
		v := append([]float64(nil), obs[k]...)
		sort.Float64s(v)
		med[k] = v[len(v)/2]
		if len(v)%2 == 0 {
			med[k] = (v[len(v)/2-1] + v[len(v)/2]) / 2
		}
		b.ReportMetric(med[k], k)
		fmt.Fprintf(os.Stderr, "%-28s median %10.3f  range %10.3f – %10.3f  (%d runs)\n", k, med[k], v[0], v[len(v)-1], len(v))
	}
	b.ReportMetric(med["cold_remote_startup_s"]/med["warm_page_startup_s"], "cold/warm_page")
	b.ReportMetric(med["cold_remote_startup_s"]/med["warm_disk_startup_s"], "cold/warm_disk")
	if dropCaches {
		b.ReportMetric(med["cold_dropped_startup_s"]/med["warm_dropped_startup_s"], "cold_dropped/warm_dropped")
		b.ReportMetric(med["cold_dropped_startup_s"]/med["warm_page_startup_s"], "cold_dropped/warm_page")
	}
	if throttledSrc != nil {
		b.ReportMetric(med["cold_throttled_startup_s"]/med["warm_page_startup_s"], "cold_throttled/warm_page")
	}
}

// dropAll drops the host's whole page cache (sync, then 3 into
// /proc/sys/vm/drop_caches; root only).
func dropAll(b *testing.B) {
	if err := exec.Command("sync").Run(); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0o200); err != nil {
		b.Fatalf("INFERGATE_ARTIFACT_BENCH_DROP_CACHES=1: %v (root only)", err)
	}
}

// readMBps reads a file sequentially and returns MB/s.
func readMBps(b *testing.B, p string) float64 {
	f, err := os.Open(p)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	t0 := time.Now()
	n, err := io.CopyBuffer(io.Discard, f, make([]byte, 1<<20))
	if err != nil {
		b.Fatal(err)
	}
	return float64(n) / time.Since(t0).Seconds() / 1e6
}

// phases of one model load, read from the Ollama server's log: alloc is
// from the runner's "Operation:alloc" load request to its "Operation:commit"
// (memory for weights, KV cache and compute graph allocated and the graph
// reserved: engine warm-up), weights from commit to "llama runner started"
// (the tensors read from the GGUF into those buffers). The log lines are
// Ollama v0.17.4's (server/server.go, runner/ollamarunner/runner.go); a
// phase not found is 0.
type phases struct{ alloc, weights time.Duration }

var logTime = regexp.MustCompile(`^time=(\S+) `)

func loadPhases(log string) phases {
	var allocAt, commitAt, startedAt time.Time
	for _, line := range strings.Split(log, "\n") {
		m := logTime.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		at, err := time.Parse(time.RFC3339Nano, m[1])
		if err != nil {
			continue
		}
		switch {
		case strings.Contains(line, "Operation:alloc"):
			allocAt = at
		case strings.Contains(line, "Operation:commit"):
			commitAt = at
		case strings.Contains(line, "llama runner started"):
			startedAt = at
		}
	}
	var p phases
	if !allocAt.IsZero() && commitAt.After(allocAt) {
		p.alloc = commitAt.Sub(allocAt)
	}
	if !commitAt.IsZero() && startedAt.After(commitAt) {
		p.weights = startedAt.Sub(commitAt)
	}
	return p
}
