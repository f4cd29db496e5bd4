// Package gguf writes small, deterministic GGUF v3 model files: a
// llama-architecture transformer with random weights and a real byte-level
// BPE tokenizer learned from text. Real inference engines (Ollama, llama.cpp)
// load such a file and serve it through their normal code paths -- tokenizer,
// scheduler, KV cache, prefix reuse, streaming, usage accounting -- on a CPU
// in seconds. The generated text is gibberish; callers should always bound
// generation (max_tokens).
//
// File format: GGUF version 3 as specified in ggml's docs/gguf.md
// (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):
//
//	uint32 magic "GGUF" | uint32 version (3) | uint64 tensor_count |
//	uint64 metadata_kv_count | metadata_kv[] | tensor_info[] |
//	padding to general.alignment | tensor data (each tensor aligned)
//
// All integers are little-endian; strings are a uint64 length followed by
// UTF-8 bytes (no terminator); a metadata value is a uint32 type tag and the
// value; arrays are an element type tag, a uint64 count and the elements.
// A tensor_info is name, uint32 n_dims, uint64 dims[n_dims] (ggml order:
// dims[0] is the contiguous, innermost dimension), uint32 ggml_type and a
// uint64 offset relative to the start of the data section, a multiple of the
// alignment. The llama.* and tokenizer.ggml.* keys follow the "Standardized
// key-value pairs" section of the same document and llama.cpp's
// src/llama-arch.cpp; tensor names follow llama.cpp's LLM_ARCH_LLAMA tensor
// map (token_embd, blk.N.attn_q, ...).
package gguf

import (
	"bufio"
	_ "embed"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
)

// Magic is the first four bytes of every GGUF file.
const Magic = "GGUF"

// Version is the GGUF version this package writes.
const Version = 3

// Alignment is the general.alignment written (and the spec's default).
const Alignment = 32

// Metadata value types (gguf_metadata_value_type).
const (
	TypeUint8   uint32 = 0
	TypeInt8    uint32 = 1
	TypeUint16  uint32 = 2
	TypeInt16   uint32 = 3
	TypeUint32  uint32 = 4
	TypeInt32   uint32 = 5
	TypeFloat32 uint32 = 6
	TypeBool    uint32 = 7
	TypeString  uint32 = 8
	TypeArray   uint32 = 9
	TypeUint64  uint32 = 10
	TypeInt64   uint32 = 11
	TypeFloat64 uint32 = 12
)

// Tensor element types (ggml_type) used here.
const (
	GGMLTypeF32 uint32 = 0
	GGMLTypeF16 uint32 = 1
)

// general.file_type values (llama_ftype).
const (
	FileTypeAllF32    uint32 = 0
	FileTypeMostlyF16 uint32 = 1
)

//go:embed corpus.txt
var defaultCorpus []byte

// DefaultCorpus returns the small English text (prose, numbers, punctuation,
// code) the tokenizer is trained on when Options.Corpus is empty.
func DefaultCorpus() []byte { return append([]byte(nil), defaultCorpus...) }

// Options describes the model to generate. Zero fields take the defaults
// shown; the defaults give about 4.5M parameters (18 MB as F32).
type Options struct {
	Seed              uint64  // weight RNG seed (0 is a valid seed)
	Name              string  // general.name; "infergate-tiny"
	ContextLength     int     // llama.context_length; 8192
	EmbeddingLength   int     // llama.embedding_length; 256
	BlockCount        int     // llama.block_count; 4
	FeedForwardLength int     // llama.feed_forward_length; 768
	HeadCount         int     // llama.attention.head_count; 4
	HeadCountKV       int     // llama.attention.head_count_kv; HeadCount
	RMSEpsilon        float32 // llama.attention.layer_norm_rms_epsilon; 1e-5
	RopeFreqBase      float32 // llama.rope.freq_base; 10000
	VocabSize         int     // target vocabulary size incl. specials; 2048
	Corpus            []byte  // tokenizer training text; DefaultCorpus()
	F16               bool    // store 2-D weights as F16 (norms stay F32)
	InitStd           float32 // std of the uniform weight init; 0.02
}

func (o Options) withDefaults() Options {
	def := func(p *int, v int) {
		if *p == 0 {
			*p = v
		}
	}
	def(&o.ContextLength, 8192)
	def(&o.EmbeddingLength, 256)
	def(&o.BlockCount, 4)
	def(&o.FeedForwardLength, 768)
	def(&o.HeadCount, 4)
	def(&o.HeadCountKV, o.HeadCount)
	def(&o.VocabSize, 2048)
	if o.Name == "" {
		o.Name = "infergate-tiny"
	}
	if o.RMSEpsilon == 0 {
		o.RMSEpsilon = 1e-5
	}
	if o.RopeFreqBase == 0 {
		o.RopeFreqBase = 10000
	}
	if o.InitStd == 0 {
		o.InitStd = 0.02
	}
	if len(o.Corpus) == 0 {
		o.Corpus = defaultCorpus
	}
	return o
}

func (o Options) validate() error {
	switch {
	case o.EmbeddingLength <= 0 || o.BlockCount <= 0 || o.FeedForwardLength <= 0 || o.HeadCount <= 0 || o.HeadCountKV <= 0 || o.ContextLength <= 0:
		return errors.New("gguf: sizes must be positive")
	case o.EmbeddingLength%o.HeadCount != 0:
		return fmt.Errorf("gguf: embedding length %d not divisible by head count %d", o.EmbeddingLength, o.HeadCount)
	case o.HeadCount%o.HeadCountKV != 0:
		return fmt.Errorf("gguf: head count %d not divisible by kv head count %d", o.HeadCount, o.HeadCountKV)
	case (o.EmbeddingLength/o.HeadCount)%2 != 0:
		return fmt.Errorf("gguf: head dimension %d must be even (RoPE)", o.EmbeddingLength/o.HeadCount)
	}
	return nil
}

// KV is one metadata key-value pair. Value is one of uint8, int8, uint16,
// int16, uint32, int32, float32, bool, string, uint64, int64, float64, or a
// slice of one of those (an array).
type KV struct {
	Key   string
	Value any
}

// TensorInfo describes one tensor: Dims in ggml order (Dims[0] innermost).
type TensorInfo struct {
	Name   string
	Dims   []uint64
	Type   uint32
	Offset uint64 // relative to the data section
}

// Elements is the product of the dimensions.
func (t TensorInfo) Elements() uint64 {
	n := uint64(1)
	for _, d := range t.Dims {
		n *= d
	}
	return n
}

// Size is the tensor's data size in bytes.
func (t TensorInfo) Size() uint64 {
	if t.Type == GGMLTypeF16 {
		return 2 * t.Elements()
	}
	return 4 * t.Elements()
}

// Model is the planned content of a file: metadata, tensors and vocabulary.
type Model struct {
	Options Options
	Vocab   *Vocab
	KVs     []KV
	Tensors []TensorInfo
}

// Params is the total number of weights.
func (m *Model) Params() uint64 {
	var n uint64
	for _, t := range m.Tensors {
		n += t.Elements()
	}
	return n
}

// Plan trains the tokenizer and lays out metadata and tensors without
// writing anything.
func Plan(opts Options) (*Model, error) {
	o := opts.withDefaults()
	if err := o.validate(); err != nil {
		return nil, err
	}
	v, err := TrainBPE(o.Corpus, o.VocabSize)
	if err != nil {
		return nil, err
	}
	nv := uint64(len(v.Tokens))
	headDim := o.EmbeddingLength / o.HeadCount
	fileType := FileTypeAllF32
	if o.F16 {
		fileType = FileTypeMostlyF16
	}
	ttypes := make([]int32, len(v.Types))
	copy(ttypes, v.Types)
	m := &Model{Options: o, Vocab: v}
	m.KVs = []KV{
		{"general.architecture", "llama"},
		{"general.name", o.Name},
		{"general.alignment", uint32(Alignment)},
		{"general.file_type", fileType},
		{"llama.context_length", uint32(o.ContextLength)},
		{"llama.embedding_length", uint32(o.EmbeddingLength)},
		{"llama.block_count", uint32(o.BlockCount)},
		{"llama.feed_forward_length", uint32(o.FeedForwardLength)},
		{"llama.attention.head_count", uint32(o.HeadCount)},
		{"llama.attention.head_count_kv", uint32(o.HeadCountKV)},
		{"llama.attention.layer_norm_rms_epsilon", o.RMSEpsilon},
		{"llama.rope.freq_base", o.RopeFreqBase},
		{"llama.rope.dimension_count", uint32(headDim)},
		{"llama.vocab_size", uint32(nv)},
		{"tokenizer.ggml.model", "gpt2"},
		{"tokenizer.ggml.pre", "default"},
		{"tokenizer.ggml.tokens", v.Tokens},
		{"tokenizer.ggml.token_type", ttypes},
		{"tokenizer.ggml.merges", v.Merges},
		{"tokenizer.ggml.bos_token_id", uint32(v.ID(BeginOfText))},
		{"tokenizer.ggml.eos_token_id", uint32(v.ID(EndOfTurn))},
		{"tokenizer.ggml.add_bos_token", true},
		{"tokenizer.ggml.add_eos_token", false},
	}

	e, ff, kvDim := uint64(o.EmbeddingLength), uint64(o.FeedForwardLength), uint64(headDim*o.HeadCountKV)
	wt := GGMLTypeF32
	if o.F16 {
		wt = GGMLTypeF16
	}
	add := func(name string, typ uint32, dims ...uint64) {
		m.Tensors = append(m.Tensors, TensorInfo{Name: name, Dims: dims, Type: typ})
	}
	add("token_embd.weight", wt, e, nv)
	for i := 0; i < o.BlockCount; i++ {
		p := fmt.Sprintf("blk.%d.", i)
		add(p+"attn_norm.weight", GGMLTypeF32, e)
		add(p+"attn_q.weight", wt, e, e)
		add(p+"attn_k.weight", wt, e, kvDim)
		add(p+"attn_v.weight", wt, e, kvDim)
		add(p+"attn_output.weight", wt, e, e)
		add(p+"ffn_norm.weight", GGMLTypeF32, e)
		add(p+"ffn_gate.weight", wt, e, ff)
		add(p+"ffn_up.weight", wt, e, ff)
		add(p+"ffn_down.weight", wt, ff, e)
	}
	add("output_norm.weight", GGMLTypeF32, e)
	add("output.weight", wt, e, nv)
	var off uint64
	for i := range m.Tensors {
		m.Tensors[i].Offset = off
		off = align(off + m.Tensors[i].Size())
	}
	return m, nil
}

func align(n uint64) uint64 { return (n + Alignment - 1) / Alignment * Alignment }

// Generate writes a GGUF v3 llama model built from opts to w. The output is
// a pure function of opts: the same options (seed included) give the same
// bytes.
func Generate(w io.Writer, opts Options) error {
	m, err := Plan(opts)
	if err != nil {
		return err
	}
	return m.Write(w)
}

// WriteFile generates the model into path atomically (temporary file in the
// same directory, then rename) and returns its plan.
func WriteFile(path string, opts Options) (*Model, error) {
	m, err := Plan(opts)
	if err != nil {
		return nil, err
	}
	f, err := os.CreateTemp(filepath.Dir(path), ".gguf-*")
	if err != nil {
		return nil, err
	}
	defer os.Remove(f.Name())
	if err := m.Write(f); err != nil {
		f.Close()
		return nil, err
	}
	if err := f.Close(); err != nil {
		return nil, err
	}
	return m, os.Rename(f.Name(), path)
}

// Write serialises the planned model, generating weights on the fly.
func (m *Model) Write(w io.Writer) error {
	bw := bufio.NewWriterSize(w, 1<<20)
	e := &encoder{w: bw}
	e.bytes([]byte(Magic))
	e.u32(Version)
	e.u64(uint64(len(m.Tensors)))
	e.u64(uint64(len(m.KVs)))
	for _, kv := range m.KVs {
		e.str(kv.Key)
		e.value(kv.Value, true)
	}
	for _, t := range m.Tensors {
		e.str(t.Name)
		e.u32(uint32(len(t.Dims)))
		for _, d := range t.Dims {
			e.u64(d)
		}
		e.u32(t.Type)
		e.u64(t.Offset)
	}
	e.pad()
	e.n = 0 // offsets are relative to the data section, which starts aligned
	for i, t := range m.Tensors {
		if e.n != t.Offset {
			return fmt.Errorf("gguf: internal error: tensor %s at %d, planned %d", t.Name, e.n, t.Offset)
		}
		m.writeTensor(e, i, t)
		e.pad()
	}
	if e.err != nil {
		return e.err
	}
	return bw.Flush()
}

// writeTensor fills norms with 1 and every other tensor with uniform noise
// of standard deviation InitStd from a stream keyed by (seed, tensor index).
func (m *Model) writeTensor(e *encoder, idx int, t TensorInfo) {
	n := t.Elements()
	norm := len(t.Dims) == 1
	rng := splitmix64{m.Options.Seed ^ (uint64(idx+1) * 0x9E3779B97F4A7C15)}
	amp := float64(m.Options.InitStd) * math.Sqrt(3)
	var buf [4]byte
	for k := uint64(0); k < n; k++ {
		v := float32(1)
		if !norm {
			// 53 random bits -> [0,1) -> [-amp, amp).
			u := float64(rng.next()>>11) / (1 << 53)
			v = float32((2*u - 1) * amp)
		}
		if t.Type == GGMLTypeF16 {
			binary.LittleEndian.PutUint16(buf[:2], f32ToF16(v))
			e.bytes(buf[:2])
		} else {
			binary.LittleEndian.PutUint32(buf[:], math.Float32bits(v))
			e.bytes(buf[:])
		}
	}
}

// splitmix64 (Steele, Lea, Flood 2014): a tiny generator whose output is
// fixed by its definition, so files stay byte-identical across Go versions.
type splitmix64 struct{ s uint64 }

func (r *splitmix64) next() uint64 {
	r.s += 0x9E3779B97F4A7C15
	z := r.s
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

// f32ToF16 converts to IEEE 754 binary16, rounding to nearest even. The
// weights here are small normal numbers; subnormals flush toward zero
// correctly and overflow saturates to infinity.
func f32ToF16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23&0xff) - 127 + 15
	mant := b & 0x7fffff
	switch {
	case b&0x7fffffff == 0:
		return sign
	case int32(b>>23&0xff) == 0xff: // Inf/NaN
		if mant != 0 {
			return sign | 0x7e00
		}
		return sign | 0x7c00
	case exp >= 0x1f:
		return sign | 0x7c00
	case exp <= 0:
		if exp < -10 {
			return sign
		}
		mant |= 0x800000
		shift := uint32(14 - exp)
		h := mant >> shift
		rem := mant & (1<<shift - 1)
		half := uint32(1) << (shift - 1)
		if rem > half || (rem == half && h&1 == 1) {
			h++
		}
		return sign | uint16(h)
	}
	h := uint32(exp)<<10 | mant>>13
	rem := mant & 0x1fff
	if rem > 0x1000 || (rem == 0x1000 && h&1 == 1) {
		h++ // may carry into the exponent, which is the correct rounding
	}
	return sign | uint16(h)
}

type encoder struct {
	w   *bufio.Writer
	n   uint64
	err error
}

func (e *encoder) bytes(b []byte) {
	if e.err != nil {
		return
	}
	_, e.err = e.w.Write(b)
	e.n += uint64(len(b))
}

func (e *encoder) u32(v uint32) { e.bytes(binary.LittleEndian.AppendUint32(nil, v)) }
func (e *encoder) u64(v uint64) { e.bytes(binary.LittleEndian.AppendUint64(nil, v)) }

func (e *encoder) str(s string) {
	e.u64(uint64(len(s)))
	e.bytes([]byte(s))
}

func (e *encoder) pad() {
	if r := e.n % Alignment; r != 0 {
		e.bytes(make([]byte, Alignment-r))
	}
}

// value writes a metadata value, preceded by its type tag when tagged.
func (e *encoder) value(v any, tagged bool) {
	tag := func(t uint32) {
		if tagged {
			e.u32(t)
		}
	}
	le := binary.LittleEndian
	switch x := v.(type) {
	case uint8:
		tag(TypeUint8)
		e.bytes([]byte{x})
	case int8:
		tag(TypeInt8)
		e.bytes([]byte{byte(x)})
	case uint16:
		tag(TypeUint16)
		e.bytes(le.AppendUint16(nil, x))
	case int16:
		tag(TypeInt16)
		e.bytes(le.AppendUint16(nil, uint16(x)))
	case uint32:
		tag(TypeUint32)
		e.u32(x)
	case int32:
		tag(TypeInt32)
		e.u32(uint32(x))
	case float32:
		tag(TypeFloat32)
		e.u32(math.Float32bits(x))
	case bool:
		tag(TypeBool)
		if x {
			e.bytes([]byte{1})
		} else {
			e.bytes([]byte{0})
		}
	case string:
		tag(TypeString)
		e.str(x)
	case uint64:
		tag(TypeUint64)
		e.u64(x)
	case int64:
		tag(TypeInt64)
		e.u64(uint64(x))
	case float64:
		tag(TypeFloat64)
		e.u64(math.Float64bits(x))
	case []string:
		array(e, tagged, TypeString, x)
	case []int32:
		array(e, tagged, TypeInt32, x)
	case []uint32:
		array(e, tagged, TypeUint32, x)
	case []float32:
		array(e, tagged, TypeFloat32, x)
	default:
		if e.err == nil {
			e.err = fmt.Errorf("gguf: unsupported metadata value type %T", v)
		}
	}
}

func array[T any](e *encoder, tagged bool, elem uint32, xs []T) {
	if tagged {
		e.u32(TypeArray)
	}
	e.u32(elem)
	e.u64(uint64(len(xs)))
	for _, x := range xs {
		e.value(x, false)
	}
}
