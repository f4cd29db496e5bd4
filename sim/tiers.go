package sim

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/infergate/infergate/kvevents/kvevent"
)

// KV tiers behind the GPU: a host-memory tier, a local-disk tier and a
// shared remote tier, as vLLM with its CPU offloading connector
// (vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py,
// vllm/v1/kv_offload: LRUOffloadingManager over CPULoadStoreSpec blocks)
// and LMCache (lmcache/v1/storage_backend: LocalCPUBackend,
// LocalDiskBackend, remote connectors) put them behind vLLM's GPU block pool.
//
// The model, step by step:
//
//   - Store (write-through). Every block the GPU pool registers — computed,
//     or loaded from a lower tier — is written to every local tier and to the
//     remote tier, as LMCache's StorageManager puts each chunk to all its
//     backends and vLLM's offloading connector offloads each block once it is
//     computed. A block already in a tier is only touched there (LRU). Each
//     tier evicts its least recently stored or used block when full,
//     independently of the others: the tiers are not inclusive.
//   - Lookup. At admission the engine takes its longest GPU prefix hit
//     (findCached), then continues block by block in the lower tiers: a block
//     comes from the host tier if held there, else the disk tier, else the
//     remote tier, and the lookup stops at the first block no tier holds
//     (LMCache's contains across its backends; vLLM's connector
//     get_num_new_matched_tokens counts hits from the first block the GPU
//     missed). As on the GPU, at most prompt−1 tokens are hits.
//   - Load (asynchronous). A request with a lower-tier hit gets its GPU blocks
//     (those of the hit and of the loaded part) and waits in the waiting
//     queue, not running and using no token budget, while its blocks are
//     copied in — vLLM's WAITING_FOR_REMOTE_KVS state (load_kv_async). Each
//     tier has one link per engine (host: the GPUs' PCIe links, TP in
//     parallel; disk: the node's NVMe drives; remote: its NICs) on which
//     transfers queue first come, first served:
//     done = max(now, link free) + latency + bytes / bandwidth.
//     A request's load ends when its slowest tier's transfer ends; the loaded
//     blocks are then registered in the GPU prefix cache (vLLM
//     _update_waiting_for_remote_kv → cache_blocks: BlockStored GPU) and the
//     request is scheduled, FCFS, with the loaded tokens computed.
//   - How loading competes with compute. Copies run on DMA copy engines, not
//     on the SMs, so they do not lengthen steps (the HBM traffic they add,
//     ≤ 200 GB/s against 4 × 3.35 TB/s, is ignored); they compete with each
//     other for their link, and with every other request for GPU blocks,
//     which a loading request holds from admission. Stores are free: they
//     run in the opposite direction of full-duplex links, overlapped with
//     compute (a simplification: a disk's reads and writes share one drive).
//
// Bandwidths, latencies and tier sizes come from the GPUProfile (the
// node's hardware, each figure with its source in sim/profiles/*.yaml);
// TiersConfig sizes the tiers an engine uses.

// Tier identifies where a prompt block was found at admission.
type Tier uint8

// Tiers, fastest first. TierGPU hits cost nothing; the others are loaded.
const (
	TierGPU Tier = iota
	TierHost
	TierDisk
	TierRemote
	// NumTiers is the number of tiers.
	NumTiers = 4
)

// String returns "gpu", "host", "disk" or "remote".
func (t Tier) String() string {
	switch t {
	case TierGPU:
		return "gpu"
	case TierHost:
		return "host"
	case TierDisk:
		return "disk"
	case TierRemote:
		return "remote"
	}
	return "tier(" + strconv.Itoa(int(t)) + ")"
}

// Medium is the medium field of the KV events of blocks in tier t.
func (t Tier) Medium() string {
	switch t {
	case TierHost:
		return kvevent.MediumCPU
	case TierDisk:
		return kvevent.MediumDisk
	case TierRemote:
		return kvevent.MediumRemote
	}
	return kvevent.MediumGPU
}

// TierSize is a tier's capacity: bytes, or a multiple of the engine's GPU KV
// cache. In YAML and flags it is "0" (off), a multiple such as "4x" or
// "0.25x", or a byte size such as "512GiB", "1.5TB" or "3e11".
type TierSize struct {
	// Bytes is the capacity in bytes (used when Multiple is 0).
	Bytes float64
	// Multiple is the capacity as a multiple of the GPU KV cache.
	Multiple float64
}

// IsZero reports whether the tier is off.
func (s TierSize) IsZero() bool { return s.Bytes == 0 && s.Multiple == 0 }

// String formats s as ParseTierSize reads it.
func (s TierSize) String() string {
	if s.Multiple != 0 {
		return strconv.FormatFloat(s.Multiple, 'g', -1, 64) + "x"
	}
	if s.Bytes == 0 {
		return "0"
	}
	for _, u := range []struct {
		name string
		v    float64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}} {
		if q := s.Bytes / u.v; q >= 1 && q == math.Trunc(q*1000)/1000 {
			return strconv.FormatFloat(q, 'g', -1, 64) + u.name
		}
	}
	return strconv.FormatFloat(s.Bytes, 'g', -1, 64)
}

// byteUnits are the suffixes ParseTierSize accepts, binary and decimal.
var byteUnits = []struct {
	suffix string
	v      float64
}{
	{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
	{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"B", 1},
}

// ParseTierSize reads a TierSize: "0", "4x" (a multiple of the GPU KV
// cache), or bytes with an optional unit (KiB…TiB, KB…TB, B).
func ParseTierSize(s string) (TierSize, error) {
	s = strings.TrimSpace(s)
	bad := func() (TierSize, error) {
		return TierSize{}, fmt.Errorf("tier size %q: want 0, a multiple of the GPU KV cache such as 4x, or bytes such as 512GiB", s)
	}
	if m, ok := strings.CutSuffix(s, "x"); ok {
		v, err := strconv.ParseFloat(m, 64)
		if err != nil || !(v >= 0) || math.IsInf(v, 0) {
			return bad()
		}
		return TierSize{Multiple: v}, nil
	}
	mul := 1.0
	for _, u := range byteUnits {
		if n, ok := strings.CutSuffix(s, u.suffix); ok {
			s, mul = strings.TrimSpace(n), u.v
			break
		}
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || !(v >= 0) || math.IsInf(v, 0) {
		return bad()
	}
	return TierSize{Bytes: v * mul}, nil
}

// UnmarshalText implements encoding.TextUnmarshaler (YAML scalars, flags).
func (s *TierSize) UnmarshalText(b []byte) error {
	v, err := ParseTierSize(string(b))
	if err != nil {
		return err
	}
	*s = v
	return nil
}

// MarshalText implements encoding.TextMarshaler.
func (s TierSize) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// Set implements pflag.Value.
func (s *TierSize) Set(v string) error { return s.UnmarshalText([]byte(v)) }

// Type implements pflag.Value.
func (s *TierSize) Type() string { return "size" }

// TiersConfig sizes the KV tiers behind an engine's GPU (YAML kv_tiers).
// Every tier is off by default; bandwidths and latencies are the
// GPUProfile's.
type TiersConfig struct {
	// Host is the host-memory tier (vLLM --kv-offloading-size with
	// --kv-offloading-backend native; LMCache max_local_cpu_size).
	Host TierSize `yaml:"host"`
	// Disk is the local-disk tier (LMCache local_disk, max_local_disk_size).
	Disk TierSize `yaml:"disk"`
	// Remote is the shared remote tier the engine writes through to and
	// loads from (LMCache remote_url; infergate kvstore). Its capacity is
	// the store's: RemoteTier, set by whoever builds the fleet. nil: off.
	Remote RemoteTier `yaml:"-"`
}

// Enabled reports whether any tier is on.
func (c TiersConfig) Enabled() bool {
	return !c.Host.IsZero() || !c.Disk.IsZero() || c.Remote != nil
}

// RemoteTier is the shared remote KV store as an engine sees it: a set of
// blocks by their engine hash (chained from RootHash, so the adapter and
// cache salt are part of it) that engines write through to and look up.
// A fleet of engines shares one. The simulator's engines store metadata
// only; what a block weighs is the engine's concern (its bandwidth). Not
// called concurrently by one engine; implementations shared by engines on
// several goroutines synchronise themselves.
type RemoteTier interface {
	// Holds reports whether the block with hash h is stored.
	Holds(h uint64) bool
	// Store writes blocks through: hashes are chained, the first from
	// parent when hasParent; tokens holds blockSize tokens per block.
	// Blocks already stored are touched.
	Store(hashes []uint64, parent uint64, hasParent bool, tokens []uint32, blockSize int, lora string)
}

// tierCache is one local tier's set of blocks, by hash, in LRU order,
// bounded to capacity blocks. It records BlockStored/BlockRemoved events of
// its medium when ev is set.
type tierCache struct {
	hashLRU
	link  // loads from it into the GPU
	tier  Tier
	added []uint64 // scratch: the hashes one store added
	ev    *kvEventLog
}

func newTierCache(t Tier, capacity int, bw float64, latency time.Duration) *tierCache {
	return &tierCache{hashLRU: newHashLRU(capacity), tier: t, link: link{bw: bw, latency: latency}}
}

// link is one transfer path into an engine's GPUs (a tier's, or the P/D
// interconnect's) on which transfers queue first come, first served:
// done = max(now, free) + latency + bytes / bw.
type link struct {
	bw      float64       // bytes/s
	latency time.Duration // fixed cost of one transfer
	free    time.Duration // when it finishes the transfers queued on it
}

// send queues a transfer of bytes at now and returns when it completes.
func (l *link) send(now time.Duration, bytes float64) time.Duration {
	start := max(now, l.free)
	l.free = start + l.latency + time.Duration(bytes/l.bw*float64(time.Second))
	return l.free
}

// store adds the blocks of hashes not yet held (touching the others),
// evicting least recently used blocks beyond capacity, and records one
// BlockStored for the new ones — with no token ids and no parent, as vLLM's
// offloading connector publishes them: subscribers resolve the hashes
// through the GPU events that named their tokens.
func (c *tierCache) store(hashes []uint64, blockSize int, lora string, loraID int) {
	c.added = c.added[:0]
	for _, h := range hashes {
		if c.touch(h) {
			continue
		}
		for c.full() {
			c.evictLRU() // its BlockRemoved precedes the BlockStored below
		}
		c.insert(h)
		c.added = append(c.added, h)
	}
	if c.ev != nil && len(c.added) > 0 {
		// The stored hashes go to the arena after the removals' (which
		// share it), so that the event's slice holds them alone.
		h0 := len(c.ev.hashes)
		c.ev.hashes = append(c.ev.hashes, c.added...)
		c.ev.events = append(c.ev.events, kvevent.Event{
			Type:        kvevent.BlockStored,
			BlockHashes: c.ev.hashes[h0:len(c.ev.hashes):len(c.ev.hashes)],
			BlockSize:   blockSize,
			LoRAName:    lora,
			LoRAID:      loraID,
			Medium:      c.tier.Medium(),
		})
	}
}

func (c *tierCache) evictLRU() {
	h := c.evict()
	if c.ev != nil {
		c.ev.removedIn(h, c.tier.Medium())
	}
}

// transfer queues a load of n blocks of blockBytes each on the tier's link
// at now and returns when it completes.
func (c *tierCache) transfer(now time.Duration, n int, blockBytes float64) time.Duration {
	return c.send(now, float64(n)*blockBytes)
}

// tiers is an engine's lower tiers: local caches (nil when off) and the
// remote link.
type tiers struct {
	local      [NumTiers]*tierCache // TierHost, TierDisk; nil when off
	remote     RemoteTier
	remoteLink *tierCache // link timing of the remote tier (holds no blocks)
	blockBytes float64
}

// ErrTierConfig wraps invalid tier settings.
var ErrTierConfig = errors.New("sim: kv_tiers")

// tierBlocks converts a TierSize into blocks of blockBytes, against a GPU
// cache of gpuBlocks.
func tierBlocks(s TierSize, gpuBlocks int, blockBytes float64) int {
	n := math.Floor(s.Bytes / blockBytes)
	if s.Multiple != 0 {
		n = math.Floor(s.Multiple * float64(gpuBlocks))
	}
	if !(n < maxTierBlocks) { // NaN, Inf, or more than anything holds
		return maxTierBlocks
	}
	return int(n)
}

// maxTierBlocks caps a tier's size in blocks (2^40: 5 EiB of 5 MiB blocks),
// so that sizes past any machine's read as too large, not as overflowed.
const maxTierBlocks = 1 << 40

// TierBlocks is the capacity in blocks of a tier of size s behind an engine
// of configuration c (defaults applied): s's bytes over the KV bytes of one
// block, or s's multiple of the GPU KV cache.
func (c Config) TierBlocks(s TierSize) int {
	c = c.WithDefaults()
	return tierBlocks(s, c.NumBlocks, c.BlockBytes())
}

// BlockBytes is the KV size of one block in bytes over all TP ranks
// (KVBytesPerToken × BlockSize; 5 MiB for the 70B default).
func (c Config) BlockBytes() float64 {
	c = c.WithDefaults()
	return c.Profile.KVBytesPerToken() * float64(c.BlockSize)
}

// LoadCost returns, for each tier below the GPU, the seconds one block takes
// to load into this engine's GPUs and the fixed latency of a load (zero for
// tiers the profile lacks): tiers.go's model, for routing to price.
func (c Config) LoadCost() (perBlock, latency [NumTiers]float64) {
	c = c.WithDefaults()
	bb, p := c.BlockBytes(), c.Profile
	set := func(t Tier, bw float64, lat time.Duration) {
		if bw > 0 {
			perBlock[t], latency[t] = bb/bw, lat.Seconds()
		}
	}
	set(TierHost, float64(p.TensorParallel)*p.HostBandwidth, p.HostLatency)
	set(TierDisk, p.DiskBandwidth, p.DiskLatency)
	set(TierRemote, p.NetworkBandwidth, p.NetworkLatency)
	return perBlock, latency
}

// validateTiers checks c against profile p and a GPU cache of gpuBlocks
// blocks of blockSize tokens.
func validateTiers(c TiersConfig, p GPUProfile, gpuBlocks, blockSize int) error {
	var errs []error
	bb := p.KVBytesPerToken() * float64(blockSize)
	check := func(name string, s TierSize, limit, bw float64, limitKey, bwKey string) {
		if s.IsZero() {
			return
		}
		if s.Bytes < 0 || s.Multiple < 0 {
			errs = append(errs, fmt.Errorf("%s must not be negative", name))
			return
		}
		if bw <= 0 {
			errs = append(errs, fmt.Errorf("%s needs the profile's %s", name, bwKey))
		}
		if n := tierBlocks(s, gpuBlocks, bb); n < 1 {
			errs = append(errs, fmt.Errorf("%s %s holds no %d-token block (%.4g bytes each)", name, s, blockSize, bb))
		} else if limit > 0 && float64(n)*bb > limit*1.0000001 {
			errs = append(errs, fmt.Errorf("%s %s (%.4g bytes) exceeds the profile's %s (%.4g bytes)", name, s, float64(n)*bb, limitKey, limit))
		}
	}
	check("kv_tiers.host", c.Host, p.HostKVBytes, p.HostBandwidth, "host_kv_bytes", "host_bandwidth")
	check("kv_tiers.disk", c.Disk, p.DiskKVBytes, p.DiskBandwidth, "disk_kv_bytes", "disk_bandwidth")
	if c.Remote != nil && p.NetworkBandwidth <= 0 {
		errs = append(errs, errors.New("kv_tiers remote needs the profile's network_bandwidth"))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", ErrTierConfig, err)
	}
	return nil
}

// newTiers builds an engine's tiers from a validated configuration.
func newTiers(cfg Config, ev *kvEventLog) *tiers {
	c, p := cfg.Tiers, cfg.Profile
	if !c.Enabled() {
		return nil
	}
	t := &tiers{blockBytes: p.KVBytesPerToken() * float64(cfg.BlockSize), remote: c.Remote}
	if !c.Host.IsZero() {
		t.local[TierHost] = newTierCache(TierHost, tierBlocks(c.Host, cfg.NumBlocks, t.blockBytes),
			float64(p.TensorParallel)*p.HostBandwidth, p.HostLatency)
	}
	if !c.Disk.IsZero() {
		t.local[TierDisk] = newTierCache(TierDisk, tierBlocks(c.Disk, cfg.NumBlocks, t.blockBytes),
			p.DiskBandwidth, p.DiskLatency)
	}
	if c.Remote != nil {
		t.remoteLink = newTierCache(TierRemote, 0, p.NetworkBandwidth, p.NetworkLatency)
	}
	for _, tc := range t.local {
		if tc != nil {
			tc.ev = ev
		}
	}
	return t
}

// find returns the tier holding block h below the GPU, fastest first, or
// TierGPU when none does.
func (t *tiers) find(h uint64) Tier {
	for _, tc := range t.local[TierHost:TierRemote] {
		if tc != nil && tc.holds(h) {
			return tc.tier
		}
	}
	if t.remote != nil && t.remote.Holds(h) {
		return TierRemote
	}
	return TierGPU
}

// store writes blocks [from, to) of s through to every tier.
func (t *tiers) store(s *seq, from, to, blockSize int) {
	hs := s.hashes[from:to]
	for _, tc := range t.local[TierHost:TierRemote] {
		if tc != nil {
			tc.store(hs, blockSize, s.lora, s.loraID)
		}
	}
	if t.remote != nil {
		parent, has := uint64(0), from > 0
		if has {
			parent = s.hashes[from-1]
		}
		t.remote.Store(hs, parent, has, s.tokens[from*blockSize:to*blockSize], blockSize, s.lora)
	}
}

// hit marks the first n blocks of s, a GPU prefix hit, used: touched in
// every local tier holding them, and written to the remote tier again —
// touched there, or stored back where it lost them — as LMCache's connector
// saves every chunk its own lookup missed, GPU hits included (its store
// mask skips the tokens LMCache holds, not those vLLM had on the GPU). A
// remote store that kept a chain's tail but lost its head would orphan the
// tail's events in a gateway's index.
func (t *tiers) hit(s *seq, n, blockSize int) {
	hashes := s.hashes[:n]
	for _, tc := range t.local[TierHost:TierRemote] {
		if tc == nil {
			continue
		}
		for _, h := range hashes {
			tc.touch(h)
		}
	}
	if t.remote != nil && n > 0 {
		t.remote.Store(hashes, 0, false, s.tokens[:n*blockSize], blockSize, s.lora)
	}
}

// load queues the transfers of n[tier] blocks from each lower tier at now
// and returns when the last completes.
func (t *tiers) load(now time.Duration, n [NumTiers]int) time.Duration {
	done := now
	for tier := TierHost; tier < NumTiers; tier++ {
		if n[tier] == 0 {
			continue
		}
		link := t.local[tier]
		if tier == TierRemote {
			link = t.remoteLink
		}
		done = max(done, link.transfer(now, n[tier], t.blockBytes))
	}
	return done
}

// clear drops every local tier's blocks (the remote tier is shared and
// not the engine's to reset).
func (t *tiers) clear() {
	for _, tc := range t.local {
		if tc != nil {
			tc.clear()
		}
	}
}

// TierHolds reports whether the engine's local tier t (TierHost or
// TierDisk) holds the block with hash h: for tests comparing a gateway's
// index with the engine.
func (e *Engine) TierHolds(t Tier, h uint64) bool {
	if e.tiers == nil || t < TierHost || t > TierDisk || e.tiers.local[t] == nil {
		return false
	}
	return e.tiers.local[t].holds(h)
}
