package gguf

import (
	"bytes"
	"reflect"
	"strings"
	"testing"
)

// ReadMetadata returns what Generate wrote: every key, in order, with its
// type.
func TestReadMetadataRoundTrip(t *testing.T) {
	o := small()
	b := gen(t, o)
	m, err := ReadMetadata(bytes.NewReader(b), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	p, _ := Plan(o)
	if m.Version != Version || m.TensorCount != uint64(len(p.Tensors)) || !reflect.DeepEqual(m.KVs, p.KVs) {
		t.Fatalf("read %d KVs (version %d, %d tensors), planned %d", len(m.KVs), m.Version, m.TensorCount, len(p.KVs))
	}
	if m.Get("tokenizer.ggml.pre") != "default" || m.Get("absent") != nil {
		t.Fatal("Get")
	}
	kvs := []KV{{"u8", uint8(1)}, {"i8", int8(-2)}, {"u16", uint16(3)}, {"i16", int16(-4)}, {"u32", uint32(5)},
		{"i32", int32(-6)}, {"f32", float32(1.5)}, {"b", true}, {"s", "héllo"}, {"u64", uint64(1 << 40)},
		{"i64", int64(-1 << 40)}, {"f64", 2.25}, {"as", []string{"a", "", "c"}}, {"ai", []int32{1, -1}},
		{"au", []uint32{7}}, {"af", []float32{0.5}}}
	var buf bytes.Buffer
	if err := WriteMetadata(&buf, kvs); err != nil {
		t.Fatal(err)
	}
	m, err = ReadMetadata(bytes.NewReader(buf.Bytes()), Limits{})
	if err != nil || !reflect.DeepEqual(m.KVs, kvs) || m.TensorCount != 0 {
		t.Fatalf("%v: %#v", err, m)
	}
	// Every truncation is an error, never a panic or a partial answer.
	for n := range buf.Len() {
		if _, err := ReadMetadata(bytes.NewReader(buf.Bytes()[:n]), Limits{}); err == nil {
			t.Fatalf("truncated at %d of %d: no error", n, buf.Len())
		}
	}
}

func TestReadMetadataLimits(t *testing.T) {
	write := func(kvs ...KV) []byte {
		var buf bytes.Buffer
		if err := WriteMetadata(&buf, kvs); err != nil {
			t.Fatal(err)
		}
		return buf.Bytes()
	}
	for _, tc := range []struct {
		b    []byte
		lim  Limits
		want string
	}{
		{write(KV{"k", strings.Repeat("x", 100)}), Limits{MaxStringBytes: 99}, "string of 100 bytes"},
		{write(KV{"k", make([]uint32, 10)}), Limits{MaxArrayLen: 9}, "array of 10 elements"},
		{write(KV{"a", "x"}, KV{"b", "y"}), Limits{MaxKVs: 1}, "2 metadata pairs"},
		{write(KV{"k", make([]uint32, 10)}), Limits{MaxTotalBytes: 39}, "metadata larger than 39"},
		{write(KV{"k", []string{"", "", ""}}), Limits{MaxTotalBytes: 40}, "metadata larger than 40"},
		{[]byte("GGUF\x01\x00\x00\x00"), Limits{}, "version 1"},
		{[]byte("GGML\x03\x00\x00\x00"), Limits{}, "not a GGUF"},
	} {
		_, err := ReadMetadata(bytes.NewReader(tc.b), tc.lim)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.lim, err, tc.want)
		}
	}
	// A length past the file's end allocates nothing near it.
	b := write(KV{"k", "x"})
	copy(b[len(b)-9:], []byte{0xff, 0xff, 0xff, 0x00, 0, 0, 0, 0}) // the value's length: 16 MiB - 1
	if _, err := ReadMetadata(bytes.NewReader(b), Limits{}); err == nil || !strings.Contains(err.Error(), "truncated") {
		t.Fatalf("lying length: %v", err)
	}
}

// FuzzReadMetadata: any input is read or refused, never a panic, within
// the limits; what is read writes back to the same bytes.
func FuzzReadMetadata(f *testing.F) {
	var buf bytes.Buffer
	_ = WriteMetadata(&buf, []KV{{"tokenizer.ggml.model", "gpt2"}, {"tokenizer.ggml.tokens", []string{"a", "b", "ab"}},
		{"tokenizer.ggml.merges", []string{"a b"}}, {"tokenizer.ggml.token_type", []int32{1, 1, 1}},
		{"tokenizer.ggml.bos_token_id", uint32(0)}, {"tokenizer.ggml.add_bos_token", true}, {"f", float32(1)}})
	f.Add(buf.Bytes())
	f.Add([]byte("GGUF\x03\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00k\x09\x00\x00\x00\x09\x00\x00\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		lim := Limits{MaxKVs: 64, MaxStringBytes: 1 << 12, MaxArrayLen: 1 << 12, MaxTotalBytes: 1 << 16}
		m, err := ReadMetadata(bytes.NewReader(b), lim)
		if err != nil {
			return
		}
		var out bytes.Buffer
		var kvs []KV
		for _, kv := range m.KVs {
			switch kv.Value.(type) {
			case []uint8, []int8, []uint16, []int16, []bool, []uint64, []int64, []float64:
				return // arrays the writer does not write
			}
			kvs = append(kvs, kv)
		}
		if m.Version != 3 || WriteMetadata(&out, kvs) != nil {
			return
		}
		m2, err := ReadMetadata(bytes.NewReader(out.Bytes()), lim)
		if err != nil || !reflect.DeepEqual(m2.KVs, m.KVs) && !hasNaN(m.KVs) {
			t.Fatalf("rewritten metadata reads back as %v (%v)", m2, err)
		}
	})
}

func hasNaN(kvs []KV) bool {
	for _, kv := range kvs {
		switch v := kv.Value.(type) {
		case float32:
			if v != v {
				return true
			}
		case float64:
			if v != v {
				return true
			}
		case []float32:
			for _, x := range v {
				if x != x {
					return true
				}
			}
		}
	}
	return false
}
