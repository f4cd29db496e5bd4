package artifact

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Config configures a Cache.
type Config struct {
	// Dir is the cache folder (an Ollama model store; created if missing).
	Dir string
	// Budget bounds the bytes of blobs held (<= 0: unbounded).
	Budget int64
	// Peers are other nodes' caches, tried before Origins for each blob.
	Peers []Source
	// Origins are where models come from (a registry, a file server, a
	// folder), tried in order.
	Origins []Source
	// Fetch bounds fetches (zero fields take FetchConfig's defaults).
	Fetch FetchConfig
	// Scrub rehashes every blob at Open and deletes the bad ones (reads
	// everything: minutes for a large cache).
	Scrub bool
	// VerifyReads rehashes a blob every time Open serves it.
	VerifyReads bool
	// Registry receives the cache's metrics (nil: a registry of its own,
	// Cache.Gatherer).
	Registry *prometheus.Registry
	// Logger (nil: slog.Default()).
	Logger *slog.Logger
}

// FetchConfig bounds blob fetches.
type FetchConfig struct {
	// Concurrency is how many blobs download at once, across the cache (4).
	Concurrency int
	// Attempts is how many times one source is tried for a blob before the
	// next (5). An attempt that received bytes resets the back-off.
	Attempts int
	// BackoffMin and BackoffMax bound the exponential back-off between
	// attempts (250 ms, 10 s; each wait is jittered to [½, 1] of its value).
	BackoffMin, BackoffMax time.Duration
	// IdleTimeout aborts an attempt that receives no byte for this long: a
	// stalled server (30 s).
	IdleTimeout time.Duration
	// MinRate aborts an attempt that receives fewer than MinRate ×
	// IdleTimeout bytes in an IdleTimeout: a server that trickles (bytes/s;
	// 64 KiB/s, 1.9 MiB in 30 s; < 0: off). The idle timeout alone let a
	// source sending a byte every 20 s hold a blob's fetch, and one of the
	// Concurrency slots, for ever, and a slow peer was never left for the
	// origin. An attempt so abandoned is retried, then the next source.
	MinRate int64
	// ManifestTimeout bounds a manifest fetch (30 s).
	ManifestTimeout time.Duration
}

func (f FetchConfig) withDefaults() FetchConfig {
	if f.Concurrency <= 0 {
		f.Concurrency = 4
	}
	if f.Attempts <= 0 {
		f.Attempts = 5
	}
	if f.BackoffMin <= 0 {
		f.BackoffMin = 250 * time.Millisecond
	}
	if f.BackoffMax <= 0 {
		f.BackoffMax = 10 * time.Second
	}
	if f.BackoffMax < f.BackoffMin {
		f.BackoffMax = f.BackoffMin
	}
	if f.IdleTimeout <= 0 {
		f.IdleTimeout = 30 * time.Second
	}
	if f.MinRate == 0 {
		f.MinRate = 64 << 10
	}
	if f.ManifestTimeout <= 0 {
		f.ManifestTimeout = 30 * time.Second
	}
	return f
}

// Cache is a node's artifact cache: the Index's accounting over the folder's
// blobs, fetches deduplicated per digest and bounded in number, leases that
// pin a model's blobs while an engine uses them. Safe for concurrent use.
type Cache struct {
	cfg Config
	st  *store
	log *slog.Logger
	reg *prometheus.Registry
	m   *metrics
	sem chan struct{}
	// ctx is the parent of every fetch; Close cancels it.
	ctx    context.Context
	cancel context.CancelFunc

	mu        sync.Mutex
	idx       *Index
	manifests map[Ref]*Manifest // complete models (every blob present)
	flights   map[Digest]*flight
	wg        sync.WaitGroup
	closed    bool
	lock      *os.File // flock on <dir>/.lock: one process per folder

	// openPartial opens a fetch's file in partial/ (os.OpenFile; a test
	// gives a file that fails its writes).
	openPartial func(path string) (*os.File, error)
}

// Open opens (or creates) the cache folder, which one process at a time may
// hold (an exclusive flock on <dir>/.lock; engines reading the folder take
// no lock): it removes partial downloads untouched for 24 h, indexes the blobs found there
// (most recently used first, by mtime), drops manifests that name a missing
// blob, optionally scrubs, and trims to the budget.
func Open(cfg Config) (*Cache, error) {
	if cfg.Dir == "" {
		return nil, errors.New("artifact: Config.Dir is empty")
	}
	cfg.Fetch = cfg.Fetch.withDefaults()
	st, err := openStore(cfg.Dir)
	if err != nil {
		return nil, err
	}
	lock, err := lockDir(cfg.Dir)
	if err != nil {
		return nil, err
	}
	c, err := open(cfg, st)
	if err != nil {
		lock.Close()
		return nil, err
	}
	c.lock = lock
	return c, nil
}

func open(cfg Config, st *store) (*Cache, error) {
	var err error
	c := &Cache{
		cfg: cfg, st: st, log: cfg.Logger, reg: cfg.Registry,
		sem:       make(chan struct{}, cfg.Fetch.Concurrency),
		idx:       NewIndex(cfg.Budget),
		manifests: make(map[Ref]*Manifest),
		flights:   make(map[Digest]*flight),
		openPartial: func(p string) (*os.File, error) {
			return openNoFollow(p, os.O_RDWR|os.O_CREATE, 0o644)
		},
	}
	if c.log == nil {
		c.log = slog.Default()
	}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	if c.reg == nil {
		c.reg = prometheus.NewRegistry()
	}
	if c.m, err = newMetrics(c.reg, c); err != nil {
		return nil, err
	}
	if n := st.prunePartials(time.Now()); n > 0 {
		c.log.Info("artifact: removed stale partial downloads", "count", n)
	}
	blobs, err := st.scanBlobs()
	if err != nil {
		return nil, err
	}
	for _, b := range blobs {
		c.idx.Add(b.digest, b.size)
	}
	if cfg.Scrub {
		if _, err := c.Scrub(context.Background()); err != nil {
			return nil, err
		}
	}
	found, bad, err := st.scanManifests()
	if err != nil {
		return nil, err
	}
	if len(bad) > 0 {
		c.log.Warn("artifact: ignoring unreadable manifests", "count", len(bad), "first", bad[0])
	}
	c.mu.Lock()
	for _, f := range found {
		c.manifests[f.ref] = f.m
	}
	c.dropIncompleteLocked()
	c.evictLocked(c.idx.Trim())
	c.trimPartialsLocked()
	c.mu.Unlock()
	return c, nil
}

// trimPartialsLocked keeps the partial downloads no fetch is writing (those
// of fetches that failed or were cancelled, kept for a resume) within what
// the budget leaves: Budget − Used (held and reserved blobs), deleting the
// least recently written first. Without it, a source that cuts every blob
// near its end (or a prefetch cancelled each time) leaves a partial file per
// digest outside the budget, for 24 h: the attack filled partial/ with
// 481 MiB under a 100 MiB budget in 8 prefetches, and more prefetches add
// more. Run when a fetch is admitted, when one fails, and at Open.
func (c *Cache) trimPartialsLocked() {
	if c.cfg.Budget <= 0 {
		return
	}
	limit := max(c.cfg.Budget-c.idx.Stats().Used, 0)
	n, b := c.st.trimPartials(limit, func(d Digest) bool { return c.flights[d] != nil })
	if n > 0 {
		c.log.Info("artifact: partial downloads deleted for the budget", "count", n, "bytes", b)
	}
}

// Gatherer is the registry holding the cache's metrics.
func (c *Cache) Gatherer() prometheus.Gatherer { return c.reg }

// Dir is the cache folder.
func (c *Cache) Dir() string { return c.cfg.Dir }

// Stats is the index's totals.
func (c *Cache) Stats() IndexStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.idx.Stats()
}

// Close stops the cache: fetches in flight are cancelled and waited for.
// Leases stay valid (their blobs are files on disk).
func (c *Cache) Close() error {
	c.mu.Lock()
	first := !c.closed
	if first {
		c.closed = true
		c.cancel()
	}
	c.mu.Unlock()
	c.wg.Wait()
	if first && c.lock != nil {
		return c.lock.Close() // releases the flock
	}
	return nil
}

// dropIncompleteLocked removes manifests naming a blob the index does not
// hold.
func (c *Cache) dropIncompleteLocked() {
	for r, m := range c.manifests {
		for _, b := range m.Blobs() {
			if !c.idx.Has(b.Digest) {
				c.log.Info("artifact: model incomplete, manifest dropped", "model", r.String(), "missing", b.Digest.Short())
				delete(c.manifests, r)
				if err := c.st.removeManifest(r); err != nil {
					c.log.Warn("artifact: remove manifest", "model", r.String(), "err", err)
				}
				break
			}
		}
	}
}

// removeBlobsLocked deletes blobs' files (the index has forgotten them
// already) and the manifests that named them. It runs under c.mu, so no
// fetch can reserve and write one of these digests in between.
func (c *Cache) removeBlobsLocked(ds []Digest) {
	if len(ds) == 0 {
		return
	}
	for _, d := range ds {
		if err := os.Remove(c.st.blobPath(d)); err != nil && !errors.Is(err, os.ErrNotExist) {
			c.log.Warn("artifact: remove blob", "digest", d.Short(), "err", err)
		}
	}
	c.dropIncompleteLocked()
}

// evictLocked records and deletes the blobs the index evicted.
func (c *Cache) evictLocked(ds []Digest) {
	for _, d := range ds {
		var size int64
		if fi, err := os.Stat(c.st.blobPath(d)); err == nil {
			size = fi.Size()
		}
		c.m.evictions.Inc()
		c.m.evicted.Add(float64(size))
		c.log.Info("artifact: evicted", "digest", d.Short(), "bytes", size)
	}
	c.removeBlobsLocked(ds)
}

// Model is a model the cache holds completely.
type Model struct {
	Ref      Ref
	Manifest *Manifest
	Size     int64 // bytes of its distinct blobs
}

// Models lists the complete models.
func (c *Cache) Models() []Model {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]Model, 0, len(c.manifests))
	for r, m := range c.manifests {
		out = append(out, Model{Ref: r, Manifest: m, Size: m.Size()})
	}
	return out
}

// Manifest returns a complete model's manifest (nil if the cache does not
// hold the model).
func (c *Cache) Manifest(r Ref) *Manifest {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.manifests[r]
}

// Has reports whether the cache holds blob d (a Holder). A blob written
// into the folder by someone else (an Ollama pointed at it that pulls) is
// not indexed until the next Open: share the folder with engines read-only.
func (c *Cache) Has(d Digest) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.idx.Has(d)
}

// BlobPath is where blob d's file is (whether or not it is held).
func (c *Cache) BlobPath(d Digest) string { return c.st.blobPath(d) }

// OpenBlob opens a held blob for reading, rehashing it first when
// Config.VerifyReads is set (a bad blob is deleted and ErrIntegrity
// returned). It returns an error wrapping ErrNotFound for a blob not held.
func (c *Cache) OpenBlob(d Digest) (*os.File, error) {
	c.mu.Lock()
	size, ok := c.idx.Size(d)
	held := ok && c.idx.Has(d)
	if held {
		c.idx.Touch(d)
	}
	c.mu.Unlock()
	if !held {
		return nil, fmt.Errorf("%w: blob %s", ErrNotFound, d.Short())
	}
	if c.cfg.VerifyReads {
		if err := verifyFile(c.st.blobPath(d), d, size); err != nil {
			if errors.Is(err, ErrIntegrity) || errors.Is(err, os.ErrNotExist) {
				c.m.integrity.WithLabelValues("read").Inc()
				c.discard(d)
			}
			return nil, err
		}
	}
	f, err := openNoFollow(c.st.blobPath(d), os.O_RDONLY, 0)
	if errors.Is(err, os.ErrNotExist) {
		c.discard(d)
		return nil, fmt.Errorf("%w: blob %s vanished from disk", ErrNotFound, d.Short())
	}
	return f, err
}

// discard forgets a blob found bad or missing and deletes its file and the
// manifests naming it.
func (c *Cache) discard(d Digest) {
	c.log.Warn("artifact: blob discarded", "digest", d.Short())
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.idx.Has(d) {
		return // already gone, or being fetched anew: not ours to delete
	}
	c.idx.Remove(d)
	c.removeBlobsLocked([]Digest{d})
}

// Scrub rehashes every held blob that no fetch is writing, deletes the bad
// ones (and the manifests naming them) and returns them.
func (c *Cache) Scrub(ctx context.Context) ([]Digest, error) {
	c.mu.Lock()
	ds := c.idx.Order()
	c.mu.Unlock()
	var bad []Digest
	for _, d := range ds {
		if err := ctx.Err(); err != nil {
			return bad, err
		}
		c.mu.Lock()
		size, ok := c.idx.Size(d)
		ok = ok && c.idx.Has(d)
		c.mu.Unlock()
		if !ok {
			continue
		}
		if err := verifyFile(c.st.blobPath(d), d, size); err != nil {
			if !errors.Is(err, ErrIntegrity) && !errors.Is(err, os.ErrNotExist) {
				return bad, err
			}
			c.m.integrity.WithLabelValues("scrub").Inc()
			c.log.Warn("artifact: scrub found a bad blob", "digest", d.Short(), "err", err)
			bad = append(bad, d)
			c.discard(d)
		}
	}
	return bad, nil
}

// Lease holds a model's blobs pinned: they are not evicted until Release.
// An engine holds one from before it starts until it stops.
type Lease struct {
	Ref      Ref
	Manifest *Manifest
	Report   Report
	c        *Cache
	once     sync.Once
}

// Release unpins the blobs. Idempotent.
func (l *Lease) Release() {
	l.once.Do(func() {
		l.c.mu.Lock()
		defer l.c.mu.Unlock()
		for _, b := range l.Manifest.Blobs() {
			l.c.idx.Unpin(b.Digest)
		}
	})
}

// Report says what one Acquire did.
type Report struct {
	Blobs, Hits, Misses, Shared int
	// Bytes is the model's size; HitBytes the part already held.
	Bytes, HitBytes int64
	// Fetched is bytes received per source kind by the fetches this
	// acquire started (not those it joined).
	Fetched  map[SourceKind]int64
	Duration time.Duration
	// ManifestFrom names the source of the manifest ("cache" when offline).
	ManifestFrom string
}

// AcquireOptions tune Acquire.
type AcquireOptions struct {
	// Offline uses only the cached manifest, asking no source.
	Offline bool
	// Manifest, when set, is the model's manifest (e.g. read from a file):
	// no source is asked for one; blobs still come from the sources.
	Manifest []byte
}

// Acquire makes a model's blobs present and pinned, and returns the lease
// that holds them: the manifest comes from the first source that has it
// (origins, then peers; the cached copy when every source fails, or with
// Offline), each missing blob is fetched once however many callers want it
// at the same time, and the manifest is written to the folder once all blobs
// are present. On error nothing stays pinned.
func (c *Cache) Acquire(ctx context.Context, r Ref, opts AcquireOptions) (*Lease, error) {
	start := time.Now()
	l, err := c.acquire(ctx, r, opts, nil)
	outcome := "ok"
	if err != nil {
		outcome = "error"
	} else {
		l.Report.Duration = time.Since(start)
	}
	c.m.prefetches.WithLabelValues(outcome).Inc()
	return l, err
}

// Prefetch is Acquire and Release: the model is in the cache, unpinned.
func (c *Cache) Prefetch(ctx context.Context, r Ref, opts AcquireOptions) (Report, error) {
	l, err := c.Acquire(ctx, r, opts)
	if err != nil {
		return Report{}, err
	}
	l.Release()
	return l.Report, nil
}

// acquire is acquireOnce, again while it joined an abandoned fetch and ctx
// lasts (each retry waited for that fetch to end, and means another caller
// gave up on the same blob: no spin). srcs
// nil means the configured sources: origins then peers for the manifest (a
// tag is mutable, and the origin says what it names now; a peer may hold an
// older one), peers then origins for blobs (content-addressed: any holder's
// bytes are the same).
func (c *Cache) acquire(ctx context.Context, r Ref, opts AcquireOptions, srcs []Source) (*Lease, error) {
	for {
		l, err := c.acquireOnce(ctx, r, opts, srcs)
		if !errors.Is(err, errAbandoned) || ctx.Err() != nil {
			return l, err
		}
	}
}

func (c *Cache) acquireOnce(ctx context.Context, r Ref, opts AcquireOptions, srcs []Source) (*Lease, error) {
	if err := r.Validate(); err != nil {
		return nil, err
	}
	var (
		m    *Manifest
		from = "given"
		err  error
	)
	if opts.Manifest != nil {
		m, err = ParseManifest(opts.Manifest)
	} else {
		msrcs := srcs
		if msrcs == nil {
			msrcs = append(append([]Source(nil), c.cfg.Origins...), c.cfg.Peers...)
		}
		m, from, err = c.resolve(ctx, r, opts.Offline, msrcs)
	}
	if err != nil {
		return nil, err
	}
	l := &Lease{Ref: r, Manifest: m, c: c, Report: Report{ManifestFrom: from, Fetched: map[SourceKind]int64{}}}
	blobs := m.Blobs()
	l.Report.Blobs = len(blobs)
	var (
		pinned  []Digest
		waits   []*flight
		started []*flight
	)
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, errors.New("artifact: cache closed")
	}
	for _, b := range blobs {
		l.Report.Bytes += b.Size
		if size, ok := c.idx.Size(b.Digest); ok {
			if size != b.Size {
				err = fmt.Errorf("%w: manifest says blob %s is %d bytes, the cache holds %d", ErrManifest, b.Digest.Short(), b.Size, size)
				break
			}
			c.idx.Pin(b.Digest)
			pinned = append(pinned, b.Digest)
			if f := c.flights[b.Digest]; f != nil {
				f.waiters++
				waits = append(waits, f)
				l.Report.Shared++
				c.m.lookups.WithLabelValues("shared").Inc()
			} else {
				l.Report.Hits++
				l.Report.HitBytes += b.Size
				c.m.lookups.WithLabelValues("hit").Inc()
			}
			continue
		}
		var victims []Digest
		if victims, err = c.idx.Reserve(b.Digest, b.Size); err != nil {
			break
		}
		c.evictLocked(victims)
		pinned = append(pinned, b.Digest)
		bsrcs := srcs
		if bsrcs == nil {
			bsrcs = c.sources()
		}
		f := c.startFlightLocked(r, b, bsrcs)
		c.trimPartialsLocked()
		waits = append(waits, f)
		started = append(started, f)
		l.Report.Misses++
		c.m.lookups.WithLabelValues("miss").Inc()
	}
	c.mu.Unlock()
	// Wait for the flights; after a failure, leave the rest (the last
	// waiter to leave a flight cancels it).
	for _, f := range waits {
		if err != nil {
			f.leave(c)
			continue
		}
		err = f.wait(ctx, c)
	}
	for _, f := range started {
		select {
		case <-f.done:
			for i, n := range f.fetched {
				if n > 0 {
					l.Report.Fetched[sourceKinds[i]] += n
				}
			}
		default:
		}
	}
	if err == nil {
		err = c.commitManifest(r, m)
	}
	if err != nil {
		c.mu.Lock()
		for _, d := range pinned {
			c.idx.Unpin(d)
		}
		c.mu.Unlock()
		return nil, fmt.Errorf("artifact: acquire %s: %w", r, err)
	}
	for _, d := range pinned {
		c.touch(d)
	}
	return l, nil
}

// touch sets a blob's mtime to now: the recency Open reads back at the next
// start. Best effort.
func (c *Cache) touch(d Digest) {
	now := time.Now()
	_ = os.Chtimes(c.st.blobPath(d), now, now)
}

// commitManifest writes a model's manifest once all its blobs are present.
func (c *Cache) commitManifest(r Ref, m *Manifest) error {
	c.mu.Lock()
	old := c.manifests[r]
	for _, b := range m.Blobs() {
		if !c.idx.Has(b.Digest) {
			c.mu.Unlock()
			return fmt.Errorf("blob %s missing after fetch", b.Digest.Short())
		}
	}
	c.mu.Unlock()
	if old != nil && old.Digest == m.Digest {
		return nil
	}
	if err := c.st.writeManifest(r, m.Raw); err != nil {
		return err
	}
	c.mu.Lock()
	c.manifests[r] = m
	c.mu.Unlock()
	return nil
}

// resolve finds r's manifest: from the sources in order unless offline,
// else (or when all fail) the cached copy.
func (c *Cache) resolve(ctx context.Context, r Ref, offline bool, srcs []Source) (*Manifest, string, error) {
	var errs []error
	if !offline {
		for _, s := range srcs {
			mctx, cancel := context.WithTimeout(ctx, c.cfg.Fetch.ManifestTimeout)
			raw, err := s.Manifest(mctx, r)
			cancel()
			if err == nil {
				m, perr := ParseManifest(raw)
				if perr == nil {
					return m, s.String(), nil
				}
				err = perr
			}
			errs = append(errs, fmt.Errorf("%s: %w", s, err))
			if ctx.Err() != nil {
				return nil, "", ctx.Err()
			}
		}
	}
	if m := c.Manifest(r); m != nil {
		if len(errs) > 0 {
			c.log.Warn("artifact: no source answered; using the cached manifest", "model", r.String(), "err", errors.Join(errs...))
		}
		return m, "cache", nil
	}
	if len(errs) == 0 {
		return nil, "", fmt.Errorf("%w: %s is not cached and no source is configured", ErrNotFound, r)
	}
	return nil, "", fmt.Errorf("manifest of %s: %w", r, errors.Join(errs...))
}

// sources is peers, then origins: where blobs are fetched from.
func (c *Cache) sources() []Source {
	return append(append([]Source(nil), c.cfg.Peers...), c.cfg.Origins...)
}

// Locate says where each blob of r would come from if an engine started now
// (the simulator's start-up tiers): this cache, the first peer that holds it,
// or the origin; for local blobs, how much the page cache holds. The
// manifest is the cached one, else the first source's.
func (c *Cache) Locate(ctx context.Context, r Ref) (Plan, error) {
	m := c.Manifest(r)
	if m == nil {
		var err error
		if m, _, err = c.resolve(ctx, r, false, append(append([]Source(nil), c.cfg.Origins...), c.cfg.Peers...)); err != nil {
			return Plan{}, err
		}
	}
	peers := make([]Holder, len(c.cfg.Peers))
	for i, p := range c.cfg.Peers {
		if h, ok := p.(*HTTP); ok {
			peers[i] = h.Holder(r)
		} else if h, ok := p.(Holder); ok {
			peers[i] = h
		}
	}
	p := Locate(m.Blobs(), c, peers...)
	for i := range p.Blobs {
		if p.Blobs[i].Tier == TierLocal {
			if n, err := residentBytes(c.st.blobPath(p.Blobs[i].Digest)); err == nil {
				p.Blobs[i].Resident = n
			}
		}
	}
	return p, nil
}

// Link gives an Ollama engine its own model store holding r: hard links to
// the cache's blobs (a copy where the folders are on different file
// systems) under ollamaModels/blobs and the manifest under
// ollamaModels/manifests, so OLLAMA_MODELS=ollamaModels serves r. The
// links share the cache's disk blocks and page cache. Hold a lease while the
// engine runs: the cache may evict an unpinned blob, which removes its own
// link only.
func (c *Cache) Link(r Ref, ollamaModels string) error {
	m := c.Manifest(r)
	if m == nil {
		return fmt.Errorf("%w: %s is not cached", ErrNotFound, r)
	}
	dst, err := openStore(ollamaModels)
	if err != nil {
		return err
	}
	for _, b := range m.Blobs() {
		to := dst.blobPath(b.Digest)
		if fi, err := os.Stat(to); err == nil && fi.Size() == b.Size {
			continue
		}
		from := c.st.blobPath(b.Digest)
		if err := os.Link(from, to); err != nil {
			if errors.Is(err, os.ErrExist) {
				os.Remove(to)
				err = os.Link(from, to)
			}
			if err != nil {
				if err := copyFile(from, to); err != nil {
					return fmt.Errorf("artifact: link %s: %w", b.Digest.Short(), err)
				}
			}
		}
	}
	return dst.writeManifest(r, m.Raw)
}

// copyFile copies a blob through a temporary file, atomically.
func copyFile(from, to string) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.CreateTemp(filepath.Dir(to), ".tmp-*")
	if err != nil {
		return err
	}
	_, err = io.Copy(out, in)
	if err == nil {
		err = out.Sync()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(out.Name(), to)
	}
	if err != nil {
		os.Remove(out.Name())
	}
	return err
}
