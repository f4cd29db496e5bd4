package simserver

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	segjson "github.com/segmentio/encoding/json"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sim"
)

// Disaggregated prefill/decode (P/D) on the HTTP front: the request
// protocols of docs/PROTOCOLS.md §3 over the engine's P/D model
// (sim/pd.go: Request.HoldKV, Request.RemotePrefill). README.md "P/D"
// describes the flows; this file parses the request fields (bounded: they
// are client input) and defines the server's configuration. The side
// channel P and D talk over is in pdchannel.go.

// Role is what a server is in a P/D deployment. Engines are kv_both (any
// of them serves either leg of vLLM's protocols, as the request's
// kv_transfer_params say); the role decides what SGLang's bootstrap fields
// mean (its --disaggregation-mode) and what the server advertises.
type Role string

// The roles.
const (
	RoleBoth    Role = "both"    // SGLang --disaggregation-mode null
	RolePrefill Role = "prefill" // computes prompts and holds their KV for decode engines
	RoleDecode  Role = "decode"  // reads prompts' KV from prefill engines and decodes
)

// ParseRole reads a role: "both" (or "", or SGLang's "null"), "prefill",
// "decode".
func ParseRole(s string) (Role, error) {
	switch s {
	case "", "both", "null":
		return RoleBoth, nil
	case "prefill":
		return RolePrefill, nil
	case "decode":
		return RoleDecode, nil
	}
	return "", fmt.Errorf("sim: P/D role must be prefill, decode or both (null), got %q", s)
}

// DefaultBootstrapPort is the bootstrap port of vLLM's MooncakeConnector
// (VLLM_MOONCAKE_BOOTSTRAP_PORT) and SGLang's --disaggregation-bootstrap-port.
const DefaultBootstrapPort = 8998

// P/D defaults.
const (
	// DefaultPDWait bounds how long a decode leg of the concurrent flows
	// (Mooncake, SGLang) waits, in wall time, for its prefill engine to hold
	// the prompt's KV before recomputing it.
	DefaultPDWait = 30 * time.Second
	// DefaultSideChannelTimeout bounds every other side-channel call (the
	// NIXL read check, the release notification), in wall time.
	DefaultSideChannelTimeout = 5 * time.Second
	// DefaultPDMaxWaiters bounds the transfer long polls a server holds
	// open at once (PDConfig.MaxWaiters).
	DefaultPDMaxWaiters = 1024
	// DefaultPDBodyTimeout bounds, in wall time, how long a side-channel
	// request's body may take to arrive (PDConfig.BodyTimeout).
	DefaultPDBodyTimeout = 5 * time.Second
)

// PDConfig configures a Server's side of P/D hand-offs (the engine's own,
// its abort timeout, is sim.Config.PD).
type PDConfig struct {
	// Role is the server's role (default RoleBoth).
	Role Role `yaml:"role"`
	// BootstrapAddr is the address of the server's bootstrap listener
	// (vLLM MooncakeConnector's bootstrap server, SGLang's bootstrap
	// server), e.g. "127.0.0.1:8998"; port 0 takes a free port
	// (Server.BootstrapAddr tells which); "" runs none. It serves GET
	// /query and the side channel (pdchannel.go).
	BootstrapAddr string `yaml:"bootstrap_addr"`
	// BootstrapOnMain serves GET /query on the main handler too (the side
	// channel always is), for deployments that give the main port as the
	// bootstrap port.
	BootstrapOnMain bool `yaml:"bootstrap_on_main"`
	// EngineID is the engine's id in kv_transfer_params (remote_engine_id)
	// and /query; default a random UUID, stable for the server's life.
	EngineID string `yaml:"engine_id"`
	// AdvertiseAddr is the host:port a prefill response names as
	// remote_host/remote_port (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST/PORT);
	// default the local address the request came in on.
	AdvertiseAddr string `yaml:"advertise_addr"`
	// Wait bounds a concurrent decode leg's wait for its prefill (default
	// DefaultPDWait).
	Wait time.Duration `yaml:"wait"`
	// SideChannelTimeout bounds the other side-channel calls (default
	// DefaultSideChannelTimeout).
	SideChannelTimeout time.Duration `yaml:"side_channel_timeout"`
	// MaxWaiters bounds the side channel's transfer long polls waiting at
	// once on this server (default DefaultPDMaxWaiters); one more is
	// answered 503 with Retry-After at once.
	MaxWaiters int `yaml:"max_waiters"`
	// BodyTimeout bounds how long the body of a side-channel POST may take
	// to arrive (default DefaultPDBodyTimeout); a slower one is answered
	// 408 and its connection closed.
	BodyTimeout time.Duration `yaml:"body_timeout"`
}

// withDefaults returns c with its defaults filled in.
func (c PDConfig) withDefaults() (PDConfig, error) {
	r, err := ParseRole(string(c.Role))
	if err != nil {
		return c, err
	}
	c.Role = r
	if c.EngineID == "" {
		c.EngineID = newUUID()
	}
	if len(c.EngineID) > maxPDString {
		return c, fmt.Errorf("sim: pd.engine_id longer than %d bytes", maxPDString)
	}
	if c.Wait == 0 {
		c.Wait = DefaultPDWait
	}
	if c.SideChannelTimeout == 0 {
		c.SideChannelTimeout = DefaultSideChannelTimeout
	}
	if c.MaxWaiters == 0 {
		c.MaxWaiters = DefaultPDMaxWaiters
	}
	if c.BodyTimeout == 0 {
		c.BodyTimeout = DefaultPDBodyTimeout
	}
	if c.Wait < 0 || c.SideChannelTimeout < 0 || c.BodyTimeout < 0 {
		return c, errors.New("sim: pd.wait, pd.side_channel_timeout and pd.body_timeout must not be negative")
	}
	if c.MaxWaiters < 0 {
		return c, fmt.Errorf("sim: pd.max_waiters must not be negative, got %d", c.MaxWaiters)
	}
	if c.AdvertiseAddr != "" {
		if _, err := splitHostPort(c.AdvertiseAddr); err != nil {
			return c, fmt.Errorf("sim: pd.advertise_addr: %w", err)
		}
	}
	return c, nil
}

// newUUID returns a random (version 4) UUID, as vLLM's engine ids are.
func newUUID() string {
	var b [16]byte
	_, _ = crand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

// Bounds on P/D fields: they are client input.
const (
	// maxPDString bounds ids, hosts and addresses.
	maxPDString = 512
	// MaxRemoteBlockIDs bounds kv_transfer_params.remote_block_ids (all
	// groups together): more blocks than any context fills.
	MaxRemoteBlockIDs = 1 << 16
	// maxBootstrapBatch bounds SGLang's per-item bootstrap arrays before
	// their length is compared with the batch (always 1 here).
	maxBootstrapBatch = 1024
)

// pdSource is where a decode leg reads its prompt's KV from.
type pdSource struct {
	flow string // "nixl", "mooncake", "sglang"
	// base is P's side channel, "http://host:port".
	base string
	// engineID is P's engine id as the request names it ("" for SGLang,
	// which names none).
	engineID string
	// NIXL: P's request id and the blocks it holds.
	requestID string
	blockIDs  []int32
	// Mooncake: the transfer id; SGLang: the room.
	transferID string
	room       string
}

// pdRequest is what a generation request's P/D fields ask for.
type pdRequest struct {
	// hold: a prefill leg (HoldKV); keys are the registry keys besides its
	// request id (a transfer id, a room).
	hold bool
	keys []string
	// params: the hold came from kv_transfer_params, so the response
	// carries P's (SGLang's prefill answers without them).
	params bool
	// oneToken: SGLang's prefill server generates one token whatever
	// max_tokens says.
	oneToken bool
	// src: a decode leg's prefill (nil: none).
	src *pdSource
	// invalid: a decode leg whose parameters do not name its prefill in
	// full (vLLM warns and recomputes); its reason for the metric.
	invalid string
}

// pdBody holds the P/D fields of a generation request, raw.
type pdBody struct {
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
	BootstrapHost    json.RawMessage `json:"bootstrap_host"`
	BootstrapPort    json.RawMessage `json:"bootstrap_port"`
	BootstrapRoom    json.RawMessage `json:"bootstrap_room"`
}

// kvParams is kv_transfer_params, raw; unknown keys are ignored.
type kvParams struct {
	DoRemoteDecode      json.RawMessage `json:"do_remote_decode"`
	DoRemotePrefill     json.RawMessage `json:"do_remote_prefill"`
	RemoteBlockIDs      json.RawMessage `json:"remote_block_ids"`
	RemoteEngineID      json.RawMessage `json:"remote_engine_id"`
	RemoteRequestID     json.RawMessage `json:"remote_request_id"`
	RemoteHost          json.RawMessage `json:"remote_host"`
	RemotePort          json.RawMessage `json:"remote_port"`
	TPSize              json.RawMessage `json:"tp_size"`
	TransferID          json.RawMessage `json:"transfer_id"`
	RemoteBootstrapAddr json.RawMessage `json:"remote_bootstrap_addr"`
}

// kvParamsOut is the kv_transfer_params of a prefill leg's response
// (PROTOCOLS.md §3.1 step 2).
type kvParamsOut struct {
	DoRemotePrefill bool    `json:"do_remote_prefill"`
	DoRemoteDecode  bool    `json:"do_remote_decode"`
	RemoteBlockIDs  []int32 `json:"remote_block_ids"`
	RemoteEngineID  string  `json:"remote_engine_id"`
	RemoteRequestID string  `json:"remote_request_id"`
	RemoteHost      string  `json:"remote_host"`
	RemotePort      int     `json:"remote_port"`
	TPSize          int     `json:"tp_size"`
}

// parsePD reads the P/D fields of a generation request body (already
// decoded as a whole, so valid JSON) for a server of role role: nil when
// it has none that apply, a 400 when one has the wrong type or is out of
// range.
func parsePD(body []byte, role Role) (*pdRequest, *openai.Error) {
	var b pdBody
	if _, err := segjson.Parse(body, &b, segjson.DontMatchCaseInsensitiveStructFields); err != nil {
		return nil, openai.Errorf("", "invalid request body: "+err.Error())
	}
	var pd pdRequest
	if !isNull(b.KVTransferParams) {
		if e := parseKVParams(b.KVTransferParams, &pd); e != nil {
			return nil, e
		}
	}
	if e := parseBootstrap(&b, role, &pd); e != nil {
		return nil, e
	}
	if !pd.hold && pd.src == nil && pd.invalid == "" {
		return nil, nil
	}
	return &pd, nil
}

func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || string(raw) == "null"
}

func pdErr(param, msg string) *openai.Error {
	return openai.NewError(http.StatusBadRequest, msg, param, openai.CodeInvalidValue)
}

// parseKVParams reads vLLM's kv_transfer_params (§3.1, and the Mooncake
// connector's, §3.2).
func parseKVParams(raw json.RawMessage, pd *pdRequest) *openai.Error {
	const p = "kv_transfer_params"
	raw = bytes.TrimSpace(raw)
	if raw[0] != '{' {
		return pdErr(p, "kv_transfer_params must be an object")
	}
	var kp kvParams
	if _, err := segjson.Parse(raw, &kp, segjson.DontMatchCaseInsensitiveStructFields); err != nil {
		return pdErr(p, "invalid kv_transfer_params: "+strings.TrimPrefix(err.Error(), "json: "))
	}
	decode, e := optBool(kp.DoRemoteDecode, p+".do_remote_decode")
	if e != nil {
		return e
	}
	prefill, e := optBool(kp.DoRemotePrefill, p+".do_remote_prefill")
	if e != nil {
		return e
	}
	blocks, e := parseBlockIDs(kp.RemoteBlockIDs, p+".remote_block_ids")
	if e != nil {
		return e
	}
	engineID, e := optString(kp.RemoteEngineID, p+".remote_engine_id")
	if e != nil {
		return e
	}
	reqID, e := optString(kp.RemoteRequestID, p+".remote_request_id")
	if e != nil {
		return e
	}
	host, e := optString(kp.RemoteHost, p+".remote_host")
	if e != nil {
		return e
	}
	port, e := optInt(kp.RemotePort, p+".remote_port", 1, 65535)
	if e != nil {
		return e
	}
	if _, e := optInt(kp.TPSize, p+".tp_size", 1, 1<<20); e != nil {
		return e
	}
	xfer, e := optString(kp.TransferID, p+".transfer_id")
	if e != nil {
		return e
	}
	bootstrap, e := optString(kp.RemoteBootstrapAddr, p+".remote_bootstrap_addr")
	if e != nil {
		return e
	}
	if bootstrap != "" {
		u, err := url.Parse(bootstrap)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil {
			return pdErr(p+".remote_bootstrap_addr", "kv_transfer_params.remote_bootstrap_addr must be an http(s)://host:port URL")
		}
	}
	if decode {
		pd.hold, pd.params = true, true
		if xfer != "" {
			pd.keys = append(pd.keys, xferKey(xfer))
		}
	}
	if !prefill {
		return nil
	}
	switch {
	case len(blocks) > 0:
		// NIXL (vLLM NixlConnector.get_num_new_matched_tokens): all four
		// fields or a warning and a recompute.
		if engineID == "" || reqID == "" || host == "" || port == 0 {
			pd.invalid = "invalid_params"
			return nil
		}
		pd.src = &pdSource{flow: "nixl", base: "http://" + net.JoinHostPort(host, strconv.Itoa(port)),
			engineID: engineID, requestID: reqID, blockIDs: blocks}
	case xfer != "" || bootstrap != "":
		// Mooncake: D is sent at once with P; it waits for P's hold.
		if xfer == "" || bootstrap == "" {
			pd.invalid = "invalid_params"
			return nil
		}
		pd.src = &pdSource{flow: "mooncake", base: strings.TrimRight(bootstrap, "/"), engineID: engineID, transferID: xfer}
	}
	// do_remote_prefill without blocks: nothing to read (vLLM computes).
	return nil
}

// parseBootstrap reads SGLang's bootstrap_host, bootstrap_port and
// bootstrap_room (§3.3): scalars, or arrays of one per batch item (the
// batch here is always one).
func parseBootstrap(b *pdBody, role Role, pd *pdRequest) *openai.Error {
	if isNull(b.BootstrapHost) && isNull(b.BootstrapPort) && isNull(b.BootstrapRoom) {
		return nil
	}
	hosts, e := bootstrapItems(b.BootstrapHost, "bootstrap_host")
	if e != nil {
		return e
	}
	ports, e := bootstrapItems(b.BootstrapPort, "bootstrap_port")
	if e != nil {
		return e
	}
	rooms, e := bootstrapItems(b.BootstrapRoom, "bootstrap_room")
	if e != nil {
		return e
	}
	n := -1
	for _, l := range [...]int{len(hosts), len(ports), len(rooms)} {
		if l == 0 {
			continue
		}
		if n >= 0 && l != n {
			return pdErr("bootstrap_room", "bootstrap_host, bootstrap_port and bootstrap_room arrays must have the same length")
		}
		n = l
	}
	if n != 1 {
		return pdErr("bootstrap_room", fmt.Sprintf("bootstrap arrays have %d items; the simulator serves one prompt per request", n))
	}
	host, port, room := "", DefaultBootstrapPort, ""
	if len(hosts) == 1 && !isNull(hosts[0]) {
		var err *openai.Error
		if host, err = optString(hosts[0], "bootstrap_host"); err != nil {
			return err
		}
	}
	if len(ports) == 1 && !isNull(ports[0]) {
		var err *openai.Error
		if port, err = optInt(ports[0], "bootstrap_port", 1, 65535); err != nil {
			return err
		}
	}
	if len(rooms) == 1 && !isNull(rooms[0]) {
		r, err := optInt(rooms[0], "bootstrap_room", 0, 1<<63-1)
		if err != nil {
			return err
		}
		room = strconv.Itoa(r)
	}
	switch role {
	case RolePrefill:
		if room == "" {
			return pdErr("bootstrap_room", "a prefill server needs bootstrap_room")
		}
		pd.hold, pd.oneToken = true, true
		pd.keys = append(pd.keys, roomKey(room))
	case RoleDecode:
		if pd.src != nil {
			return nil // kv_transfer_params named the prefill
		}
		if room == "" || host == "" {
			pd.invalid = "invalid_params"
			return nil
		}
		pd.src = &pdSource{flow: "sglang", base: "http://" + net.JoinHostPort(host, strconv.Itoa(port)), room: room}
	}
	return nil
}

// bootstrapItems returns a bootstrap field's items: none when absent, one
// for a scalar, the elements of an array (at most maxBootstrapBatch).
func bootstrapItems(raw json.RawMessage, param string) ([]json.RawMessage, *openai.Error) {
	raw = bytes.TrimSpace(raw)
	if isNull(raw) {
		return nil, nil
	}
	if raw[0] != '[' {
		return []json.RawMessage{raw}, nil
	}
	var items []json.RawMessage
	err := eachElement(raw, func(el json.RawMessage) error {
		if len(items) == maxBootstrapBatch {
			return fmt.Errorf("%s has more than %d items", param, maxBootstrapBatch)
		}
		items = append(items, el)
		return nil
	})
	if err != nil {
		return nil, pdErr(param, err.Error())
	}
	if len(items) == 0 {
		return nil, pdErr(param, param+" must not be an empty array")
	}
	return items, nil
}

// eachElement calls f with each element of the JSON array raw, stopping
// at f's first error.
func eachElement(raw json.RawMessage, f func(json.RawMessage) error) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	if _, err := dec.Token(); err != nil { // '['
		return err
	}
	for dec.More() {
		var el json.RawMessage
		if err := dec.Decode(&el); err != nil {
			return err
		}
		if err := f(el); err != nil {
			return err
		}
	}
	return nil
}

func optBool(raw json.RawMessage, param string) (bool, *openai.Error) {
	switch string(bytes.TrimSpace(raw)) {
	case "", "null", "false":
		return false, nil
	case "true":
		return true, nil
	}
	return false, pdErr(param, param+" must be a boolean")
}

func optString(raw json.RawMessage, param string) (string, *openai.Error) {
	raw = bytes.TrimSpace(raw)
	if isNull(raw) {
		return "", nil
	}
	if raw[0] != '"' || len(raw) > 6*maxPDString+2 {
		return "", pdErr(param, fmt.Sprintf("%s must be a string of at most %d bytes", param, maxPDString))
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil || len(s) > maxPDString {
		return "", pdErr(param, fmt.Sprintf("%s must be a string of at most %d bytes", param, maxPDString))
	}
	return s, nil
}

// optInt reads an integer in [lo, hi] (0 when absent or null).
func optInt(raw json.RawMessage, param string, lo, hi int) (int, *openai.Error) {
	raw = bytes.TrimSpace(raw)
	if isNull(raw) {
		return 0, nil
	}
	v, err := strconv.ParseInt(string(raw), 10, 64)
	if err != nil || v < int64(lo) || v > int64(hi) {
		return 0, pdErr(param, fmt.Sprintf("%s must be an integer in [%d, %d]", param, lo, hi))
	}
	return int(v), nil
}

// parseBlockIDs reads remote_block_ids: a flat list of block ids, or one
// list per KV-cache group (vLLM's hybrid allocator), concatenated; at most
// MaxRemoteBlockIDs ids, each in [0, 2^31−1].
func parseBlockIDs(raw json.RawMessage, param string) ([]int32, *openai.Error) {
	raw = bytes.TrimSpace(raw)
	if isNull(raw) {
		return nil, nil
	}
	bad := pdErr(param, fmt.Sprintf("%s must be a list of at most %d block ids (or of lists of them)", param, MaxRemoteBlockIDs))
	if raw[0] != '[' {
		return nil, bad
	}
	var ids []int32
	var add func(el json.RawMessage, depth int) error
	add = func(el json.RawMessage, depth int) error {
		el = bytes.TrimSpace(el)
		if len(el) > 0 && el[0] == '[' && depth == 0 {
			return eachElement(el, func(x json.RawMessage) error { return add(x, 1) })
		}
		if len(ids) == MaxRemoteBlockIDs {
			return errors.New("too many")
		}
		v, err := strconv.ParseInt(string(el), 10, 32)
		if err != nil || v < 0 {
			return errors.New("not a block id")
		}
		ids = append(ids, int32(v))
		return nil
	}
	if err := eachElement(raw, func(el json.RawMessage) error { return add(el, 0) }); err != nil {
		return nil, bad
	}
	return ids, nil
}

// Registry keys of the holds a prefill leg makes: its request id, its
// Mooncake transfer id, its SGLang room.
func reqKey(id string) string    { return "req:" + id }
func xferKey(id string) string   { return "xfer:" + id }
func roomKey(room string) string { return "room:" + room }

// splitHostPort checks a host:port address with a port in [1, 65535].
func splitHostPort(addr string) (port int, err error) {
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, err
	}
	port, err = strconv.Atoi(p)
	if err != nil || port < 1 || port > 65535 {
		return 0, fmt.Errorf("bad port in %q", addr)
	}
	return port, nil
}

// pdPrepare applies a request's P/D fields to its call: a prefill leg
// holds its KV for D; a decode leg asks its prefill over the side channel
// (waiting for it in the concurrent flows) and reads the prompt when P
// holds it, else recomputes it (vLLM's kv_load_failure_policy
// "recompute"), counting why. It reports false when ctx ended meanwhile.
func (s *Server) pdPrepare(ctx context.Context, r *http.Request, g *genRequest, c *call, auth string) bool {
	pd := g.pd
	if pd.hold {
		c.req.HoldKV = true
		c.pdKeys = pd.keys
		g.pdHost, g.pdPort = s.advertise(r)
	}
	switch {
	case pd.invalid != "":
		slog.Warn("sim: the P/D fields do not name a prefill in full; recomputing the prompt", "id", g.id)
		s.metrics.pdRecompute(pd.invalid)
	case pd.src != nil && s.eng.Profile.KVTransferBandwidth <= 0:
		slog.Warn("sim: the profile has no kv_transfer_bandwidth; recomputing the prompt", "id", g.id)
		s.metrics.pdRecompute("no_interconnect")
	case pd.src != nil:
		ok, reason := s.pdAcquire(ctx, pd.src, auth)
		if ctx.Err() != nil {
			return false
		}
		if !ok {
			slog.Info("sim: the prefill's KV cannot be read; recomputing the prompt", "id", g.id, "flow", pd.src.flow, "prefill", pd.src.base, "reason", reason)
			s.metrics.pdRecompute(reason)
			break
		}
		c.req.RemotePrefill = true
		c.pdSrc = pd.src
	}
	return true
}

// pdStep does the driver's P/D work after a step: it marks the decode
// legs whose reads ended (their handlers then notify P), and registers
// the prefill legs that finished holding their blocks — before their
// responses go out — and drops the holds the engine no longer has.
func (s *Server) pdStep(e *sim.Engine, calls map[string]*call, res *sim.StepResult, end time.Duration) {
	for _, id := range res.Transferred {
		if c := calls[id]; c != nil && c.pdSrc != nil {
			c.readDone.Store(true)
			s.metrics.pdTransfers.Inc()
			s.metrics.pdTransferTime.Observe((end - c.arrival).Seconds())
		}
	}
	for _, o := range res.Outputs {
		if !o.Finished {
			continue
		}
		c := calls[o.ID]
		if c == nil || !c.req.HoldKV || !e.Holds(o.ID) {
			continue
		}
		c.held = e.HeldBlockIDs(o.ID)
		s.pdReg.add(&pdHold{reqID: o.ID, blocks: c.held, keys: append([]string{reqKey(o.ID)}, c.pdKeys...)})
	}
	if s.pdReg.len() > 0 {
		s.pdReg.sweep(e.Holds)
	}
}

// withKVParams returns v, a response body or its last chunk, with the
// prefill leg's kv_transfer_params added at its top level (PROTOCOLS.md
// §3.1 step 2) when held names the blocks it holds; v itself otherwise.
func (s *Server) withKVParams(v any, g *genRequest, held []int32) any {
	if held == nil || g.pd == nil || !g.pd.params {
		return v
	}
	b, err := json.Marshal(v)
	if err != nil || len(b) < 2 || b[len(b)-1] != '}' {
		return v
	}
	p, err := json.Marshal(kvParamsOut{DoRemotePrefill: true, RemoteBlockIDs: held, RemoteEngineID: s.pd.EngineID,
		RemoteRequestID: g.id, RemoteHost: g.pdHost, RemotePort: g.pdPort, TPSize: max(1, s.eng.Profile.TensorParallel)})
	if err != nil {
		return v
	}
	out := append(b[:len(b)-1:len(b)-1], `,"kv_transfer_params":`...)
	out = append(out, p...)
	return json.RawMessage(append(out, '}'))
}
