package sched

import (
	"fmt"
	"strings"
)

// Disaggregated prefill and decode (P/D). A P/D pool's endpoints each have
// a Role; a request is either served whole by one endpoint (aggregated) or
// split: a prefill endpoint (P) computes its prompt's KV and hands it to a
// decode endpoint (D), which decodes (DistServe, Zhong et al., OSDI'24).
//
// PD decides as llm-d's scheduler does with its two profiles and its
// prefix-based P/D decider (llm-d/llm-d-inference-scheduler,
// pkg/plugins/profile/pd_profile_handler.go and prefix_based_pd_decider.go):
//
//  1. The decode profile picks D among the decode (and both-role)
//     endpoints, by its own scorers (load, KV headroom, prefix: D prefills
//     the request itself when it is not split).
//  2. The decider splits when the prompt's part D is not expected to hold,
//     nonCached = PromptTokens − Decision.MatchedBlocks × block size, is at
//     least Threshold tokens (llm-d's nonCachedTokens parameter; Dynamo's
//     conditional disaggregation likewise prefills locally below
//     max_local_prefill_length, components/src/dynamo/vllm/handlers.py).
//  3. The prefill profile picks P among the prefill (and both-role)
//     endpoints, by prefix (where the prompt's KV already lives, tiers
//     included) and prefill load.
//  4. P busy: when P's prefill backlog (PendingPrefillTokens /
//     PrefillTokensPerSecond) exceeds MaxPrefillQueue seconds, the request
//     is prefilled on D instead (Dynamo's prefill-queue bound). With
//     PrefillBusy PDBusyCost the bound is no constant but the request's
//     own local cost: P is busy when the wait for P's backlog alone is
//     longer than D would take to prefill the request itself, its own
//     backlog first, (D.PendingPrefillTokens + nonCached) / D's rate
//     (DistServe's and Dynamo's point that a split pays only while the
//     prefill pool keeps up; the local prefill's cost to D's decodes is
//     bounded by D's token budget, sim.PDConfig.DecodeMaxNumBatchedTokens).
//
// Each profile learns only its own decisions: the decode profile's
// approximate index that D will hold the prompt (computed there, or
// received from P and cached), the prefill profile's that P holds it.

// Role is what an endpoint of a P/D pool does.
type Role uint8

const (
	// RoleBoth serves whole requests, and either leg of a split one (the
	// default; every endpoint of a pool without P/D).
	RoleBoth Role = iota
	// RolePrefill computes prompts for decode endpoints (vLLM
	// kv_role kv_producer; SGLang --disaggregation-mode prefill).
	RolePrefill
	// RoleDecode decodes prompts computed elsewhere, and whole requests the
	// decider keeps local (kv_consumer; --disaggregation-mode decode).
	RoleDecode
)

// String returns "both", "prefill" or "decode".
func (r Role) String() string {
	switch r {
	case RolePrefill:
		return "prefill"
	case RoleDecode:
		return "decode"
	}
	return "both"
}

// ParseRole parses "prefill", "decode", "both" or "" (both).
func ParseRole(s string) (Role, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "both":
		return RoleBoth, nil
	case "prefill":
		return RolePrefill, nil
	case "decode":
		return RoleDecode, nil
	}
	return RoleBoth, fmt.Errorf("unknown endpoint role %q (want prefill, decode or both)", s)
}

// serves reports whether an endpoint of role ep may take a request (or
// leg) wanting role want: a request without a role (RoleBoth) goes
// anywhere, a leg to its role or to both-role endpoints.
func serves(ep, want Role) bool { return want == RoleBoth || ep == RoleBoth || ep == want }

// DefaultPDThreshold is PDConfig.Threshold's default, in tokens: Dynamo's
// max_local_prefill_length default is 1000 and llm-d's examples use 512 to
// 2048; 2048 is where, on the default profile, a prefill chunk starts to
// take longer than a decode step several times over (8192-token steps take
// ~0.2 s against ~25 ms) and where the sweep in sched/README.md ("P/D")
// put the best value on the Mooncake and Azure traces.
const DefaultPDThreshold = 2048

// PDConfig configures P/D decisions (YAML routing.pd).
type PDConfig struct {
	// Threshold is the number of prompt tokens D is not expected to hold
	// at or above which a request is split (0: DefaultPDThreshold;
	// negative: always split).
	Threshold int `yaml:"threshold"`
	// MaxPrefillQueue is P's prefill backlog, in seconds of its prefill
	// throughput, above which a request is prefilled on D instead
	// (0: no bound).
	MaxPrefillQueue float64 `yaml:"max_prefill_queue_seconds"`
	// PrefillBusy is how the decider judges P busy: PDBusyQueue (default:
	// MaxPrefillQueue, when set) or PDBusyCost (P's backlog wait against
	// D's estimated local prefill; PD's comment, item 4).
	PrefillBusy string `yaml:"prefill_busy"`
	// Decode and Prefill name the profiles (built-in or of Config.Profiles)
	// that pick D and P; "" takes the routing policy.
	Decode  string `yaml:"decode_policy"`
	Prefill string `yaml:"prefill_policy"`
	// Local is where a request that is not split runs: PDLocalDecode
	// (default: on a decode endpoint, as llm-d and Dynamo do) or
	// PDLocalAny (on any endpoint, prefill endpoints included, so that on
	// short-prompt traffic the whole fleet serves whole requests; pd.go).
	Local string `yaml:"local"`
}

// PDConfig.PrefillBusy values.
const (
	PDBusyQueue = "queue"
	PDBusyCost  = "cost"
)

// PDConfig.Local values.
const (
	PDLocalDecode = "decode"
	PDLocalAny    = "any"
)

// WithDefaults returns c with zero fields replaced by their defaults.
func (c PDConfig) WithDefaults() PDConfig {
	if c.Threshold == 0 {
		c.Threshold = DefaultPDThreshold
	}
	if c.Local == "" {
		c.Local = PDLocalDecode
	}
	if c.PrefillBusy == "" {
		c.PrefillBusy = PDBusyQueue
	}
	return c
}

// Validate reports settings PD cannot use.
func (c PDConfig) Validate() error {
	if c.MaxPrefillQueue < 0 || c.MaxPrefillQueue != c.MaxPrefillQueue {
		return fmt.Errorf("routing.pd.max_prefill_queue_seconds must be >= 0, got %g", c.MaxPrefillQueue)
	}
	if l := c.WithDefaults().Local; l != PDLocalDecode && l != PDLocalAny {
		return fmt.Errorf("routing.pd.local %q: want %q or %q", c.Local, PDLocalDecode, PDLocalAny)
	}
	if b := c.WithDefaults().PrefillBusy; b != PDBusyQueue && b != PDBusyCost {
		return fmt.Errorf("routing.pd.prefill_busy %q: want %q or %q", c.PrefillBusy, PDBusyQueue, PDBusyCost)
	}
	return nil
}

// PDDecision is PD's pick for one request.
type PDDecision struct {
	// Decode is D's decision (Endpoint −1: no decode endpoint is ready).
	Decode Decision
	// Prefill is P's when Split, else Endpoint −1.
	Prefill Decision
	// Split is true when the request runs on P then D; false when D serves
	// it whole.
	Split bool
	// Reason says why a request was not split (a PDReason* constant), ""
	// when it was.
	Reason string
}

// Why a request was served whole (PDDecision.Reason; metric label values).
const (
	PDReasonShort       = "below-threshold" // its part D does not hold is under Threshold (short, or cached on D)
	PDReasonNoPrefill   = "no-prefill"      // no prefill endpoint is ready
	PDReasonPrefillBusy = "prefill-busy"
	PDReasonNoDecode    = "no-decode" // no decode endpoint is ready (nothing served)
)

// PD picks decode and prefill endpoints and decides when to split. It is
// safe for concurrent use if its policies are.
type PD struct {
	cfg             PDConfig
	decode, prefill Policy
	blockSize       int
}

// NewPD builds the P/D decisions of cfg.PD for pool: the decode and
// prefill profiles (cfg.PD.Decode and .Prefill, else cfg.Policy), each its
// own Policy with its own per-endpoint state.
func NewPD(cfg Config, pool Pool) (*PD, error) {
	pc := cfg.PD.WithDefaults()
	if err := pc.Validate(); err != nil {
		return nil, err
	}
	build := func(name string) (Policy, error) {
		c := cfg
		if name != "" {
			c.Policy = name
		}
		pol, err := NewPolicy(c, pool)
		if pr, ok := pol.(*Profile); ok {
			// A split request's legs end on two engines along paths
			// (the hand-off, D's retries) that do not each end a pick:
			// its picks touch, never pin, and Finished only touches.
			pr.unpinned()
		}
		return pol, err
	}
	d, err := build(pc.Decode)
	if err != nil {
		return nil, fmt.Errorf("routing.pd decode: %w", err)
	}
	p, err := build(pc.Prefill)
	if err != nil {
		return nil, fmt.Errorf("routing.pd prefill: %w", err)
	}
	return &PD{cfg: pc, decode: d, prefill: p, blockSize: cfg.Prefix.WithDefaults().BlockSize}, nil
}

// Config returns the P/D configuration with defaults applied.
func (pd *PD) Config() PDConfig { return pd.cfg }

// Decode and Prefill are the two profiles (for Forget and SetCapacity,
// and for a retry's second pick).
func (pd *PD) Decode() Policy  { return pd.decode }
func (pd *PD) Prefill() Policy { return pd.prefill }

// NeedsHashes reports whether either profile reads Request.Hashes.
func (pd *PD) NeedsHashes() bool { return pd.decode.NeedsHashes() || pd.prefill.NeedsHashes() }

// Pick decides for req over eps (PD's comment): D, whether to split, P.
// req.Role is set for each profile's pick and restored.
func (pd *PD) Pick(req *Request, eps []Endpoint) PDDecision {
	if pd.cfg.Local == PDLocalAny {
		return pd.pickAny(req, eps)
	}
	d := pd.PickDecode(req, eps)
	out := PDDecision{Decode: d, Prefill: Decision{Endpoint: -1}}
	if d.Endpoint < 0 {
		out.Reason = PDReasonNoDecode
		return out
	}
	if !pd.Wants(req, d) {
		out.Reason = PDReasonShort
		return out
	}
	return pd.withPrefill(req, eps, out)
}

// pickAny is Pick with Local PDLocalAny: the decode profile picks among
// every endpoint; a request the decider keeps whole runs there. A split
// one takes that endpoint as P when it is a prefill endpoint (the profile
// chose it for its prefix and load) and picks D among the decode ones,
// else takes it as D and picks P.
func (pd *PD) pickAny(req *Request, eps []Endpoint) PDDecision {
	out := PDDecision{Prefill: Decision{Endpoint: -1}}
	first := pd.pickRole(pd.decode, RoleBoth, req, eps)
	out.Decode = first
	if first.Endpoint < 0 {
		out.Reason = PDReasonNoDecode
		return out
	}
	if !pd.Wants(req, first) {
		out.Reason = PDReasonShort
		if ep := &eps[first.Endpoint]; ep.Role == RolePrefill && ep.PendingPrefillTokens >= max(pd.cfg.Threshold, 1) {
			// A prefill endpoint with a long prefill queued would stall
			// this request's decode behind it: a decode endpoint serves it.
			if d := pd.PickDecode(req, eps); d.Endpoint >= 0 {
				out.Decode = d
			}
		}
		return out
	}
	if eps[first.Endpoint].Role == RolePrefill {
		d := pd.PickDecode(req, eps)
		if d.Endpoint < 0 {
			out.Reason = PDReasonNoDecode // served whole where it was picked
			return out
		}
		out.Decode, out.Prefill, out.Split = d, first, true
		return out
	}
	return pd.withPrefill(req, eps, out)
}

// withPrefill completes out, whose D is chosen, with P: split, unless no
// prefill endpoint is ready or the chosen one is busy.
func (pd *PD) withPrefill(req *Request, eps []Endpoint, out PDDecision) PDDecision {
	p := pd.PickPrefill(req, eps)
	switch {
	case p.Endpoint < 0:
		out.Reason = PDReasonNoPrefill
	case pd.busy(req, &eps[p.Endpoint], eps, out.Decode):
		out.Reason = PDReasonPrefillBusy
	default:
		out.Prefill, out.Split = p, true
	}
	return out
}

// Wants reports whether the decider splits req given D's decision d.
func (pd *PD) Wants(req *Request, d Decision) bool {
	if pd.cfg.Threshold < 0 {
		return true
	}
	nonCached := req.PromptTokens - d.MatchedBlocks*pd.blockSize
	return nonCached >= pd.cfg.Threshold
}

// busy reports whether P (ep) is too busy to take req, whose D decision
// is d: its prefill backlog exceeds MaxPrefillQueue seconds or, with
// PrefillBusy PDBusyCost, the time D would take to prefill req itself
// (localPrefillSeconds).
func (pd *PD) busy(req *Request, ep *Endpoint, eps []Endpoint, d Decision) bool {
	wait := float64(ep.PendingPrefillTokens) / prefillRate(ep)
	if pd.cfg.MaxPrefillQueue > 0 && wait > pd.cfg.MaxPrefillQueue {
		return true
	}
	if pd.cfg.PrefillBusy != PDBusyCost || d.Endpoint < 0 || d.Endpoint >= len(eps) {
		return false
	}
	return wait > pd.localPrefillSeconds(req, &eps[d.Endpoint], d)
}

// localPrefillSeconds is the time D (ep, decision d) is expected to take
// to prefill req itself: its own prefill backlog, then req's tokens it
// does not hold, at its prefill rate, in seconds.
func (pd *PD) localPrefillSeconds(req *Request, ep *Endpoint, d Decision) float64 {
	nonCached := max(0, req.PromptTokens-d.MatchedBlocks*pd.blockSize)
	return float64(ep.PendingPrefillTokens+nonCached) / prefillRate(ep)
}

// prefillRate is ep's prefill throughput in tokens/s, or
// DefaultPrefillTokensPerSecond when unknown.
func prefillRate(ep *Endpoint) float64 {
	if r := ep.PrefillTokensPerSecond; r > 0 {
		return r
	}
	return DefaultPrefillTokensPerSecond
}

// Finished implements Finisher for both profiles: endpoint i's cache is
// the one both indexes model.
func (pd *PD) Finished(i int, hashes []uint64, pinned bool) {
	for _, p := range [2]Policy{pd.decode, pd.prefill} {
		if f, ok := p.(Finisher); ok {
			f.Finished(i, hashes, pinned)
		}
	}
}

// LearnsOnFinish implements Finisher: either profile does.
func (pd *PD) LearnsOnFinish() bool {
	for _, p := range [2]Policy{pd.decode, pd.prefill} {
		if f, ok := p.(Finisher); ok && f.LearnsOnFinish() {
			return true
		}
	}
	return false
}

// Settle implements Settler for both profiles.
func (pd *PD) Settle() {
	for _, p := range [2]Policy{pd.decode, pd.prefill} {
		if s, ok := p.(Settler); ok {
			s.Settle()
		}
	}
}

// Queued implements Settler: the learns both profiles hold queued.
func (pd *PD) Queued() int {
	n := 0
	for _, p := range [2]Policy{pd.decode, pd.prefill} {
		if s, ok := p.(Settler); ok {
			n += s.Queued()
		}
	}
	return n
}

// Unsettled implements Settler.
func (pd *PD) Unsettled() bool {
	for _, p := range [2]Policy{pd.decode, pd.prefill} {
		if s, ok := p.(Settler); ok && s.Unsettled() {
			return true
		}
	}
	return false
}

// PickDecode is the decode profile's pick alone (a retry of D).
func (pd *PD) PickDecode(req *Request, eps []Endpoint) Decision {
	return pd.pickRole(pd.decode, RoleDecode, req, eps)
}

// PickPrefill is the prefill profile's pick alone (a retry of P).
func (pd *PD) PickPrefill(req *Request, eps []Endpoint) Decision {
	return pd.pickRole(pd.prefill, RolePrefill, req, eps)
}

func (pd *PD) pickRole(p Policy, role Role, req *Request, eps []Endpoint) Decision {
	was := req.Role
	req.Role = role
	d := p.Pick(req, eps)
	req.Role = was
	return d
}
