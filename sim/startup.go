package sim

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// Engine start-up and sleep: how long an engine takes from "scheduled on a
// node" to "serving", and from asleep to awake. Pure: a profile and a
// source tier in, durations per phase out, so the real-time simulated
// engine (simserver), plan's virtual fleet and the artifact cache (which
// decides the source tier: a warm cache is the page cache or local NVMe, a
// cold one the remote object store) share one model.
//
// A cold start is three phases, one after the other, as vLLM's log shows
// them (vllm/v1/worker/gpu_model_runner.py load_model "Model loading took",
// vllm/v1/engine/core.py _initialize_kv_caches "init engine (profile,
// create kv cache, warmup model) took"):
//
//	image pull  = image_bytes / image_pull_bandwidth          (0 when the image is on the node)
//	weights     = weight_bytes / min(source bandwidth, TP × host_bandwidth)
//	warm-up     = warm_up                                     (profiling run, torch.compile, CUDA graph capture)
//
// weight_bytes = params × bytes_per_param (WeightBytes, all TP shards);
// every byte crosses the source's link and then a GPU's PCIe link, the TP
// ranks each reading their shard in parallel, so the slower of the two
// bounds the read (a pipelined copy; no overlap with warm-up, which needs
// the weights).

// WeightSource is where an engine reads its weights from at start-up (and
// at a wake-up from sleep level 2).
type WeightSource string

// Weight sources, fastest last but one: a peer is another node's GPU or
// host memory over the RDMA compute fabric.
const (
	// SourceRemote is a remote object store or model hub (S3, GCS, the
	// Hugging Face hub): a cold node, no artifact cached.
	SourceRemote WeightSource = "remote"
	// SourceNVMe is the node's local NVMe drives: the artifact cached on
	// disk, not in memory.
	SourceNVMe WeightSource = "nvme"
	// SourcePageCache is the host's page cache: the files were read on
	// this node recently (another engine, a prefetch).
	SourcePageCache WeightSource = "page_cache"
	// SourcePeer is a peer node that holds the weights in memory, read
	// over the compute fabric (RDMA), as weight-transfer systems do.
	SourcePeer WeightSource = "peer"
)

// WeightSources lists every WeightSource, slowest first.
func WeightSources() []WeightSource {
	return []WeightSource{SourceRemote, SourceNVMe, SourcePageCache, SourcePeer}
}

// ParseWeightSource reads a WeightSource by its name.
func ParseWeightSource(s string) (WeightSource, error) {
	for _, w := range WeightSources() {
		if string(w) == s {
			return w, nil
		}
	}
	return "", fmt.Errorf("weight source %q: want remote, nvme, page_cache or peer", s)
}

// StartupProfile is a profile's start-up model (YAML `startup`), the node
// and deployment figures a cold start depends on. All bandwidths are
// bytes/s for the whole engine (all its TP ranks together); each figure's
// source is in the profile YAML. The zero value is "no start-up model":
// StartupPhases refuses it.
type StartupProfile struct {
	// ImageBytes is the engine's container image (compressed, as pulled).
	ImageBytes float64 `yaml:"image_bytes"`
	// ImagePullBandwidth is the image pull rate, registry download and
	// layer unpacking together (bytes/s of compressed image).
	ImagePullBandwidth float64 `yaml:"image_pull_bandwidth"`
	// RemoteBandwidth is the read rate of the weights from the remote
	// object store or hub (SourceRemote).
	RemoteBandwidth float64 `yaml:"remote_bandwidth"`
	// NVMeBandwidth is the read rate from the node's local NVMe drives
	// (SourceNVMe); zero: the profile's disk_bandwidth.
	NVMeBandwidth float64 `yaml:"nvme_bandwidth"`
	// PageCacheBandwidth is the read rate of files held in the host's
	// page cache (SourcePageCache): copying them out of memory.
	PageCacheBandwidth float64 `yaml:"page_cache_bandwidth"`
	// PeerBandwidth is the read rate from a peer node's memory over the
	// compute fabric (SourcePeer); zero: the profile's
	// kv_transfer_bandwidth (the same NICs).
	PeerBandwidth float64 `yaml:"peer_bandwidth"`
	// WarmUp is the engine's initialisation once the weights are on the
	// GPUs: the profiling run that sizes the KV cache, torch.compile and
	// CUDA graph capture.
	WarmUp time.Duration `yaml:"warm_up"`
}

// IsZero reports whether the profile has no start-up model.
func (s StartupProfile) IsZero() bool { return s == StartupProfile{} }

// validate checks a start-up model that is set (every key at fault named).
func (s StartupProfile) validate() []error {
	if s.IsZero() {
		return nil
	}
	var errs []error
	for _, f := range []struct {
		key string
		v   float64
	}{{"startup.image_bytes", s.ImageBytes}, {"startup.image_pull_bandwidth", s.ImagePullBandwidth},
		{"startup.remote_bandwidth", s.RemoteBandwidth}, {"startup.nvme_bandwidth", s.NVMeBandwidth},
		{"startup.page_cache_bandwidth", s.PageCacheBandwidth}, {"startup.peer_bandwidth", s.PeerBandwidth},
		{"startup.warm_up", float64(s.WarmUp)}} {
		if f.v < 0 || math.IsInf(f.v, 0) || math.IsNaN(f.v) {
			errs = append(errs, fmt.Errorf("%s must be >= 0 and finite, got %v", f.key, f.v))
		}
	}
	if s.ImageBytes > 0 && s.ImagePullBandwidth <= 0 {
		errs = append(errs, errors.New("startup.image_pull_bandwidth must be > 0 when startup.image_bytes is set"))
	}
	if s.RemoteBandwidth <= 0 || s.PageCacheBandwidth <= 0 {
		errs = append(errs, errors.New("startup.remote_bandwidth and startup.page_cache_bandwidth must be > 0"))
	}
	return errs
}

// StartupInput is what varies between two starts of the same profile.
type StartupInput struct {
	// Source is where the weights are read from.
	Source WeightSource
	// ImageCached: the container image is already on the node (no pull).
	ImageCached bool
	// Placement, when set and not empty, is where the node's artifact
	// cache found the weights (PlacementOf, startupplan.go): each source
	// serves its share of the bytes, and Source is ignored
	// (StartupPhases.Source is Placement.Source()).
	Placement *WeightsPlacement
}

// StartupPhases is a cold start's duration per phase (modelled hardware
// time, not wall time).
type StartupPhases struct {
	ImagePull   time.Duration
	WeightsLoad time.Duration
	WarmUp      time.Duration
	// Source and ReadBandwidth (bytes/s, the bottleneck of the read) say
	// how WeightsLoad was reached.
	Source        WeightSource
	ReadBandwidth float64
}

// Total is the whole cold start: the engine is unready for that long.
func (p StartupPhases) Total() time.Duration { return p.ImagePull + p.WeightsLoad + p.WarmUp }

// StartupPhase names a phase, as logs and metrics label them.
type StartupPhase string

// The phases, in order.
const (
	PhaseImagePull   StartupPhase = "image_pull"
	PhaseWeightsLoad StartupPhase = "weights_load"
	PhaseWarmUp      StartupPhase = "warm_up"
)

// Phases returns the phases in order with their durations.
func (p StartupPhases) Phases() [3]struct {
	Phase    StartupPhase
	Duration time.Duration
} {
	return [3]struct {
		Phase    StartupPhase
		Duration time.Duration
	}{{PhaseImagePull, p.ImagePull}, {PhaseWeightsLoad, p.WeightsLoad}, {PhaseWarmUp, p.WarmUp}}
}

// ErrNoStartupModel is returned for a profile without a `startup` section.
var ErrNoStartupModel = errors.New("sim: the profile has no start-up model (YAML startup)")

// sourceBandwidth is the read rate of the weights from src, bytes/s.
func (p GPUProfile) sourceBandwidth(src WeightSource) (float64, error) {
	s := p.Startup
	switch src {
	case SourceRemote:
		return s.RemoteBandwidth, nil
	case SourceNVMe:
		if s.NVMeBandwidth > 0 {
			return s.NVMeBandwidth, nil
		}
		if p.DiskBandwidth > 0 {
			return p.DiskBandwidth, nil
		}
		return 0, fmt.Errorf("sim: profile %q knows no NVMe bandwidth (startup.nvme_bandwidth or disk_bandwidth)", p.Name)
	case SourcePageCache:
		return s.PageCacheBandwidth, nil
	case SourcePeer:
		if s.PeerBandwidth > 0 {
			return s.PeerBandwidth, nil
		}
		if p.KVTransferBandwidth > 0 {
			return p.KVTransferBandwidth, nil
		}
		return 0, fmt.Errorf("sim: profile %q knows no peer bandwidth (startup.peer_bandwidth or kv_transfer_bandwidth)", p.Name)
	}
	return 0, fmt.Errorf("sim: unknown weight source %q", src)
}

// readTime is the time to move the weights from a source of bandwidth bw
// (bytes/s) onto the GPUs: the slower of the source and the GPUs' PCIe
// links (TP × host_bandwidth) bounds it.
func (p GPUProfile) readTime(bw float64) (time.Duration, float64) {
	if p.HostBandwidth > 0 {
		bw = math.Min(bw, float64(p.TensorParallel)*p.HostBandwidth)
	}
	return time.Duration(p.WeightBytes() / bw * float64(time.Second)), bw
}

// StartupPhases is the pure start-up model: the duration of each phase of
// a cold start of an engine of this profile reading its weights from
// in.Source, or from the sources in.Placement splits them between (see the
// formulas at the top of startup.go; startupplan.go). The 70B default
// (141 GB of weights) from the page cache, image on the node: 3.5 s of
// weights and 60 s of warm-up; from the remote store with the image to
// pull: 50 s + 28 s + 60 s.
func (p GPUProfile) StartupPhases(in StartupInput) (StartupPhases, error) {
	if p.Startup.IsZero() {
		return StartupPhases{}, ErrNoStartupModel
	}
	out := StartupPhases{Source: in.Source, WarmUp: p.Startup.WarmUp}
	if in.Placement != nil && in.Placement.Total() > 0 {
		var err error
		out.Source = in.Placement.Source()
		if out.WeightsLoad, out.ReadBandwidth, err = p.placedReadTime(*in.Placement); err != nil {
			return StartupPhases{}, err
		}
	} else {
		bw, err := p.sourceBandwidth(in.Source)
		if err != nil {
			return StartupPhases{}, err
		}
		out.WeightsLoad, out.ReadBandwidth = p.readTime(bw)
	}
	if !in.ImageCached && p.Startup.ImageBytes > 0 {
		out.ImagePull = time.Duration(p.Startup.ImageBytes / p.Startup.ImagePullBandwidth * float64(time.Second))
	}
	return out, nil
}

// SleepLevel is vLLM's sleep level (POST /sleep?level=N; docs/features/
// sleep_mode.md): 1 offloads the weights to host memory and discards the
// KV cache, 2 discards both.
type SleepLevel int

// Sleep levels; Awake is not sleeping.
const (
	Awake       SleepLevel = 0
	SleepWeight SleepLevel = 1 // weights offloaded to host memory, KV discarded
	SleepAll    SleepLevel = 2 // weights and KV discarded
)

// WakeTime is the time a wake-up from level takes (POST /wake_up): level 1
// copies the weights back from host memory over the GPUs' PCIe links
// (weight_bytes / (TP × host_bandwidth)); level 2 reads them again from
// src, as a cold start's weights phase (vLLM's reload_weights after a
// level-2 wake), without image pull or warm-up (the process, its compiled
// graphs and CUDA graphs stay). Re-mapping the KV cache's memory costs
// nothing here. 70B default: 0.7 s from level 1, 3.5 s from level 2 with
// the page cache as source, against a 64 s cold start from the same
// source (the vLLM team reports wake-ups 18–200× faster than a reload).
func (p GPUProfile) WakeTime(level SleepLevel, src WeightSource) (time.Duration, error) {
	switch level {
	case Awake:
		return 0, nil
	case SleepWeight:
		if p.HostBandwidth <= 0 {
			return 0, fmt.Errorf("sim: profile %q has no host_bandwidth: cannot wake from sleep level 1", p.Name)
		}
		d, _ := p.readTime(math.Inf(1))
		return d, nil
	case SleepAll:
		if p.Startup.IsZero() {
			return 0, ErrNoStartupModel
		}
		bw, err := p.sourceBandwidth(src)
		if err != nil {
			return 0, err
		}
		d, _ := p.readTime(bw)
		return d, nil
	}
	return 0, fmt.Errorf("sim: sleep level %d: want 1 or 2", level)
}
