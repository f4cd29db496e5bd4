package artifact

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

const tinyRef = "registry.ollama.ai/library/tiny:latest"

func TestAcquireFetchesVerifiesAndHits(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {300_000, 1_000, 64_000}})
	c := openCache(t, Config{Origins: []Source{o.source(t)}})
	r := mustRef(t, tinyRef)
	rep, err := c.Prefetch(testCtx(t), r, AcquireOptions{})
	if err != nil {
		t.Fatal(err)
	}
	m := o.models[tinyRef]
	if rep.Blobs != 4 || rep.Misses != 4 || rep.Hits != 0 || rep.Bytes != m.Size() || rep.Fetched[SourceHTTP] != m.Size() {
		t.Fatalf("first report %+v, model %d bytes", rep, m.Size())
	}
	checkHeld(t, c, o, m)
	raw, err := os.ReadFile(filepath.Join(c.Dir(), "manifests", "registry.ollama.ai", "library", "tiny", "latest"))
	if err != nil || string(raw) != string(m.Raw) {
		t.Fatalf("manifest file: %v", err)
	}
	rep, err = c.Prefetch(testCtx(t), r, AcquireOptions{})
	if err != nil || rep.Hits != 4 || rep.Misses != 0 || rep.HitBytes != m.Size() || len(rep.Fetched) != 0 {
		t.Fatalf("second report %+v %v", rep, err)
	}
	if got := o.blobGets(); got != 4 {
		t.Errorf("origin served %d blob GETs, want 4", got)
	}
	if h, ms := counter(t, c, "infergate_artifact_lookups_total", "result", "hit"), counter(t, c, "infergate_artifact_lookups_total", "result", "miss"); h != 4 || ms != 4 {
		t.Errorf("lookups hit %v miss %v", h, ms)
	}
	if got := counter(t, c, "infergate_artifact_fetched_bytes_total", "source", "http"); got != float64(m.Size()) {
		t.Errorf("fetched bytes %v want %d", got, m.Size())
	}
	if s := c.Stats(); s.Used != m.Size() || s.Pinned != 0 || s.Blobs != 4 {
		t.Errorf("stats %+v", s)
	}
	// Offline: the cached manifest, nothing asked.
	before := o.gets["/manifests/registry.ollama.ai/library/tiny/latest"]
	if rep, err := c.Prefetch(testCtx(t), r, AcquireOptions{Offline: true}); err != nil || rep.ManifestFrom != "cache" {
		t.Fatalf("offline: %+v %v", rep, err)
	}
	if o.gets["/manifests/registry.ollama.ai/library/tiny/latest"] != before {
		t.Error("offline acquire asked the origin")
	}
	// A model no source has.
	if _, err := c.Prefetch(testCtx(t), mustRef(t, "nothere"), AcquireOptions{}); !errors.Is(err, ErrNotFound) {
		t.Errorf("missing model: %v", err)
	}
}

func TestConcurrentAcquiresFetchEachBlobOnce(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {2_000_000, 5_000}})
	c := openCache(t, Config{Origins: []Source{o.source(t)}})
	r := mustRef(t, tinyRef)
	var wg sync.WaitGroup
	leases := make([]*Lease, 8)
	errs := make([]error, 8)
	for i := range leases {
		wg.Go(func() { leases[i], errs[i] = c.Acquire(testCtx(t), r, AcquireOptions{}) })
	}
	wg.Wait()
	var misses, shared, hits int
	for i, l := range leases {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		misses += l.Report.Misses
		shared += l.Report.Shared
		hits += l.Report.Hits
	}
	if got := o.blobGets(); got != 3 {
		t.Errorf("origin served %d blob GETs for 8 concurrent acquires of 3 blobs, want 3", got)
	}
	if misses != 3 || misses+shared+hits != 24 {
		t.Errorf("misses %d shared %d hits %d", misses, shared, hits)
	}
	if s := c.Stats(); s.PinnedBlobs != 3 {
		t.Errorf("8 leases pin %d blobs, want 3", s.PinnedBlobs)
	}
	for _, l := range leases {
		l.Release()
		l.Release()
	}
	if s := c.Stats(); s.Pinned != 0 {
		t.Errorf("after release: %+v", s)
	}
}

// TestResumeAfterCut: the origin drops the connection halfway through the
// big blob; the next attempt asks for the rest with a Range and the bytes
// received add up to the blob once.
func TestResumeAfterCut(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {1_000_000}})
	big := o.biggest(tinyRef)
	var once sync.Once
	o.setFault(func(w http.ResponseWriter, r *http.Request) bool {
		cut := false
		if strings.HasSuffix(r.URL.Path, big.Digest.Hex()) {
			once.Do(func() { cut = true })
		}
		if !cut {
			return false
		}
		w.Header().Set("Content-Length", strconv.FormatInt(big.Size, 10))
		w.WriteHeader(http.StatusOK)
		w.Write(o.blobs[big.Digest][:400_000])
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	})
	c := openCache(t, Config{Origins: []Source{o.source(t)}})
	rep, err := c.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{})
	if err != nil {
		t.Fatal(err)
	}
	checkHeld(t, c, o, o.models[tinyRef])
	o.mu.Lock()
	ranges := append([]string(nil), o.ranges...)
	o.mu.Unlock()
	if len(ranges) != 1 || ranges[0] != "bytes=400000-" {
		t.Errorf("ranges %q, want one resuming at 400000", ranges)
	}
	if got := rep.Fetched[SourceHTTP]; got != o.models[tinyRef].Size() {
		t.Errorf("received %d bytes, want %d (each byte once)", got, o.models[tinyRef].Size())
	}
	if counter(t, c, "infergate_artifact_fetch_retries_total") != 1 {
		t.Error("retry not counted")
	}
}

// TestResumeAcrossRestart: a partial download left by an earlier process is
// resumed, not refetched.
func TestResumeAcrossRestart(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {500_000}})
	big := o.biggest(tinyRef)
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "partial"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "partial", big.Digest.FileName()), o.blobs[big.Digest][:123_456], 0o644); err != nil {
		t.Fatal(err)
	}
	c := openCache(t, Config{Dir: dir, Origins: []Source{o.source(t)}})
	if _, err := c.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{}); err != nil {
		t.Fatal(err)
	}
	checkHeld(t, c, o, o.models[tinyRef])
	if len(o.ranges) != 1 || o.ranges[0] != "bytes=123456-" {
		t.Errorf("ranges %q", o.ranges)
	}
	if _, err := os.Stat(filepath.Join(dir, "partial", big.Digest.FileName())); !os.IsNotExist(err) {
		t.Error("partial file left behind")
	}
	// A restart finds the model complete and serves it offline.
	c.Close()
	c2 := openCache(t, Config{Dir: dir})
	if len(c2.Models()) != 1 {
		t.Fatalf("models after restart: %v", c2.Models())
	}
	if rep, err := c2.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{}); err != nil || rep.Hits != rep.Blobs {
		t.Fatalf("after restart %+v %v", rep, err)
	}
}

// TestCorruptSource: bytes that do not hash to the digest are deleted, never
// installed, and the next source is tried.
func TestCorruptSource(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {200_000, 3_000}})
	big := o.biggest(tinyRef)
	bad := newOrigin(t, map[string][]int{tinyRef: {200_000, 3_000}})
	bad.setFault(func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.HasSuffix(r.URL.Path, big.Digest.Hex()) {
			return false
		}
		b := append([]byte(nil), o.blobs[big.Digest]...)
		b[len(b)/2] ^= 1
		w.Write(b)
		return true
	})
	c := openCache(t, Config{Origins: []Source{bad.source(t)}})
	_, err := c.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{})
	if !errors.Is(err, ErrIntegrity) {
		t.Fatalf("want ErrIntegrity, got %v", err)
	}
	if _, err := os.Stat(c.BlobPath(big.Digest)); !os.IsNotExist(err) {
		t.Error("corrupt blob installed")
	}
	if c.Manifest(mustRef(t, tinyRef)) != nil || c.Stats().Pinned != 0 || c.Has(big.Digest) {
		t.Errorf("failed acquire left state: %+v", c.Stats())
	}
	if counter(t, c, "infergate_artifact_integrity_failures_total", "stage", "fetch") != 1 {
		t.Error("integrity failure not counted")
	}
	// The bad origin first, a good one second.
	c2 := openCache(t, Config{Origins: []Source{bad.source(t), o.source(t)}})
	if _, err := c2.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{}); err != nil {
		t.Fatal(err)
	}
	checkHeld(t, c2, o, o.models[tinyRef])
}

// TestOversizeAndShortBodies: a source that sends more bytes than the
// manifest declares, or fewer every time, fails the fetch.
func TestOversizeAndShortBodies(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {50_000}})
	big := o.biggest(tinyRef)
	for name, body := range map[string][]byte{
		"long":  append(append([]byte(nil), o.blobs[big.Digest]...), 'x'),
		"short": o.blobs[big.Digest][:10_000],
	} {
		t.Run(name, func(t *testing.T) {
			o.setFault(func(w http.ResponseWriter, r *http.Request) bool {
				if !strings.Contains(r.URL.Path, big.Digest.Hex()) {
					return false
				}
				w.Write(body) // ignores Range: a 200 from 0 each time
				return true
			})
			c := openCache(t, Config{Origins: []Source{o.source(t)}})
			_, err := c.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{})
			if err == nil || c.Has(big.Digest) {
				t.Fatalf("accepted a %s body: %v", name, err)
			}
			if name == "long" && !errors.Is(err, ErrIntegrity) {
				t.Errorf("long body: %v", err)
			}
		})
	}
}

// TestStalledSource: a server that sends a little then nothing is abandoned
// after IdleTimeout, each attempt; the acquire fails and nothing is pinned.
func TestStalledSource(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {100_000}})
	big := o.biggest(tinyRef)
	release := make(chan struct{})
	defer close(release)
	o.setFault(func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.Contains(r.URL.Path, big.Digest.Hex()) {
			return false
		}
		w.Header().Set("Content-Length", strconv.FormatInt(big.Size, 10))
		w.Write(o.blobs[big.Digest][:1_000])
		w.(http.Flusher).Flush()
		select {
		case <-r.Context().Done():
		case <-release:
		}
		return true
	})
	fc := fastFetch
	fc.IdleTimeout = 50_000_000 // 50 ms
	fc.MinRate = -1             // the idle timer alone (TestTricklingSourceLeft has the floor)
	fc.Attempts = 2
	c := openCache(t, Config{Origins: []Source{o.source(t)}, Fetch: fc})
	_, err := c.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{})
	if !errors.Is(err, errStalled) {
		t.Fatalf("want a stall, got %v", err)
	}
	if s := c.Stats(); s.Pinned != 0 || s.Reserved != 0 {
		t.Errorf("stats %+v", s)
	}
}

// TestCancelledAcquire: the caller gives up while the origin stalls; the
// fetch is cancelled (its last waiter left) and Close returns.
func TestCancelledAcquire(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {100_000}})
	big := o.biggest(tinyRef)
	started := make(chan struct{}, 1)
	o.setFault(func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.Contains(r.URL.Path, big.Digest.Hex()) {
			return false
		}
		select {
		case started <- struct{}{}:
		default:
		}
		<-r.Context().Done()
		return true
	})
	c := openCache(t, Config{Origins: []Source{o.source(t)}})
	ctx, cancel := context.WithCancel(testCtx(t))
	done := make(chan error, 1)
	go func() {
		_, err := c.Acquire(ctx, mustRef(t, tinyRef), AcquireOptions{})
		done <- err
	}()
	select {
	case <-started:
	case <-testCtx(t).Done():
		t.Fatal("fetch never started")
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("want context.Canceled, got %v", err)
	}
	c.Close() // waits for the flight, which its cancellation ended
	if s := c.Stats(); s.Reserved != 0 || s.Pinned != 0 {
		t.Errorf("stats %+v", s)
	}
}

// TestCorruptOnDisk: a blob damaged on disk is caught by a verified read or a
// scrub, deleted with the manifests naming it, and fetched again.
func TestCorruptOnDisk(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {80_000, 2_000}})
	big := o.biggest(tinyRef)
	r := mustRef(t, tinyRef)
	damage := func(c *Cache) {
		t.Helper()
		f, err := os.OpenFile(c.BlobPath(big.Digest), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		f.WriteAt([]byte{0xff, 0xfe}, 100)
		f.Close()
	}
	t.Run("read", func(t *testing.T) {
		c := openCache(t, Config{Origins: []Source{o.source(t)}, VerifyReads: true})
		if _, err := c.Prefetch(testCtx(t), r, AcquireOptions{}); err != nil {
			t.Fatal(err)
		}
		damage(c)
		if _, err := c.OpenBlob(big.Digest); !errors.Is(err, ErrIntegrity) {
			t.Fatalf("open: %v", err)
		}
		if c.Has(big.Digest) || c.Manifest(r) != nil {
			t.Fatal("bad blob or its manifest kept")
		}
		if _, err := os.Stat(filepath.Join(c.Dir(), "manifests", r.Path())); !os.IsNotExist(err) {
			t.Error("manifest file kept")
		}
		if counter(t, c, "infergate_artifact_integrity_failures_total", "stage", "read") != 1 {
			t.Error("not counted")
		}
		rep, err := c.Prefetch(testCtx(t), r, AcquireOptions{})
		if err != nil || rep.Misses != 1 {
			t.Fatalf("refetch %+v %v", rep, err)
		}
		checkHeld(t, c, o, o.models[tinyRef])
	})
	t.Run("scrub", func(t *testing.T) {
		dir := t.TempDir()
		c := openCache(t, Config{Dir: dir, Origins: []Source{o.source(t)}})
		if _, err := c.Prefetch(testCtx(t), r, AcquireOptions{}); err != nil {
			t.Fatal(err)
		}
		c.Close()
		damage(c)
		c2 := openCache(t, Config{Dir: dir, Scrub: true})
		if c2.Has(big.Digest) || len(c2.Models()) != 0 || c2.Stats().Blobs != 2 {
			t.Fatalf("scrub at open kept the bad blob: %+v", c2.Stats())
		}
		if counter(t, c2, "infergate_artifact_integrity_failures_total", "stage", "scrub") != 1 {
			t.Error("not counted")
		}
	})
}

// TestEvictionRespectsPinsAndBudget: LRU over unpinned blobs within the
// budget; a model in use is never evicted; when only pinned blobs remain the
// acquire fails cleanly.
func TestEvictionRespectsPinsAndBudget(t *testing.T) {
	refs := []string{"library/a:1", "library/b:1", "library/c:1"}
	o := newOrigin(t, map[string][]int{
		"registry.ollama.ai/" + refs[0]: {100_000},
		"registry.ollama.ai/" + refs[1]: {100_000},
		"registry.ollama.ai/" + refs[2]: {100_000},
	})
	// Two models and the shared 2-byte config fit, three do not.
	c := openCache(t, Config{Origins: []Source{o.source(t)}, Budget: 250_000})
	ctx := testCtx(t)
	a, err := c.Acquire(ctx, mustRef(t, refs[0]), AcquireOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Prefetch(ctx, mustRef(t, refs[1]), AcquireOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Prefetch(ctx, mustRef(t, refs[2]), AcquireOptions{}); err != nil {
		t.Fatal(err)
	}
	names := func() (out []string) {
		for _, m := range c.Models() {
			out = append(out, m.Ref.Namespace+"/"+m.Ref.Model+":"+m.Ref.Tag)
		}
		return out
	}
	if c.Manifest(mustRef(t, refs[0])) == nil || c.Manifest(mustRef(t, refs[1])) != nil || c.Manifest(mustRef(t, refs[2])) == nil {
		t.Fatalf("held %v: want a (pinned) and c; b evicted", names())
	}
	if _, err := os.Stat(filepath.Join(c.Dir(), "manifests", mustRef(t, refs[1]).Path())); !os.IsNotExist(err) {
		t.Error("evicted model's manifest file kept")
	}
	if counter(t, c, "infergate_artifact_evictions_total") != 1 || counter(t, c, "infergate_artifact_evicted_bytes_total") != 100_000 {
		t.Error("eviction not counted")
	}
	if s := c.Stats(); s.Used > 250_000 {
		t.Errorf("over budget: %+v", s)
	}
	cl, err := c.Acquire(ctx, mustRef(t, refs[2]), AcquireOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Prefetch(ctx, mustRef(t, refs[1]), AcquireOptions{}); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("want ErrNoSpace with a and c pinned, got %v", err)
	}
	if s := c.Stats(); s.Reserved != 0 || c.Manifest(mustRef(t, refs[0])) == nil || c.Manifest(mustRef(t, refs[2])) == nil {
		t.Fatalf("failed acquire disturbed the cache: %+v %v", s, names())
	}
	a.Release()
	cl.Release()
	if _, err := c.Prefetch(ctx, mustRef(t, refs[1]), AcquireOptions{}); err != nil {
		t.Fatal(err)
	}
}

func TestLinkSharesBlobs(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {10_000}})
	c := openCache(t, Config{Origins: []Source{o.source(t)}})
	r := mustRef(t, tinyRef)
	if err := c.Link(r, t.TempDir()); !errors.Is(err, ErrNotFound) {
		t.Fatalf("link of an absent model: %v", err)
	}
	if _, err := c.Prefetch(testCtx(t), r, AcquireOptions{}); err != nil {
		t.Fatal(err)
	}
	dst := t.TempDir()
	for range 2 { // idempotent
		if err := c.Link(r, dst); err != nil {
			t.Fatal(err)
		}
	}
	big := o.biggest(tinyRef)
	a, _ := os.Stat(c.BlobPath(big.Digest))
	b, err := os.Stat(filepath.Join(dst, "blobs", big.Digest.FileName()))
	if err != nil || !os.SameFile(a, b) || a.Sys().(*syscall.Stat_t).Nlink != 2 {
		t.Fatalf("not a hard link: %v", err)
	}
	if raw, err := os.ReadFile(filepath.Join(dst, "manifests", r.Path())); err != nil || string(raw) != string(o.models[tinyRef].Raw) {
		t.Fatalf("manifest: %v", err)
	}
}

// TestHostileManifestFromSource: a source's oversized or malformed manifest
// is refused before any blob is fetched.
func TestHostileManifestFromSource(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {1_000}})
	for name, body := range map[string]string{
		"huge":      strings.Repeat(" ", MaxManifestBytes+10),
		"traversal": `{"schemaVersion":2,"config":{"digest":"sha256:../../../etc/passwd","size":1},"layers":[]}`,
		"deep":      strings.Repeat("[", 100_000),
	} {
		t.Run(name, func(t *testing.T) {
			o.setFault(func(w http.ResponseWriter, r *http.Request) bool {
				if strings.HasPrefix(r.URL.Path, "/manifests/") {
					fmt.Fprint(w, body)
					return true
				}
				return false
			})
			c := openCache(t, Config{Origins: []Source{o.source(t)}})
			if _, err := c.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{}); !errors.Is(err, ErrManifest) {
				t.Fatalf("want ErrManifest, got %v", err)
			}
		})
	}
	if o.blobGets() != 0 {
		t.Error("blobs fetched for a refused manifest")
	}
}

func TestOneProcessPerFolder(t *testing.T) {
	dir := t.TempDir()
	c := openCache(t, Config{Dir: dir})
	if _, err := Open(Config{Dir: dir}); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("second open: %v", err)
	}
	c.Close()
	openCache(t, Config{Dir: dir})
}

func TestStalePartialsPruned(t *testing.T) {
	dir := t.TempDir()
	part := filepath.Join(dir, "partial")
	os.MkdirAll(part, 0o755)
	fresh, stale, junk := filepath.Join(part, dg(1).FileName()), filepath.Join(part, dg(2).FileName()), filepath.Join(part, "junk")
	for _, p := range []string{fresh, stale, junk} {
		os.WriteFile(p, []byte("x"), 0o644)
	}
	old := time.Now().Add(-25 * time.Hour)
	os.Chtimes(stale, old, old)
	openCache(t, Config{Dir: dir})
	for p, want := range map[string]bool{fresh: true, stale: false, junk: false} {
		if _, err := os.Stat(p); (err == nil) != want {
			t.Errorf("%s kept=%v, want %v", filepath.Base(p), err == nil, want)
		}
	}
}

// BenchmarkPrefetch is the cache's own fetch pipeline on loopback: a 64 MiB
// blob from a file server (its file in the page cache), hashed, written,
// fsynced and installed; MB/s of the blob. The origin and the cache share
// the machine's cores.
func BenchmarkPrefetch(b *testing.B) {
	o := newOrigin(b, map[string][]int{tinyRef: {64 << 20}})
	b.SetBytes(64 << 20)
	for b.Loop() {
		c, err := Open(Config{Dir: b.TempDir(), Origins: []Source{o.source(b)}, Fetch: fastFetch})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := c.Prefetch(context.Background(), mustRef(b, tinyRef), AcquireOptions{}); err != nil {
			b.Fatal(err)
		}
		c.Close()
	}
}

// TestConcurrentAcquiresUnderBudget: engines acquire and release random
// models concurrently in a cache that holds about three of six. Whatever the
// interleaving, a leased model's blobs are on disk with their sizes, the
// budget holds, every manifest on disk names present blobs, every blob file
// is indexed, and nothing stays pinned or reserved.
func TestConcurrentAcquiresUnderBudget(t *testing.T) {
	models := map[string][]int{}
	var refs []string
	for i := range 6 {
		r := fmt.Sprintf("registry.ollama.ai/library/m%d:latest", i)
		models[r] = []int{20_000 + 1_000*i, 3_000}
		refs = append(refs, r)
	}
	o := newOrigin(t, models)
	const budget = 80_000
	c := openCache(t, Config{Origins: []Source{o.source(t)}, Budget: budget})
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		noSpace int
		ok      int
	)
	for g := range 6 {
		wg.Go(func() {
			for i := range 25 {
				ref := refs[(g*7+i*5)%len(refs)]
				l, err := c.Acquire(testCtx(t), mustRef(t, ref), AcquireOptions{})
				if errors.Is(err, ErrNoSpace) {
					mu.Lock()
					noSpace++
					mu.Unlock()
					continue
				}
				if err != nil {
					t.Error(err)
					return
				}
				for _, b := range l.Manifest.Blobs() {
					if st, err := os.Stat(c.BlobPath(b.Digest)); err != nil || st.Size() != b.Size {
						t.Errorf("leased blob %s of %s: %v", b.Digest.Short(), ref, err)
					}
				}
				if s := c.Stats(); s.Budget > 0 && s.Used > budget {
					t.Errorf("over budget: %+v", s)
				}
				l.Release()
				mu.Lock()
				ok++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	s := c.Stats()
	if s.Pinned != 0 || s.Reserved != 0 || s.Used > budget {
		t.Fatalf("after: %+v", s)
	}
	if ok == 0 {
		t.Fatal("no acquire succeeded")
	}
	for _, m := range c.Models() {
		for _, b := range m.Manifest.Blobs() {
			if !c.Has(b.Digest) {
				t.Errorf("model %s names missing blob %s", m.Ref, b.Digest.Short())
			}
		}
	}
	files, _ := filepath.Glob(filepath.Join(c.Dir(), "blobs", "sha256-*"))
	if len(files) != s.Blobs {
		t.Errorf("%d blob files, %d indexed", len(files), s.Blobs)
	}
	for _, f := range files {
		d, _ := ParseDigest(filepath.Base(f))
		if !c.Has(d) {
			t.Errorf("unindexed blob file %s", filepath.Base(f))
		}
	}
	t.Logf("%d acquires, %d refused for space, %d evictions", ok, noSpace, int(counter(t, c, "infergate_artifact_evictions_total")))
}

// TestFailedPartialsWithinBudget: partial downloads left by failed fetches
// (kept for a resume) stay within what the budget leaves. The attack: an
// origin that cuts every blob one byte short left a 60 MiB partial per model,
// 481 MiB in partial/ after 8 prefetches under a 100 MiB budget.
func TestFailedPartialsWithinBudget(t *testing.T) {
	const blobSize, budget = 40_000, 100_000
	models := map[string][]int{}
	for i := range 6 {
		models[fmt.Sprintf("m%d", i)] = []int{blobSize}
	}
	o := newOrigin(t, models)
	o.setFault(func(w http.ResponseWriter, r *http.Request) bool {
		d, err := ParseDigest(path.Base(r.URL.Path))
		if err != nil || len(o.blobs[d]) != blobSize {
			return false
		}
		w.Write(o.blobs[d][:blobSize-1]) // a 200 from 0, one byte short
		return true
	})
	c := openCache(t, Config{Budget: budget, Origins: []Source{o.source(t)}})
	partials := func() (n int, bytes int64) {
		ents, err := os.ReadDir(filepath.Join(c.Dir(), partialDir))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			fi, err := e.Info()
			if err != nil {
				t.Fatal(err)
			}
			n, bytes = n+1, bytes+fi.Size()
		}
		return n, bytes
	}
	for i := range 6 {
		if _, err := c.Prefetch(testCtx(t), mustRef(t, fmt.Sprintf("m%d", i)), AcquireOptions{}); err == nil {
			t.Fatalf("m%d: a short body was accepted", i)
		}
		n, bytes := partials()
		if used := c.Stats().Used; bytes+used > budget {
			t.Errorf("after m%d failed: %d partial files of %d bytes, %d used, budget %d", i, n, bytes, used, budget)
		}
		if i == 0 && bytes != blobSize-1 {
			t.Errorf("the first failure's partial (%d bytes) should stay for a resume: %d bytes", blobSize-1, bytes)
		}
	}
	// A restart keeps the bound too.
	c.Close()
	c = openCache(t, Config{Dir: c.Dir(), Budget: budget / 4})
	if _, bytes := partials(); bytes > budget/4 {
		t.Errorf("after Open with budget %d: %d partial bytes", budget/4, bytes)
	}
}

// TestFullDiskStopsFetch: a blob that cannot be written (its partial file
// is /dev/full: every write fails ENOSPC) fails its fetch at the first
// attempt, asking no other attempt or source (the attack: a 3 MiB tmpfs and
// a 5 MB blob, 5 attempts and 2 origins: 10 GETs, each downloading until
// the disk was full again).
func TestFullDiskStopsFetch(t *testing.T) {
	if _, err := os.Stat("/dev/full"); err != nil {
		t.Skip("no /dev/full here")
	}
	o := newOrigin(t, map[string][]int{tinyRef: {100_000}})
	big := o.biggest(tinyRef)
	c := openCache(t, Config{Origins: []Source{o.source(t), o.source(t)}})
	c.openPartial = func(p string) (*os.File, error) {
		if filepath.Base(p) == big.Digest.FileName() {
			return os.OpenFile("/dev/full", os.O_RDWR, 0)
		}
		return os.OpenFile(p, os.O_RDWR|os.O_CREATE, 0o644)
	}
	_, err := c.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{})
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("prefetch onto a full disk: %v, want ENOSPC", err)
	}
	o.mu.Lock()
	gets := o.gets["/blobs/"+big.Digest.FileName()]
	o.mu.Unlock()
	if gets != 1 {
		t.Errorf("%d GETs of the blob, want 1: a full disk is not the source's fault (%v)", gets, err)
	}
	if c.Has(big.Digest) {
		t.Error("the blob is held")
	}
}

// TestTricklingSourceLeft: a source that sends a byte every 20 ms, never
// idle long enough for IdleTimeout, is abandoned for
// sending under MinRate, and the next source serves the blob (the attack:
// a peer sending a byte every 20 s held the blob's fetch, never falling
// back to the origin, for as long as it kept trickling).
func TestTricklingSourceLeft(t *testing.T) {
	slow := newOrigin(t, map[string][]int{tinyRef: {100_000}})
	good := newOrigin(t, map[string][]int{tinyRef: {100_000}})
	big := slow.biggest(tinyRef)
	slow.setFault(func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.Contains(r.URL.Path, big.Digest.Hex()) {
			return false
		}
		w.Header().Set("Content-Length", strconv.FormatInt(big.Size, 10))
		for i := 0; i < len(slow.blobs[big.Digest]); i++ {
			if _, err := w.Write(slow.blobs[big.Digest][i : i+1]); err != nil {
				return true
			}
			w.(http.Flusher).Flush()
			select {
			case <-r.Context().Done():
				return true
			case <-time.After(20 * time.Millisecond):
			}
		}
		return true
	})
	// The floor: 2 KiB in any 2 s. The trickle sends at most 100 bytes in
	// 2 s; the good origin's 100,000 bytes would fail it only if the
	// process stood still for 2 s with under 2 KiB of them read.
	fc := fastFetch
	fc.IdleTimeout = 2 * time.Second
	fc.MinRate = 1 << 10
	fc.Attempts = 1
	c := openCache(t, Config{Peers: []Source{slow.source(t)}, Origins: []Source{good.source(t)}, Fetch: fc})
	l, err := c.Acquire(testCtx(t), mustRef(t, tinyRef), AcquireOptions{})
	if err != nil {
		t.Fatalf("acquire with a trickling peer and a good origin: %v", err)
	}
	defer l.Release()
	checkHeld(t, c, good, l.Manifest)
	good.mu.Lock()
	gets := good.gets["/blobs/"+big.Digest.FileName()]
	good.mu.Unlock()
	if gets == 0 {
		t.Error("the origin was never asked for the blob")
	}

	// The trickle alone fails as too slow, each attempt.
	c2 := openCache(t, Config{Origins: []Source{slow.source(t)}, Fetch: fc})
	if _, err := c2.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{}); !errors.Is(err, errSlow) {
		t.Fatalf("a trickling origin alone: %v, want errSlow", err)
	}
}
