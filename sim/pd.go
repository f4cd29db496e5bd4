package sim

import (
	"errors"
	"fmt"
	"time"
)

// Disaggregated prefill and decode (P/D): one engine computes a prompt's KV
// (the prefill engine, P) and another reads it over the interconnect and
// decodes (D), as vLLM's NixlConnector does
// (vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py,
// v0.11–v0.13; docs/PROTOCOLS.md §3.1). Roles are a routing matter:
// every engine here is kv_both, and what a request asks decides.
//
//   - P: a request with HoldKV (kv_transfer_params.do_remote_decode) runs
//     as usual — with max_tokens 1 from the proxy, it finishes after its
//     prefill — but its blocks are not freed when it finishes: they stay
//     allocated, counted in KV usage, for D to read (vLLM's
//     request_finished returns delay_free_blocks), until Release(id) (D
//     read them: vLLM's finished-sending notification), Abort(id), or
//     PDConfig.AbortTimeout after its finish (VLLM_NIXL_ABORT_REQUEST_TIMEOUT,
//     480 s in vllm/envs.py), whichever comes first.
//   - D: a request with RemotePrefill (do_remote_prefill with P's
//     remote_block_ids) takes its local GPU prefix hit, then gets blocks
//     for the rest of its prompt and waits, skipped, while they are read
//     from P (WAITING_FOR_REMOTE_KVS, as for a lower-tier load): the read
//     queues on the engine's interconnect link (GPUProfile.KVTransferBandwidth,
//     its RDMA NICs) first come, first served,
//     done = max(now, link free) + KVTransferLatency + bytes / bandwidth,
//     bytes = the missing blocks × BlockBytes (vLLM's get_num_new_matched_tokens:
//     the prompt's tokens beyond the local hit, the partial last block
//     included). When the read ends, its full blocks join D's prefix cache
//     (BlockStored GPU) and all but the last prompt token count as computed:
//     D recomputes one token and samples the first output token
//     (_update_waiting_for_remote_kv: num_computed_tokens −1 when it covers
//     the whole request). Its cached_tokens is then prompt − 1, as vLLM
//     reports it (the gateway rewrites it from P's, as llm-d's sidecar does).
//     StepResult.Transferred names the requests whose reads ended, for the
//     driver to release P's blocks. A D request without RemotePrefill —
//     P's blocks gone, or no P at all — is computed whole (vLLM recomputes
//     when the read fails: kv_load_failure_policy "recompute").
//
// What the model leaves out: P's side of the link (reads of one P by many
// D's share P's NICs; only D's inbound link queues), layer-wise pipelining
// of the transfer with P's prefill (vLLM's NIXL reads after P finishes),
// and the side channel's handshake, done once per P/D pair.

// PDConfig tunes an engine's side of P/D hand-offs.
type PDConfig struct {
	// AbortTimeout is how long a prefill request's blocks are held for a
	// decode engine after it finishes (default DefaultAbortTimeout).
	AbortTimeout time.Duration `yaml:"abort_timeout"`
	// DecodeMaxNumBatchedTokens is the per-step token budget
	// (Config.MaxNumBatchedTokens) of an engine started as a decode
	// engine of a P/D fleet (ForDecode); 0 keeps MaxNumBatchedTokens.
	// P/D deployments launch their decode instances with their own
	// --max-num-batched-tokens; a small one bounds the step that mixes a
	// local prefill chunk with the running decodes, and so the decodes'
	// inter-token latency, as Sarathi-Serve chooses its token budget from
	// the TBT SLO (Agrawal et al., OSDI'24, §4.3). DecodeTokenBudget
	// computes that budget from the profile.
	DecodeMaxNumBatchedTokens int `yaml:"decode_max_num_batched_tokens"`
}

// ForDecode returns c as configured for an engine started as a decode
// engine of a P/D fleet: MaxNumBatchedTokens replaced by
// PD.DecodeMaxNumBatchedTokens when that is set. Prefill engines and
// engines of an aggregated fleet use c unchanged.
func (c Config) ForDecode() Config {
	if b := c.PD.DecodeMaxNumBatchedTokens; b > 0 {
		c.MaxNumBatchedTokens = b
	}
	return c
}

// DefaultAbortTimeout is vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default
// (vllm/envs.py: 480 s).
const DefaultAbortTimeout = 480 * time.Second

// WithDefaults returns c with zero fields replaced by their defaults.
func (c PDConfig) WithDefaults() PDConfig {
	if c.AbortTimeout == 0 {
		c.AbortTimeout = DefaultAbortTimeout
	}
	return c
}

// ErrNoInterconnect is returned by Add for a RemotePrefill request on an
// engine whose profile has no kv_transfer_bandwidth.
var ErrNoInterconnect = errors.New("sim: remote prefill needs the profile's kv_transfer_bandwidth")

// heldKV is a finished prefill request's blocks, kept for D.
type heldKV struct {
	id      string
	blocks  []int32
	expires time.Duration // set at the end of the step that finished it
	done    bool          // released, aborted or expired (still queued in expiry)
}

// hold keeps the blocks of s, which finished with HoldKV, for D.
func (e *Engine) hold(s *seq) {
	if e.held == nil {
		e.held = make(map[string]*heldKV)
	}
	h := &heldKV{id: s.id, blocks: s.blocks, expires: -1}
	s.blocks = nil
	s.numCachedBl = 0
	e.held[s.id] = h
	e.heldBlocks += len(h.blocks)
	e.justHeld = append(e.justHeld, h)
	e.expiry = append(e.expiry, h) // holds start in time order, with one timeout
}

// Release frees the blocks a finished HoldKV request id holds for D (D
// read them). It reports whether id held any.
func (e *Engine) Release(id string) bool {
	h, ok := e.held[id]
	if !ok {
		return false
	}
	e.dropHeld(id, h)
	e.stats.HeldReleased++
	return true
}

func (e *Engine) dropHeld(id string, h *heldKV) {
	h.done = true
	delete(e.held, id)
	e.heldBlocks -= len(h.blocks)
	// Freed in reverse order, as freeBlocks does: the tail is evicted first.
	for i, j := 0, len(h.blocks)-1; i < j; i, j = i+1, j-1 {
		h.blocks[i], h.blocks[j] = h.blocks[j], h.blocks[i]
	}
	e.pool.release(h.blocks)
}

// ExpireHeld frees the held blocks whose abort timeout has passed by now
// (vLLM's P frees them then, whether or not D read them) and returns how
// many requests' blocks it freed. Step calls it; a driver may call it on an
// idle engine.
func (e *Engine) ExpireHeld(now time.Duration) int {
	n := 0
	for len(e.expiry) > 0 {
		h := e.expiry[0]
		if !h.done {
			if h.expires < 0 || h.expires > now {
				break
			}
			e.dropHeld(h.id, h)
			e.stats.HeldExpired++
			n++
		}
		e.expiry[0] = nil
		e.expiry = e.expiry[1:]
	}
	if len(e.expiry) == 0 {
		e.expiry = nil // let the backing array go
	}
	return n
}

// NextHeldExpiry returns the earliest abort timeout of the held blocks (ok
// false when none is held).
func (e *Engine) NextHeldExpiry() (at time.Duration, ok bool) {
	for _, h := range e.expiry {
		if !h.done {
			return h.expires, h.expires >= 0
		}
	}
	return 0, false
}

// Holds reports whether the finished request id holds blocks for D.
func (e *Engine) Holds(id string) bool { _, ok := e.held[id]; return ok }

// HeldBlockIDs returns a copy of the ids of the blocks the finished
// request id holds for D, in prompt order (what vLLM's P returns as
// kv_transfer_params.remote_block_ids), or nil when it holds none.
func (e *Engine) HeldBlockIDs(id string) []int32 {
	h, ok := e.held[id]
	if !ok {
		return nil
	}
	return append([]int32(nil), h.blocks...)
}

// startTransfer admits s, a RemotePrefill request, to read the blocks of
// its prompt beyond its local hit from P at now (the package comment's D
// side). It reports false, changing nothing, when the free queue is too
// short.
func (e *Engine) startTransfer(s *seq, hit []int32, now time.Duration) bool {
	bs := e.cfg.BlockSize
	n := (s.promptLen+bs-1)/bs - len(hit)
	if !e.takeForLoad(s, hit, n) {
		return false
	}
	s.loadDone = e.xfer.send(now, float64(n)*e.cfg.BlockBytes())
	e.stats.TransferredBlocks += int64(n)
	if s.cached < 0 {
		e.firstLookup(s, s.promptLen-1, [NumTiers]int{TierGPU: len(hit)})
		s.transferred = s.promptLen - 1 - len(hit)*bs
	}
	return true
}

// validatePD checks the P/D settings of c.
func validatePD(c Config) error {
	if c.PD.AbortTimeout < 0 {
		return fmt.Errorf("pd.abort_timeout must not be negative, got %v", c.PD.AbortTimeout)
	}
	if c.PD.DecodeMaxNumBatchedTokens < 0 {
		return fmt.Errorf("pd.decode_max_num_batched_tokens must not be negative, got %d", c.PD.DecodeMaxNumBatchedTokens)
	}
	return nil
}

// DecodeTokenBudget is the largest per-step token budget (tokens) whose
// step stays within itl on profile p when it runs decodes sequences of
// decodeContext tokens each (one new token apiece) and fills the rest of
// the budget with one prefill chunk on top of prefillContext tokens
// already computed: Sarathi-Serve's rule for the token budget (Agrawal et
// al., OSDI'24, §4.3: the largest chunk whose hybrid batch meets the TBT
// SLO), evaluated on the roofline StepTime instead of by profiling. It
// returns decodes (no room for a chunk) when even a chunk of one token
// overruns itl, and at most decodes + 1<<20. StepTime grows with the
// chunk, so a bisection over the chunk finds it in ~20 steps.
func DecodeTokenBudget(p GPUProfile, itl time.Duration, decodes, decodeContext, prefillContext int) int {
	decodes = max(decodes, 0)
	var base StepCost // decodes × Add(1, decodeContext), in closed form
	base.Tokens, base.Seqs = decodes, decodes
	base.AttnPairs = float64(decodes) * (float64(decodeContext) + 1)
	base.KVTokens = decodes * (decodeContext + 1)
	step := func(chunk int) time.Duration {
		c := base
		c.Add(chunk, prefillContext)
		return p.StepTime(c)
	}
	if step(1) > itl {
		return decodes
	}
	lo, hi := 1, 1<<20 // step(lo) ≤ itl < step(hi), unless hi is the cap
	if step(hi) <= itl {
		return decodes + hi
	}
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if step(mid) <= itl {
			lo = mid
		} else {
			hi = mid
		}
	}
	return decodes + lo
}
