package simserver

import (
	"context"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sim"
)

// vLLM's sleep mode (docs/features/sleep_mode.md; the routes of
// vllm/entrypoints/serve/dev/sleep/api_router.py, served with
// VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode; the engine side in
// vllm/v1/engine/core.py since vllm-project/vllm PR #34528, 2026-02:
// sleep = pause the scheduler, mode "abort" by default, then free the
// memory):
//
//   - POST /sleep?level=1|2 (default 1): requests in flight are aborted,
//     the prefix cache is reset (AllBlocksCleared), scheduling pauses;
//     level 1 offloads the weights to host memory (the copy takes
//     sim.GPUProfile.WakeTime(1), the same PCIe links), level 2 discards
//     them. 200 with an empty body once asleep; sleeping again is a no-op.
//   - POST /wake_up[?tags=weights&tags=kv_cache]: restores the tags named
//     (all without tags) and resumes scheduling once none sleeps; the
//     weights take WakeTime(level, ServerConfig.Startup.Source). 200 once
//     done; waking what is awake is a no-op.
//   - GET /is_sleeping → {"is_sleeping": bool}: true until every tag woke.
//   - A request that arrives while asleep is accepted and waits, not
//     scheduled, until the wake-up (vLLM PR #34125: "new requests are
//     frozen until resumed"); /health stays 200, as vLLM's: an engine
//     asleep is alive. A router that must not send it traffic reads
//     /is_sleeping or vllm:engine_sleep_state{sleep_state="awake"}.
//
// Only sleep mode="abort" (vLLM's default) is simulated; "wait" and
// "keep" answer 400.

// sleepState is the server's sleep mode state.
type sleepState struct {
	// turn serialises sleeps and wake-ups (vLLM's engine core runs one
	// utility call at a time) and guards the tags: a call holds its one
	// slot. A call waiting for its turn leaves when its client does — a
	// storm of sleeps and wake-ups (each waits its modelled copy time)
	// made the calls of clients long gone run one after the other, each
	// putting the engine to sleep or waking it for nobody.
	turn chan struct{}
	// level is the sim.SleepLevel while any tag sleeps, 0 awake (read
	// by /health, /is_sleeping and the metric without mu).
	level atomic.Int32
	// weights and kv: the tags asleep (during a turn).
	weights, kv bool
}

// Sleep tags of POST /wake_up?tags=.
const (
	tagWeights = "weights"
	tagKVCache = "kv_cache"
)

// errSlept ends a request aborted by POST /sleep.
var errSlept = openai.NewError(http.StatusServiceUnavailable,
	"the engine was put to sleep; the request was aborted", "", "")

// sleepRoutes registers the sleep endpoints on mux (ServerConfig.EnableSleepMode).
func (s *Server) sleepRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /sleep", s.handleSleep)
	mux.HandleFunc("POST /wake_up", s.handleWakeUp)
	mux.HandleFunc("GET /is_sleeping", s.handleIsSleeping)
}

// Sleep puts the engine to sleep at level (1 or 2), as POST /sleep does;
// false when the engine does not run (not started, loading or closed).
func (s *Server) Sleep(level sim.SleepLevel) bool {
	return s.sleepCtx(context.Background(), level)
}

// lockSleep takes the sleep state's turn; false when ctx ends first or
// the server stops.
func (s *Server) lockSleep(ctx context.Context) bool {
	select {
	case s.sleep.turn <- struct{}{}:
		return true
	case <-ctx.Done():
	case <-s.quit:
	}
	return false
}

func (s *Server) unlockSleep() { <-s.sleep.turn }

// sleepCtx is Sleep for a caller that may leave while it waits for its
// turn (ctx).
func (s *Server) sleepCtx(ctx context.Context, level sim.SleepLevel) bool {
	if s.State() == StateLoading || s.State() == StateStopped {
		return false
	}
	if !s.lockSleep(ctx) {
		return false
	}
	defer s.unlockSleep()
	if s.sleep.level.Load() != int32(sim.Awake) {
		return true // already asleep: a no-op, as vLLM's
	}
	ok := s.withEngine(func(e *sim.Engine, _ time.Duration) {
		for id, c := range s.inflight {
			e.Abort(id)
			delete(s.inflight, id)
			s.metrics.success.WithLabelValues("abort").Inc()
			c.push(event{err: errSlept, finished: true})
		}
		e.ResetPrefixCache() // the KV cache is discarded at either level
		s.paused = true
	})
	if !ok {
		return false
	}
	s.sleep.weights, s.sleep.kv = true, true
	s.sleep.level.Store(int32(level))
	var d time.Duration
	if level == sim.SleepWeight {
		d, _ = s.eng.Profile.WakeTime(sim.SleepWeight, "") // the copy out takes the copy back's time
	}
	slog.Info("sim: engine asleep", "level", level, "modelled", d)
	return s.waitScaled(d)
}

// WakeUp wakes the tags named (weights, kv_cache; none: all), as POST
// /wake_up does; false when the server stopped meanwhile.
func (s *Server) WakeUp(tags []string) bool {
	return s.wakeUpCtx(context.Background(), tags)
}

// wakeUpCtx is WakeUp for a caller that may leave while it waits for its
// turn (ctx).
func (s *Server) wakeUpCtx(ctx context.Context, tags []string) bool {
	if !s.lockSleep(ctx) {
		return false
	}
	defer s.unlockSleep()
	level := sim.SleepLevel(s.sleep.level.Load())
	if level == sim.Awake {
		return true
	}
	all := len(tags) == 0
	var d time.Duration
	if (all || slices.Contains(tags, tagWeights)) && s.sleep.weights {
		src := sim.SourcePageCache
		if s.cfg.Startup != nil && s.cfg.Startup.Source != "" {
			src = s.cfg.Startup.Source
		}
		var err error
		if d, err = s.eng.Profile.WakeTime(level, src); err != nil {
			slog.Warn("sim: wake-up time not modelled; waking at once", "err", err)
			d = 0
		}
	}
	if !s.waitScaled(d) {
		return false
	}
	if all || slices.Contains(tags, tagWeights) {
		s.sleep.weights = false
	}
	if all || slices.Contains(tags, tagKVCache) {
		s.sleep.kv = false
	}
	if s.sleep.weights || s.sleep.kv {
		return true // is_sleeping stays true until every tag woke
	}
	if !s.withEngine(func(*sim.Engine, time.Duration) { s.paused = false }) {
		return false
	}
	s.sleep.level.Store(int32(sim.Awake))
	slog.Info("sim: engine awake", "from_level", level, "modelled", d)
	return true
}

// waitScaled waits engine time d at the server's time scale; false when
// the server is closed meanwhile.
func (s *Server) waitScaled(d time.Duration) bool {
	if d <= 0 {
		return true
	}
	t := time.NewTimer(scaled(d, s.cfg.TimeScale))
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-s.quit:
		return false
	}
}

func (s *Server) handleSleep(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	level := sim.SleepWeight
	if v := q.Get("level"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || (n != 1 && n != 2) {
			openai.WriteError(w, openai.Errorf("level", "level must be 1 or 2, got "+strconv.Quote(v)))
			return
		}
		level = sim.SleepLevel(n)
	}
	if m := q.Get("mode"); m != "" && m != "abort" {
		openai.WriteError(w, openai.Errorf("mode", "only mode=abort (the default) is simulated, got "+strconv.Quote(m)))
		return
	}
	if !s.sleepCtx(r.Context(), level) {
		openai.WriteError(w, openai.NewError(http.StatusServiceUnavailable, "the engine is not running", "", ""))
		return
	}
	w.WriteHeader(http.StatusOK)
}

func (s *Server) handleWakeUp(w http.ResponseWriter, r *http.Request) {
	tags := r.URL.Query()["tags"]
	for _, t := range tags {
		if t != tagWeights && t != tagKVCache {
			openai.WriteError(w, openai.Errorf("tags", "unknown sleep tag "+strconv.Quote(t)+" (want weights or kv_cache)"))
			return
		}
	}
	if s.State() == StateLoading || s.State() == StateStopped || !s.wakeUpCtx(r.Context(), tags) {
		openai.WriteError(w, openai.NewError(http.StatusServiceUnavailable, "the engine is not running", "", ""))
		return
	}
	w.WriteHeader(http.StatusOK)
}

func (s *Server) handleIsSleeping(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]bool{"is_sleeping": s.sleep.level.Load() != int32(sim.Awake)})
}
