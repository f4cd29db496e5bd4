package simserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/infergate/infergate/artifact"
	"github.com/infergate/infergate/sim"
)

// Weights makes an engine's start-up read its weights through the node's
// artifact cache (StartupConfig.Weights; issue 20, item 2): the real bytes
// of a model the cache holds or fetches stand for the profile's full-size
// weights, and the cache decides the weights' source tier. README
// "Weights through the artifact cache".
type Weights struct {
	// Cache is the node's artifact cache, shared by every engine on the
	// node (one per process: the cache's folder takes one process).
	Cache *artifact.Cache
	// Ref names the model.
	Ref artifact.Ref
	// Manifest, when set, is the model's manifest (no source is asked for
	// one).
	Manifest []byte
	// NoVerify skips hashing the bytes as they are read at start-up (the
	// fetch verifies what it downloads either way).
	NoVerify bool
	// RetryMin and RetryMax bound the back-off between failed start-up
	// attempts, wall time (1 s, 30 s).
	RetryMin, RetryMax time.Duration
}

// WeightsReport is what one start-up through the artifact cache did (real,
// wall-clock figures; Server.WeightsReport).
type WeightsReport struct {
	// Placement is where the cache found the bytes (the tier choice,
	// sim.PlacementOf of artifact.Cache.Locate).
	Placement sim.WeightsPlacement
	// Acquire is the cache's report: hits, misses, bytes fetched by
	// source.
	Acquire artifact.Report
	// Locate, Fetch and Read are the wall times of the look-up, of the
	// acquire (fetching what was missing) and of reading (and hashing)
	// every byte; Bytes the bytes read.
	Locate, Fetch, Read time.Duration
	Bytes               int64
	// Attempts is the start-up attempts it took (1 without failures).
	Attempts int
}

// Real is the wall time of the real part of the start-up: look-up, fetch
// and read.
func (r WeightsReport) Real() time.Duration { return r.Locate + r.Fetch + r.Read }

// WeightsReport returns the report of the engine's start-up through the
// artifact cache (zero before it finished or without Weights).
func (s *Server) WeightsReport() WeightsReport {
	if r := s.weightsReport.Load(); r != nil {
		return *r
	}
	return WeightsReport{}
}

// locateWeights decides the start-up's tier from where the cache finds the
// weights now, and returns the modelled phases.
func (s *Server) locateWeights(ctx context.Context, w *Weights, rep *WeightsReport) (sim.StartupPhases, error) {
	t0 := time.Now()
	plan, err := w.Cache.Locate(ctx, w.Ref)
	rep.Locate = time.Since(t0)
	if err != nil {
		return sim.StartupPhases{}, fmt.Errorf("locate %s: %w", w.Ref, err)
	}
	rep.Placement = sim.PlacementOf(&plan)
	return s.eng.Profile.StartupPhases(sim.StartupInput{Placement: &rep.Placement, ImageCached: s.cfg.Startup.ImageCached,
		Source: s.cfg.Startup.source()})
}

// acquireWeights fetches what the cache lacks (real bytes, verified) and
// pins the model (the lease the server holds until Close), then reads every
// byte as the engine's load would, hashing it unless NoVerify.
func (s *Server) acquireWeights(ctx context.Context, w *Weights, rep *WeightsReport) (*artifact.Lease, error) {
	t0 := time.Now()
	lease, err := w.Cache.Acquire(ctx, w.Ref, artifact.AcquireOptions{Manifest: w.Manifest})
	rep.Fetch = time.Since(t0)
	if err != nil {
		return nil, err
	}
	rep.Acquire = lease.Report
	t1 := time.Now()
	for _, b := range lease.Manifest.Blobs() {
		var n int64
		if w.NoVerify {
			n, err = readBlob(ctx, w.Cache, b.Digest)
		} else {
			n, err = w.Cache.ReadVerified(ctx, b.Digest, nil)
		}
		rep.Bytes += n
		if err != nil {
			lease.Release()
			return nil, fmt.Errorf("read %s: %w", b.Digest.Short(), err)
		}
	}
	rep.Read = time.Since(t1)
	return lease, nil
}

// readBlob reads a held blob without hashing it.
func readBlob(ctx context.Context, c *artifact.Cache, d artifact.Digest) (int64, error) {
	f, err := c.OpenBlob(d)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	var n int64
	for {
		if err := ctx.Err(); err != nil {
			return n, err
		}
		k, err := f.Read(buf)
		n += int64(k)
		if err != nil {
			if errors.Is(err, io.EOF) {
				return n, nil
			}
			return n, err
		}
	}
}

// weightsStart is the start-up of a server with Weights, on the driver
// goroutine: locate (the tier), the image pull, the weights phase (acquire
// and read for real, then the rest of the modelled time), the warm-up. A
// failed look-up, fetch or read is logged and retried with back-off (a pod
// restarted by its controller) until Close. It reports false when the
// server was closed meanwhile.
func (s *Server) weightsStart(w *Weights, timer *time.Timer) bool {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-s.quit:
			cancel()
		case <-ctx.Done():
		}
	}()
	wait := func(d time.Duration) bool {
		if d <= 0 {
			return ctx.Err() == nil
		}
		timer.Reset(d)
		select {
		case <-timer.C:
			return true
		case <-ctx.Done():
			return false
		}
	}
	backoff := w.RetryMin
	if backoff <= 0 {
		backoff = time.Second
	}
	maxBackoff := max(w.RetryMax, backoff)
	if w.RetryMax <= 0 {
		maxBackoff = max(30*time.Second, backoff)
	}
	for attempt := 1; ; attempt++ {
		rep := WeightsReport{Attempts: attempt}
		err := s.weightsAttempt(ctx, w, &rep, wait)
		if err == nil {
			s.weightsReport.Store(&rep)
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		s.metrics.startupFailed()
		slog.Error("sim: start-up failed; retrying", "model", w.Ref.String(), "attempt", attempt, "retry_in", backoff, "err", err)
		if !wait(backoff) {
			return false
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

// weightsAttempt is one try of weightsStart.
func (s *Server) weightsAttempt(ctx context.Context, w *Weights, rep *WeightsReport, wait func(time.Duration) bool) error {
	ph, err := s.locateWeights(ctx, w, rep)
	if err != nil {
		return err
	}
	s.startup.Store(&ph)
	slog.Info("sim: start-up through the artifact cache", "model", w.Ref.String(), "source", ph.Source,
		"remote_bytes", rep.Placement.Remote, "peer_bytes", rep.Placement.Peer, "nvme_bytes", rep.Placement.NVMe,
		"page_cache_bytes", rep.Placement.PageCache, "modelled", ph.Total())
	scale := s.cfg.TimeScale
	if ph.ImagePull > 0 {
		s.metrics.setPhase(string(sim.PhaseImagePull))
		if !wait(scaled(ph.ImagePull, scale)) {
			return ctx.Err()
		}
	}
	s.metrics.setPhase(string(sim.PhaseWeightsLoad))
	t0 := time.Now()
	lease, err := s.acquireWeights(ctx, w, rep)
	if err != nil {
		return err
	}
	// The weights phase lasts the longer of the real fetch and read and
	// the modelled time of the full-size model's bytes from those tiers.
	if !wait(scaled(ph.WeightsLoad, scale) - time.Since(t0)) {
		lease.Release()
		return ctx.Err()
	}
	if ph.WarmUp > 0 {
		s.metrics.setPhase(string(sim.PhaseWarmUp))
		if !wait(scaled(ph.WarmUp, scale)) {
			lease.Release()
			return ctx.Err()
		}
	}
	s.lease = lease
	return nil
}

// errNoWeights is a Weights without a cache or model.
var errNoWeights = errors.New("startup.weights needs a cache and a model reference")
