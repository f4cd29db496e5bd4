package gguf

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
)

// Limits bound what ReadMetadata reads, so a corrupt or hostile file cannot
// make it allocate without bound. The zero value takes the defaults, sized
// for real models' metadata: Qwen2's 151,936 tokens and 151,387 merges,
// Llama-3's 128,256 and 280,147, templates of tens of kilobytes.
type Limits struct {
	// MaxKVs bounds the number of metadata pairs (default 65,536).
	MaxKVs uint64
	// MaxStringBytes bounds one string: a key, a value, an array element
	// (default 16 MiB: the largest chat templates are ~100 KB).
	MaxStringBytes uint64
	// MaxArrayLen bounds one array's elements (default 4 Mi).
	MaxArrayLen uint64
	// MaxTotalBytes bounds the metadata's decoded size in all: the bytes
	// of every string plus every element of every array (default 512
	// MiB).
	MaxTotalBytes uint64
}

func (l Limits) withDefaults() Limits {
	if l.MaxKVs == 0 {
		l.MaxKVs = 1 << 16
	}
	if l.MaxStringBytes == 0 {
		l.MaxStringBytes = 16 << 20
	}
	if l.MaxArrayLen == 0 {
		l.MaxArrayLen = 4 << 20
	}
	if l.MaxTotalBytes == 0 {
		l.MaxTotalBytes = 512 << 20
	}
	return l
}

// Metadata is the header and key-value metadata of a GGUF file (the tensor
// infos and data are not read).
type Metadata struct {
	Version     uint32
	TensorCount uint64
	KVs         []KV
}

// Get returns the value of key, nil if absent.
func (m *Metadata) Get(key string) any {
	for i := range m.KVs {
		if m.KVs[i].Key == key {
			return m.KVs[i].Value
		}
	}
	return nil
}

// ErrNotGGUF: the file does not start with the GGUF magic.
var ErrNotGGUF = errors.New("gguf: not a GGUF file")

// ReadMetadataFile reads the metadata of the GGUF file at path (see
// ReadMetadata).
func ReadMetadataFile(path string, lim Limits) (*Metadata, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	m, err := ReadMetadata(bufio.NewReaderSize(f, 1<<20), lim)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return m, nil
}

// ReadMetadata reads a GGUF header and its metadata key-value pairs from r
// (ggml docs/gguf.md; versions 2 and 3, whose lengths and counts are
// uint64; version 1's uint32 lengths are refused). Values come back as
// Generate writes them: uint8 … float64, bool, string, and arrays as
// []uint8, []int8, []uint16, []int16, []uint32, []int32, []float32, []bool,
// []string, []uint64, []int64, []float64. An array of arrays is refused
// (no model writes one; llama.cpp's gguf.cpp refuses them too). Every
// length is checked against lim before anything is allocated for it, and
// arrays grow as their elements arrive, so a lying length costs at most
// what the file really holds.
func ReadMetadata(r io.Reader, lim Limits) (*Metadata, error) {
	lim = lim.withDefaults()
	d := &decoder{r: r, lim: lim}
	var magic [4]byte
	if _, err := io.ReadFull(r, magic[:]); err != nil {
		return nil, fmt.Errorf("gguf: reading magic: %w", err)
	}
	if string(magic[:]) != Magic {
		return nil, ErrNotGGUF
	}
	m := &Metadata{Version: d.u32()}
	if d.err == nil && m.Version != 2 && m.Version != 3 {
		return nil, fmt.Errorf("gguf: version %d is not supported (2 or 3)", m.Version)
	}
	m.TensorCount = d.u64()
	n := d.u64()
	if d.err == nil && n > lim.MaxKVs {
		return nil, fmt.Errorf("gguf: %d metadata pairs, more than %d", n, lim.MaxKVs)
	}
	for i := uint64(0); i < n && d.err == nil; i++ {
		key := d.str()
		typ := d.u32()
		if d.err != nil {
			break
		}
		v := d.value(typ, true)
		if d.err != nil {
			d.err = fmt.Errorf("key %q: %w", key, d.err)
			break
		}
		m.KVs = append(m.KVs, KV{Key: key, Value: v})
	}
	if d.err != nil {
		if errors.Is(d.err, io.EOF) || errors.Is(d.err, io.ErrUnexpectedEOF) {
			return nil, fmt.Errorf("gguf: truncated: %w", d.err)
		}
		return nil, fmt.Errorf("gguf: %w", d.err)
	}
	return m, nil
}

type decoder struct {
	r     io.Reader
	lim   Limits
	total uint64 // decoded bytes so far (strings, array elements)
	buf   [8]byte
	err   error
}

func (d *decoder) read(n int) []byte {
	if d.err != nil {
		return d.buf[:n]
	}
	_, d.err = io.ReadFull(d.r, d.buf[:n])
	return d.buf[:n]
}

func (d *decoder) u8() uint8   { return d.read(1)[0] }
func (d *decoder) u16() uint16 { return binary.LittleEndian.Uint16(d.read(2)) }
func (d *decoder) u32() uint32 { return binary.LittleEndian.Uint32(d.read(4)) }
func (d *decoder) u64() uint64 { return binary.LittleEndian.Uint64(d.read(8)) }

// charge counts n decoded bytes against MaxTotalBytes.
func (d *decoder) charge(n uint64) bool {
	if d.err != nil {
		return false
	}
	if n > d.lim.MaxTotalBytes-d.total || d.total > d.lim.MaxTotalBytes {
		d.err = fmt.Errorf("metadata larger than %d bytes", d.lim.MaxTotalBytes)
		return false
	}
	d.total += n
	return true
}

func (d *decoder) str() string {
	n := d.u64()
	if d.err != nil {
		return ""
	}
	if n > d.lim.MaxStringBytes {
		d.err = fmt.Errorf("string of %d bytes, more than %d", n, d.lim.MaxStringBytes)
		return ""
	}
	if !d.charge(n) {
		return ""
	}
	// Read through a bounded copy: n was checked, but the file may end
	// before it.
	b := make([]byte, 0, min(n, 64<<10))
	for uint64(len(b)) < n && d.err == nil {
		k := int(min(n-uint64(len(b)), 64<<10))
		b = slices.Grow(b, k)
		b = b[:len(b)+k]
		_, d.err = io.ReadFull(d.r, b[len(b)-k:])
	}
	return string(b)
}

// elemSize is the encoded size of a scalar type (0: not a fixed-size
// scalar).
func elemSize(typ uint32) uint64 {
	switch typ {
	case TypeUint8, TypeInt8, TypeBool:
		return 1
	case TypeUint16, TypeInt16:
		return 2
	case TypeUint32, TypeInt32, TypeFloat32:
		return 4
	case TypeUint64, TypeInt64, TypeFloat64:
		return 8
	}
	return 0
}

// value reads one value of typ; arrays only when top (no nesting).
func (d *decoder) value(typ uint32, top bool) any {
	switch typ {
	case TypeUint8:
		return d.u8()
	case TypeInt8:
		return int8(d.u8())
	case TypeUint16:
		return d.u16()
	case TypeInt16:
		return int16(d.u16())
	case TypeUint32:
		return d.u32()
	case TypeInt32:
		return int32(d.u32())
	case TypeFloat32:
		return math.Float32frombits(d.u32())
	case TypeBool:
		return d.boolean()
	case TypeString:
		return d.str()
	case TypeUint64:
		return d.u64()
	case TypeInt64:
		return int64(d.u64())
	case TypeFloat64:
		return math.Float64frombits(d.u64())
	case TypeArray:
		if !top {
			d.err = errors.New("array of arrays")
			return nil
		}
		return d.array()
	}
	if d.err == nil {
		d.err = fmt.Errorf("unknown value type %d", typ)
	}
	return nil
}

func (d *decoder) boolean() bool {
	b := d.u8()
	if d.err == nil && b > 1 {
		d.err = fmt.Errorf("bool value %d", b)
	}
	return b == 1
}

func (d *decoder) array() any {
	typ := d.u32()
	n := d.u64()
	if d.err != nil {
		return nil
	}
	if n > d.lim.MaxArrayLen {
		d.err = fmt.Errorf("array of %d elements, more than %d", n, d.lim.MaxArrayLen)
		return nil
	}
	if sz := elemSize(typ); sz > 0 && !d.charge(n*sz) {
		return nil
	}
	switch typ {
	case TypeUint8:
		return readArray(d, n, d.u8)
	case TypeInt8:
		return readArray(d, n, func() int8 { return int8(d.u8()) })
	case TypeUint16:
		return readArray(d, n, d.u16)
	case TypeInt16:
		return readArray(d, n, func() int16 { return int16(d.u16()) })
	case TypeUint32:
		return readArray(d, n, d.u32)
	case TypeInt32:
		return readArray(d, n, func() int32 { return int32(d.u32()) })
	case TypeFloat32:
		return readArray(d, n, func() float32 { return math.Float32frombits(d.u32()) })
	case TypeBool:
		return readArray(d, n, d.boolean)
	case TypeString:
		// Each element also costs its string header (16 bytes) in memory.
		return readArray(d, n, func() string {
			if !d.charge(16) {
				return ""
			}
			return d.str()
		})
	case TypeUint64:
		return readArray(d, n, d.u64)
	case TypeInt64:
		return readArray(d, n, func() int64 { return int64(d.u64()) })
	case TypeFloat64:
		return readArray(d, n, func() float64 { return math.Float64frombits(d.u64()) })
	case TypeArray:
		d.err = errors.New("array of arrays")
	default:
		d.err = fmt.Errorf("unknown array element type %d", typ)
	}
	return nil
}

// readArray reads n elements with next, growing the slice as they arrive.
func readArray[T any](d *decoder, n uint64, next func() T) []T {
	out := make([]T, 0, min(n, 4096))
	for i := uint64(0); i < n && d.err == nil; i++ {
		v := next()
		if d.err == nil {
			out = append(out, v)
		}
	}
	return out
}

// WriteMetadata writes a GGUF v3 file of kvs and no tensors: a vocabulary-
// only model as llama.cpp's models/ggml-vocab-*.gguf are (values as
// Model.KVs take them).
func WriteMetadata(w io.Writer, kvs []KV) error {
	bw := bufio.NewWriterSize(w, 1<<20)
	e := &encoder{w: bw}
	e.bytes([]byte(Magic))
	e.u32(Version)
	e.u64(0)
	e.u64(uint64(len(kvs)))
	for _, kv := range kvs {
		e.str(kv.Key)
		e.value(kv.Value, true)
	}
	if e.err != nil {
		return e.err
	}
	return bw.Flush()
}
