package sim

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/infergate/infergate/prefix"
)

// DefaultLoRALoadLatency is the simulated time to load an adapter that is
// not resident (LoRAConfig.LoadLatency when zero). It is an assumption, not a
// measurement: a rank-16/32 adapter of a 7B–70B model is tens to a few
// hundred MB of safetensors (a rank-32 Mistral-7B adapter is ~85 MB), so
// reading and parsing it from a warm page cache and copying it over PCIe
// (~25 GB/s) into a GPU slot is in the tens of milliseconds; cold storage is
// slower. vLLM loads adapters synchronously in the worker before the forward
// pass that needs them (vllm/lora/worker_manager.py,
// LRUCacheWorkerLoRAManager), so the load lengthens that step.
const DefaultLoRALoadLatency = 50 * time.Millisecond

// ErrUnknownLoRA is returned by Engine.Add for a request naming an adapter
// that is not in LoRAConfig.Adapters (or when LoRA is disabled).
var ErrUnknownLoRA = errors.New("sim: unknown LoRA adapter")

// LoRAConfig enables LoRA adapters (vLLM --enable-lora) and configures them.
// The zero value disables LoRA. Adapters are identified by name only; the
// simulator has no adapter weights, so an adapter request costs what a base
// request of the same shape costs, plus LoadLatency when its adapter must be
// loaded.
type LoRAConfig struct {
	// Adapters are the known adapter names (vLLM --lora-modules NAME=PATH, the
	// names only). A non-empty list enables LoRA. Adapter i gets the integer id
	// i+1, as vLLM numbers --lora-modules (vllm/entrypoints/openai/serving_models.py);
	// it is published as KV events' lora_id.
	Adapters []string `yaml:"adapters"`
	// MaxLoras is the number of distinct adapters that may be in the running
	// batch at once (vLLM --max-loras; default 1).
	MaxLoras int `yaml:"max_loras"`
	// MaxCPULoras is the number of adapters kept loaded (vLLM --max-cpu-loras;
	// default and minimum MaxLoras). An adapter outside this LRU set must be
	// loaded before a request using it runs, which costs LoadLatency.
	MaxCPULoras int `yaml:"max_cpu_loras"`
	// LoadLatency is the simulated time to load one non-resident adapter; it
	// is added to the step that admits the first request needing it
	// (default DefaultLoRALoadLatency; negative means 0).
	LoadLatency time.Duration `yaml:"load_latency"`
}

// Enabled reports whether LoRA is enabled (Adapters is not empty).
func (c LoRAConfig) Enabled() bool { return len(c.Adapters) > 0 }

// WithDefaults returns c with zero fields replaced by their defaults; a
// disabled config is returned unchanged.
func (c LoRAConfig) WithDefaults() LoRAConfig {
	if !c.Enabled() {
		return c
	}
	if c.MaxLoras == 0 {
		c.MaxLoras = 1
	}
	if c.MaxCPULoras < c.MaxLoras {
		c.MaxCPULoras = c.MaxLoras
	}
	if c.LoadLatency == 0 {
		c.LoadLatency = DefaultLoRALoadLatency
	}
	if c.LoadLatency < 0 {
		c.LoadLatency = 0
	}
	return c
}

// Validate reports whether c (after defaults) is usable.
func (c LoRAConfig) Validate() error {
	c = c.WithDefaults()
	if !c.Enabled() {
		if c.MaxLoras != 0 || c.MaxCPULoras != 0 {
			return errors.New("lora: max_loras / max_cpu_loras given without adapters")
		}
		return nil
	}
	var errs []error
	if c.MaxLoras < 1 {
		errs = append(errs, fmt.Errorf("lora: max_loras must be >= 1, got %d", c.MaxLoras))
	}
	seen := make(map[string]bool, len(c.Adapters))
	for _, a := range c.Adapters {
		switch {
		case a == "":
			errs = append(errs, errors.New("lora: empty adapter name"))
		case seen[a]:
			errs = append(errs, fmt.Errorf("lora: duplicate adapter %q", a))
		}
		seen[a] = true
	}
	return errors.Join(errs...)
}

// AdapterID returns the integer id of adapter name (vLLM lora_int_id: its
// 1-based position in Adapters), or 0 if it is not known.
func (c LoRAConfig) AdapterID(name string) int {
	if name == "" {
		return 0
	}
	return slices.Index(c.Adapters, name) + 1
}

// RootHash returns the parent hash of the first prompt block of a request
// served under adapter ("" for the base model) with cache-salt identity extra
// (Request.Extra; the HTTP front uses prefix.Seed(cache_salt)). For the base
// model it is extra itself; for an adapter it mixes prefix.Seed(adapter) with
// extra, so that a prefix cached under one adapter is not a hit under another
// or under the base model (vLLM puts the lora_name in every block's
// extra_keys, vllm/v1/core/kv_cache_utils.py generate_block_hash_extra_keys).
// A KV-event consumer recomputes the engine's block hashes as
// prefix.Hashes(nil, token_ids, block_size, RootHash(lora_name, prefix.Seed(cache_salt))).
func RootHash(adapter string, extra uint64) uint64 {
	if adapter == "" {
		return extra
	}
	var buf [16]byte
	binary.LittleEndian.PutUint64(buf[:8], prefix.Seed(adapter))
	binary.LittleEndian.PutUint64(buf[8:], extra)
	return xxhash.Sum64(buf[:])
}

// loraState is the engine's adapter bookkeeping: which adapters are loaded
// (an LRU set of MaxCPULoras names, most recent last) and how many running
// requests use each.
type loraState struct {
	cfg      LoRAConfig
	resident []string       // loaded adapters, least recently used first
	running  map[string]int // adapter → running requests using it
	loads    int64          // cumulative loads
}

func newLoRAState(cfg LoRAConfig) *loraState {
	return &loraState{cfg: cfg, running: make(map[string]int, cfg.MaxLoras)}
}

// admissible reports whether a request of adapter a may join the running
// batch without exceeding MaxLoras distinct adapters (vLLM
// Scheduler.schedule: "Scheduling would exceed max_loras, skip").
func (l *loraState) admissible(a string) bool {
	return a == "" || l.running[a] > 0 || len(l.running) < l.cfg.MaxLoras
}

// start marks a request of adapter a running. It reports whether the
// adapter had to be loaded; either way it becomes the most recently used.
func (l *loraState) start(a string) (loaded bool) {
	if a == "" {
		return false
	}
	l.running[a]++
	if i := slices.Index(l.resident, a); i >= 0 {
		l.resident = append(slices.Delete(l.resident, i, i+1), a)
		return false
	}
	// Evict the least recently used adapter that no running request uses.
	// Running adapters number at most MaxLoras <= MaxCPULoras, and this one is
	// not resident, so a victim exists whenever the set is full.
	if len(l.resident) >= l.cfg.MaxCPULoras {
		for i, r := range l.resident {
			if l.running[r] == 0 {
				l.resident = slices.Delete(l.resident, i, i+1)
				break
			}
		}
	}
	l.resident = append(l.resident, a)
	l.loads++
	return true
}

// stop marks a request of adapter a no longer running (finished, aborted or
// preempted). The adapter stays loaded.
func (l *loraState) stop(a string) {
	if a == "" {
		return
	}
	if l.running[a]--; l.running[a] <= 0 {
		delete(l.running, a)
	}
}

// runningAdapters returns the distinct adapters of running requests, sorted.
func (l *loraState) runningAdapters() []string {
	if len(l.running) == 0 {
		return nil
	}
	out := make([]string, 0, len(l.running))
	for a := range l.running {
		out = append(out, a)
	}
	slices.Sort(out)
	return out
}
