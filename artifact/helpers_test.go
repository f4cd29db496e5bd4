package artifact

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func dg(i int) Digest { return DigestOf([]byte(fmt.Sprint("blob", i))) }

// testCtx bounds a test's waits.
func testCtx(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// origin is an Ollama model store in a folder, served by a file server
// (LayoutOllamaDir) whose requests are counted and can be faulted.
type origin struct {
	dir    string
	srv    *httptest.Server
	models map[string]*Manifest // by ref string
	blobs  map[Digest][]byte

	mu     sync.Mutex
	gets   map[string]int // URL path → GETs
	ranges []string       // Range headers seen, in order
	fault  func(w http.ResponseWriter, r *http.Request) bool
}

// newOrigin adds each model (ref → sizes of its files, filled with seeded
// random bytes) to a fresh store and serves it.
func newOrigin(t testing.TB, models map[string][]int) *origin {
	t.Helper()
	o := &origin{dir: t.TempDir(), models: map[string]*Manifest{}, blobs: map[Digest][]byte{}, gets: map[string]int{}}
	c, err := Open(Config{Dir: o.dir})
	if err != nil {
		t.Fatal(err)
	}
	files := t.TempDir()
	seed := uint64(1)
	for ref, sizes := range models {
		r, err := ParseRef(ref)
		if err != nil {
			t.Fatal(err)
		}
		var fs []File
		for i, n := range sizes {
			b := make([]byte, n)
			rng := rand.New(rand.NewPCG(seed, uint64(i)))
			seed++
			for j := range b {
				b[j] = byte(rng.Uint32())
			}
			p := filepath.Join(files, r.Model+"-"+string(rune('a'+i)))
			if err := os.WriteFile(p, b, 0o644); err != nil {
				t.Fatal(err)
			}
			o.blobs[DigestOf(b)] = b
			fs = append(fs, File{Path: p, MediaType: MediaTypeOllamaModel})
		}
		m, err := c.Add(testCtx(t), r, fs)
		if err != nil {
			t.Fatal(err)
		}
		o.models[r.String()] = m
	}
	o.blobs[DigestOf([]byte("{}"))] = []byte("{}")
	c.Close()
	fsrv := http.FileServer(http.Dir(o.dir))
	o.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		o.mu.Lock()
		o.gets[r.URL.Path]++
		if rg := r.Header.Get("Range"); rg != "" {
			o.ranges = append(o.ranges, rg)
		}
		fault := o.fault
		o.mu.Unlock()
		if fault != nil && fault(w, r) {
			return
		}
		fsrv.ServeHTTP(w, r)
	}))
	t.Cleanup(o.srv.Close)
	return o
}

func (o *origin) setFault(f func(w http.ResponseWriter, r *http.Request) bool) {
	o.mu.Lock()
	o.fault = f
	o.mu.Unlock()
}

// blobGets counts GETs of blobs.
func (o *origin) blobGets() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for p, k := range o.gets {
		if strings.HasPrefix(p, "/blobs/") {
			n += k
		}
	}
	return n
}

func (o *origin) source(t testing.TB) Source {
	t.Helper()
	s, err := NewHTTP(o.srv.URL, LayoutOllamaDir, false)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// biggest is the model's largest blob.
func (o *origin) biggest(ref string) Blob {
	var big Blob
	for _, b := range o.models[ref].Blobs() {
		if b.Size > big.Size {
			big = b
		}
	}
	return big
}

// fastFetch retries at once, so tests of failures stay short.
var fastFetch = FetchConfig{BackoffMin: time.Millisecond, BackoffMax: 5 * time.Millisecond, Attempts: 3}

// openCache opens a cache in a fresh folder (or dir) and closes it at
// cleanup.
func openCache(t *testing.T, cfg Config) *Cache {
	t.Helper()
	if cfg.Dir == "" {
		cfg.Dir = t.TempDir()
	}
	if cfg.Fetch == (FetchConfig{}) {
		cfg.Fetch = fastFetch
	}
	c, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func mustRef(t testing.TB, s string) Ref {
	t.Helper()
	r, err := ParseRef(s)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// checkHeld verifies every blob of m is in c's folder with the right bytes.
func checkHeld(t *testing.T, c *Cache, o *origin, m *Manifest) {
	t.Helper()
	for _, b := range m.Blobs() {
		got, err := os.ReadFile(c.BlobPath(b.Digest))
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != string(o.blobs[b.Digest]) {
			t.Fatalf("blob %s differs", b.Digest.Short())
		}
	}
}

func counter(t *testing.T, c *Cache, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := c.Gatherer().Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.Metric {
			for i := 0; i+1 < len(labels); i += 2 {
				ok := false
				for _, lp := range m.Label {
					if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
						ok = true
					}
				}
				if !ok {
					continue metric
				}
			}
			if m.Counter != nil {
				sum += m.Counter.GetValue()
			} else if m.Gauge != nil {
				sum += m.Gauge.GetValue()
			}
		}
	}
	return sum
}
