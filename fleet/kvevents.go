package fleet

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"github.com/infergate/infergate/prefix"
)

// KV-cache events (docs/PROTOCOLS.md §1): an engine publishes what its prefix
// cache stores and evicts; the gateway subscribes and keeps a
// prefix.PreciseIndex of it.
//
//	DecodeKVEventBatch  one msgpack payload → KVEventBatch (both vLLM encodings)
//	KVEventSubscriber   SUB socket per engine: sequence numbers, gap detection,
//	                    replay over the engine's ROUTER, reconnects
//	KVEventApplier      a KVEventHandler that applies batches to a PreciseIndex

// KVEventType is the tag of a KV-cache event: the msgspec class name vLLM
// puts on the wire.
type KVEventType uint8

// KV-cache event types.
const (
	// KVBlockStored: full blocks got their hash registered in the prefix cache.
	KVBlockStored KVEventType = iota + 1
	// KVBlockRemoved: cached blocks were evicted.
	KVBlockRemoved
	// KVAllBlocksCleared: the engine's whole prefix cache was reset.
	KVAllBlocksCleared
	// KVTierBlocksCleared: the prefix cache of one tier (Medium; "GPU" when
	// null) was reset, blocks in other tiers kept (vLLM with
	// tier_scoped_clear_events, vllm/distributed/kv_events.py; Dynamo's
	// kv-router decodes it the same way).
	KVTierBlocksCleared
)

// String returns the vLLM class name.
func (t KVEventType) String() string {
	switch t {
	case KVBlockStored:
		return "BlockStored"
	case KVBlockRemoved:
		return "BlockRemoved"
	case KVAllBlocksCleared:
		return "AllBlocksCleared"
	case KVTierBlocksCleared:
		return "TierBlocksCleared"
	}
	return fmt.Sprintf("KVEventType(%d)", uint8(t))
}

// KVEvent is one decoded KV-cache event. Fields a type does not carry are
// zero.
type KVEvent struct {
	Type KVEventType
	// BlockHashes are the engine's hashes of the stored (in sequence order)
	// or removed blocks, as unsigned 64-bit integers: integer hashes as sent
	// (negative int64 reinterpreted), byte-string hashes by their last 8
	// bytes big-endian (docs/PROTOCOLS.md §1.5).
	BlockHashes []uint64
	// ParentBlockHash is the hash of the block before the first stored one;
	// HasParent is false when it was null (the first block of a sequence).
	ParentBlockHash uint64
	HasParent       bool
	// TokenIDs are the tokens of all stored blocks, concatenated.
	TokenIDs []uint32
	// BlockSize is the block size in tokens (0 when absent).
	BlockSize int
	// LoRAName is the adapter the blocks were computed under ("" for none).
	LoRAName string
	// Medium is the cache tier ("" when null, which means the GPU).
	Medium string
	// GroupIdx is the KV-cache group of hybrid models (-1 when null or absent).
	GroupIdx int
}

// KVEventBatch is one decoded message payload: vLLM's KVEventBatch.
type KVEventBatch struct {
	// TS is the engine's timestamp of the batch, in seconds since the epoch.
	TS float64
	// DataParallelRank is the publishing rank (-1 when null or absent).
	DataParallelRank int
	// Events are the batch's events of known types, in order.
	Events []KVEvent
	// Unknown counts events of other types, left out of Events.
	Unknown int
}

// kvMaxDepth bounds the nesting of skipped values, so a hostile payload
// cannot recurse the decoder off its stack.
const kvMaxDepth = 32

var errKVTooDeep = errors.New("kv events: msgpack nesting too deep")

// Field lists of the array ("array_like") encoding, position i+1 being
// field i (position 0 is the tag); docs/PROTOCOLS.md §1.4.
var (
	kvStoredFields = [...]string{"block_hashes", "parent_block_hash", "token_ids", "block_size",
		"lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
		"kv_cache_spec_sliding_window"}
	kvRemovedFields = [...]string{"block_hashes", "medium", "group_idx"}
	// kvTierClearedFields are TierBlocksCleared's fields in array order
	// (medium, then ownership, which the decoder skips).
	kvTierClearedFields = [...]string{"medium"}
)

// DecodeKVEventBatch decodes one msgpack KVEventBatch payload as vLLM
// publishes it, in either encoding (docs/PROTOCOLS.md §1.4): the batch an array
// [ts, events, dp_rank?] or a map {ts, events, data_parallel_rank}; each
// event an array (tag first, fields by position, missing trailing fields
// null, extra ones ignored) or a map (tag under "type", unknown keys
// ignored). Integers are accepted in any msgpack width. It fails on a
// payload that is not msgpack or whose known fields have the wrong type.
func DecodeKVEventBatch(payload []byte) (KVEventBatch, error) {
	r := bytes.NewReader(payload)
	d := msgpack.GetDecoder()
	defer msgpack.PutDecoder(d)
	d.Reset(r)
	kd := kvDecoder{d: d, r: r}
	b, err := kd.batch()
	if err != nil {
		return KVEventBatch{}, fmt.Errorf("kv events: %w", err)
	}
	return b, nil
}

type kvDecoder struct {
	d   *msgpack.Decoder
	r   *bytes.Reader
	key [64]byte // scratch for keys and tags
}

// capHint bounds a preallocation by the bytes left (every element takes at
// least one), so a forged length cannot make the decoder allocate.
func (kd *kvDecoder) capHint(n int) int { return max(0, min(n, kd.r.Len())) }

func (kd *kvDecoder) peek() (byte, error) { return kd.d.PeekCode() }

func (kd *kvDecoder) isNil() (bool, error) {
	c, err := kd.peek()
	if err != nil {
		return false, err
	}
	if c == msgpcode.Nil {
		return true, kd.d.DecodeNil()
	}
	return false, nil
}

// skip skips one value of any kind.
func (kd *kvDecoder) skip(depth int) error {
	if depth > kvMaxDepth {
		return errKVTooDeep
	}
	c, err := kd.peek()
	if err != nil {
		return err
	}
	var n int
	switch {
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		if n, err = kd.d.DecodeArrayLen(); err != nil {
			return err
		}
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		if n, err = kd.d.DecodeMapLen(); err != nil {
			return err
		}
		n *= 2
	case msgpcode.IsString(c) || msgpcode.IsBin(c):
		if n, err = kd.d.DecodeBytesLen(); err != nil {
			return err
		}
		return kd.seek(n)
	case msgpcode.IsExt(c):
		if _, n, err = kd.d.DecodeExtHeader(); err != nil {
			return err
		}
		return kd.seek(n)
	default: // fixed size
		return kd.d.Skip()
	}
	for range n {
		if err := kd.skip(depth + 1); err != nil {
			return err
		}
	}
	return nil
}

// seek skips n bytes of the payload. (The msgpack decoder's own Skip reads
// what it skips into a buffer it grows up to the claimed length, a megabyte
// at a time: a forged length costs a megabyte for a few input bytes.)
func (kd *kvDecoder) seek(n int) error {
	if n < 0 || n > kd.r.Len() {
		return io.ErrUnexpectedEOF
	}
	_, err := kd.r.Seek(int64(n), io.SeekCurrent)
	return err
}

// shortString reads a string (or bin) into the scratch buffer; ok is false,
// and the value skipped, when it is of another type or longer than the buffer.
func (kd *kvDecoder) shortString() (s []byte, ok bool, err error) {
	c, err := kd.peek()
	if err != nil {
		return nil, false, err
	}
	if !msgpcode.IsString(c) && !msgpcode.IsBin(c) {
		return nil, false, kd.skip(1)
	}
	n, err := kd.d.DecodeBytesLen()
	if err != nil {
		return nil, false, err
	}
	if n > len(kd.key) || n > kd.r.Len() {
		return nil, false, kd.seek(n)
	}
	n = max(n, 0)
	if _, err := io.ReadFull(kd.r, kd.key[:n]); err != nil {
		return nil, false, err
	}
	return kd.key[:n], true, nil
}

// optString reads a string or null.
func (kd *kvDecoder) optString(field string) (string, error) {
	if null, err := kd.isNil(); null || err != nil {
		return "", err
	}
	c, err := kd.peek()
	if err != nil {
		return "", err
	}
	if !msgpcode.IsString(c) {
		return "", fmt.Errorf("%s: not a string (msgpack code %#x)", field, c)
	}
	n, err := kd.d.DecodeBytesLen()
	if err != nil {
		return "", err
	}
	if n < 0 || n > kd.r.Len() {
		return "", io.ErrUnexpectedEOF
	}
	buf := kd.key[:0]
	if n > len(kd.key) {
		buf = make([]byte, 0, n)
	}
	buf = buf[:n]
	if _, err := io.ReadFull(kd.r, buf); err != nil {
		return "", err
	}
	switch string(buf) { // common values without allocating
	case "GPU":
		return "GPU", nil
	case "CPU":
		return "CPU", nil
	}
	return string(buf), nil
}

// optInt reads an integer, or null as def.
func (kd *kvDecoder) optInt(field string, def int) (int, error) {
	if null, err := kd.isNil(); null || err != nil {
		return def, err
	}
	c, err := kd.peek()
	if err != nil {
		return 0, err
	}
	if !kvIsInt(c) {
		return 0, fmt.Errorf("%s: not an integer (msgpack code %#x)", field, c)
	}
	v, err := kd.d.DecodeInt64()
	if err != nil {
		return 0, err
	}
	if v < math.MinInt32 || v > math.MaxInt32 {
		return 0, fmt.Errorf("%s: %d out of range", field, v)
	}
	return int(v), nil
}

func kvIsInt(c byte) bool {
	switch c {
	case msgpcode.Uint8, msgpcode.Uint16, msgpcode.Uint32, msgpcode.Uint64,
		msgpcode.Int8, msgpcode.Int16, msgpcode.Int32, msgpcode.Int64:
		return true
	}
	return msgpcode.IsFixedNum(c)
}

// hash reads one block hash: an integer of any width, or bytes whose last 8
// (left-padded with zeros) are read big-endian.
func (kd *kvDecoder) hash(field string) (uint64, error) {
	c, err := kd.peek()
	if err != nil {
		return 0, err
	}
	switch {
	case kvIsInt(c):
		return kd.d.DecodeUint64()
	case msgpcode.IsBin(c) || msgpcode.IsString(c):
		n, err := kd.d.DecodeBytesLen()
		if err != nil {
			return 0, err
		}
		if n > kd.r.Len() {
			return 0, io.ErrUnexpectedEOF
		}
		if n > 8 {
			if _, err := kd.r.Seek(int64(n-8), io.SeekCurrent); err != nil {
				return 0, err
			}
			n = 8
		}
		var b [8]byte
		if _, err := io.ReadFull(kd.r, b[8-max(n, 0):]); err != nil {
			return 0, err
		}
		return binary.BigEndian.Uint64(b[:]), nil
	}
	return 0, fmt.Errorf("%s: hash is neither an integer nor bytes (msgpack code %#x)", field, c)
}

// hashes reads a list of hashes (null: none).
func (kd *kvDecoder) hashes(field string) ([]uint64, error) {
	n, err := kd.d.DecodeArrayLen()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", field, err)
	}
	out := make([]uint64, 0, kd.capHint(n))
	for range n {
		h, err := kd.hash(field)
		if err != nil {
			return nil, err
		}
		out = append(out, h)
	}
	return out, nil
}

// tokens reads a list of token ids (null: none).
func (kd *kvDecoder) tokens() ([]uint32, error) {
	n, err := kd.d.DecodeArrayLen()
	if err != nil {
		return nil, fmt.Errorf("token_ids: %w", err)
	}
	out := make([]uint32, 0, kd.capHint(n))
	for range n {
		c, err := kd.peek()
		if err != nil {
			return nil, err
		}
		if !kvIsInt(c) {
			return nil, fmt.Errorf("token_ids: not an integer (msgpack code %#x)", c)
		}
		v, err := kd.d.DecodeInt64()
		if err != nil {
			return nil, err
		}
		if v < 0 || v > math.MaxUint32 {
			return nil, fmt.Errorf("token_ids: %d out of range", v)
		}
		out = append(out, uint32(v))
	}
	return out, nil
}

// field reads the value of the named field into ev; unknown names are skipped.
func (kd *kvDecoder) field(ev *KVEvent, name string) error {
	var err error
	switch name {
	case "block_hashes":
		ev.BlockHashes, err = kd.hashes(name)
	case "parent_block_hash":
		var null bool
		if null, err = kd.isNil(); err == nil && !null {
			ev.ParentBlockHash, err = kd.hash(name)
			ev.HasParent = err == nil
		}
	case "token_ids":
		ev.TokenIDs, err = kd.tokens()
	case "block_size":
		ev.BlockSize, err = kd.optInt(name, 0)
		if err == nil && ev.BlockSize < 0 {
			err = fmt.Errorf("block_size %d", ev.BlockSize)
		}
	case "medium":
		ev.Medium, err = kd.optString(name)
	case "lora_name":
		ev.LoRAName, err = kd.optString(name)
	case "group_idx":
		ev.GroupIdx, err = kd.optInt(name, -1)
	default:
		err = kd.skip(1)
	}
	return err
}

// kvFieldName returns the event field named key as a constant string ("" if
// the decoder does not read it), without allocating.
func kvFieldName(key []byte) string {
	for _, f := range kvStoredFields {
		if string(key) == f {
			return f
		}
	}
	return ""
}

func kvTag(s []byte) KVEventType {
	switch string(s) {
	case "BlockStored":
		return KVBlockStored
	case "BlockRemoved":
		return KVBlockRemoved
	case "AllBlocksCleared":
		return KVAllBlocksCleared
	case "TierBlocksCleared":
		return KVTierBlocksCleared
	}
	return 0
}

// event reads one event; a zero Type means an unknown tag.
func (kd *kvDecoder) event() (KVEvent, error) {
	ev := KVEvent{GroupIdx: -1}
	c, err := kd.peek()
	if err != nil {
		return ev, err
	}
	switch {
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		n, err := kd.d.DecodeArrayLen()
		if err != nil {
			return ev, err
		}
		if n == 0 {
			return ev, errors.New("event: empty array")
		}
		tag, ok, err := kd.shortString()
		if err != nil {
			return ev, err
		}
		if ok {
			ev.Type = kvTag(tag)
		}
		var names []string
		switch ev.Type {
		case KVBlockStored:
			names = kvStoredFields[:]
		case KVBlockRemoved:
			names = kvRemovedFields[:]
		case KVTierBlocksCleared:
			names = kvTierClearedFields[:]
		}
		for i := range n - 1 {
			if i < len(names) {
				err = kd.field(&ev, names[i])
			} else {
				err = kd.skip(1)
			}
			if err != nil {
				return ev, err
			}
		}
		return ev, nil
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		n, err := kd.d.DecodeMapLen()
		if err != nil {
			return ev, err
		}
		for range n {
			key, ok, err := kd.shortString()
			if err != nil {
				return ev, err
			}
			switch {
			case !ok:
				err = kd.skip(1)
			case string(key) == "type":
				var tag []byte
				if tag, ok, err = kd.shortString(); ok {
					ev.Type = kvTag(tag)
				}
			default:
				err = kd.field(&ev, kvFieldName(key))
			}
			if err != nil {
				return ev, err
			}
		}
		return ev, nil
	}
	return ev, fmt.Errorf("event is neither an array nor a map (msgpack code %#x)", c)
}

// events reads the list of events into b.
func (kd *kvDecoder) events(b *KVEventBatch) error {
	n, err := kd.d.DecodeArrayLen()
	if err != nil {
		return fmt.Errorf("events: %w", err)
	}
	b.Events = make([]KVEvent, 0, kd.capHint(n))
	for range n {
		ev, err := kd.event()
		if err != nil {
			return err
		}
		if ev.Type == 0 {
			b.Unknown++
			continue
		}
		b.Events = append(b.Events, ev)
	}
	return nil
}

func (kd *kvDecoder) ts() (float64, error) {
	if null, err := kd.isNil(); null || err != nil {
		return 0, err
	}
	c, err := kd.peek()
	if err != nil {
		return 0, err
	}
	if c != msgpcode.Float && c != msgpcode.Double && !kvIsInt(c) {
		return 0, fmt.Errorf("ts: not a number (msgpack code %#x)", c)
	}
	return kd.d.DecodeFloat64()
}

func (kd *kvDecoder) batch() (KVEventBatch, error) {
	b := KVEventBatch{DataParallelRank: -1}
	c, err := kd.peek()
	if err != nil {
		return b, err
	}
	switch {
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		n, err := kd.d.DecodeArrayLen()
		if err != nil {
			return b, err
		}
		if n < 2 {
			return b, fmt.Errorf("batch: array of %d elements, want [ts, events, dp_rank?]", n)
		}
		if b.TS, err = kd.ts(); err != nil {
			return b, err
		}
		if err := kd.events(&b); err != nil {
			return b, err
		}
		if n > 2 {
			if b.DataParallelRank, err = kd.optInt("data_parallel_rank", -1); err != nil {
				return b, err
			}
		}
		for range n - 3 {
			if err := kd.skip(1); err != nil {
				return b, err
			}
		}
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		n, err := kd.d.DecodeMapLen()
		if err != nil {
			return b, err
		}
		seen := false
		for range n {
			key, ok, err := kd.shortString()
			if err != nil {
				return b, err
			}
			switch {
			case !ok:
				err = kd.skip(1)
			case string(key) == "ts":
				b.TS, err = kd.ts()
			case string(key) == "events":
				err, seen = kd.events(&b), true
			case string(key) == "data_parallel_rank":
				b.DataParallelRank, err = kd.optInt("data_parallel_rank", -1)
			default:
				err = kd.skip(1)
			}
			if err != nil {
				return b, err
			}
		}
		if !seen {
			return b, errors.New("batch: map without events")
		}
	default:
		return b, fmt.Errorf("batch is neither an array nor a map (msgpack code %#x)", c)
	}
	return b, nil
}

// ---------------------------------------------------------------------------
// Subscriber

// KVResetReason says why a KVEventHandler must forget what it learnt from a
// stream.
type KVResetReason uint8

// Reset reasons.
const (
	// KVResetStart: Run started; whatever the handler knew of this engine is
	// of unknown age.
	KVResetStart KVResetReason = iota
	// KVResetGap: batches were lost and replay could not restore them all.
	KVResetGap
	// KVResetRestart: the publisher restarted (its sequence numbers went
	// back), so the engine's cache is a new one.
	KVResetRestart
	// KVResetDecode: a batch could not be decoded.
	KVResetDecode
	// KVResetResync: the owner asked for it (KVEventSubscriber.Resync: the
	// endpoint failed a health check or was ejected, and its engine may
	// have restarted).
	KVResetResync
	// KVResetFailure: a session ended in a recovered panic, part way
	// through whatever it was doing.
	KVResetFailure
)

// String returns "start", "gap", "restart", "decode", "resync" or "failure".
func (r KVResetReason) String() string {
	switch r {
	case KVResetStart:
		return "start"
	case KVResetGap:
		return "gap"
	case KVResetRestart:
		return "restart"
	case KVResetDecode:
		return "decode"
	case KVResetResync:
		return "resync"
	case KVResetFailure:
		return "failure"
	}
	return fmt.Sprintf("KVResetReason(%d)", uint8(r))
}

// KVEventHandler receives one engine's KV-event stream from a
// KVEventSubscriber, on Run's goroutine.
type KVEventHandler interface {
	// KVBatch applies one batch. Batches arrive in sequence order without
	// gaps, except after a KVReset. b must not be retained after the call.
	KVBatch(seq uint64, b *KVEventBatch)
	// KVReset tells the handler to forget everything it learnt from the
	// stream: it can no longer be sure of it. Forgetting is safe (a missed
	// prefix hit), believing stale blocks is not (a routing decision made on
	// blocks the engine no longer holds).
	KVReset(reason KVResetReason)
}

// Defaults of KVEventSubscriberConfig.
const (
	DefaultKVMinBackoff    = 100 * time.Millisecond
	DefaultKVMaxBackoff    = 5 * time.Second
	DefaultKVReplayTimeout = 5 * time.Second
)

// KVEventSubscriberConfig configures a KVEventSubscriber. Zero durations
// take defaults.
type KVEventSubscriberConfig struct {
	// Endpoint is the engine's PUB socket, tcp://host:port (vLLM
	// --kv-events-config endpoint, with the engine's host in place of "*").
	// The subscriber dials it.
	Endpoint string
	// ReplayEndpoint is the engine's replay ROUTER socket (vLLM
	// replay_endpoint), or "" when it has none: lost batches then reset the
	// handler.
	ReplayEndpoint string
	// Topic is the topic prefix subscribed to ("" for every message).
	Topic string
	// MinBackoff and MaxBackoff bound the wait before redialing after a
	// failed dial or a lost connection; it doubles per failure and returns
	// to MinBackoff once messages flow.
	MinBackoff, MaxBackoff time.Duration
	// ReplayTimeout bounds one replay request.
	ReplayTimeout time.Duration
	// MaxMessageBytes bounds one message from the engine, its frames
	// together (default DefaultKVMaxMessageBytes): a connection whose peer
	// announces more is closed before anything is allocated for it, counted
	// in Oversized, and redialled after the backoff (zmtpguard.go).
	MaxMessageBytes int
	// HandshakeTimeout bounds the ZMTP greeting and handshake of a dial
	// (default DefaultKVHandshakeTimeout).
	HandshakeTimeout time.Duration
}

// KVEventSubscriberStats are a subscriber's cumulative counters.
type KVEventSubscriberStats struct {
	// Connects counts successful dials of the PUB socket.
	Connects uint64
	// Batches counts batches delivered to the handler (live and replayed);
	// Events the known events in them, UnknownEvents the others.
	Batches, Events, UnknownEvents uint64
	// Replayed counts batches delivered from the replay socket.
	Replayed uint64
	// Gaps counts sequence gaps in the live stream; ReplayFailures replay
	// requests that failed or came back incomplete.
	Gaps, ReplayFailures uint64
	// Restarts counts publisher restarts detected.
	Restarts uint64
	// Resets counts KVReset calls.
	Resets uint64
	// DecodeErrors counts payloads that failed to decode; Malformed messages
	// that were not [topic, 8-byte seq, payload].
	DecodeErrors, Malformed uint64
	// Oversized counts connections (PUB or replay) closed because the peer
	// announced a frame or message over MaxMessageBytes, or more than 16
	// frames in one message.
	Oversized uint64
	// Panics counts sessions ended by a recovered panic (the handler is then
	// reset and the engine redialled after the backoff).
	Panics uint64
	// Resyncs counts Resync calls.
	Resyncs uint64
}

// KVEventSubscriber follows one engine's KV-event stream (docs/PROTOCOLS.md
// §1.2-1.3): a SUB socket dials the engine's PUB socket and every message
// [topic, seq (8-byte big-endian), payload] is decoded and handed to a
// KVEventHandler in sequence order.
//
// Sequence numbers start at 0 per publisher process and grow by one per
// batch. A gap (a batch dropped at the publisher's high-water mark, or sent
// while the connection was down) is filled from the engine's replay socket
// when there is one: a DEALER asks for the batches from the first missing
// one, and they are delivered, in order, before the batch that revealed the
// gap. When there is no replay socket, or it cannot fill the whole gap, the
// handler is reset instead. A sequence number that goes back means the
// publisher restarted: reset as well. At the start of a stream (Run, or a
// restart) the batches before the first one received are replayed when
// available, so that the handler sees the engine's cache from its start as
// far as the engine's buffer reaches.
//
// Limits: an engine that restarts and has published more batches than the
// old one by the time the subscriber hears from it again looks like a gap,
// not a restart (the sequence numbers alone cannot tell): the old life's
// blocks then stay in the handler until its next reset, which the owner may
// trigger from another restart signal (a changed process start time in the
// engine's metrics, a failed health check: Resync). A connection that stays
// open but silently dead (no FIN, no RST) is noticed only by TCP keepalive.
//
// Hostile peers: every connection is dialled through the ZMTP guard
// (zmtpguard.go), which bounds messages (MaxMessageBytes, 16 frames) and the
// handshake (HandshakeTimeout) before go-zeromq allocates anything; a
// session that panics is recovered. Either failure costs this subscription
// only: the handler is reset, the failure counted (Oversized, Panics) and
// the engine redialled after a backoff that keeps growing. go-zeromq
// v0.17.0 may leave one of its own goroutines blocked forever when a socket
// closes with its receive queue full; Run drains the queue when it closes a
// socket to make that unlikely.
type KVEventSubscriber struct {
	cfg KVEventSubscriberConfig

	connects, batches, events, unknown       atomic.Uint64
	replayed, gaps, replayFailures, restarts atomic.Uint64
	resets, decodeErrors, malformed          atomic.Uint64
	oversized, panics, resyncs               atomic.Uint64

	// mu guards resync and cancel: Resync sets resync and ends the running
	// session (cancel), Run forgets the stream before its next session.
	mu     sync.Mutex
	resync bool
	cancel context.CancelFunc

	// waited, when set (tests), is told every backoff Run waits.
	waited func(time.Duration)
}

// NewKVEventSubscriber validates cfg and returns a subscriber; Run starts it.
func NewKVEventSubscriber(cfg KVEventSubscriberConfig) (*KVEventSubscriber, error) {
	check := func(name, ep string) error {
		scheme, addr, ok := strings.Cut(ep, "://")
		if !ok || addr == "" || (scheme != "tcp" && scheme != "ipc" && scheme != "inproc") {
			return fmt.Errorf("kv events %s %q: want tcp://host:port", name, ep)
		}
		return nil
	}
	if err := check("endpoint", cfg.Endpoint); err != nil {
		return nil, err
	}
	if cfg.ReplayEndpoint != "" {
		if err := check("replay endpoint", cfg.ReplayEndpoint); err != nil {
			return nil, err
		}
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = DefaultKVMinBackoff
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = DefaultKVMaxBackoff
	}
	cfg.MaxBackoff = max(cfg.MaxBackoff, cfg.MinBackoff)
	if cfg.ReplayTimeout <= 0 {
		cfg.ReplayTimeout = DefaultKVReplayTimeout
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = DefaultKVMaxMessageBytes
	}
	if cfg.HandshakeTimeout <= 0 {
		cfg.HandshakeTimeout = DefaultKVHandshakeTimeout
	}
	if err := registerGuard(); err != nil {
		return nil, err
	}
	return &KVEventSubscriber{cfg: cfg}, nil
}

// Config returns the configuration with defaults applied.
func (s *KVEventSubscriber) Config() KVEventSubscriberConfig { return s.cfg }

// Stats returns the subscriber's counters.
func (s *KVEventSubscriber) Stats() KVEventSubscriberStats {
	return KVEventSubscriberStats{
		Connects: s.connects.Load(), Batches: s.batches.Load(), Events: s.events.Load(),
		UnknownEvents: s.unknown.Load(), Replayed: s.replayed.Load(), Gaps: s.gaps.Load(),
		ReplayFailures: s.replayFailures.Load(), Restarts: s.restarts.Load(), Resets: s.resets.Load(),
		DecodeErrors: s.decodeErrors.Load(), Malformed: s.malformed.Load(),
		Oversized: s.oversized.Load(), Panics: s.panics.Load(), Resyncs: s.resyncs.Load(),
	}
}

// kvQuiet discards zmq4's log lines (it logs every failed handshake).
var kvQuiet = log.New(io.Discard, "", 0)

// Run resets h (KVResetStart), then follows the stream and feeds h until ctx
// is done, redialing with backoff whenever the dial fails or the connection
// drops; it returns ctx's error. h is called on Run's goroutine only. Run may
// be called again after it returned; not concurrently with itself.
//
// A session that ends in a panic (recovered: its own, the handler's, or the
// ZMTP library's on this goroutine) or on a peer over the message bounds
// counts as a failure: the backoff keeps growing even if messages had
// arrived, so a hostile peer is redialled at most every MaxBackoff.
func (s *KVEventSubscriber) Run(ctx context.Context, h KVEventHandler) error {
	s.reset(h, KVResetStart)
	st := kvStream{}
	backoff := s.cfg.MinBackoff
	for {
		if s.takeResync() {
			s.reset(h, KVResetResync)
			st = kvStream{}
		}
		sctx, cancel := context.WithCancel(ctx)
		s.mu.Lock()
		s.cancel = cancel
		s.mu.Unlock()
		received, failed := s.safeSession(sctx, h, &st)
		s.mu.Lock()
		s.cancel = nil
		resync := s.resync
		s.mu.Unlock()
		cancel()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if failed {
			s.reset(h, KVResetFailure)
			st = kvStream{}
		} else if received || resync {
			backoff = s.cfg.MinBackoff
		}
		if s.waited != nil {
			s.waited(backoff)
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		backoff = min(2*backoff, s.cfg.MaxBackoff)
	}
}

// Resync makes Run forget the stream: the running session ends (its
// connection closes, with whatever it had queued), the handler is reset
// (KVResetResync) and the engine is dialled again as a new stream, whose
// batches from the first one are replayed when the engine has a replay
// socket. The owner calls it when the endpoint leaves rotation (a failed
// health check, an ejection): an engine that restarted in place publishes
// nothing until it serves, so its stream alone would reveal the restart
// only after requests were routed on the old cache. Safe for concurrent use;
// it does not wait.
func (s *KVEventSubscriber) Resync() {
	s.resyncs.Add(1)
	s.mu.Lock()
	s.resync = true
	if s.cancel != nil {
		s.cancel()
	}
	s.mu.Unlock()
}

func (s *KVEventSubscriber) takeResync() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.resync
	s.resync = false
	return r
}

// safeSession runs session, recovering a panic: it is counted and logged,
// and reported as a failure. Panics in the library's own goroutines cannot
// be recovered here; the ZMTP guard (zmtpguard.go) keeps the one known
// there from happening.
func (s *KVEventSubscriber) safeSession(ctx context.Context, h KVEventHandler, st *kvStream) (received, failed bool) {
	before := s.oversized.Load()
	defer func() {
		if p := recover(); p != nil {
			// The stack is logged once per subscriber: a hostile peer may
			// repeat the panic at every dial.
			if s.panics.Add(1) == 1 {
				slog.Error("kv events: subscriber session panicked; redialling after the backoff",
					"endpoint", s.cfg.Endpoint, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
			} else {
				slog.Error("kv events: subscriber session panicked again; redialling after the backoff",
					"endpoint", s.cfg.Endpoint, "panic", fmt.Sprint(p), "panics", s.panics.Load())
			}
			received, failed = false, true
		}
	}()
	received = s.session(ctx, h, st)
	return received, s.oversized.Load() != before
}

// kvStream is Run's position in the stream.
type kvStream struct {
	started bool   // a batch was delivered since the last reset
	next    uint64 // the sequence number expected next
	// dupFrom: after the catch-up on joining, live messages with seq in
	// [dupFrom, next) are the replayed batches again (queued while the
	// replay ran), not a restart; valid while dup is set, which the first
	// live message at or past next clears.
	dupFrom uint64
	dup     bool
}

// kvJoinDelay is how long after dialling the subscriber waits before it
// asks the replay socket for what it missed: long enough for the
// subscription to reach the publisher (ZeroMQ's "slow joiner"), so that
// nothing published around the join falls between replay and live stream.
const kvJoinDelay = 100 * time.Millisecond

// session dials the PUB socket and handles messages until the connection
// drops or ctx is done. It reports whether any message arrived.
func (s *KVEventSubscriber) session(ctx context.Context, h KVEventHandler, st *kvStream) (received bool) {
	ep, err := guardedEndpoint(s.cfg.Endpoint)
	if err != nil {
		return false
	}
	sub := zmq4.NewSub(s.guarded(ctx), zmq4.WithLogger(kvQuiet), zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(s.cfg.HandshakeTimeout))
	defer kvClose(sub)
	if err := sub.SetOption(zmq4.OptionSubscribe, s.cfg.Topic); err != nil {
		return false
	}
	if err := sub.Dial(ep); err != nil {
		return false
	}
	s.connects.Add(1)
	st.dup = false // a new connection: a lower seq now means a restart
	if s.cfg.ReplayEndpoint != "" {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(kvJoinDelay):
		}
		s.joinCatchUp(ctx, h, st)
	}
	for {
		msg, err := sub.Recv()
		if err != nil {
			return received // connection lost, or ctx done
		}
		received = true
		if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 {
			s.malformed.Add(1)
			continue
		}
		s.receive(ctx, h, st, binary.BigEndian.Uint64(msg.Frames[1]), msg.Frames[2])
	}
}

// guarded returns ctx carrying the bounds of the connections dialled under
// it (zmtpguard.go).
func (s *KVEventSubscriber) guarded(ctx context.Context) context.Context {
	return withZMTPLimits(ctx, zmtpLimits{maxMessage: uint64(s.cfg.MaxMessageBytes), maxFrames: kvMaxFrames,
		handshake: s.cfg.HandshakeTimeout, exceeded: &s.oversized})
}

// kvClose closes a socket, then drains what its connection readers queued,
// so that none stays blocked on the queue (go-zeromq v0.17.0's qreader.listen
// sends to its 10-message queue without watching the context). Receiving on
// a closed socket returns at once.
func kvClose(sock zmq4.Socket) {
	_ = sock.Close()
	for range 64 {
		_, _ = sock.Recv()
	}
}

// receive handles one live message.
func (s *KVEventSubscriber) receive(ctx context.Context, h KVEventHandler, st *kvStream, seq uint64, payload []byte) {
	if st.dup {
		if seq >= st.dupFrom && seq < st.next {
			return // delivered by the catch-up on joining
		}
		st.dup = false
	}
	b, err := DecodeKVEventBatch(payload)
	switch {
	case !st.started:
		if seq > 0 {
			s.catchUp(ctx, h, 0, seq, false)
		}
	case seq == st.next:
	case seq > st.next:
		s.gaps.Add(1)
		s.catchUp(ctx, h, st.next, seq, true)
	default: // seq < next
		s.restarts.Add(1)
		s.reset(h, KVResetRestart)
		if seq > 0 {
			s.catchUp(ctx, h, 0, seq, false)
		}
	}
	st.started, st.next = true, seq+1
	if err != nil {
		s.decodeErrors.Add(1)
		s.reset(h, KVResetDecode)
		return
	}
	s.deliver(h, seq, &b)
}

func (s *KVEventSubscriber) reset(h KVEventHandler, why KVResetReason) {
	s.resets.Add(1)
	h.KVReset(why)
}

func (s *KVEventSubscriber) deliver(h KVEventHandler, seq uint64, b *KVEventBatch) {
	s.batches.Add(1)
	s.events.Add(uint64(len(b.Events)))
	s.unknown.Add(uint64(b.Unknown))
	h.KVBatch(seq, b)
}

// joinCatchUp asks the replay socket, right after joining, for every batch
// from the one expected next (0 on a fresh stream) to the newest: without
// it, batches published before the subscription took effect stay missing
// until the engine publishes again (and an idle engine may not for a long
// time). A hole before the first batch returned resets the handler.
func (s *KVEventSubscriber) joinCatchUp(ctx context.Context, h KVEventHandler, st *kvStream) {
	from := uint64(0)
	if st.started {
		from = st.next
	}
	got, err := s.replay(ctx, from, kvReplayEnd)
	if ctx.Err() != nil || err != nil || len(got) == 0 {
		return
	}
	if st.started {
		// Batches missed while disconnected: recovered, or (when the
		// buffer no longer reaches back to them) a reset.
		s.gaps.Add(1)
		if got[0].seq != from {
			s.reset(h, KVResetGap)
		}
	}
	for i := range got {
		s.replayed.Add(1)
		s.deliver(h, got[i].seq, &got[i].b)
	}
	st.started, st.next = true, got[len(got)-1].seq+1
	st.dupFrom, st.dup = got[0].seq, true
}

// catchUp delivers the batches [from, to) from the replay socket. When the
// handler has seen the batches before from (mustCover), anything short of
// all of them resets it first; what arrived contiguously up to to-1 is
// delivered either way (after a reset it can only add blocks, never leave
// stale ones).
func (s *KVEventSubscriber) catchUp(ctx context.Context, h KVEventHandler, from, to uint64, mustCover bool) {
	var got []kvSeqBatch
	if s.cfg.ReplayEndpoint != "" {
		var err error
		got, err = s.replay(ctx, from, to)
		if ctx.Err() != nil {
			return
		}
		if err != nil || len(got) == 0 || got[0].seq != from {
			s.replayFailures.Add(1)
		}
	}
	if mustCover && (len(got) == 0 || got[0].seq != from) {
		s.reset(h, KVResetGap)
	}
	for i := range got {
		s.replayed.Add(1)
		s.deliver(h, got[i].seq, &got[i].b)
	}
}

type kvSeqBatch struct {
	seq uint64
	b   KVEventBatch
}

// kvReplayEnd is the sequence number of the replay end marker (-1 as a signed
// 8-byte big-endian integer).
const kvReplayEnd = ^uint64(0)

// replay asks the replay socket for the batches from seq from on and returns
// the contiguous run of them that ends at to-1 (nil with an error when there
// is none), or with to = kvReplayEnd the contiguous run that ends at the
// newest buffered batch. It reads the reply to its end marker, ignoring
// batches from to on, so that the DEALER is drained when it closes.
func (s *KVEventSubscriber) replay(ctx context.Context, from, to uint64) ([]kvSeqBatch, error) {
	ep, err := guardedEndpoint(s.cfg.ReplayEndpoint)
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, s.cfg.ReplayTimeout)
	defer cancel()
	d := zmq4.NewDealer(s.guarded(rctx), zmq4.WithLogger(kvQuiet), zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(s.cfg.ReplayTimeout))
	defer kvClose(d)
	if err := d.Dial(ep); err != nil {
		return nil, fmt.Errorf("kv events replay: %w", err)
	}
	req := binary.BigEndian.AppendUint64(nil, from)
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, req)); err != nil {
		return nil, fmt.Errorf("kv events replay: %w", err)
	}
	var got []kvSeqBatch
	for {
		msg, err := d.Recv()
		if err != nil {
			return nil, fmt.Errorf("kv events replay: %w", err)
		}
		if len(msg.Frames) != 3 || len(msg.Frames[0]) != 0 || len(msg.Frames[1]) != 8 {
			s.malformed.Add(1)
			return nil, fmt.Errorf("kv events replay: reply of %d frames", len(msg.Frames))
		}
		seq := binary.BigEndian.Uint64(msg.Frames[1])
		if seq == kvReplayEnd {
			break
		}
		if seq < from || seq >= to {
			continue
		}
		b, err := DecodeKVEventBatch(msg.Frames[2])
		if err != nil {
			s.decodeErrors.Add(1)
			got = got[:0] // a hole: keep what follows it only
			continue
		}
		if n := len(got); n > 0 && got[n-1].seq+1 != seq {
			got = got[:0]
		}
		got = append(got, kvSeqBatch{seq, b})
	}
	if to == kvReplayEnd {
		return got, nil
	}
	if len(got) == 0 || got[len(got)-1].seq != to-1 {
		return nil, errors.New("kv events replay: the engine's buffer does not reach the gap")
	}
	return got, nil
}

// ---------------------------------------------------------------------------
// Applier

// KVSeeds returns the root seeds the gateway hashes prompts with
// (gateway.go): prefix.Seed(model+"\x00") for the base model, and
// prefix.Seed(adapter+"\x00") for blocks an adapter computed.
func KVSeeds(model string) func(loraName string) uint64 {
	base := prefix.Seed(model + "\x00")
	return func(lora string) uint64 {
		if lora == "" {
			return base
		}
		return prefix.Seed(lora + "\x00")
	}
}

// KVEventApplier is the KVEventHandler that keeps one engine's blocks in a
// prefix.PreciseIndex, as endpoint Endpoint. Request keys are recomputed
// from each BlockStored's token ids, the first block of a sequence chained
// from SeedFor(lora_name).
type KVEventApplier struct {
	ix      *prefix.PreciseIndex
	e       int
	seedFor func(loraName string) uint64

	stored, removed, cleared      atomic.Uint64
	invalid                       atomic.Uint64
	blockSizeMismatch, otherMedia atomic.Uint64
}

// KVEventApplierStats are an applier's counters, in events.
type KVEventApplierStats struct {
	// Stored, Removed and Cleared count events applied.
	Stored, Removed, Cleared uint64
	// UnknownParents counts BlockStored events whose parent block the index
	// did not know on the endpoint (its own BlockStored was lost, or came
	// before the subscription); they are kept as orphans or joined to a
	// routed prompt (prefix.PreciseIndex). Joined counts the events joined;
	// OrphansDropped the orphan blocks evicted or reset before a join.
	UnknownParents, Joined, OrphansDropped uint64
	// Evicted counts blocks the index evicted because the endpoint held more
	// than its capacity (prefix.PreciseIndex.SetCapacity).
	Evicted uint64
	// BlockSizeMismatch counts BlockStored events skipped because their
	// block size is not the index's; Invalid other skipped BlockStored events
	// (token count not blocks × block size).
	BlockSizeMismatch, Invalid uint64
	// OtherMedia counts events whose medium is not GPU, CPU or DISK (indexed
	// as prefix.MediumOther).
	OtherMedia uint64
}

// NewKVEventApplier returns an applier of endpoint e's events to ix; seedFor
// gives the root seed of a sequence computed under an adapter ("" for the
// base model); see KVSeeds.
func NewKVEventApplier(ix *prefix.PreciseIndex, e int, seedFor func(loraName string) uint64) *KVEventApplier {
	return &KVEventApplier{ix: ix, e: e, seedFor: seedFor}
}

// KVBatch applies b's events in order.
func (a *KVEventApplier) KVBatch(_ uint64, b *KVEventBatch) {
	for i := range b.Events {
		ev := &b.Events[i]
		switch ev.Type {
		case KVBlockStored:
			if ev.BlockSize != 0 && ev.BlockSize != a.ix.BlockSize() {
				a.blockSizeMismatch.Add(1)
				continue
			}
			err := a.ix.Stored(a.e, a.medium(ev.Medium), ev.BlockHashes, ev.ParentBlockHash, ev.HasParent, ev.TokenIDs, a.seedFor(ev.LoRAName))
			if err == nil {
				a.stored.Add(1)
			} else {
				a.invalid.Add(1)
			}
		case KVBlockRemoved:
			a.ix.Removed(a.e, a.medium(ev.Medium), ev.BlockHashes)
			a.removed.Add(1)
		case KVAllBlocksCleared:
			a.ix.Cleared(a.e)
			a.cleared.Add(1)
		case KVTierBlocksCleared:
			a.ix.ClearedMedium(a.e, a.medium(ev.Medium))
			a.cleared.Add(1)
		}
	}
}

// KVReset forgets the endpoint's blocks.
func (a *KVEventApplier) KVReset(KVResetReason) { a.Forget() }

// Forget forgets the endpoint's blocks now. Unlike the handler methods it
// may be called from any goroutine (the owner calls it when the endpoint
// leaves rotation, then KVEventSubscriber.Resync).
func (a *KVEventApplier) Forget() { a.ix.Forget(a.e) }

func (a *KVEventApplier) medium(name string) prefix.Medium {
	m, known := prefix.ParseMedium(name)
	if !known {
		a.otherMedia.Add(1)
	}
	return m
}

// Stats returns the applier's counters.
func (a *KVEventApplier) Stats() KVEventApplierStats {
	ix := a.ix.EndpointStats(a.e)
	return KVEventApplierStats{
		Stored: a.stored.Load(), Removed: a.removed.Load(), Cleared: a.cleared.Load(),
		UnknownParents: ix.UnknownParents, Joined: ix.Joined, OrphansDropped: ix.OrphansDropped, Evicted: ix.Evicted,
		BlockSizeMismatch: a.blockSizeMismatch.Load(), Invalid: a.invalid.Load(), OtherMedia: a.otherMedia.Load(),
	}
}
