package gguf

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"
)

// reader is an independent minimal GGUF v3 parser (ggml docs/gguf.md) used to
// check what Generate writes.
type reader struct {
	b   []byte
	off int
	err error
}

func (r *reader) take(n int) []byte {
	if r.err != nil {
		return make([]byte, n)
	}
	if n < 0 || r.off+n > len(r.b) {
		r.err = fmt.Errorf("short read at %d (+%d of %d)", r.off, n, len(r.b))
		return make([]byte, n)
	}
	p := r.b[r.off : r.off+n]
	r.off += n
	return p
}

func (r *reader) u32() uint32 { return binary.LittleEndian.Uint32(r.take(4)) }
func (r *reader) u64() uint64 { return binary.LittleEndian.Uint64(r.take(8)) }
func (r *reader) str() string { return string(r.take(int(r.u64()))) }

func (r *reader) value(t uint32) any {
	switch t {
	case TypeUint8:
		return r.take(1)[0]
	case TypeInt8:
		return int8(r.take(1)[0])
	case TypeUint16:
		return binary.LittleEndian.Uint16(r.take(2))
	case TypeInt16:
		return int16(binary.LittleEndian.Uint16(r.take(2)))
	case TypeUint32:
		return r.u32()
	case TypeInt32:
		return int32(r.u32())
	case TypeFloat32:
		return math.Float32frombits(r.u32())
	case TypeBool:
		return r.take(1)[0] != 0
	case TypeString:
		return r.str()
	case TypeUint64:
		return r.u64()
	case TypeInt64:
		return int64(r.u64())
	case TypeFloat64:
		return math.Float64frombits(r.u64())
	case TypeArray:
		et, n := r.u32(), r.u64()
		switch et {
		case TypeString:
			xs := make([]string, n)
			for i := range xs {
				xs[i] = r.str()
			}
			return xs
		case TypeInt32:
			xs := make([]int32, n)
			for i := range xs {
				xs[i] = int32(r.u32())
			}
			return xs
		default:
			xs := make([]any, n)
			for i := range xs {
				xs[i] = r.value(et)
			}
			return xs
		}
	}
	r.err = fmt.Errorf("unknown value type %d", t)
	return nil
}

type parsed struct {
	version  uint32
	kv       map[string]any
	order    []string
	tensors  []TensorInfo
	dataOff  int
	fileSize int
}

func parse(t *testing.T, b []byte) *parsed {
	t.Helper()
	r := &reader{b: b}
	if string(r.take(4)) != Magic {
		t.Fatalf("bad magic %q", b[:4])
	}
	p := &parsed{kv: map[string]any{}, fileSize: len(b)}
	p.version = r.u32()
	nt, nkv := r.u64(), r.u64()
	for i := uint64(0); i < nkv && r.err == nil; i++ {
		k := r.str()
		p.kv[k] = r.value(r.u32())
		p.order = append(p.order, k)
	}
	for i := uint64(0); i < nt && r.err == nil; i++ {
		ti := TensorInfo{Name: r.str()}
		nd := r.u32()
		for d := uint32(0); d < nd; d++ {
			ti.Dims = append(ti.Dims, r.u64())
		}
		ti.Type = r.u32()
		ti.Offset = r.u64()
		p.tensors = append(p.tensors, ti)
	}
	if r.err != nil {
		t.Fatal(r.err)
	}
	al := int(p.kv["general.alignment"].(uint32))
	p.dataOff = (r.off + al - 1) / al * al
	return p
}

func small() Options {
	return Options{Seed: 7, EmbeddingLength: 64, BlockCount: 2, FeedForwardLength: 128, HeadCount: 4, HeadCountKV: 2, VocabSize: 600}
}

func gen(t *testing.T, o Options) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := Generate(&buf, o); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestRoundTrip(t *testing.T) {
	for _, f16 := range []bool{false, true} {
		t.Run(fmt.Sprintf("f16=%v", f16), func(t *testing.T) {
			o := small()
			o.F16 = f16
			b := gen(t, o)
			m, err := Plan(o)
			if err != nil {
				t.Fatal(err)
			}
			p := parse(t, b)
			if p.version != 3 {
				t.Fatalf("version %d", p.version)
			}
			if p.kv["general.architecture"] != "llama" || p.kv["tokenizer.ggml.model"] != "gpt2" || p.kv["tokenizer.ggml.pre"] != "default" {
				t.Fatalf("arch/tokenizer keys: %v %v %v", p.kv["general.architecture"], p.kv["tokenizer.ggml.model"], p.kv["tokenizer.ggml.pre"])
			}
			want := map[string]any{
				"general.alignment":                      uint32(32),
				"llama.embedding_length":                 uint32(64),
				"llama.block_count":                      uint32(2),
				"llama.feed_forward_length":              uint32(128),
				"llama.attention.head_count":             uint32(4),
				"llama.attention.head_count_kv":          uint32(2),
				"llama.context_length":                   uint32(8192),
				"llama.rope.dimension_count":             uint32(16),
				"llama.attention.layer_norm_rms_epsilon": float32(1e-5),
				"llama.rope.freq_base":                   float32(10000),
				"llama.vocab_size":                       uint32(len(m.Vocab.Tokens)),
				"tokenizer.ggml.add_bos_token":           true,
			}
			for k, v := range want {
				if !reflect.DeepEqual(p.kv[k], v) {
					t.Errorf("%s = %#v, want %#v", k, p.kv[k], v)
				}
			}
			toks := p.kv["tokenizer.ggml.tokens"].([]string)
			if !reflect.DeepEqual(toks, m.Vocab.Tokens) || !reflect.DeepEqual(p.kv["tokenizer.ggml.merges"].([]string), m.Vocab.Merges) {
				t.Fatal("tokens/merges differ from plan")
			}
			if got := p.kv["tokenizer.ggml.token_type"].([]int32); len(got) != len(toks) {
				t.Fatalf("%d token types for %d tokens", len(got), len(toks))
			}
			bos, eos := p.kv["tokenizer.ggml.bos_token_id"].(uint32), p.kv["tokenizer.ggml.eos_token_id"].(uint32)
			if toks[bos] != BeginOfText || toks[eos] != EndOfTurn {
				t.Fatalf("bos %q eos %q", toks[bos], toks[eos])
			}
			if len(p.order) != len(m.KVs) {
				t.Fatalf("%d kvs, planned %d", len(p.order), len(m.KVs))
			}

			if !reflect.DeepEqual(p.tensors, m.Tensors) {
				t.Fatalf("tensor infos differ:\n%v\n%v", p.tensors, m.Tensors)
			}
			names := map[string]TensorInfo{}
			for _, ti := range p.tensors {
				names[ti.Name] = ti
				if ti.Offset%Alignment != 0 {
					t.Errorf("%s offset %d not aligned", ti.Name, ti.Offset)
				}
				if end := p.dataOff + int(ti.Offset) + int(ti.Size()); end > p.fileSize {
					t.Errorf("%s ends at %d past file end %d", ti.Name, end, p.fileSize)
				}
			}
			nv := uint64(len(toks))
			for name, dims := range map[string][]uint64{
				"token_embd.weight":        {64, nv},
				"output.weight":            {64, nv},
				"output_norm.weight":       {64},
				"blk.0.attn_norm.weight":   {64},
				"blk.1.attn_q.weight":      {64, 64},
				"blk.1.attn_k.weight":      {64, 32},
				"blk.1.attn_v.weight":      {64, 32},
				"blk.1.attn_output.weight": {64, 64},
				"blk.0.ffn_norm.weight":    {64},
				"blk.0.ffn_gate.weight":    {64, 128},
				"blk.0.ffn_up.weight":      {64, 128},
				"blk.0.ffn_down.weight":    {128, 64},
			} {
				ti, ok := names[name]
				if !ok {
					t.Errorf("missing tensor %s", name)
					continue
				}
				if !reflect.DeepEqual(ti.Dims, dims) {
					t.Errorf("%s dims %v, want %v", name, ti.Dims, dims)
				}
			}
			if len(p.tensors) != 2+9*2+1 {
				t.Errorf("%d tensors", len(p.tensors))
			}
			last := p.tensors[len(p.tensors)-1]
			if want := p.dataOff + int(align(last.Offset+last.Size())); want != p.fileSize {
				t.Errorf("file size %d, want %d", p.fileSize, want)
			}

			// Norms are ones; weights are small and finite.
			norm := names["output_norm.weight"]
			if v := math.Float32frombits(binary.LittleEndian.Uint32(b[p.dataOff+int(norm.Offset):])); v != 1 {
				t.Errorf("norm weight %v", v)
			}
			q := names["blk.0.attn_q.weight"]
			data := b[p.dataOff+int(q.Offset) : p.dataOff+int(q.Offset+q.Size())]
			var sum, sq float64
			n := float64(q.Elements())
			for i := uint64(0); i < q.Elements(); i++ {
				var v float64
				if f16 {
					v = f16ToF32(binary.LittleEndian.Uint16(data[2*i:]))
				} else {
					v = float64(math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:])))
				}
				if math.IsNaN(v) || math.Abs(v) > 0.05 {
					t.Fatalf("weight %d = %v", i, v)
				}
				sum += v
				sq += v * v
			}
			if std := math.Sqrt(sq/n - (sum/n)*(sum/n)); math.Abs(std-0.02) > 0.002 {
				t.Errorf("weight std %v, want ~0.02", std)
			}
		})
	}
}

func f16ToF32(h uint16) float64 {
	sign := 1.0
	if h&0x8000 != 0 {
		sign = -1
	}
	exp := int(h>>10) & 0x1f
	mant := float64(h & 0x3ff)
	switch exp {
	case 0:
		return sign * mant * math.Pow(2, -24)
	case 0x1f:
		return math.Inf(int(sign))
	}
	return sign * (1 + mant/1024) * math.Pow(2, float64(exp-15))
}

func TestF16Conversion(t *testing.T) {
	for _, c := range []struct {
		f float32
		h uint16
	}{
		{0, 0}, {1, 0x3c00}, {-2, 0xc000}, {0.5, 0x3800}, {65504, 0x7bff}, {1e6, 0x7c00},
		{float32(math.Pow(2, -24)), 0x0001}, {float32(math.Pow(2, -14)), 0x0400},
		{1 + 1.0/2048, 0x3c00}, // tie rounds to even
		{1 + 3.0/2048, 0x3c02},
	} {
		if got := f32ToF16(c.f); got != c.h {
			t.Errorf("f32ToF16(%v) = %#04x, want %#04x", c.f, got, c.h)
		}
	}
	for i := 0; i < 1000; i++ {
		f := float32(i-500) / 7919
		if d := math.Abs(f16ToF32(f32ToF16(f)) - float64(f)); d > math.Abs(float64(f))/1024+1e-7 {
			t.Errorf("%v round-trips with error %v", f, d)
		}
	}
}

func TestDeterministic(t *testing.T) {
	h := func(o Options) string {
		s := sha256.Sum256(gen(t, o))
		return hex.EncodeToString(s[:])
	}
	o := small()
	a, b := h(o), h(o)
	if a != b {
		t.Fatalf("same options, different bytes: %s vs %s", a, b)
	}
	o.Seed++
	if c := h(o); c == a {
		t.Fatal("different seed, same bytes")
	}
}

// TestDefaultModel checks the default model's size and pins its hash so an
// accidental format change is noticed (update the hash deliberately).
func TestDefaultModel(t *testing.T) {
	m, err := Plan(Options{})
	if err != nil {
		t.Fatal(err)
	}
	if p := m.Params(); p < 3_000_000 || p > 6_000_000 {
		t.Errorf("default model has %d params, want ~4.5M", p)
	}
	if n := len(m.Vocab.Tokens); n < 1000 || n > 4096 {
		t.Errorf("default vocab %d tokens, want 1k-4k", n)
	}
	t.Logf("default model: %d params, %d tokens, %d merges", m.Params(), len(m.Vocab.Tokens), len(m.Vocab.Merges))
	s := sha256.New()
	if err := m.Write(s); err != nil {
		t.Fatal(err)
	}
	const want = "d2f6619553c8b6a3354f5dd87c5f433b966be0b3e5b17aae14eaecbce2de6d2c"
	if got := hex.EncodeToString(s.Sum(nil)); got != want {
		t.Errorf("default model sha256 %s, want %s (update deliberately if the format changed)", got, want)
	}
}

func TestTokenizer(t *testing.T) {
	corpus := DefaultCorpus()
	b, err := os.ReadFile(filepath.Join("..", "data", "vllm_sonnet.txt"))
	if err != nil {
		t.Fatal(err)
	}
	corpus = append(corpus, b...)
	v, err := TrainBPE(corpus, 2048)
	if err != nil {
		t.Fatal(err)
	}
	if len(v.Tokens) != 2048 || len(v.Types) != 2048 {
		t.Fatalf("%d tokens, %d types", len(v.Tokens), len(v.Types))
	}
	// Every byte has its token, at id = byte value.
	for b := 0; b < 256; b++ {
		tok := ByteToToken(byte(b))
		if v.Tokens[b] != tok || v.ID(tok) != b {
			t.Fatalf("byte %d: token %q id %d", b, v.Tokens[b], v.ID(tok))
		}
		if strings.ContainsAny(tok, " \t\n") || utf8.RuneCountInString(tok) != 1 {
			t.Fatalf("byte %d maps to %q", b, tok)
		}
	}
	// Tokens are unique and valid UTF-8.
	seen := map[string]bool{}
	for i, tok := range v.Tokens {
		if seen[tok] {
			t.Fatalf("duplicate token %q", tok)
		}
		seen[tok] = true
		if !utf8.ValidString(tok) || tok == "" {
			t.Fatalf("token %d invalid: %q", i, tok)
		}
	}
	// Every merge joins two known tokens into a known token, and each merge's
	// parts exist before it (rank order).
	known := map[string]bool{}
	for b := 0; b < 256; b++ {
		known[ByteToToken(byte(b))] = true
	}
	for i, m := range v.Merges {
		l, r, ok := strings.Cut(m, " ")
		if !ok || l == "" || r == "" || strings.Contains(r, " ") {
			t.Fatalf("merge %d malformed: %q", i, m)
		}
		if !known[l] || !known[r] {
			t.Fatalf("merge %d %q uses unknown part", i, m)
		}
		if v.ID(l+r) < 0 {
			t.Fatalf("merge %d %q result missing", i, m)
		}
		known[l+r] = true
	}
	// Specials are control tokens at the end.
	for i, s := range SpecialTokens {
		id := len(v.Tokens) - len(SpecialTokens) + i
		if v.Tokens[id] != s || v.Types[id] != TokenTypeControl {
			t.Fatalf("special %q at %d: %q type %d", s, id, v.Tokens[id], v.Types[id])
		}
	}
	// Encode/Decode round trip, including bytes outside the corpus, and the
	// vocabulary actually compresses English.
	for _, s := range []string{
		string(corpus),
		"Shall I compare thee to a summer's day?\n\n  Thou art more lovely\tand more temperate:",
		"héllo wörld — ✓ 日本語 \x00\x01\xff invalid utf8 \xc3",
		"   leading and trailing   ",
		"",
	} {
		ids := v.Encode(s)
		if got := v.Decode(ids); got != s {
			t.Fatalf("round trip of %.40q gave %.40q", s, got)
		}
		for _, id := range ids {
			if id < 0 || id >= len(v.Tokens)-len(SpecialTokens) {
				t.Fatalf("encode produced id %d", id)
			}
		}
	}
	if ids := v.Encode(string(corpus)); float64(len(corpus))/float64(len(ids)) < 3 {
		t.Errorf("compression %.2f bytes/token, want >= 3", float64(len(corpus))/float64(len(ids)))
	}
	if _, err := TrainBPE(corpus, 100); err == nil {
		t.Error("tiny vocab accepted")
	}
}

func TestTokenize(t *testing.T) {
	v, err := TrainBPE(DefaultCorpus(), 1024)
	if err != nil {
		t.Fatal(err)
	}
	text := StartHeader + "user" + EndHeader + "\n\nHello there" + EndOfTurn + StartHeader + "assistant" + EndHeader + "\n\n"
	ids := v.Tokenize(text, true)
	want := []int{v.ID(BeginOfText), v.ID(StartHeader)}
	want = append(want, v.Encode("user")...)
	want = append(want, v.ID(EndHeader))
	want = append(want, v.Encode("\n\nHello there")...)
	want = append(want, v.ID(EndOfTurn), v.ID(StartHeader))
	want = append(want, v.Encode("assistant")...)
	want = append(want, v.ID(EndHeader))
	want = append(want, v.Encode("\n\n")...)
	if !reflect.DeepEqual(ids, want) {
		t.Fatalf("Tokenize = %v, want %v", ids, want)
	}
	if got := v.Decode(ids); got != BeginOfText+text {
		t.Fatalf("Decode(Tokenize) = %q", got)
	}
	if got := v.Tokenize("plain", false); !reflect.DeepEqual(got, v.Encode("plain")) {
		t.Fatalf("Tokenize(plain) = %v", got)
	}
}

func TestPretokenize(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []string
	}{
		{"Hello world", []string{"Hello", " world"}},
		{"it's  fine!!", []string{"it", "'s", " ", " fine", "!!"}},
		{"a\n\nb", []string{"a", "\n", "\n", "b"}},
		{"x   ", []string{"x", "   "}},
		{"12 34abc", []string{"12", " 34", "abc"}},
		{" ?! ok", []string{" ?!", " ok"}},
		{"tab\tend", []string{"tab", "\t", "end"}},
	} {
		got := Pretokenize(c.in)
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("Pretokenize(%q) = %q, want %q", c.in, got, c.want)
		}
		if strings.Join(got, "") != c.in {
			t.Errorf("pieces of %q do not concatenate back", c.in)
		}
	}
}

func TestModelfile(t *testing.T) {
	mf := Modelfile("")
	for _, s := range []string{"FROM ./model.gguf\n", "PARAMETER num_thread 1\n", "PARAMETER num_ctx 4096\n", `PARAMETER stop "<|eot_id|>"`, "<|start_header_id|>assistant<|end_header_id|>\n\n\"\"\"\n"} {
		if !strings.Contains(mf, s) {
			t.Errorf("Modelfile lacks %q:\n%s", s, mf)
		}
	}
	if !strings.HasPrefix(Modelfile("/abs/m.gguf"), "FROM /abs/m.gguf\n") || !strings.HasPrefix(Modelfile("x.gguf"), "FROM ./x.gguf\n") {
		t.Error("FROM path handling")
	}
}

func TestWriteFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.gguf")
	m, err := WriteFile(path, small())
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, gen(t, small())) || m == nil {
		t.Fatal("WriteFile differs from Generate")
	}
	if err := Generate(io.Discard, Options{EmbeddingLength: 100, HeadCount: 3}); err == nil {
		t.Error("invalid shape accepted")
	}
}
