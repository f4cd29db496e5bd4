// Package prefix turns prompts into chained token-block hashes and keeps the
// gateway's approximate index of which endpoint holds which blocks.
//
// A prompt of n tokens is cut into floor(n/B) full blocks of B tokens (B is the
// block size, 16 by default like vLLM's --block-size); a partial tail block is
// never hashed, as in vLLM's prefix cache (vllm/v1/core/kv_cache_utils.py).
// Block i's hash is
//
//	h_i = xxh64( le64(h_{i-1}) || le32(t_{iB}) || ... || le32(t_{iB+B-1}) )
//
// with h_{-1} = seed. Chaining makes h_i identify the whole prefix up to and
// including block i, so two prompts share block i's hash only if they share all
// of their first (i+1)·B tokens. The seed carries identity that is not in the
// tokens (model, LoRA adapter, cache salt): equal tokens under different seeds
// never match.
package prefix

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"
)

// DefaultBlockSize is the number of tokens per KV block (vLLM's default
// --block-size, vllm/config/cache.py).
const DefaultBlockSize = 16

// hashChunk is how many tokens are staged in the stack buffer per Write.
const hashChunk = 64

// Hashes appends to dst the chained 64-bit hashes of every full blockSize-token
// block of tokens (len(tokens)/blockSize of them) and returns the extended
// slice. It allocates only if dst lacks capacity. blockSize must be > 0; it
// panics otherwise (a configuration error, caught at start-up).
func Hashes(dst []uint64, tokens []uint32, blockSize int, seed uint64) []uint64 {
	if blockSize <= 0 {
		panic("prefix: block size must be positive")
	}
	var d xxhash.Digest
	var buf [8 + 4*hashChunk]byte
	parent := seed
	for start := 0; start+blockSize <= len(tokens); start += blockSize {
		d.Reset()
		binary.LittleEndian.PutUint64(buf[:8], parent)
		_, _ = d.Write(buf[:8])
		block := tokens[start : start+blockSize]
		for len(block) > 0 {
			n := min(len(block), hashChunk)
			for i, t := range block[:n] {
				binary.LittleEndian.PutUint32(buf[4*i:], t)
			}
			_, _ = d.Write(buf[:4*n])
			block = block[n:]
		}
		parent = d.Sum64()
		dst = append(dst, parent)
	}
	return dst
}

// Seed returns the root hash for prompts served under identity id (a model
// name, or a LoRA adapter name, optionally joined with a cache salt). The empty
// string maps to 0.
func Seed(id string) uint64 {
	if id == "" {
		return 0
	}
	return xxhash.Sum64String(id)
}
