package sim

import (
	"bytes"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"math"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"gopkg.in/yaml.v3"
)

// GPUProfile describes a model served on a group of GPUs: the architecture numbers
// that size the KV cache and the work of a step, the hardware numbers that turn
// that work into time, and the efficiency factors fitted to measured vLLM runs
// (sim/CALIBRATION.md).
//
// The latency model is a roofline (Williams et al. 2009) applied per engine step,
// as in "LLM Inference Unveiled: Survey and Roofline Model Insights" (Yuan et al.
// 2024, arXiv:2402.16363) and kipply's "Transformer Inference Arithmetic"
// (kipp.ly/transformer-inference-arithmetic). See StepTime for the formula.
//
// Built-in profiles are YAML files in sim/profiles, embedded at build time;
// LoadProfile reads a user's own. All sizes are in bytes, all rates per second,
// per GPU unless stated.
type GPUProfile struct {
	// Name is the key of the profile in Profiles(), e.g. "llama-3.1-70b-4xh100".
	Name string `yaml:"name"`
	// Model is the Hugging Face id of the model, used as the default served name.
	Model string `yaml:"model"`
	// GPU names the accelerator, e.g. "H100-SXM5-80GB" (informational).
	GPU string `yaml:"gpu"`

	// Layers is the number of transformer layers (num_hidden_layers).
	Layers int `yaml:"layers"`
	// HiddenSize is the model dimension (hidden_size).
	HiddenSize int `yaml:"hidden_size"`
	// NumHeads is the number of attention (query) heads (num_attention_heads).
	NumHeads int `yaml:"num_attention_heads"`
	// NumKVHeads is the number of key/value heads (grouped-query attention).
	NumKVHeads int `yaml:"num_key_value_heads"`
	// HeadDim is the dimension of one attention head. NumHeads × HeadDim is the
	// query/attention width, which need not equal HiddenSize (Qwen3-32B: 8192 vs 5120).
	HeadDim int `yaml:"head_dim"`
	// IntermediateSize is the gated MLP inner dimension (intermediate_size).
	IntermediateSize int `yaml:"intermediate_size"`
	// VocabSize is the vocabulary size (vocab_size).
	VocabSize int `yaml:"vocab_size"`
	// TieWordEmbeddings is true when the LM head shares the embedding matrix
	// (tie_word_embeddings); false stores, and counts in Params, both.
	TieWordEmbeddings bool `yaml:"tie_word_embeddings"`
	// Params is the total parameter count (embedding and LM head included), as
	// published for the model. Validate checks it against the count implied by
	// the architecture (ArchParams) to catch a mistyped dimension.
	Params float64 `yaml:"params"`
	// BytesPerParam is the weight storage size: 2 for bf16/fp16, 1 for fp8.
	BytesPerParam float64 `yaml:"bytes_per_param"`
	// KVBytesPerElem is the KV-cache element size: 2 for bf16 ("auto"), 1 for fp8.
	// Zero means BytesPerParam.
	KVBytesPerElem float64 `yaml:"kv_bytes_per_elem"`
	// MaxModelLen is the longest sequence (prompt + output) a request may have,
	// in tokens (vLLM --max-model-len). Zero means no limit beyond KV capacity.
	MaxModelLen int `yaml:"max_model_len"`

	// TensorParallel is the number of GPUs the model is sharded over (TP degree).
	TensorParallel int `yaml:"tensor_parallel"`
	// GPUFLOPS is the peak dense bf16 tensor throughput of one GPU, FLOP/s.
	GPUFLOPS float64 `yaml:"gpu_flops"`
	// GPUBandwidth is the HBM bandwidth of one GPU, bytes/s.
	GPUBandwidth float64 `yaml:"gpu_bandwidth"`
	// GPUMemory is the memory of one GPU, bytes.
	GPUMemory float64 `yaml:"gpu_memory"`
	// GPUMemoryUtilization is the fraction of GPU memory the engine may use
	// (vLLM --gpu-memory-utilization, default 0.9).
	GPUMemoryUtilization float64 `yaml:"gpu_memory_utilization"`
	// ActivationReserve is the fraction of total GPU memory kept for activations,
	// CUDA graphs and the sampler, and thus unavailable to the KV cache.
	ActivationReserve float64 `yaml:"activation_reserve"`

	// PrefillMFU is the achieved fraction of peak FLOP/s on compute-bound steps
	// (model FLOPs utilisation, including tensor-parallel communication).
	PrefillMFU float64 `yaml:"prefill_mfu"`
	// DecodeBandwidthEfficiency is the achieved fraction of HBM bandwidth on
	// memory-bound steps.
	DecodeBandwidthEfficiency float64 `yaml:"decode_bandwidth_efficiency"`
	// StepOverhead is the fixed cost of one engine step: scheduling, input
	// preparation, sampling, kernel launches and all-reduce latency.
	StepOverhead time.Duration `yaml:"step_overhead"`

	// The node's KV tiers behind the GPU (sim/tiers.go; zero: the profile
	// knows no such tier, and TiersConfig cannot turn it on).
	//
	// HostKVBytes is the host memory an engine may give a KV tier, bytes
	// (the upper bound of TiersConfig.Host).
	HostKVBytes float64 `yaml:"host_kv_bytes"`
	// HostBandwidth is one GPU's host→GPU copy bandwidth, bytes/s; the
	// engine's TP GPUs load their shards over their own links in parallel.
	HostBandwidth float64 `yaml:"host_bandwidth"`
	// HostLatency is the fixed cost of one host→GPU load.
	HostLatency time.Duration `yaml:"host_latency"`
	// DiskKVBytes is the local disk an engine may give a KV tier, bytes.
	DiskKVBytes float64 `yaml:"disk_kv_bytes"`
	// DiskBandwidth is the engine's disk→GPU load bandwidth, bytes/s (all
	// its drives together).
	DiskBandwidth float64 `yaml:"disk_bandwidth"`
	// DiskLatency is the fixed cost of one disk load.
	DiskLatency time.Duration `yaml:"disk_latency"`
	// NetworkBandwidth is the engine's remote-store→GPU load bandwidth,
	// bytes/s.
	NetworkBandwidth float64 `yaml:"network_bandwidth"`
	// NetworkLatency is the fixed cost of one remote load (lookup and
	// round trips).
	NetworkLatency time.Duration `yaml:"network_latency"`

	// KVTransferBandwidth is the bandwidth at which a decode engine reads
	// a prompt's KV from a prefill engine, bytes/s: its GPUs' RDMA NICs
	// together (NIXL reads each TP rank's shard over its own NIC; pd.go).
	// Zero: the profile knows no interconnect, and its engines cannot take
	// RemotePrefill requests.
	KVTransferBandwidth float64 `yaml:"kv_transfer_bandwidth"`
	// KVTransferLatency is the fixed cost of one read (posting it and the
	// completion notification).
	KVTransferLatency time.Duration `yaml:"kv_transfer_latency"`

	// Startup is the start-up model (startup.go): image, weight-read
	// bandwidths per source tier and warm-up. Zero: none
	// (StartupPhases returns ErrNoStartupModel).
	Startup StartupProfile `yaml:"startup"`

	// Tokenizer is the model's own Hugging Face tokenizer the simulated
	// engine tokenizes with (simserver ServerConfig.Tokenizer, which
	// overrides it): a tokenizer.json, or a folder holding one and its
	// tokenizer_config.json; a relative path is relative to the profile
	// file (LoadProfile). "" (every built-in profile: no model files are
	// shipped): cl100k_base. Informational to the engine model itself.
	Tokenizer string `yaml:"tokenizer"`
}

// Gibibyte is 2^30 bytes. GPU memory sizes such as "80GB" are binary (H100 80GB = 80 GiB).
const Gibibyte = 1 << 30

// Hardware constants of an NVIDIA H100 SXM5 80GB, from the NVIDIA H100 Tensor
// Core GPU datasheet: 989 TFLOP/s dense BF16 (1979 with sparsity), 3.35 TB/s
// HBM3, 80 GB. The same numbers appear in sim/profiles/*h100*.yaml.
const (
	H100FLOPS     = 989e12
	H100Bandwidth = 3.35e12
	H100Memory    = 80 * Gibibyte
)

// DefaultProfileName is the key of DefaultProfile in Profiles().
const DefaultProfileName = "llama-3.1-70b-4xh100"

// DefaultModel is the served model name of a simulated engine when neither
// its front's configuration (simserver.ServerConfig.Model, virtual.Config.Model)
// nor the profile's Model sets one.
const DefaultModel = "meta-llama/Llama-3.1-70B-Instruct"

//go:embed profiles/*.yaml
var profileFS embed.FS

// builtin holds the embedded profiles, parsed and validated once.
var builtin = sync.OnceValues(func() (map[string]GPUProfile, error) {
	entries, err := fs.Glob(profileFS, "profiles/*.yaml")
	if err != nil {
		return nil, err
	}
	ps := make(map[string]GPUProfile, len(entries))
	for _, name := range entries {
		data, err := profileFS.ReadFile(name)
		if err != nil {
			return nil, err
		}
		p, err := ParseProfile(data)
		if err != nil {
			return nil, fmt.Errorf("embedded %s: %w", name, err)
		}
		if want := strings.TrimSuffix(path.Base(name), ".yaml"); p.Name != want {
			return nil, fmt.Errorf("embedded %s: name %q does not match the file name", name, p.Name)
		}
		ps[p.Name] = p
	}
	if _, ok := ps[DefaultProfileName]; !ok {
		return nil, fmt.Errorf("embedded profiles: default %q missing", DefaultProfileName)
	}
	return ps, nil
})

// mustBuiltin returns the embedded profiles; they are checked by tests, so an
// error here is a build defect and panics.
func mustBuiltin() map[string]GPUProfile {
	ps, err := builtin()
	if err != nil {
		panic("sim: " + err.Error())
	}
	return ps
}

// Profiles returns the built-in profiles by name, loaded from the YAML files
// embedded from sim/profiles (each documents its sources). The map is freshly
// built on every call, so callers may modify it.
func Profiles() map[string]GPUProfile {
	return maps.Clone(mustBuiltin())
}

// ProfileNames returns the names of the built-in profiles, sorted.
func ProfileNames() []string {
	return slices.Sorted(maps.Keys(mustBuiltin()))
}

// DefaultProfile is Llama-3.1-70B(-Instruct) in bf16 on 4×H100-80GB SXM with
// tensor parallelism 4 (sim/profiles/llama-3.1-70b-4xh100.yaml). With the
// calibrated constants an 8k-token prompt prefills in about 1.0 s and a decode
// step at batch 16 with 8k context takes about 27 ms; see sim/CALIBRATION.md.
func DefaultProfile() GPUProfile { return mustBuiltin()[DefaultProfileName] }

// Llama8BH100 is Llama-3.1-8B(-Instruct) in bf16 on one H100-80GB SXM
// (sim/profiles/llama-3.1-8b-h100.yaml).
func Llama8BH100() GPUProfile { return mustBuiltin()["llama-3.1-8b-h100"] }

// ParseProfile decodes a profile from YAML (the format of sim/profiles/*.yaml)
// and validates it. Unknown keys are errors, so a misspelt field is not
// silently left zero.
func ParseProfile(data []byte) (GPUProfile, error) {
	var p GPUProfile
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&p); err != nil {
		return GPUProfile{}, fmt.Errorf("decode profile: %w", err)
	}
	if err := p.Validate(); err != nil {
		return GPUProfile{}, err
	}
	return p, nil
}

// LoadProfile reads and validates a user's profile YAML file. See
// sim/profiles/*.yaml for the format and the meaning of each key.
func LoadProfile(file string) (GPUProfile, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return GPUProfile{}, err
	}
	p, err := ParseProfile(data)
	if err != nil {
		return GPUProfile{}, fmt.Errorf("%s: %w", file, err)
	}
	if p.Tokenizer != "" && !filepath.IsAbs(p.Tokenizer) {
		p.Tokenizer = filepath.Join(filepath.Dir(file), p.Tokenizer)
	}
	return p, nil
}

// archParamsTolerance is how far Params may be from ArchParams (relative):
// published counts are rounded (70.6e9) and omit nothing else of note (norm
// weights are under 0.01%).
const archParamsTolerance = 0.02

// Validate reports whether the profile can size a KV cache and time a step.
// Every problem is listed, each naming the YAML key at fault.
func (p GPUProfile) Validate() error {
	var errs []error
	pos := func(name string, v float64) {
		if !(v > 0) || math.IsInf(v, 0) {
			errs = append(errs, fmt.Errorf("%s must be > 0, got %v", name, v))
		}
	}
	if p.Name == "" {
		errs = append(errs, errors.New("name must be set"))
	}
	pos("layers", float64(p.Layers))
	pos("hidden_size", float64(p.HiddenSize))
	pos("num_attention_heads", float64(p.NumHeads))
	pos("num_key_value_heads", float64(p.NumKVHeads))
	pos("head_dim", float64(p.HeadDim))
	pos("intermediate_size", float64(p.IntermediateSize))
	pos("vocab_size", float64(p.VocabSize))
	pos("params", p.Params)
	pos("bytes_per_param", p.BytesPerParam)
	pos("tensor_parallel", float64(p.TensorParallel))
	pos("gpu_flops", p.GPUFLOPS)
	pos("gpu_bandwidth", p.GPUBandwidth)
	pos("gpu_memory", p.GPUMemory)
	pos("prefill_mfu", p.PrefillMFU)
	pos("decode_bandwidth_efficiency", p.DecodeBandwidthEfficiency)
	if p.NumHeads > 0 && p.NumKVHeads > 0 && p.NumHeads%p.NumKVHeads != 0 {
		errs = append(errs, fmt.Errorf("num_attention_heads (%d) must be a multiple of num_key_value_heads (%d)", p.NumHeads, p.NumKVHeads))
	}
	if p.GPUMemoryUtilization <= 0 || p.GPUMemoryUtilization > 1 {
		errs = append(errs, fmt.Errorf("gpu_memory_utilization must be in (0,1], got %v", p.GPUMemoryUtilization))
	}
	if p.ActivationReserve < 0 || p.ActivationReserve >= 1 {
		errs = append(errs, fmt.Errorf("activation_reserve must be in [0,1), got %v", p.ActivationReserve))
	}
	if p.PrefillMFU > 1 {
		errs = append(errs, fmt.Errorf("prefill_mfu must be <= 1, got %v", p.PrefillMFU))
	}
	if p.DecodeBandwidthEfficiency > 1 {
		errs = append(errs, fmt.Errorf("decode_bandwidth_efficiency must be <= 1, got %v", p.DecodeBandwidthEfficiency))
	}
	if p.StepOverhead < 0 {
		errs = append(errs, fmt.Errorf("step_overhead must not be negative, got %v", p.StepOverhead))
	}
	if p.MaxModelLen < 0 {
		errs = append(errs, fmt.Errorf("max_model_len must not be negative, got %d", p.MaxModelLen))
	}
	for _, f := range []struct {
		key string
		v   float64
	}{{"host_kv_bytes", p.HostKVBytes}, {"host_bandwidth", p.HostBandwidth}, {"disk_kv_bytes", p.DiskKVBytes},
		{"disk_bandwidth", p.DiskBandwidth}, {"network_bandwidth", p.NetworkBandwidth},
		{"kv_transfer_bandwidth", p.KVTransferBandwidth}, {"kv_transfer_latency", float64(p.KVTransferLatency)},
		{"host_latency", float64(p.HostLatency)}, {"disk_latency", float64(p.DiskLatency)}, {"network_latency", float64(p.NetworkLatency)}} {
		if f.v < 0 || math.IsInf(f.v, 0) || math.IsNaN(f.v) {
			errs = append(errs, fmt.Errorf("%s must be >= 0 and finite, got %v", f.key, f.v))
		}
	}
	errs = append(errs, p.Startup.validate()...)
	if p.KVBytesPerElem < 0 {
		errs = append(errs, fmt.Errorf("kv_bytes_per_elem must not be negative, got %v", p.KVBytesPerElem))
	}
	if len(errs) == 0 {
		if a := p.ArchParams(); math.Abs(p.Params-a) > archParamsTolerance*a {
			errs = append(errs, fmt.Errorf("params %.4g disagrees with the architecture, which implies %.4g (layers × (attention + MLP) + embeddings): check the dimensions", p.Params, a))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("profile %q: %w", p.Name, err)
	}
	return nil
}

// qDim is the attention width NumHeads × HeadDim (8192 for Llama-3.1-70B and
// for Qwen3-32B, whose hidden size is 5120).
func (p GPUProfile) qDim() float64 { return float64(p.NumHeads) * float64(p.HeadDim) }

// LayerMatmulParams is the weight count of the matrix multiplications of one
// transformer layer: Q (hidden×qDim), K and V (hidden×kv_heads·head_dim each),
// O (qDim×hidden) and the gated MLP (3×hidden×intermediate). Norm weights are
// negligible and omitted. Llama-3.1-70B: 855.6M; Llama-3.1-8B: 218.1M;
// Qwen3-32B: 487.6M.
func (p GPUProfile) LayerMatmulParams() float64 {
	h := float64(p.HiddenSize)
	kv := float64(p.NumKVHeads) * float64(p.HeadDim)
	return 2*h*p.qDim() + 2*h*kv + 3*h*float64(p.IntermediateSize)
}

// EmbeddingParams is vocab_size × hidden_size, the size of the embedding table
// (and of the LM head).
func (p GPUProfile) EmbeddingParams() float64 { return float64(p.VocabSize) * float64(p.HiddenSize) }

// ArchParams is the parameter count implied by the architecture: layers ×
// LayerMatmulParams plus the embedding table, plus the LM head unless tied.
// Llama-3.1-70B: 70.55e9; Llama-3.1-8B: 8.03e9; Qwen3-32B: 32.76e9.
func (p GPUProfile) ArchParams() float64 {
	n := float64(p.Layers)*p.LayerMatmulParams() + p.EmbeddingParams()
	if !p.TieWordEmbeddings {
		n += p.EmbeddingParams()
	}
	return n
}

// KVBytesPerToken is the KV-cache size of one token over all layers and all
// tensor-parallel ranks: 2 (K and V) × layers × kv_heads × head_dim × element size.
// Llama-3.1-70B bf16: 2×80×8×128×2 = 327,680 B = 320 KiB.
func (p GPUProfile) KVBytesPerToken() float64 {
	elem := p.KVBytesPerElem
	if elem == 0 {
		elem = p.BytesPerParam
	}
	return 2 * float64(p.Layers) * float64(p.NumKVHeads) * float64(p.HeadDim) * elem
}

// WeightBytes is the size of the weights over all ranks: params × bytes per param.
// It is what the weights occupy in GPU memory.
func (p GPUProfile) WeightBytes() float64 { return p.Params * p.BytesPerParam }

// StreamedWeightBytes is the weight bytes one step reads from HBM: all weights
// except an untied embedding table, of which a step only gathers the rows of
// its tokens. Llama-3.1-70B bf16: 139.1e9 B of 141.2e9.
func (p GPUProfile) StreamedWeightBytes() float64 {
	n := p.Params
	if !p.TieWordEmbeddings {
		n -= p.EmbeddingParams()
	}
	return n * p.BytesPerParam
}

// KVCacheBytes is the memory left for the KV cache over all ranks:
// TP × memory × utilisation − weights − activation reserve (ActivationReserve × TP × memory).
// It may be negative when the model does not fit.
func (p GPUProfile) KVCacheBytes() float64 {
	total := float64(p.TensorParallel) * p.GPUMemory
	return total*p.GPUMemoryUtilization - p.WeightBytes() - total*p.ActivationReserve
}

// NumBlocks is the KV capacity in blocks of blockSize tokens:
// floor(KVCacheBytes / (KVBytesPerToken × blockSize)); 0 when nothing fits.
// The 70B default gives 28,773 blocks of 16 (460k tokens).
func (p GPUProfile) NumBlocks(blockSize int) int {
	if blockSize <= 0 || p.KVBytesPerToken() <= 0 {
		return 0
	}
	n := math.Floor(p.KVCacheBytes() / (p.KVBytesPerToken() * float64(blockSize)))
	if n < 0 {
		return 0
	}
	return int(n)
}

// NumBlocksAt is NumBlocks with gpu_memory_utilization replaced by util
// (vLLM --gpu-memory-utilization).
func (p GPUProfile) NumBlocksAt(util float64, blockSize int) int {
	p.GPUMemoryUtilization = util
	return p.NumBlocks(blockSize)
}

// StepCost is the work of one engine step, summed over the sequences it runs.
// Build it with Add, one call per scheduled sequence.
type StepCost struct {
	// Tokens is Σ nᵢ, the tokens computed in the step (prefill chunks and decodes).
	Tokens int
	// Seqs is the number of sequences in the step; each computes one row of
	// logits (vLLM evaluates the LM head only at the last position of each).
	Seqs int
	// AttnPairs is Σ nᵢ × (cᵢ + (nᵢ+1)/2): query–key pairs of causal attention, where
	// cᵢ is the number of tokens of sequence i already in the KV cache (cached
	// prefix and earlier chunks included) and the (nᵢ+1)/2 term is the mean causal
	// span inside the new chunk.
	AttnPairs float64
	// KVTokens is Σ (cᵢ + nᵢ): tokens whose K and V the step reads or writes.
	KVTokens int
}

// Add accounts one sequence computing newTokens on top of context tokens already in KV.
func (c *StepCost) Add(newTokens, context int) {
	n := float64(newTokens)
	c.Tokens += newTokens
	c.Seqs++
	c.AttnPairs += n * (float64(context) + (n+1)/2)
	c.KVTokens += context + newTokens
}

// FLOPs is the floating-point work of a step over all ranks:
//
//	FLOPs = 2 × Layers × LayerMatmulParams × Tokens      (projections and MLP)
//	      + 2 × HiddenSize × VocabSize × Seqs             (LM head, one row per sequence)
//	      + 4 × Layers × NumHeads × HeadDim × AttnPairs   (QKᵀ and AV)
//
// Two FLOPs per weight per token (a multiply and an add; Kaplan et al. 2020,
// kipply), no work for the embedding lookup, and for attention 2·qDim per
// query–key pair for each of QKᵀ and AV, with qDim = NumHeads × HeadDim, not
// HiddenSize (they differ for Qwen3).
func (p GPUProfile) FLOPs(c StepCost) float64 {
	return 2*float64(p.Layers)*p.LayerMatmulParams()*float64(c.Tokens) +
		2*p.EmbeddingParams()*float64(c.Seqs) +
		4*float64(p.Layers)*p.qDim()*c.AttnPairs
}

// BytesMoved is the HBM traffic of a step over all ranks: every streamed weight
// once, plus the K and V of every token the step attends to or writes:
//
//	bytes = StreamedWeightBytes + KVBytesPerToken × KVTokens
func (p GPUProfile) BytesMoved(c StepCost) float64 {
	return p.StreamedWeightBytes() + p.KVBytesPerToken()*float64(c.KVTokens)
}

// StepTime is the duration of one engine step, a roofline over the whole batch
// and the only latency formula of the simulator:
//
//	t = StepOverhead + max(FLOPs(c) / (TP × GPUFLOPS × PrefillMFU),
//	                       BytesMoved(c) / (TP × GPUBandwidth × DecodeBandwidthEfficiency))
//
// A prefill-heavy step is compute-bound, a decode step memory-bound; the fixed
// overhead covers scheduling, sampling, launches and all-reduce latency
// (Yuan et al. 2024, §3). The efficiency factors and the overhead are fitted to
// published vLLM measurements (sim/CALIBRATION.md). An empty step takes zero time.
func (p GPUProfile) StepTime(c StepCost) time.Duration {
	if c.Tokens == 0 {
		return 0
	}
	tp := float64(p.TensorParallel)
	compute := p.FLOPs(c) / (tp * p.GPUFLOPS * p.PrefillMFU)
	memory := p.BytesMoved(c) / (tp * p.GPUBandwidth * p.DecodeBandwidthEfficiency)
	return p.StepOverhead + time.Duration(math.Max(compute, memory)*float64(time.Second))
}

// PrefillTime is the time of one step prefilling a single prompt of
// uncached tokens on top of cached prefix tokens, with no other work in the step.
func (p GPUProfile) PrefillTime(uncached, cached int) time.Duration {
	var c StepCost
	c.Add(uncached, cached)
	return p.StepTime(c)
}

// DecodeTime is the time of one decode step of batch sequences, each with
// context tokens in KV.
func (p GPUProfile) DecodeTime(batch, context int) time.Duration {
	var c StepCost
	for range batch {
		c.Add(1, context)
	}
	return p.StepTime(c)
}
