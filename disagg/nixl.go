package disagg

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/infergate/infergate/openai"
)

// nixlPrefillParams is the kv_transfer_params of NIXL's prefill leg: a
// remote decode is asked for, the remote fields are still unknown.
var nixlPrefillParams = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

var (
	jsonFalse = []byte("false")
	jsonOne   = []byte("1")
)

// oneTokenLeg is the set and removed members of a prefill leg that
// computes the prompt and stops at one token: no stream, max_tokens 1 (and
// max_completion_tokens 1 when the client gave it), no stream_options, no
// minimum length (the toy proxy's and llm-d's sidecar's P request).
func oneTokenLeg(body []byte, params []byte) ([]field, []string) {
	set := []field{{"kv_transfer_params", params}, {"stream", jsonFalse}, {"max_tokens", jsonOne}}
	if _, ok := lookup(body, "max_completion_tokens"); ok {
		set = append(set, field{"max_completion_tokens", jsonOne})
	}
	return set, []string{"stream_options", "min_tokens", "min_completion_tokens"}
}

// NIXLPrefillBody appends to dst the body of NIXL's prefill leg for the
// client's body (a chat or completion request): kv_transfer_params
// {do_remote_decode: true, do_remote_prefill: false, remote_*: null},
// stream false, max_tokens 1 (max_completion_tokens 1 if present),
// stream_options, min_tokens and min_completion_tokens removed.
func NIXLPrefillBody(dst, body []byte) ([]byte, error) {
	if err := checkObject(body); err != nil {
		return nil, fmt.Errorf("nixl prefill body: %w", err)
	}
	set, del := oneTokenLeg(body, nixlPrefillParams)
	return edit(dst, body, set, del...)
}

// NIXLDecodeBody appends to dst the body of NIXL's decode leg: the
// client's body as sent (stream, stream_options, token limits) with
// kv_transfer_params set to params, P's, verbatim.
func NIXLDecodeBody(dst, body, params []byte) ([]byte, error) {
	return edit(dst, body, []field{{"kv_transfer_params", params}})
}

// Prefill is what a NIXL prefill leg answered: the kv_transfer_params to
// pass D verbatim, the fields the gateway reads of them (to release the
// blocks P holds), and P's prefix-cache hits.
type Prefill struct {
	// Params is P's kv_transfer_params, raw.
	Params []byte
	// EngineID, RequestID, Host and Port are its remote_engine_id,
	// remote_request_id (NIXL connector version 2; "" before), remote_host
	// and remote_port; Blocks is whether remote_block_ids is non-empty.
	EngineID, RequestID, Host string
	Port                      int
	Blocks                    bool
	// Cached is P's usage.prompt_tokens_details.cached_tokens (0 when
	// null); HasUsage whether P reported usage.
	Cached   int
	HasUsage bool
}

// Holds reports whether P holds blocks for D (remote_block_ids non-empty)
// that a release can name.
func (p *Prefill) Holds() bool { return p.Blocks && p.EngineID != "" && p.RequestID != "" }

// ErrBadParams is wrapped by ParsePrefill's errors: P's answer has no
// usable kv_transfer_params.
var ErrBadParams = errors.New("bad kv_transfer_params")

// ParsePrefill reads a NIXL prefill leg's answer (a chat or completion
// response, at most MaxResponseBytes): its kv_transfer_params, which must
// be an object with do_remote_prefill true and a remote_engine_id, and
// with remote_host and remote_port when remote_block_ids is non-empty (what
// D requires; NixlConnector's scheduler).
func ParsePrefill(resp []byte) (Prefill, error) {
	var p Prefill
	if len(resp) > MaxResponseBytes {
		return p, fmt.Errorf("%w: answer of %d bytes over %d", ErrBadParams, len(resp), MaxResponseBytes)
	}
	if err := checkObject(resp); err != nil {
		return p, fmt.Errorf("%w: %v", ErrBadParams, err)
	}
	raw, ok := lookup(resp, "kv_transfer_params")
	if !ok || isNull(raw) {
		return p, fmt.Errorf("%w: none in the prefill answer", ErrBadParams)
	}
	var kv struct {
		DoRemotePrefill *bool           `json:"do_remote_prefill"`
		EngineID        *string         `json:"remote_engine_id"`
		RequestID       *string         `json:"remote_request_id"`
		Host            *string         `json:"remote_host"`
		Port            *int            `json:"remote_port"`
		Blocks          json.RawMessage `json:"remote_block_ids"`
	}
	if err := json.Unmarshal(raw, &kv); err != nil {
		return p, fmt.Errorf("%w: %v", ErrBadParams, err)
	}
	switch {
	case kv.DoRemotePrefill == nil || !*kv.DoRemotePrefill:
		return p, fmt.Errorf("%w: do_remote_prefill is not true", ErrBadParams)
	case kv.EngineID == nil || *kv.EngineID == "":
		return p, fmt.Errorf("%w: no remote_engine_id", ErrBadParams)
	}
	p.Params, p.EngineID = raw, *kv.EngineID
	if kv.RequestID != nil {
		p.RequestID = *kv.RequestID
	}
	p.Blocks = nonEmptyArray(kv.Blocks)
	if kv.Host != nil {
		p.Host = *kv.Host
	}
	if kv.Port != nil {
		p.Port = *kv.Port
	}
	if p.Blocks && (p.Host == "" || kv.Port == nil) {
		return p, fmt.Errorf("%w: remote_block_ids without remote_host and remote_port", ErrBadParams)
	}
	p.Cached, p.HasUsage = PromptCached(resp)
	return p, nil
}

// nonEmptyArray reports whether raw is a JSON array with an element.
func nonEmptyArray(raw json.RawMessage) bool {
	var a []json.RawMessage
	return json.Unmarshal(raw, &a) == nil && len(a) > 0
}

// PromptCached returns a response's usage.prompt_tokens_details.cached_tokens
// (0 when null or absent) and whether it reports usage at all.
func PromptCached(resp []byte) (int, bool) {
	if len(resp) > MaxResponseBytes || openai.TooDeep(resp) {
		return 0, false
	}
	var r struct {
		Usage *openai.Usage `json:"usage"`
	}
	if json.Unmarshal(resp, &r) != nil || r.Usage == nil {
		return 0, false
	}
	return max(r.Usage.Cached(), 0), true
}

// ReleasePath is the simulated engine's endpoint that frees the blocks a
// prefill holds for a decode that will not come (POST, ReleaseBody; 200
// released, 404 nothing held). vLLM has none: its blocks expire after
// VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s).
const ReleasePath = "/infergate/pd/v1/release"

// ReleaseBody is the body of a release of p's blocks.
func ReleaseBody(p *Prefill) []byte {
	b, _ := json.Marshal(struct {
		EngineID  string `json:"remote_engine_id"`
		RequestID string `json:"remote_request_id"`
	}{p.EngineID, p.RequestID})
	return b
}

// ReleaseTransferBody names a Mooncake hold by its transfer_id, and
// ReleaseRoomBody an SGLang hold by its bootstrap_room, for ReleasePath.
func ReleaseTransferBody(transferID string) []byte {
	b, _ := json.Marshal(struct {
		TransferID string `json:"transfer_id"`
	}{transferID})
	return b
}

// ReleaseRoomBody: see ReleaseTransferBody.
func ReleaseRoomBody(room uint64) []byte {
	b, _ := json.Marshal(struct {
		Room uint64 `json:"bootstrap_room"`
	}{room})
	return b
}
