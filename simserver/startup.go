package simserver

import (
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/infergate/infergate/artifact"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sim"
)

// StartupConfig makes a Server start unready and load for the modelled
// cold-start time (sim.GPUProfile.StartupPhases: image pull, weights read
// from Source, warm-up), scaled by the server's TimeScale, before it
// serves. README "Start-up and sleep".
type StartupConfig struct {
	// Source is where the weights are read from (sim.SourceRemote,
	// SourceNVMe, SourcePageCache, SourcePeer); an artifact cache decides
	// it (warm: page cache or NVMe; cold: remote). Also the source of a
	// wake-up from sleep level 2. Default page_cache.
	Source sim.WeightSource `yaml:"source"`
	// ImageCached: the container image is on the node (no pull).
	ImageCached bool `yaml:"image_cached"`
	// Weights, when set, makes the start-up read the weights through the
	// node's artifact cache, which decides their source (Source is then
	// only the level-2 wake-up's): startupweights.go.
	Weights *Weights `yaml:"-"`
}

// source is Source or its default.
func (c *StartupConfig) source() sim.WeightSource {
	if c.Source == "" {
		return sim.SourcePageCache
	}
	return c.Source
}

// phases returns the modelled start-up of a server of eng (engine time).
func (c *StartupConfig) phases(eng sim.Config) (sim.StartupPhases, error) {
	if c == nil {
		return sim.StartupPhases{}, nil
	}
	if w := c.Weights; w != nil && (w.Cache == nil || w.Ref == (artifact.Ref{})) {
		return sim.StartupPhases{}, errNoWeights
	}
	return eng.Profile.StartupPhases(sim.StartupInput{Source: c.source(), ImageCached: c.ImageCached})
}

// Lifecycle states of a Server (Server.State).
const (
	// StateLoading: starting up (image pull, weights, warm-up); /health
	// answers 503, requests 503.
	StateLoading = "loading"
	// StateReady: serving.
	StateReady = "ready"
	// StateSleeping: asleep (level 1 or 2); /health 200 as vLLM's,
	// requests queue until a wake-up.
	StateSleeping = "sleeping"
	// StateStopped: not started, or closed.
	StateStopped = "stopped"
)

// State returns the server's lifecycle state.
func (s *Server) State() string {
	select {
	case <-s.done:
		return StateStopped
	default:
	}
	switch {
	case !s.started.Load():
		return StateStopped
	case s.loading.Load():
		return StateLoading
	case s.sleep.level.Load() != int32(sim.Awake):
		return StateSleeping
	}
	return StateReady
}

// Ready returns a channel closed when the server has finished its
// start-up (at once for a server without StartupConfig, once Start ran).
func (s *Server) Ready() <-chan struct{} { return s.ready }

// StartupPhases returns the modelled start-up of the server (zero without
// StartupConfig), engine time. With Weights it is the estimate from
// Source until the start-up has asked the artifact cache, then what the
// cache's tiers give.
func (s *Server) StartupPhases() sim.StartupPhases { return *s.startup.Load() }

// load runs the start-up phases on the driver goroutine before the engine
// serves: each phase's modelled time scaled by TimeScale, logged and
// exposed (infergate_sim_startup_phase). It reports false when the server
// was closed meanwhile.
func (s *Server) load() bool {
	defer close(s.ready)
	if s.cfg.Startup == nil {
		return true
	}
	s.loading.Store(true)
	defer s.loading.Store(false)
	t0 := time.Now()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	if w := s.cfg.Startup.Weights; w != nil {
		if !s.weightsStart(w, timer) {
			return false
		}
		s.metrics.setPhase("")
		ph, rep := s.StartupPhases(), s.WeightsReport()
		slog.Info("sim: engine ready", "modelled", ph.Total(), "wall", time.Since(t0).Round(time.Millisecond),
			"source", ph.Source, "image_pull", ph.ImagePull, "weights_load", ph.WeightsLoad, "warm_up", ph.WarmUp,
			"fetched_bytes", rep.Acquire.Bytes-rep.Acquire.HitBytes, "fetch_wall", rep.Fetch.Round(time.Millisecond),
			"read_bytes", rep.Bytes, "read_wall", rep.Read.Round(time.Millisecond))
		return true
	}
	startup := s.StartupPhases()
	for _, ph := range startup.Phases() {
		if ph.Duration <= 0 {
			continue
		}
		s.metrics.setPhase(string(ph.Phase))
		slog.Info("sim: start-up phase", "phase", ph.Phase, "modelled", ph.Duration, "source", startup.Source,
			"wall", scaled(ph.Duration, s.cfg.TimeScale))
		timer.Reset(scaled(ph.Duration, s.cfg.TimeScale))
		select {
		case <-timer.C:
		case <-s.quit:
			return false
		}
	}
	s.metrics.setPhase("")
	slog.Info("sim: engine ready", "modelled", startup.Total(), "wall", time.Since(t0).Round(time.Millisecond),
		"source", startup.Source, "image_pull", startup.ImagePull, "weights_load", startup.WeightsLoad, "warm_up", startup.WarmUp)
	return true
}

// scaled turns engine time into wall time at scale (engine seconds per
// wall second).
func scaled(d time.Duration, scale float64) time.Duration {
	return time.Duration(float64(d) / scale)
}

// errLoading answers requests that arrive while the engine starts up.
var errLoading = openai.NewError(http.StatusServiceUnavailable,
	"the engine is starting up (loading the model); retry later", "", "")

// startupErr checks the start-up model of cfg (ServerConfig.Startup).
func startupErr(cfg ServerConfig, eng sim.Config) (sim.StartupPhases, error) {
	ph, err := cfg.Startup.phases(eng)
	if err != nil {
		return ph, fmt.Errorf("sim: startup: %w", err)
	}
	return ph, nil
}
