package disagg

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/infergate/infergate/openai"
)

// BootstrapQueryPath is the path of a Mooncake P's bootstrap server that
// lists its engines: {"<dp_rank>": {"engine_id": …}, …}.
const BootstrapQueryPath = "/query"

// ParseBootstrap returns the engine id of data-parallel rank rank in a
// Mooncake bootstrap server's /query answer (at most MaxResponseBytes).
func ParseBootstrap(resp []byte, rank int) (string, error) {
	if len(resp) > MaxResponseBytes || openai.TooDeep(resp) {
		return "", fmt.Errorf("%w: bootstrap answer too large or too deep", ErrBadParams)
	}
	var ranks map[string]struct {
		EngineID *string `json:"engine_id"`
	}
	if err := json.Unmarshal(resp, &ranks); err != nil {
		return "", fmt.Errorf("%w: bootstrap answer: %v", ErrBadParams, err)
	}
	e, ok := ranks[strconv.Itoa(rank)]
	if !ok || e.EngineID == nil || *e.EngineID == "" {
		return "", fmt.Errorf("%w: bootstrap answer has no engine_id for rank %d", ErrBadParams, rank)
	}
	return *e.EngineID, nil
}

// NewTransferID returns a fresh Mooncake transfer id, "xfer-<uuid>" (a
// random version-4 UUID, as llm-d's sidecar makes it).
func NewTransferID() string {
	var u [16]byte
	_, _ = rand.Read(u[:])
	u[6] = u[6]&0x0f | 0x40
	u[8] = u[8]&0x3f | 0x80
	h := hex.EncodeToString(u[:])
	return "xfer-" + h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// MooncakePrefillBody appends to dst the body of the Mooncake prefill leg:
// kv_transfer_params {do_remote_prefill: false, do_remote_decode: true,
// transfer_id}, and one token without a stream as for NIXL.
func MooncakePrefillBody(dst, body []byte, transferID string) ([]byte, error) {
	if err := checkObject(body); err != nil {
		return nil, fmt.Errorf("mooncake prefill body: %w", err)
	}
	params, _ := json.Marshal(struct {
		DoRemotePrefill bool   `json:"do_remote_prefill"`
		DoRemoteDecode  bool   `json:"do_remote_decode"`
		TransferID      string `json:"transfer_id"`
	}{false, true, transferID})
	set, del := oneTokenLeg(body, params)
	return edit(dst, body, set, del...)
}

// MooncakeDecodeBody appends to dst the body of the Mooncake decode leg:
// the client's body with kv_transfer_params {do_remote_prefill: true,
// do_remote_decode: false, transfer_id, remote_bootstrap_addr
// ("http://<P host>:<bootstrap port>"), remote_engine_id}.
func MooncakeDecodeBody(dst, body []byte, transferID, bootstrapAddr, engineID string) ([]byte, error) {
	params, _ := json.Marshal(struct {
		DoRemotePrefill bool   `json:"do_remote_prefill"`
		DoRemoteDecode  bool   `json:"do_remote_decode"`
		TransferID      string `json:"transfer_id"`
		BootstrapAddr   string `json:"remote_bootstrap_addr"`
		EngineID        string `json:"remote_engine_id"`
	}{true, false, transferID, bootstrapAddr, engineID})
	return edit(dst, body, []field{{"kv_transfer_params", params}})
}
