package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Wire decoding: one msgpack payload → Batch, both vLLM encodings
// (docs/PROTOCOLS.md §1.4), bounded against hostile payloads.

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

// DecodeBatch decodes one msgpack Batch payload as vLLM
// publishes it, in either encoding (docs/PROTOCOLS.md §1.4): the batch an array
// [ts, events, dp_rank?] or a map {ts, events, data_parallel_rank}; each
// event an array (tag first, fields by position, missing trailing fields
// null, extra ones ignored) or a map (tag under "type", unknown keys
// ignored). Integers are accepted in any msgpack width. It fails on a
// payload that is not msgpack or whose known fields have the wrong type.
func DecodeBatch(payload []byte) (Batch, error) {
	r := bytes.NewReader(payload)
	d := msgpack.GetDecoder()
	defer msgpack.PutDecoder(d)
	d.Reset(r)
	kd := kvDecoder{d: d, r: r}
	b, err := kd.batch()
	if err != nil {
		return Batch{}, fmt.Errorf("kv events: %w", err)
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
func (kd *kvDecoder) field(ev *Event, name string) error {
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
	case "lora_id":
		ev.LoRAID, err = kd.optInt(name, 0)
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

func kvTag(s []byte) Type {
	switch string(s) {
	case "BlockStored":
		return BlockStored
	case "BlockRemoved":
		return BlockRemoved
	case "AllBlocksCleared":
		return AllBlocksCleared
	case "TierBlocksCleared":
		return TierBlocksCleared
	}
	return 0
}

// event reads one event; a zero Type means an unknown tag.
func (kd *kvDecoder) event() (Event, error) {
	ev := Event{GroupIdx: -1}
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
		case BlockStored:
			names = kvStoredFields[:]
		case BlockRemoved:
			names = kvRemovedFields[:]
		case TierBlocksCleared:
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
func (kd *kvDecoder) events(b *Batch) error {
	n, err := kd.d.DecodeArrayLen()
	if err != nil {
		return fmt.Errorf("events: %w", err)
	}
	b.Events = make([]Event, 0, kd.capHint(n))
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

func (kd *kvDecoder) batch() (Batch, error) {
	b := Batch{DataParallelRank: -1}
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
