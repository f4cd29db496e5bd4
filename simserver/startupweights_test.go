package simserver

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/artifact"
	"github.com/infergate/infergate/gguf"
	"github.com/infergate/infergate/sim"
)

// weightsOrigin is a generated GGUF published as a model in an Ollama
// store, served by a loopback file server (artifact.LayoutOllamaDir) that
// counts blob GETs and can be taken down.
type weightsOrigin struct {
	srv   *httptest.Server
	ref   artifact.Ref
	size  int64 // bytes of the model's blobs
	gets  atomic.Int64
	down  atomic.Bool
	model *artifact.Manifest
}

func newWeightsOrigin(t *testing.T) *weightsOrigin {
	t.Helper()
	dir := t.TempDir()
	file := filepath.Join(t.TempDir(), "model.gguf")
	if _, err := gguf.WriteFile(file, gguf.Options{Seed: 3, EmbeddingLength: 128, BlockCount: 2, FeedForwardLength: 256, VocabSize: 512}); err != nil {
		t.Fatal(err)
	}
	ref, err := artifact.ParseRef("local/weights-test:1")
	if err != nil {
		t.Fatal(err)
	}
	c, err := artifact.Open(artifact.Config{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m, err := c.Add(ctx, ref, []artifact.File{{Path: file, MediaType: artifact.MediaTypeOllamaModel}})
	c.Close()
	if err != nil {
		t.Fatal(err)
	}
	o := &weightsOrigin{ref: ref, size: m.Size(), model: m}
	fsrv := http.FileServer(http.Dir(dir))
	o.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if o.down.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		if strings.HasPrefix(r.URL.Path, "/blobs/") {
			o.gets.Add(1)
		}
		fsrv.ServeHTTP(w, r)
	}))
	t.Cleanup(o.srv.Close)
	return o
}

// nodeCache opens a node's artifact cache whose origin is o.
func (o *weightsOrigin) nodeCache(t *testing.T) *artifact.Cache {
	t.Helper()
	src, err := artifact.NewHTTP(o.srv.URL, artifact.LayoutOllamaDir, false)
	if err != nil {
		t.Fatal(err)
	}
	c, err := artifact.Open(artifact.Config{Dir: t.TempDir(), Origins: []artifact.Source{src},
		Fetch: artifact.FetchConfig{Attempts: 1, BackoffMin: time.Millisecond, BackoffMax: time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// startWeights starts a server whose start-up reads through c, at a time
// scale that makes the modelled 70B start-up (about 90 s) a few ms of wall
// time, and waits (bounded) until it is ready.
func startWeights(t *testing.T, c *artifact.Cache, ref artifact.Ref) *Server {
	t.Helper()
	s, err := NewServer(ServerConfig{TimeScale: 1e5, Startup: &StartupConfig{ImageCached: true,
		Weights: &Weights{Cache: c, Ref: ref, RetryMin: time.Millisecond, RetryMax: 5 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	t.Cleanup(s.Close)
	select {
	case <-s.Ready():
	case <-time.After(30 * time.Second):
		t.Fatalf("not ready within 30 s: state %s, report %+v", s.State(), s.WeightsReport())
	}
	if s.State() != StateReady {
		t.Fatalf("state %s after Ready", s.State())
	}
	return s
}

// TestStartupThroughArtifactCache checks the simulator's start-up read
// through the node's artifact cache with real bytes (a generated GGUF over
// a loopback file server): the first engine on a cold node fetches the
// model from the origin and is priced from the remote tier; a second
// engine on the node shares the blobs (no fetch) and is priced from the
// node's tiers (page cache or NVMe by mincore), faster; both pin the
// blobs until they stop.
func TestStartupThroughArtifactCache(t *testing.T) {
	o := newWeightsOrigin(t)
	c := o.nodeCache(t)
	prof := sim.DefaultProfile()

	cold := startWeights(t, c, o.ref)
	rep := cold.WeightsReport()
	if rep.Placement != (sim.WeightsPlacement{Remote: o.size}) || rep.Acquire.Misses == 0 || rep.Bytes != o.size || rep.Attempts != 1 {
		t.Fatalf("cold start: %+v, want all %d bytes remote, fetched and read", rep, o.size)
	}
	if got := o.gets.Load(); got == 0 {
		t.Fatal("cold start fetched no blob from the origin")
	}
	want, _ := prof.StartupPhases(sim.StartupInput{Source: sim.SourceRemote, ImageCached: true})
	if ph := cold.StartupPhases(); ph.Source != sim.SourceRemote || ph.Total() != want.Total() {
		t.Fatalf("cold start modelled %v from %s, want %v from remote", ph.Total(), ph.Source, want.Total())
	}
	if st := c.Stats(); st.Pinned != o.size {
		t.Fatalf("pinned %d bytes while the engine runs, want %d", st.Pinned, o.size)
	}

	gets := o.gets.Load()
	warm := startWeights(t, c, o.ref)
	wrep := warm.WeightsReport()
	if wrep.Placement.Remote != 0 || wrep.Placement.Peer != 0 || wrep.Placement.NVMe+wrep.Placement.PageCache != o.size ||
		wrep.Acquire.Misses != 0 || wrep.Bytes != o.size {
		t.Fatalf("warm start: %+v, want every byte local", wrep)
	}
	if o.gets.Load() != gets {
		t.Fatalf("warm start fetched from the origin (%d blob GETs, had %d)", o.gets.Load(), gets)
	}
	wph := warm.StartupPhases()
	if wph.Source != sim.SourceNVMe && wph.Source != sim.SourcePageCache || wph.Total() >= cold.StartupPhases().Total() {
		t.Fatalf("warm start modelled %v from %s; cold %v", wph.Total(), wph.Source, cold.StartupPhases().Total())
	}
	t.Logf("cold: modelled %v (remote); real fetch %v + read %v of %d bytes", cold.StartupPhases().Total(), rep.Fetch, rep.Read, rep.Bytes)
	t.Logf("warm: modelled %v (%s: page cache %d, nvme %d bytes); real read %v", wph.Total(), wph.Source,
		wrep.Placement.PageCache, wrep.Placement.NVMe, wrep.Read)

	cold.Close()
	if st := c.Stats(); st.Pinned != o.size {
		t.Fatalf("pinned %d bytes with one engine left, want %d (shared blobs)", st.Pinned, o.size)
	}
	warm.Close()
	if st := c.Stats(); st.Pinned != 0 || st.Used != o.size {
		t.Fatalf("after both engines stopped: %+v, want nothing pinned, the model kept", st)
	}

	// The page cache dropped (where the file system honours DONTNEED; a
	// tmpfs does not): the next start reads from NVMe.
	for _, b := range o.model.Blobs() {
		if err := artifact.DropPageCache(c.BlobPath(b.Digest)); err != nil {
			t.Fatal(err)
		}
	}
	if p, err := c.Locate(context.Background(), o.ref); err != nil {
		t.Fatal(err)
	} else if p.ResidentBytes() == 0 {
		disk := startWeights(t, c, o.ref)
		if got := disk.WeightsReport().Placement; got != (sim.WeightsPlacement{NVMe: o.size}) {
			t.Errorf("after the page cache was dropped: %+v, want all NVMe", got)
		}
		if s := disk.StartupPhases().Source; s != sim.SourceNVMe {
			t.Errorf("source %s, want nvme", s)
		}
	} else {
		t.Logf("the page cache kept %d bytes after DONTNEED (tmpfs?): NVMe tier not checked", p.ResidentBytes())
	}
}

// TestStartupWeightsCorruptRefetched checks that a blob corrupted on the
// node's disk is caught by the start-up's verified read, deleted, counted
// as a failed attempt and fetched again from the origin on the retry.
func TestStartupWeightsCorruptRefetched(t *testing.T) {
	o := newWeightsOrigin(t)
	c := o.nodeCache(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := c.Prefetch(ctx, o.ref, artifact.AcquireOptions{}); err != nil {
		t.Fatal(err)
	}
	var gguf artifact.Digest
	for _, b := range o.model.Blobs() {
		if b.MediaType == artifact.MediaTypeOllamaModel {
			gguf = b.Digest
		}
	}
	p := c.BlobPath(gguf)
	raw, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	raw[len(raw)/2] ^= 0xff
	if err := os.WriteFile(p, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	gets := o.gets.Load()
	s := startWeights(t, c, o.ref)
	rep := s.WeightsReport()
	if rep.Attempts != 2 || rep.Placement.Remote == 0 || o.gets.Load() == gets {
		t.Fatalf("report %+v, origin blob GETs %d → %d: want a second attempt that refetched the blob", rep, gets, o.gets.Load())
	}
	if v := counterValue(t, s, "infergate_sim_startup_failures_total", ""); v != 1 {
		t.Fatalf("startup failures %v, want 1", v)
	}
}

// TestStartupWeightsOriginDown checks an engine whose weights cannot be
// fetched: it stays loading (/health 503), retrying, and Close ends it
// without a lease left.
func TestStartupWeightsOriginDown(t *testing.T) {
	o := newWeightsOrigin(t)
	o.down.Store(true)
	c := o.nodeCache(t)
	s, err := NewServer(ServerConfig{TimeScale: 1e5, Startup: &StartupConfig{ImageCached: true,
		Weights: &Weights{Cache: c, Ref: o.ref, RetryMin: time.Millisecond, RetryMax: 2 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	ts := httptest.NewServer(s.Handler())
	defer ts.Close()
	waitFor(t, "two failed start-up attempts", func() bool {
		return counterValue(t, s, "infergate_sim_startup_failures_total", "") >= 2
	})
	if code, _ := get(t, ts, "/health"); code != http.StatusServiceUnavailable || s.State() != StateLoading {
		t.Fatalf("/health %d state %s while the origin is down, want 503 loading", code, s.State())
	}
	s.Close()
	if st := c.Stats(); st.Pinned != 0 {
		t.Fatalf("pinned %d bytes after Close", st.Pinned)
	}
	if _, err := NewServer(ServerConfig{Startup: &StartupConfig{Weights: &Weights{Ref: o.ref}}}); err == nil {
		t.Fatal("Weights without a cache accepted")
	}
}
