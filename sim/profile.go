package sim

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// Profile describes a model served on a group of GPUs: the architecture numbers
// that size the KV cache and the work of a step, and the hardware numbers that
// turn that work into time.
//
// The latency model is a roofline (Williams et al. 2009) applied per engine step,
// as in "LLM Inference Unveiled: Survey and Roofline Model Insights" (Yuan et al.
// 2024, arXiv:2402.16363) and kipply's "Transformer Inference Arithmetic"
// (kipp.ly/transformer-inference-arithmetic). See StepTime for the formula.
//
// All sizes are in bytes, all rates per second, per GPU unless stated.
type Profile struct {
	// Name is the key of the profile in Profiles(), e.g. "llama-3.1-70b-4xh100".
	Name string `yaml:"name"`
	// Model is the Hugging Face id of the model, used as the default served name.
	Model string `yaml:"model"`

	// Layers is the number of transformer layers (num_hidden_layers).
	Layers int `yaml:"layers"`
	// HiddenSize is the model dimension (hidden_size).
	HiddenSize int `yaml:"hidden_size"`
	// NumHeads is the number of attention (query) heads.
	NumHeads int `yaml:"num_attention_heads"`
	// NumKVHeads is the number of key/value heads (grouped-query attention).
	NumKVHeads int `yaml:"num_key_value_heads"`
	// HeadDim is the dimension of one attention head.
	HeadDim int `yaml:"head_dim"`
	// IntermediateSize is the MLP inner dimension (informational: Params is authoritative).
	IntermediateSize int `yaml:"intermediate_size"`
	// VocabSize is the vocabulary size (informational).
	VocabSize int `yaml:"vocab_size"`
	// Params is the total parameter count (embedding and LM head included).
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
}

// Gibibyte is 2^30 bytes. GPU memory sizes such as "80GB" are binary (H100 80GB = 80 GiB).
const Gibibyte = 1 << 30

// Hardware constants of an NVIDIA H100 SXM5 80GB, from the NVIDIA H100 Tensor
// Core GPU datasheet: 989 TFLOP/s dense BF16 (1979 with sparsity), 3.35 TB/s
// HBM3, 80 GB.
const (
	H100FLOPS     = 989e12
	H100Bandwidth = 3.35e12
	H100Memory    = 80 * Gibibyte
)

// DefaultProfile is Llama-3.1-70B(-Instruct) in bf16 on 4×H100-80GB SXM with
// tensor parallelism 4. Architecture from the model's config.json.
//
// The efficiency constants (PrefillMFU 0.30, DecodeBandwidthEfficiency 0.65,
// StepOverhead 3 ms) are chosen so that an 8k-token prompt prefills in about
// 1.05 s and a decode step at batch 16 with 8k context takes about 24 ms, in
// line with published vLLM numbers for this setup. They are first estimates,
// to be calibrated against measured engines in a later issue.
func DefaultProfile() Profile {
	return Profile{
		Name:                      "llama-3.1-70b-4xh100",
		Model:                     "meta-llama/Llama-3.1-70B-Instruct",
		Layers:                    80,
		HiddenSize:                8192,
		NumHeads:                  64,
		NumKVHeads:                8,
		HeadDim:                   128,
		IntermediateSize:          28672,
		VocabSize:                 128256,
		Params:                    70.6e9,
		BytesPerParam:             2,
		KVBytesPerElem:            2,
		MaxModelLen:               131072,
		TensorParallel:            4,
		GPUFLOPS:                  H100FLOPS,
		GPUBandwidth:              H100Bandwidth,
		GPUMemory:                 H100Memory,
		GPUMemoryUtilization:      0.9,
		ActivationReserve:         0.05,
		PrefillMFU:                0.30,
		DecodeBandwidthEfficiency: 0.65,
		StepOverhead:              3 * time.Millisecond,
	}
}

// Llama8BH100 is Llama-3.1-8B(-Instruct) in bf16 on one H100-80GB SXM. Without
// tensor-parallel communication the achieved MFU is higher than for the 70B
// TP4 profile (0.45 vs 0.30); the constants are first estimates, to be
// calibrated later.
func Llama8BH100() Profile {
	return Profile{
		Name:                      "llama-3.1-8b-h100",
		Model:                     "meta-llama/Llama-3.1-8B-Instruct",
		Layers:                    32,
		HiddenSize:                4096,
		NumHeads:                  32,
		NumKVHeads:                8,
		HeadDim:                   128,
		IntermediateSize:          14336,
		VocabSize:                 128256,
		Params:                    8.03e9,
		BytesPerParam:             2,
		KVBytesPerElem:            2,
		MaxModelLen:               131072,
		TensorParallel:            1,
		GPUFLOPS:                  H100FLOPS,
		GPUBandwidth:              H100Bandwidth,
		GPUMemory:                 H100Memory,
		GPUMemoryUtilization:      0.9,
		ActivationReserve:         0.05,
		PrefillMFU:                0.45,
		DecodeBandwidthEfficiency: 0.70,
		StepOverhead:              2 * time.Millisecond,
	}
}

// DefaultProfileName is the key of DefaultProfile in Profiles().
const DefaultProfileName = "llama-3.1-70b-4xh100"

// Profiles returns the built-in profiles by name. The map is freshly built on
// every call, so callers may modify it.
func Profiles() map[string]Profile {
	return map[string]Profile{
		DefaultProfileName:  DefaultProfile(),
		"llama-3.1-8b-h100": Llama8BH100(),
	}
}

// Validate reports whether the profile can size a KV cache and time a step.
func (p Profile) Validate() error {
	var errs []error
	pos := func(name string, v float64) {
		if !(v > 0) || math.IsInf(v, 0) {
			errs = append(errs, fmt.Errorf("%s must be > 0, got %v", name, v))
		}
	}
	pos("layers", float64(p.Layers))
	pos("hidden_size", float64(p.HiddenSize))
	pos("num_key_value_heads", float64(p.NumKVHeads))
	pos("head_dim", float64(p.HeadDim))
	pos("params", p.Params)
	pos("bytes_per_param", p.BytesPerParam)
	pos("tensor_parallel", float64(p.TensorParallel))
	pos("gpu_flops", p.GPUFLOPS)
	pos("gpu_bandwidth", p.GPUBandwidth)
	pos("gpu_memory", p.GPUMemory)
	pos("prefill_mfu", p.PrefillMFU)
	pos("decode_bandwidth_efficiency", p.DecodeBandwidthEfficiency)
	if p.GPUMemoryUtilization <= 0 || p.GPUMemoryUtilization > 1 {
		errs = append(errs, fmt.Errorf("gpu_memory_utilization must be in (0,1], got %v", p.GPUMemoryUtilization))
	}
	if p.ActivationReserve < 0 || p.ActivationReserve >= 1 {
		errs = append(errs, fmt.Errorf("activation_reserve must be in [0,1), got %v", p.ActivationReserve))
	}
	if p.PrefillMFU > 1 || p.DecodeBandwidthEfficiency > 1 {
		errs = append(errs, errors.New("efficiency factors must be <= 1"))
	}
	if p.StepOverhead < 0 || p.MaxModelLen < 0 || p.KVBytesPerElem < 0 {
		errs = append(errs, errors.New("step_overhead, max_model_len and kv_bytes_per_elem must not be negative"))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("profile %q: %w", p.Name, err)
	}
	return nil
}

// KVBytesPerToken is the KV-cache size of one token over all layers and all
// tensor-parallel ranks: 2 (K and V) × layers × kv_heads × head_dim × element size.
// Llama-3.1-70B bf16: 2×80×8×128×2 = 327,680 B = 320 KiB.
func (p Profile) KVBytesPerToken() float64 {
	elem := p.KVBytesPerElem
	if elem == 0 {
		elem = p.BytesPerParam
	}
	return 2 * float64(p.Layers) * float64(p.NumKVHeads) * float64(p.HeadDim) * elem
}

// WeightBytes is the size of the weights over all ranks: params × bytes per param.
func (p Profile) WeightBytes() float64 { return p.Params * p.BytesPerParam }

// KVCacheBytes is the memory left for the KV cache over all ranks:
// TP × memory × utilisation − weights − activation reserve (ActivationReserve × TP × memory).
// It may be negative when the model does not fit.
func (p Profile) KVCacheBytes() float64 {
	total := float64(p.TensorParallel) * p.GPUMemory
	return total*p.GPUMemoryUtilization - p.WeightBytes() - total*p.ActivationReserve
}

// NumBlocks is the KV capacity in blocks of blockSize tokens:
// floor(KVCacheBytes / (KVBytesPerToken × blockSize)); 0 when nothing fits.
// The 70B default gives 28,773 blocks of 16 (460k tokens).
func (p Profile) NumBlocks(blockSize int) int {
	if blockSize <= 0 || p.KVBytesPerToken() <= 0 {
		return 0
	}
	n := math.Floor(p.KVCacheBytes() / (p.KVBytesPerToken() * float64(blockSize)))
	if n < 0 {
		return 0
	}
	return int(n)
}

// StepCost is the work of one engine step, summed over the sequences it runs.
// Build it with Add, one call per scheduled sequence.
type StepCost struct {
	// Tokens is Σ nᵢ, the tokens computed in the step (prefill chunks and decodes).
	Tokens int
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
	c.AttnPairs += n * (float64(context) + (n+1)/2)
	c.KVTokens += context + newTokens
}

// StepTime is the duration of one engine step (a roofline):
//
//	t = StepOverhead + max(FLOPs / (TP × GPUFLOPS × PrefillMFU),
//	                       bytes / (TP × GPUBandwidth × DecodeBandwidthEfficiency))
//	FLOPs = 2 × Params × Tokens + 4 × Layers × HiddenSize × AttnPairs
//	bytes = WeightBytes + KVBytesPerToken × KVTokens
//
// 2·N FLOPs per token for the matmuls (kipply; Kaplan et al. 2020) and 4·L·d per
// query–key pair for QKᵀ and AV; each step reads every weight once and the KV of
// every scheduled sequence (Yuan et al. 2024, §3). An empty step takes zero time.
func (p Profile) StepTime(c StepCost) time.Duration {
	if c.Tokens == 0 {
		return 0
	}
	tp := float64(p.TensorParallel)
	flops := 2*p.Params*float64(c.Tokens) + 4*float64(p.Layers)*float64(p.HiddenSize)*c.AttnPairs
	compute := flops / (tp * p.GPUFLOPS * p.PrefillMFU)
	bytes := p.WeightBytes() + p.KVBytesPerToken()*float64(c.KVTokens)
	memory := bytes / (tp * p.GPUBandwidth * p.DecodeBandwidthEfficiency)
	return p.StepOverhead + time.Duration(math.Max(compute, memory)*float64(time.Second))
}

// PrefillTime is the time of one step prefilling a single prompt of
// uncached tokens on top of cached prefix tokens, with no other work in the step.
func (p Profile) PrefillTime(uncached, cached int) time.Duration {
	var c StepCost
	c.Add(uncached, cached)
	return p.StepTime(c)
}

// DecodeTime is the time of one decode step of batch sequences, each with
// context tokens in KV.
func (p Profile) DecodeTime(batch, context int) time.Duration {
	var c StepCost
	for range batch {
		c.Add(1, context)
	}
	return p.StepTime(c)
}
