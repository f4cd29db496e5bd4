package kvstore

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Keys. The store is content-keyed: one entry per string key. Two key
// spaces share it:
//
//   - native keys, Key{Model, Adapter, Hash}: a vLLM-style chained block
//     hash (64 bits, docs/PROTOCOLS.md §1.5) under a model and a LoRA
//     adapter. Key.String formats them in LMCache's key shape (§6.1),
//     "<model>@1@0@<hash: 16 lower-case hex digits>@kv", with the adapter as an
//     LMCache-style tag "@lora%<adapter>" when there is one; ParseKey
//     reads them back.
//   - LMCache keys, opaque strings written by LMCache over lm:// or into
//     Redis ("<model>@<world_size>@<worker_id>@<chunk_hash hex>@<dtype>[@…]",
//     §6.1). ParseKey reads their model and chunk hash where it can; the
//     events for them carry that hash.

// Key is a native key: the chained hash of one KV block (vLLM's low 64
// bits) computed under Model (the served model name) and Adapter (the LoRA
// adapter name, "" for the base model).
type Key struct {
	Model   string
	Adapter string
	Hash    uint64
}

// NativeDtype is the dtype field of native keys' string form.
const NativeDtype = "kv"

// adapterTag is the LMCache-style tag name native keys carry their adapter in.
const adapterTag = "lora"

// String returns the key's string form:
// "<model>@1@0@<hash %016x>@kv[@lora%<adapter>]".
func (k Key) String() string {
	var b strings.Builder
	b.Grow(len(k.Model) + len(k.Adapter) + 32)
	b.WriteString(k.Model)
	b.WriteString("@1@0@")
	var hex [16]byte
	h := strconv.AppendUint(hex[:0], k.Hash, 16)
	for range 16 - len(h) {
		b.WriteByte('0')
	}
	b.Write(h)
	b.WriteString("@" + NativeDtype)
	if k.Adapter != "" {
		b.WriteString("@" + adapterTag + "%")
		b.WriteString(k.Adapter)
	}
	return b.String()
}

// Validate reports whether k can be stored: a model name without '@' (the
// key separator) and an adapter without '@', each at most MaxNameBytes.
func (k Key) Validate() error {
	switch {
	case k.Model == "":
		return errors.New("kvstore: key without a model")
	case len(k.Model) > MaxNameBytes || len(k.Adapter) > MaxNameBytes:
		return fmt.Errorf("kvstore: model or adapter name over %d bytes", MaxNameBytes)
	case strings.ContainsAny(k.Model, "@ \t\r\n") || strings.ContainsAny(k.Adapter, "@ \t\r\n"):
		return errors.New("kvstore: model and adapter names must not contain '@' or whitespace")
	}
	return nil
}

// MaxNameBytes bounds a model or adapter name of a native key.
const MaxNameBytes = 200

// KeyInfo is what ParseKey learns from a string key.
type KeyInfo struct {
	// Key: the model, the adapter ("" unless a native key's lora tag) and
	// the block or chunk hash (valid when Hashed).
	Key
	// Hashed reports whether the hash field parsed (an LMCache chunk hash
	// is hex of a Python int, possibly negative, or of raw bytes: its low
	// 64 bits are kept, as §1.5 keeps the last 8 bytes).
	Hashed bool
	// Native reports a native key (dtype "kv").
	Native bool
}

// ParseKey reads a string key: a native key (Key.String) or an LMCache key
// of any of its versions (§6.1): v0.4+ "<model>@<ws>@<worker>@<hash>@<dtype>[@tags|@layer]",
// v0.3 "<fmt>@<model>@<ws>@<worker>@<hash>@<dtype>[@tags]", earliest
// "<fmt>@<model>@<ws>@<worker>@<hash>". Keys of no known shape give a zero
// KeyInfo (Hashed false): they are stored and served, but no event can
// name them. ParseKey never fails and reads at most the key.
func ParseKey(s string) KeyInfo {
	if len(s) > MaxKeyBytes {
		return KeyInfo{}
	}
	f := strings.SplitN(s, "@", 16)
	isInt := func(x string) bool {
		_, err := strconv.ParseUint(x, 10, 31)
		return err == nil
	}
	var ki KeyInfo
	var hash string
	rest := []string(nil)
	switch {
	case len(f) >= 5 && isInt(f[1]) && isInt(f[2]):
		ki.Model, hash, rest = f[0], f[3], f[4:]
	case len(f) >= 5 && isInt(f[2]) && isInt(f[3]):
		ki.Model, hash = f[1], f[4]
		if len(f) > 5 {
			rest = f[5:]
		}
	default:
		return KeyInfo{}
	}
	ki.Hash, ki.Hashed = parseChunkHash(hash)
	if !ki.Hashed {
		ki.Model = ""
		return ki
	}
	if len(rest) > 0 && rest[0] == NativeDtype {
		ki.Native = true
		for _, t := range rest[1:] {
			if name, v, ok := strings.Cut(t, "%"); ok && name == adapterTag {
				ki.Adapter = v
			}
		}
	}
	return ki
}

// parseChunkHash reads an LMCache chunk hash: lower- or upper-case hex,
// optionally "-" (Python's format of a negative int) or "0x"; longer than
// 16 digits (hex of raw hash bytes) the last 16 are kept.
func parseChunkHash(h string) (uint64, bool) {
	neg := strings.HasPrefix(h, "-")
	h = strings.TrimPrefix(h, "-")
	h = strings.TrimPrefix(strings.TrimPrefix(h, "0x"), "0X")
	if h == "" || len(h) > 128 {
		return 0, false
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return 0, false
		}
	}
	if len(h) > 16 {
		h = h[len(h)-16:]
	}
	v, err := strconv.ParseUint(h, 16, 64)
	if err != nil {
		return 0, false
	}
	if neg {
		v = -v // two's complement: Python's int & (2^64-1)
	}
	return v, true
}
