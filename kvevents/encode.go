package kvevents

import (
	"encoding/binary"
	"math"
)

// Wire encoding (vllm/distributed/kv_events.py, msgspec → msgpack).

// Encodings of PublisherConfig.Encoding and AppendBatch.
const (
	// EncodingArray is vLLM before PR #42892: every event is a msgpack array
	// ["BlockStored", f1, f2, ...] (msgspec array_like=True), trailing fields
	// equal to their declared default omitted.
	EncodingArray = "array"
	// EncodingMap is vLLM after PR #42892 (merged 2026-06-09): every event
	// is a msgpack map with the tag under "type" and fields by name, fields
	// equal to their declared default omitted (msgspec omit_defaults). The
	// outer batch stays an array.
	EncodingMap = "map"
)

// AppendBatch appends the msgpack encoding of one vLLM KVEventBatch to
// dst: the array [ts, [events...], dataParallelRank] (EventBatch fields ts,
// events, data_parallel_rank; the publisher always fills the rank). ts is in
// seconds (vLLM: time.time() when the batch is built). encoding is
// EncodingArray or EncodingMap ("" means map).
//
// Events carry the fields of the newest vLLM declaration, in its order:
//
//	BlockStored      block_hashes, parent_block_hash, token_ids, block_size,
//	                 lora_id (adapter id or null), medium ("GPU"),
//	                 lora_name (adapter name or null), extra_keys (one
//	                 entry per block: [lora_name] for an adapter, else
//	                 null), group_idx (0),
//	                 kv_cache_spec_kind ("full_attention"),
//	                 kv_cache_spec_sliding_window (null: the default, omitted)
//	BlockRemoved     block_hashes, medium ("GPU"), group_idx (null: omitted)
//	AllBlocksCleared (no fields)
//	TierBlocksCleared medium ("GPU"); ownership (null: the default, omitted)
//
// medium is Event.Medium, "GPU" when empty (the simulated engine's GPU
// block pool; its host-memory and disk tiers set "CPU" and "DISK", the
// shared remote store "REMOTE"). group_idx and kv_cache_spec_kind are
// those of the simulated engine's one full-attention KV-cache group,
// whatever Event.GroupIdx holds (DecodeBatch fills it). Fields
// without a default (up to lora_name, and BlockRemoved.medium) are always
// written, null included. Integers use the shortest msgpack form, as
// msgspec does; hashes above 2^63-1 are msgpack uint64.
func AppendBatch(dst []byte, ts float64, events []Event, dataParallelRank int, encoding string) []byte {
	asMap := encoding != EncodingArray
	dst = mpArray(dst, 3)
	dst = mpFloat64(dst, ts)
	dst = mpArray(dst, len(events))
	for i := range events {
		dst = appendEvent(dst, &events[i], asMap)
	}
	return mpInt(dst, int64(dataParallelRank))
}

func appendEvent(dst []byte, ev *Event, asMap bool) []byte {
	// field appends a field: its name first in map form.
	field := func(dst []byte, name string) []byte {
		if asMap {
			dst = mpStr(dst, name)
		}
		return dst
	}
	n := 1 // the tag
	switch ev.Type {
	case BlockStored:
		n = 11
	case BlockRemoved:
		n = 3
	case TierBlocksCleared:
		n = 2
	}
	if asMap {
		dst = mpMap(dst, n)
		dst = mpStr(dst, "type")
	} else {
		dst = mpArray(dst, n)
	}
	dst = mpStr(dst, ev.Type.String())
	switch ev.Type {
	case BlockStored:
		dst = field(dst, "block_hashes")
		dst = mpUints(dst, ev.BlockHashes)
		dst = field(dst, "parent_block_hash")
		if ev.HasParent {
			dst = mpUint(dst, ev.ParentBlockHash)
		} else {
			dst = mpNil(dst)
		}
		dst = field(dst, "token_ids")
		dst = mpArray(dst, len(ev.TokenIDs))
		for _, t := range ev.TokenIDs {
			dst = mpUint(dst, uint64(t))
		}
		dst = field(dst, "block_size")
		dst = mpInt(dst, int64(ev.BlockSize))
		dst = field(dst, "lora_id")
		if ev.LoRAName != "" {
			dst = mpInt(dst, int64(ev.LoRAID))
		} else {
			dst = mpNil(dst)
		}
		dst = field(dst, "medium")
		dst = mpStr(dst, medium(ev))
		dst = field(dst, "lora_name")
		if ev.LoRAName != "" {
			dst = mpStr(dst, ev.LoRAName)
		} else {
			dst = mpNil(dst)
		}
		// One entry per block: the block's extra hash keys, [lora_name] for an
		// adapter (the cache salt is folded into the root hash instead), else null.
		dst = field(dst, "extra_keys")
		dst = mpArray(dst, len(ev.BlockHashes))
		for range ev.BlockHashes {
			if ev.LoRAName != "" {
				dst = mpArray(dst, 1)
				dst = mpStr(dst, ev.LoRAName)
			} else {
				dst = mpNil(dst)
			}
		}
		dst = field(dst, "group_idx")
		dst = mpInt(dst, 0)
		dst = field(dst, "kv_cache_spec_kind")
		dst = mpStr(dst, CacheSpecFullAttention)
	case BlockRemoved:
		dst = field(dst, "block_hashes")
		dst = mpUints(dst, ev.BlockHashes)
		dst = field(dst, "medium")
		dst = mpStr(dst, medium(ev))
	case TierBlocksCleared:
		dst = field(dst, "medium")
		dst = mpStr(dst, medium(ev))
	}
	return dst
}

// Minimal msgpack writers (https://github.com/msgpack/msgpack/blob/master/spec.md),
// shortest forms like msgspec.

func mpNil(b []byte) []byte { return append(b, 0xc0) }

func mpArray(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n <= 0xffff:
		return append(b, 0xdc, byte(n>>8), byte(n))
	}
	return append(b, 0xdd, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
}

func mpMap(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x80|byte(n))
	case n <= 0xffff:
		return append(b, 0xde, byte(n>>8), byte(n))
	}
	return append(b, 0xdf, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
}

func mpStr(b []byte, s string) []byte {
	n := len(s)
	switch {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n <= 0xff:
		b = append(b, 0xd9, byte(n))
	case n <= 0xffff:
		b = append(b, 0xda, byte(n>>8), byte(n))
	default:
		b = append(b, 0xdb, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(b, s...)
}

func mpUint(b []byte, v uint64) []byte {
	switch {
	case v < 128:
		return append(b, byte(v))
	case v <= 0xff:
		return append(b, 0xcc, byte(v))
	case v <= 0xffff:
		return append(b, 0xcd, byte(v>>8), byte(v))
	case v <= 0xffffffff:
		return append(b, 0xce, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
}

func mpInt(b []byte, v int64) []byte {
	if v >= 0 {
		return mpUint(b, uint64(v))
	}
	switch {
	case v >= -32:
		return append(b, byte(v))
	case v >= math.MinInt8:
		return append(b, 0xd0, byte(v))
	case v >= math.MinInt16:
		return append(b, 0xd1, byte(v>>8), byte(v))
	case v >= math.MinInt32:
		return append(b, 0xd2, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(v))
}

func mpUints(b []byte, vs []uint64) []byte {
	b = mpArray(b, len(vs))
	for _, v := range vs {
		b = mpUint(b, v)
	}
	return b
}

func mpFloat64(b []byte, f float64) []byte {
	return binary.BigEndian.AppendUint64(append(b, 0xcb), math.Float64bits(f))
}

// medium is the medium field written for ev: Event.Medium, or "GPU" when empty.
func medium(ev *Event) string {
	if ev.Medium == "" {
		return MediumGPU
	}
	return ev.Medium
}
