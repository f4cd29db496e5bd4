package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/pflag"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/simserver"
)

// engineFlags are the simulated-engine flags `sim` and `up` share.
type engineFlags struct {
	profile   string
	profFile  string
	model     string
	timeScale float64
	kvEvents  string
	apiKeys   []string
	store     bool
	tokenizer string
	engine    sim.Config
}

// register binds the flags; tuning adds the KV-cache and batching knobs.
// kvHelp is the --kv-events-config help text.
func (e *engineFlags) register(f *pflag.FlagSet, tuning bool, kvHelp string) {
	f.StringVar(&e.profile, "profile", sim.DefaultProfile().Name, "engine profile: "+strings.Join(profileNames(), ", "))
	f.StringVar(&e.model, "model", "", "served model name (default: the profile's model)")
	f.Float64Var(&e.timeScale, "time-scale", 1, "simulated seconds per wall-clock second")
	f.StringVar(&e.profFile, "profile-file", "", "engine profile from a YAML file (overrides --profile; see sim/profiles/)")
	f.StringVar(&e.kvEvents, "kv-events-config", "", kvHelp)
	f.StringVar(&e.tokenizer, "tokenizer", "", "the model's own Hugging Face tokenizer: a tokenizer.json, or a folder with it and tokenizer_config.json (chat template); the engines render and tokenize prompts with it as vLLM does (default: the --profile-file's tokenizer key, else cl100k_base with a canonical Llama-3 chat layout)")
	f.BoolVar(&e.store, "responses-store", os.Getenv("VLLM_ENABLE_RESPONSES_API_STORE") == "1",
		"keep Responses API responses for previous_response_id (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1, the default when that is set)")
	if tuning {
		f.IntVar(&e.engine.BlockSize, "block-size", 0, "KV block size in tokens (default 16)")
		f.IntVar(&e.engine.NumBlocks, "num-gpu-blocks", 0, "KV cache capacity in blocks (default: derived from the profile)")
		f.IntVar(&e.engine.MaxNumSeqs, "max-num-seqs", 0, "maximum running requests per step (default 256)")
		f.IntVar(&e.engine.MaxNumBatchedTokens, "max-num-batched-tokens", 0, "token budget per step (default 8192)")
	}
	c := &e.engine.LoRA
	f.StringSliceVar(&c.Adapters, "lora-modules", nil, "LoRA adapter names served besides the base model (comma-separated; enables LoRA)")
	f.IntVar(&c.MaxLoras, "max-loras", 0, "adapters that may run in one batch (default 1)")
	f.IntVar(&c.MaxCPULoras, "max-cpu-loras", 0, "adapters kept loaded (default --max-loras)")
	f.DurationVar(&c.LoadLatency, "lora-load-latency", 0, "simulated time to load a non-resident adapter (default 50ms)")
}

// serverConfig validates the flags and returns the engine server config
// (Model defaulting to the profile's model).
func (e *engineFlags) serverConfig() (simserver.ServerConfig, error) {
	if !(e.timeScale > 0) {
		return simserver.ServerConfig{}, fmt.Errorf("--time-scale %v: must be > 0", e.timeScale)
	}
	prof, err := resolveProfile(e.profile, e.profFile)
	if err != nil {
		return simserver.ServerConfig{}, err
	}
	kv, err := parseKVEvents(e.kvEvents)
	if err != nil {
		return simserver.ServerConfig{}, err
	}
	ecfg := e.engine
	ecfg.Profile = prof
	model := e.model
	if model == "" {
		model = prof.Model
	}
	tok := e.tokenizer
	if tok == "" {
		tok = prof.Tokenizer // --profile-file's tokenizer: key
	}
	return simserver.ServerConfig{Engine: ecfg, Model: model, TimeScale: e.timeScale, KVEvents: kv, APIKeys: e.apiKeys, ResponsesStore: e.store,
		Tokenizer: tok}, nil
}

// resolveProfile returns the profile from file if given, else the built-in
// profile called name.
func resolveProfile(name, file string) (sim.GPUProfile, error) {
	if file != "" {
		return sim.LoadProfile(file)
	}
	prof, ok := sim.Profiles()[name]
	if !ok {
		return sim.GPUProfile{}, fmt.Errorf("unknown profile %q (have %s)", name, strings.Join(profileNames(), ", "))
	}
	return prof, nil
}

// parseKVEvents parses a --kv-events-config JSON object (vLLM's field names);
// "" means disabled.
func parseKVEvents(s string) (kvevents.PublisherConfig, error) {
	var c kvevents.PublisherConfig
	if s == "" {
		return c, nil
	}
	d := json.NewDecoder(strings.NewReader(s))
	d.DisallowUnknownFields()
	if err := d.Decode(&c); err != nil {
		return c, fmt.Errorf("--kv-events-config: %w", err)
	}
	if d.More() {
		return c, errors.New("--kv-events-config: data after the JSON object")
	}
	// vLLM's pydantic config refuses a bad field whether or not events are
	// enabled; so does this.
	if err := c.Validate(); err != nil {
		return c, fmt.Errorf("--kv-events-config: %w", err)
	}
	return c, nil
}

func profileNames() []string { return sim.ProfileNames() }

// tierFlags size the simulated engines' KV tiers behind the GPU (sim/tiers.go).
type tierFlags struct {
	host, disk, remote sim.TierSize
}

func (t *tierFlags) register(f *pflag.FlagSet) {
	f.Var(&t.host, "kv-host", "host-memory KV tier of each engine: 0 (off), a multiple of its GPU KV cache (4x) or bytes (512GiB); bandwidth from the profile")
	f.Var(&t.disk, "kv-disk", "local-disk KV tier of each engine: 0 (off), a multiple of its GPU KV cache or bytes")
	f.Var(&t.remote, "kv-remote", "shared remote KV tier (one in-process store for the fleet's engines; infergate sim gets one of its own, kvstore's via --kv-store-url): 0 (off), a multiple of one engine's GPU KV cache or bytes")
}

// engine returns c with the host and disk tiers set.
func (t *tierFlags) engine(c sim.Config) sim.Config {
	c.Tiers.Host, c.Tiers.Disk = t.host, t.disk
	return c
}

// gatewayTokenizers is the gateway's tokenizers: configuration for a fleet
// of simulated engines that tokenize with path: every model they serve
// (the base model and its LoRA adapters) routes on the engines' own token
// ids; nil for the engines' default (cl100k, the gateway's fallback too).
func gatewayTokenizers(path string, models ...string) map[string]string {
	if path == "" {
		return nil
	}
	m := make(map[string]string, len(models))
	for _, model := range models {
		m[model] = path
	}
	return m
}
