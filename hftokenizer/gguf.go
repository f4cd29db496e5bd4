package hftokenizer

import (
	"fmt"
	"slices"

	"github.com/infergate/infergate/gguf"
)

// GGUF dialects: the engine whose reading of a GGUF's vocabulary LoadGGUF
// follows. They differ in the pre-tokenizer a tokenizer.ggml.pre name
// selects and in their defaults.
const (
	// DialectLlamaCpp is llama.cpp's (llama-server, and Ollama's llama.cpp
	// runner): src/llama-vocab.cpp, llama_vocab::impl::load and
	// llm_tokenizer_bpe, as vendored by Ollama v0.17.4.
	DialectLlamaCpp = "llama.cpp"
	// DialectOllama is Ollama v0.17.4 as it picks a runner
	// (llm/server.go, NewLlamaServer): an architecture that requires its
	// Go engine (fs/ggml/ggml.go, OllamaEngineRequired) is read as that
	// engine's model reads it (qwen3 and qwen3moe here; others refused),
	// any other, llama and qwen2 included, by its llama.cpp runner:
	// DialectLlamaCpp's reading.
	DialectOllama = "ollama"
	// DialectOllamaEngine is Ollama's Go engine forced on a llama
	// architecture (OLLAMA_NEW_ENGINE=1): model/models/llama/model.go and
	// tokenizer/bytepairencoding.go of Ollama v0.17.4.
	DialectOllamaEngine = "ollama-engine"
)

// ollamaEngineRequired are the architectures Ollama v0.17.4 serves only
// with its Go engine (fs/ggml/ggml.go, KV.OllamaEngineRequired).
var ollamaEngineRequired = []string{"bert", "deepseek2", "deepseekocr", "gemma3", "gemma3n", "gptoss", "gpt-oss",
	"llama4", "mistral3", "mllama", "nemotron_h", "nemotron_h_moe", "nomic-bert", "olmo3", "qwen25vl", "qwen3",
	"qwen3moe", "qwen35", "qwen35moe", "qwen3next", "qwen3vl", "qwen3vlmoe", "glm4moelite", "glmocr", "lfm2", "lfm2moe"}

// Pre-tokenizer patterns of llama.cpp's llm_tokenizer_bpe (regex_exprs),
// by LLAMA_VOCAB_PRE_TYPE. llama.cpp writes Llama-3's and Qwen2's
// contractions as (?:'[sS]|'[tT]|…), the same language as tokenizer.json's
// (?i:'s|'t|…) for every input regexp2 and the scanner see (package
// README: 'ſ), so tokenizer.json's text is used and the scanner runs them.
var (
	ggufLlama3  = []string{llama3Pattern}
	ggufQwen2   = []string{qwen2Pattern}
	ggufGPT2    = []string{`'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`}
	ggufDefault = []string{`[\p{P}\$\+<=>\^~\|]+`, `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`,
		`\p{N}+`, `[0-9][0-9][0-9]`}
)

// llamaCppPre maps tokenizer.ggml.pre to llama.cpp's patterns and whether
// the type sets ignore_merges and add_bos (llama_vocab::impl::load).
// Names llama.cpp maps to other pre-tokenizers are refused here.
func llamaCppPre(name string) (pats []string, ignoreMerges, addBOS bool, ok bool) {
	switch name {
	case "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2":
		return ggufLlama3, true, true, true
	case "dbrx", "smaug-bpe":
		return ggufLlama3, false, false, true
	case "qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan":
		return ggufQwen2, false, false, true
	case "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
		"exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling":
		return ggufGPT2, false, false, true
	case "default":
		return ggufDefault, false, false, true
	}
	return nil, false, false, false
}

// ollamaPre maps tokenizer.ggml.pre as Ollama's llama model does: qwen2
// and refact by name, "default" to the byte-level default (GPT-2's
// pattern with a final \s+), any other name to Llama-3's; Ollama's BPE
// takes a pre-token that is a token whole (ignore_merges, always).
func ollamaPre(name string) []string {
	switch name {
	case "default":
		return []string{gpt2Pattern}
	case "qwen2":
		return ggufQwen2
	case "refact":
		return []string{`\p{N}`, gpt2Pattern}
	case "tekken":
		return nil // refused: no scanner or tested reading of it here
	}
	return ggufLlama3
}

// GGUFOptions tune LoadGGUF.
type GGUFOptions struct {
	// Dialect is the engine whose reading is followed (DialectLlamaCpp
	// when empty).
	Dialect string
	// Limits bound the metadata read (gguf.Limits' defaults when zero).
	Limits gguf.Limits
}

// LoadGGUF reads the vocabulary embedded in a GGUF model file (only the
// metadata is read, bounded by opts.Limits): a byte-level BPE
// (tokenizer.ggml.model "gpt2") with its tokens, token types, merges,
// pre-tokenizer (tokenizer.ggml.pre, mapped to the dialect's patterns),
// BOS/EOS ids and add_bos_token/add_eos_token, and chat template
// (tokenizer.chat_template). Other models (SentencePiece "llama", "bert",
// "t5", …) and pre-tokenizers without a mapping here are refused.
func LoadGGUF(path string, opts GGUFOptions) (*Tokenizer, error) {
	m, err := gguf.ReadMetadataFile(path, opts.Limits)
	if err != nil {
		return nil, err
	}
	t, err := FromGGUF(m, opts.Dialect)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return t, nil
}

// FromGGUF builds the tokenizer of GGUF metadata m as dialect reads it
// (see LoadGGUF).
func FromGGUF(m *gguf.Metadata, dialect string) (*Tokenizer, error) {
	str := func(k string) (string, error) {
		switch v := m.Get(k).(type) {
		case string:
			return v, nil
		case nil:
			return "", nil
		default:
			return "", fmt.Errorf("%s is a %T, not a string", k, v)
		}
	}
	model, err := str("tokenizer.ggml.model")
	if err != nil {
		return nil, err
	}
	if model != "gpt2" {
		return nil, fmt.Errorf("tokenizer.ggml.model %q is not supported (only gpt2: byte-level BPE)", model)
	}
	pre, err := str("tokenizer.ggml.pre")
	if err != nil {
		return nil, err
	}
	tokens, ok := m.Get("tokenizer.ggml.tokens").([]string)
	if !ok {
		return nil, fmt.Errorf("tokenizer.ggml.tokens missing or not a string array")
	}
	var v BPEVocab
	v.Tokens = tokens
	if merges := m.Get("tokenizer.ggml.merges"); merges != nil {
		if v.Merges, ok = merges.([]string); !ok {
			return nil, fmt.Errorf("tokenizer.ggml.merges is a %T, not a string array", merges)
		}
	}
	switch tt := m.Get("tokenizer.ggml.token_type").(type) {
	case nil:
	case []int32:
		v.Types = tt
	case []uint32:
		v.Types = make([]int32, len(tt))
		for i, x := range tt {
			v.Types[i] = int32(x)
		}
	default:
		return nil, fmt.Errorf("tokenizer.ggml.token_type is a %T, not an integer array", tt)
	}
	addBOS, addEOS := false, false
	switch dialect {
	case "", DialectLlamaCpp:
		pats, ignore, bos, known := llamaCppPre(pre)
		if !known {
			return nil, fmt.Errorf("tokenizer.ggml.pre %q is not supported for llama.cpp (llama3, qwen2, gpt-2 and default families)", pre)
		}
		v.Patterns, v.IgnoreMerges, addBOS = pats, ignore, bos
	case DialectOllama, DialectOllamaEngine:
		arch, err := str("general.architecture")
		if err != nil {
			return nil, err
		}
		switch {
		case dialect == DialectOllamaEngine && arch == "llama":
			if v.Patterns = ollamaPre(pre); v.Patterns == nil {
				return nil, fmt.Errorf("tokenizer.ggml.pre %q is not supported for Ollama's engine", pre)
			}
		case arch == "qwen3" || arch == "qwen3moe": // model/models/qwen3/model.go: Qwen2's pattern, whatever pre
			v.Patterns = ggufQwen2
		case dialect == DialectOllamaEngine || slices.Contains(ollamaEngineRequired, arch):
			return nil, fmt.Errorf("Ollama's Go engine reading of architecture %q is not supported", arch)
		default: // the llama.cpp runner
			return FromGGUF(m, DialectLlamaCpp)
		}
		// Ollama's BPE takes a pre-token that is a token whole; BOS
		// unless add_bos_token says not (c.Bool(…, true)).
		v.IgnoreMerges, addBOS = true, true
	default:
		return nil, fmt.Errorf("GGUF dialect %q (want %s, %s or %s)", dialect, DialectLlamaCpp, DialectOllama, DialectOllamaEngine)
	}
	flag := func(k string, def bool) (bool, error) {
		switch b := m.Get(k).(type) {
		case nil:
			return def, nil
		case bool:
			return b, nil
		default:
			return false, fmt.Errorf("%s is a %T, not a bool", k, b)
		}
	}
	if addBOS, err = flag("tokenizer.ggml.add_bos_token", addBOS); err != nil {
		return nil, err
	}
	if addEOS, err = flag("tokenizer.ggml.add_eos_token", addEOS); err != nil {
		return nil, err
	}
	id := func(k string) (uint32, bool, error) {
		switch x := m.Get(k).(type) {
		case nil:
			return 0, false, nil
		case uint32:
			return x, int(x) < len(tokens), nil
		case int32:
			return uint32(x), x >= 0 && int(x) < len(tokens), nil
		default:
			return 0, false, fmt.Errorf("%s is a %T, not an id", k, x)
		}
	}
	bos, hasBOS, err := id("tokenizer.ggml.bos_token_id")
	if err != nil {
		return nil, err
	}
	eos, hasEOS, err := id("tokenizer.ggml.eos_token_id")
	if err != nil {
		return nil, err
	}
	if addBOS && hasBOS {
		v.Before = []uint32{bos}
	}
	if addEOS && hasEOS {
		v.After = []uint32{eos}
	}
	if hasBOS {
		v.BOSToken = tokens[bos]
	}
	if hasEOS {
		v.EOSToken = tokens[eos]
	}
	if v.ChatTemplate, err = str("tokenizer.chat_template"); err != nil {
		return nil, err
	}
	if slices.Contains(v.Merges, "") {
		return nil, fmt.Errorf("tokenizer.ggml.merges holds an empty merge")
	}
	return NewBPE(v)
}
