// Package hftokenizer reads a Hugging Face tokenizer.json of the byte-level
// BPE family (Llama-3, Qwen2/Qwen2.5/Qwen3, Mistral-Nemo, GPT-2 and the like)
// and turns text into the same token ids as Hugging Face tokenizers (the Rust
// library behind transformers' fast tokenizers, vLLM and SGLang), and renders
// the chat template of tokenizer_config.json (chat.go). See README.md.
package hftokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"

	"github.com/infergate/infergate/gguf"
)

// MaxFileBytes bounds the tokenizer.json and tokenizer_config.json Load
// reads (the largest public byte-level BPE files are ~35 MB).
const MaxFileBytes = 128 << 20

// Tokenizer is one loaded tokenizer.json: added tokens, normalizer,
// pre-tokenizer, BPE model, post-processor and decoder. Safe for concurrent
// use; Encode allocates only its result (and the result's growth) once the
// word cache is warm.
type Tokenizer struct {
	added      *addedMatcher // normalized == false tokens, on the raw text
	addedNorm  *addedMatcher // normalized == true tokens, on the normalized text
	nfc        bool
	steps      []preStep
	model      bpe
	bos, eos   []uint32 // post-processor ids before and after a sequence
	idToBytes  [][]byte // decode: id → raw bytes (vocab) or content (added)
	special    []bool   // id is a special added token
	addedByID  map[uint32]AddedToken
	addedTable []AddedToken
	template   *ChatTemplate // from tokenizer_config.json next to it, or nil
}

// preStep is one pre-tokenizer of the sequence: a regex split and/or the
// ByteLevel prefix space.
type preStep struct {
	split          *splitter // nil: no split
	addPrefixSpace bool
}

// Load reads a tokenizer from path: a tokenizer.json, or a folder holding
// one (and, optionally, the tokenizer_config.json whose chat_template and
// special tokens Template returns), or a GGUF model file, whose embedded
// vocabulary is read as llama.cpp reads it (LoadGGUF).
func Load(path string) (*Tokenizer, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if !st.IsDir() && IsGGUF(path) {
		return LoadGGUF(path, GGUFOptions{})
	}
	file, dir := path, filepath.Dir(path)
	if st.IsDir() {
		file, dir = filepath.Join(path, "tokenizer.json"), path
	}
	raw, err := readBounded(file)
	if err != nil {
		return nil, err
	}
	t, err := Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	cfgPath := filepath.Join(dir, "tokenizer_config.json")
	if cfg, err := readBounded(cfgPath); err == nil {
		tpl, err := ParseConfig(cfg)
		switch {
		case errors.Is(err, ErrNoChatTemplate):
			// A tokenizer without a chat template: Template() is nil.
		case err != nil:
			return nil, fmt.Errorf("%s: %w", cfgPath, err)
		default:
			t.template = tpl
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	return t, nil
}

// IsGGUF reports whether the file at path starts with the GGUF magic (an
// Ollama store's blobs have no .gguf suffix).
func IsGGUF(path string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	var magic [4]byte
	_, err = io.ReadFull(f, magic[:])
	return err == nil && string(magic[:]) == gguf.Magic
}

func readBounded(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, MaxFileBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > MaxFileBytes {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, MaxFileBytes)
	}
	return b, nil
}

// Template returns the chat template of the tokenizer_config.json loaded
// with the tokenizer, or nil if there was none.
func (t *Tokenizer) Template() *ChatTemplate { return t.template }

// The tokenizer.json schema, as far as this package reads it
// (tokenizers/src/tokenizer/serialization.rs, v0.21).
type fileJSON struct {
	AddedTokens   []AddedToken    `json:"added_tokens"`
	Normalizer    *componentJSON  `json:"normalizer"`
	PreTokenizer  *componentJSON  `json:"pre_tokenizer"`
	PostProcessor *componentJSON  `json:"post_processor"`
	Decoder       *componentJSON  `json:"decoder"`
	Model         json.RawMessage `json:"model"`
}

type componentJSON struct {
	Type string `json:"type"`
	// Sequence
	Normalizers   []componentJSON `json:"normalizers"`
	PreTokenizers []componentJSON `json:"pretokenizers"`
	Processors    []componentJSON `json:"processors"`
	Decoders      []componentJSON `json:"decoders"`
	// Split
	Pattern *struct {
		Regex  *string `json:"Regex"`
		String *string `json:"String"`
	} `json:"pattern"`
	Behavior string `json:"behavior"`
	Invert   bool   `json:"invert"`
	// ByteLevel
	AddPrefixSpace bool  `json:"add_prefix_space"`
	UseRegex       *bool `json:"use_regex"`
	// TemplateProcessing
	Single        []map[string]struct{ ID string } `json:"single"`
	SpecialTokens map[string]struct {
		IDs []uint32 `json:"ids"`
	} `json:"special_tokens"`
}

type modelJSON struct {
	Type                    string            `json:"type"`
	Vocab                   map[string]uint32 `json:"vocab"`
	Merges                  []json.RawMessage `json:"merges"`
	IgnoreMerges            bool              `json:"ignore_merges"`
	ByteFallback            bool              `json:"byte_fallback"`
	Dropout                 *float64          `json:"dropout"`
	ContinuingSubwordPrefix *string           `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string           `json:"end_of_word_suffix"`
}

// Parse builds a Tokenizer from the bytes of a tokenizer.json. It refuses,
// with an error naming it, any component outside the byte-level BPE family
// rather than tokenizing differently from the reference.
func Parse(raw []byte) (*Tokenizer, error) {
	var f fileJSON
	if err := json.Unmarshal(raw, &f); err != nil {
		return nil, fmt.Errorf("tokenizer.json: %w", err)
	}
	t := &Tokenizer{}
	if err := t.parseNormalizer(f.Normalizer); err != nil {
		return nil, err
	}
	if err := t.parsePreTokenizer(f.PreTokenizer); err != nil {
		return nil, err
	}
	if err := t.parseModel(f.Model, f.AddedTokens); err != nil {
		return nil, err
	}
	if err := t.parsePostProcessor(f.PostProcessor); err != nil {
		return nil, err
	}
	if err := checkDecoder(f.Decoder); err != nil {
		return nil, err
	}
	var raw0, norm0 []AddedToken
	for _, a := range f.AddedTokens {
		if a.Normalized && t.nfc {
			a.Content = norm.NFC.String(a.Content)
		}
		if a.Normalized {
			norm0 = append(norm0, a)
		} else {
			raw0 = append(raw0, a)
		}
	}
	t.added, t.addedNorm = newAddedMatcher(raw0), newAddedMatcher(norm0)
	return t, nil
}

func (t *Tokenizer) parseNormalizer(c *componentJSON) error {
	if c == nil {
		return nil
	}
	switch c.Type {
	case "NFC":
		t.nfc = true
	case "Sequence":
		for i := range c.Normalizers {
			if err := t.parseNormalizer(&c.Normalizers[i]); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("normalizer %q is not supported (only NFC)", c.Type)
	}
	return nil
}

func (t *Tokenizer) parsePreTokenizer(c *componentJSON) error {
	if c == nil {
		return nil
	}
	switch c.Type {
	case "Sequence":
		for i := range c.PreTokenizers {
			if err := t.parsePreTokenizer(&c.PreTokenizers[i]); err != nil {
				return err
			}
		}
	case "Split":
		// Isolated keeps matches and the text between them as words;
		// Removed drops the delimiters: the matches, or with invert (the
		// pattern then matches what is kept, GPT-4o's files) the text
		// between them (tokenizers/src/pre_tokenizers/split.rs,
		// normalizer.rs NormalizedString::split).
		keep := keepBoth
		switch {
		case c.Behavior == "Isolated":
		case c.Behavior == "Removed" && c.Invert:
			keep = keepMatches
		case c.Behavior == "Removed":
			keep = keepGaps
		default:
			return fmt.Errorf("Split pre-tokenizer with behavior %q is not supported (only Isolated, Removed)", c.Behavior)
		}
		if c.Pattern == nil || (c.Pattern.Regex == nil) == (c.Pattern.String == nil) {
			return errors.New("Split pre-tokenizer needs one pattern, Regex or String")
		}
		pat := ""
		if c.Pattern.Regex != nil {
			pat = *c.Pattern.Regex
		} else {
			pat = regexpQuote(*c.Pattern.String)
		}
		s, err := newSplitter(pat, keep == keepBoth)
		if err != nil {
			return err
		}
		s.keep = keep
		t.steps = append(t.steps, preStep{split: s})
	case "ByteLevel":
		st := preStep{addPrefixSpace: c.AddPrefixSpace}
		if c.UseRegex == nil || *c.UseRegex {
			s, err := newSplitter(gpt2Pattern, true)
			if err != nil {
				return err
			}
			st.split = s
		}
		if st.split != nil || st.addPrefixSpace {
			t.steps = append(t.steps, st)
		}
	default:
		return fmt.Errorf("pre-tokenizer %q is not supported (only Split, ByteLevel, Sequence)", c.Type)
	}
	return nil
}

// regexpQuote escapes s for regexp2 (.NET syntax).
func regexpQuote(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`\*+?|{}[]()^$.#- `, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

func (t *Tokenizer) parseModel(raw json.RawMessage, added []AddedToken) error {
	var m modelJSON
	if err := json.Unmarshal(raw, &m); err != nil {
		return fmt.Errorf("model: %w", err)
	}
	if m.Type != "BPE" && !(m.Type == "" && m.Merges != nil) {
		return fmt.Errorf("model %q is not supported (only BPE)", m.Type)
	}
	if m.ByteFallback || (m.Dropout != nil && *m.Dropout != 0) ||
		(m.ContinuingSubwordPrefix != nil && *m.ContinuingSubwordPrefix != "") ||
		(m.EndOfWordSuffix != nil && *m.EndOfWordSuffix != "") {
		return errors.New("BPE model with byte_fallback, dropout, continuing_subword_prefix or end_of_word_suffix is not supported (byte-level BPE only)")
	}
	return t.buildModel(m.Vocab, len(m.Merges), func(i int) (string, string, error) { return parseMerge(m.Merges[i]) },
		m.IgnoreMerges, added)
}

// buildModel builds the BPE model and the id tables from a vocabulary in
// the byte-level alphabet (an added token's own entry may stand outside
// it), n merges given by rank (merge(i): the pair of rank i) and the added
// tokens: the one construction behind Parse (tokenizer.json) and NewBPE
// (a GGUF's tokenizer.ggml.* fields).
func (t *Tokenizer) buildModel(vocab map[string]uint32, n int, merge func(int) (string, string, error), ignoreMerges bool, added []AddedToken) error {
	addedContent := make(map[string]bool, len(added))
	maxID := uint32(0)
	for _, a := range added {
		addedContent[a.Content] = true
		maxID = max(maxID, a.ID)
	}
	b := &t.model
	b.vocab = make(map[string]uint32, len(vocab))
	for tok, id := range vocab {
		if id >= deadSymbol-1 {
			return fmt.Errorf("vocab id %d out of range", id)
		}
		raw, ok := fromByteLevel(tok)
		if !ok {
			if addedContent[tok] {
				continue // an added token's own entry, matched before the model
			}
			return fmt.Errorf("vocab token %q is not in the byte-level alphabet (not a byte-level BPE)", tok)
		}
		b.vocab[raw] = id
		maxID = max(maxID, id)
	}
	for c := 0; c < 256; c++ {
		b.byteID[c], b.hasByte[c] = b.vocab[string([]byte{byte(c)})]
	}
	b.ignoreMerges = ignoreMerges
	b.merges = make(map[uint64]uint64, n)
	for rank := range n {
		l, r, err := merge(rank)
		if err != nil {
			return fmt.Errorf("merge %d: %w", rank, err)
		}
		lb, ok1 := fromByteLevel(l)
		rb, ok2 := fromByteLevel(r)
		li, ok3 := b.vocab[lb]
		ri, ok4 := b.vocab[rb]
		mi, ok5 := b.vocab[lb+rb]
		if !(ok1 && ok2 && ok3 && ok4 && ok5) {
			return fmt.Errorf("merge %d (%q %q): token out of vocabulary", rank, l, r)
		}
		key := uint64(li)<<32 | uint64(ri)
		if _, dup := b.merges[key]; !dup { // the first (lowest) rank wins, as in HF
			b.merges[key] = uint64(rank)<<32 | uint64(mi)
		}
	}
	// Ids index tables: a file whose ids run far past its token count
	// (hostile or corrupt) must not make Load allocate gigabytes.
	if n := len(b.vocab) + len(added); int(maxID) >= 2*n+1024 {
		return fmt.Errorf("token id %d out of range for %d tokens", maxID, n)
	}
	t.idToBytes = make([][]byte, maxID+1)
	t.special = make([]bool, maxID+1)
	for raw, id := range b.vocab {
		t.idToBytes[id] = []byte(raw)
	}
	t.addedByID = make(map[uint32]AddedToken, len(added))
	for _, a := range added {
		t.idToBytes[a.ID] = []byte(a.Content)
		t.special[a.ID] = a.Special
		t.addedByID[a.ID] = a
	}
	t.addedTable = append([]AddedToken(nil), added...)
	return nil
}

// parseMerge reads one merge in either format: "left right" (tokenizers
// before v0.20) or ["left", "right"] (v0.20 on, which allows spaces).
func parseMerge(raw json.RawMessage) (l, r string, err error) {
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		i := strings.IndexByte(s, ' ')
		if i <= 0 || i == len(s)-1 || strings.IndexByte(s[i+1:], ' ') >= 0 {
			return "", "", fmt.Errorf("merge %q is not \"left right\"", s)
		}
		return s[:i], s[i+1:], nil
	}
	var p []string
	if err := json.Unmarshal(raw, &p); err != nil || len(p) != 2 {
		return "", "", fmt.Errorf("merge %s is neither \"left right\" nor [left, right]", raw)
	}
	return p[0], p[1], nil
}

func (t *Tokenizer) parsePostProcessor(c *componentJSON) error {
	if c == nil {
		return nil
	}
	switch c.Type {
	case "ByteLevel":
		// Offsets only; ids unchanged.
	case "Sequence":
		for i := range c.Processors {
			if err := t.parsePostProcessor(&c.Processors[i]); err != nil {
				return err
			}
		}
	case "TemplateProcessing":
		seen := false
		for _, item := range c.Single {
			if _, ok := item["Sequence"]; ok {
				seen = true
				continue
			}
			sp, ok := item["SpecialToken"]
			if !ok {
				return fmt.Errorf("TemplateProcessing item %v is not supported", item)
			}
			st, ok := c.SpecialTokens[sp.ID]
			if !ok {
				return fmt.Errorf("TemplateProcessing names special token %q it does not define", sp.ID)
			}
			if seen {
				t.eos = append(t.eos, st.IDs...)
			} else {
				t.bos = append(t.bos, st.IDs...)
			}
		}
	default:
		return fmt.Errorf("post-processor %q is not supported (only TemplateProcessing, ByteLevel, Sequence)", c.Type)
	}
	return nil
}

func checkDecoder(c *componentJSON) error {
	if c == nil {
		return nil
	}
	switch c.Type {
	case "ByteLevel":
	case "Sequence":
		for i := range c.Decoders {
			if err := checkDecoder(&c.Decoders[i]); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("decoder %q is not supported (only ByteLevel)", c.Type)
	}
	return nil
}

// Encode returns the token ids of text; with addSpecial, the
// post-processor's special tokens (Llama-3: <|begin_of_text|>) around them,
// as tokenizer(text) does in transformers. A chat rendered by its template
// already holds its special tokens: encode it with addSpecial false, as
// transformers' apply_chat_template and vLLM do.
//
// The error is non-nil only when a pre-tokenizer pattern that the built-in
// scanner does not cover exceeds its match budget (ErrRegexTimeout).
// Invalid UTF-8 is encoded byte by byte, never rejected.
func (t *Tokenizer) Encode(text string, addSpecial bool) ([]uint32, error) {
	return t.Append(nil, text, addSpecial)
}

// Append is Encode appending to dst.
func (t *Tokenizer) Append(dst []uint32, text string, addSpecial bool) ([]uint32, error) {
	if addSpecial {
		dst = append(dst, t.bos...)
	}
	var err error
	pos := 0
	if !t.added.empty() {
		for pos < len(text) {
			s, e, tok, ok := t.added.next(text, pos)
			if !ok {
				break
			}
			if dst, err = t.appendNormalized(dst, text[pos:s]); err != nil {
				return dst, err
			}
			dst = append(dst, tok.ID)
			pos = e
		}
	}
	if dst, err = t.appendNormalized(dst, text[pos:]); err != nil {
		return dst, err
	}
	if addSpecial {
		dst = append(dst, t.eos...)
	}
	return dst, nil
}

// appendNormalized normalizes a piece between raw added tokens, then cuts
// out the normalized added tokens, then pre-tokenizes and merges the rest.
func (t *Tokenizer) appendNormalized(dst []uint32, piece string) ([]uint32, error) {
	if piece == "" {
		return dst, nil
	}
	if t.nfc && !norm.NFC.IsNormalString(piece) {
		piece = norm.NFC.String(piece)
	}
	var err error
	pos := 0
	if !t.addedNorm.empty() {
		for pos < len(piece) {
			s, e, tok, ok := t.addedNorm.next(piece, pos)
			if !ok {
				break
			}
			if dst, err = t.appendPre(dst, piece[pos:s], 0); err != nil {
				return dst, err
			}
			dst = append(dst, tok.ID)
			pos = e
		}
	}
	return t.appendPre(dst, piece[pos:], 0)
}

// appendPre runs pre-tokenizer step k and the following ones over text, and
// the model over each final pre-token.
func (t *Tokenizer) appendPre(dst []uint32, text string, k int) ([]uint32, error) {
	if text == "" {
		return dst, nil
	}
	if k == len(t.steps) {
		return t.model.appendWord(dst, text), nil
	}
	st := &t.steps[k]
	var err error
	if st.split == nil {
		return t.appendPre(dst, prefixSpace(text, st.addPrefixSpace), k+1)
	}
	if st.split.fast {
		for i := 0; i < len(text); {
			if st.split.tiktokenGo {
				return t.appendTiktokenGo(dst, text, k)
			}
			e := scanOne(text, i, st.split.maxDigits)
			if dst, err = t.appendPre(dst, prefixSpace(text[i:e], st.addPrefixSpace), k+1); err != nil {
				return dst, err
			}
			i = e
		}
		return dst, nil
	}
	idx, err := st.split.re.FindAllStringIndex(text, -1)
	if err != nil {
		return dst, fmt.Errorf("%w: %v", ErrRegexTimeout, err)
	}
	keep := st.split.keep
	prev := 0
	for _, m := range idx {
		if m[0] == m[1] {
			continue
		}
		if m[0] > prev && keep != keepMatches {
			if dst, err = t.appendPre(dst, prefixSpace(text[prev:m[0]], st.addPrefixSpace), k+1); err != nil {
				return dst, err
			}
		}
		if keep != keepGaps {
			if dst, err = t.appendPre(dst, prefixSpace(text[m[0]:m[1]], st.addPrefixSpace), k+1); err != nil {
				return dst, err
			}
		}
		prev = m[1]
	}
	if prev < len(text) && keep != keepMatches {
		dst, err = t.appendPre(dst, prefixSpace(text[prev:], st.addPrefixSpace), k+1)
	}
	return dst, err
}

// appendTiktokenGo is appendPre's split for TiktokenGoCl100k: the text
// between DEL bytes (U+007F, which tiktoken-go's matcher drops: no set of
// its pattern holds it) cut as scanOne and tiktokenGoEnd cut it, a
// whitespace run before a DEL ending as before a non-space (the pattern's
// `\s+(?!\S)`).
func (t *Tokenizer) appendTiktokenGo(dst []uint32, text string, k int) ([]uint32, error) {
	var err error
	for len(text) > 0 {
		seg, rest, del := strings.Cut(text, "\x7f")
		for i := 0; i < len(seg); {
			e := tiktokenGoEnd(seg, i, scanOne(seg, i, 3))
			if del && e == len(seg) {
				e = beforeNonSpace(seg, i)
			}
			if dst, err = t.appendPre(dst, seg[i:e], k+1); err != nil {
				return dst, err
			}
			i = e
		}
		text = rest
	}
	return dst, nil
}

// beforeNonSpace is where the pre-token at i of seg ends when a non-space
// that no alternative matches follows seg: a run of spaces without a
// newline keeps all but its last rune for `\s+(?!\S)` (the last rune is
// then a pre-token of its own, `\s+`); any other pre-token ends as at the
// end of the text.
func beforeNonSpace(seg string, i int) int {
	for k := i; k < len(seg); {
		c, w := classAt(seg, k)
		if c != clSpace {
			return len(seg)
		}
		k += w
	}
	_, lw := utf8.DecodeLastRuneInString(seg[i:])
	if len(seg)-lw > i {
		return len(seg) - lw
	}
	return len(seg)
}

// prefixSpace is the ByteLevel pre-tokenizer's add_prefix_space: a space
// before every piece that does not start with one (byte_level.rs).
func prefixSpace(s string, add bool) string {
	if !add || strings.HasPrefix(s, " ") {
		return s
	}
	return " " + s
}

// Decode returns the text of ids: the bytes of each token (added tokens
// their content), with invalid UTF-8 replaced by U+FFFD per maximal invalid
// subsequence, as Rust's String::from_utf8_lossy and WHATWG's TextDecoder
// do. skipSpecial drops special added tokens. Unknown ids are skipped.
func (t *Tokenizer) Decode(ids []uint32, skipSpecial bool) string {
	var b []byte
	for _, id := range ids {
		if int(id) >= len(t.idToBytes) || (skipSpecial && t.special[id]) {
			continue
		}
		b = append(b, t.idToBytes[id]...)
	}
	return lossyUTF8(b)
}

// lossyUTF8 converts b to a string, one U+FFFD for each maximal subpart of
// an ill-formed sequence (Unicode §3.9, "U+FFFD substitution of maximal
// subparts").
func lossyUTF8(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	var out strings.Builder
	out.Grow(len(b) + 8)
	for i := 0; i < len(b); {
		r, w := utf8.DecodeRune(b[i:])
		if r != utf8.RuneError || w > 1 {
			out.Write(b[i : i+w])
			i += w
			continue
		}
		out.WriteRune(utf8.RuneError)
		i += maximalSubpart(b[i:])
	}
	return out.String()
}

// maximalSubpart returns the length (≥ 1) of the longest prefix of b that
// starts a well-formed UTF-8 sequence without completing one.
func maximalSubpart(b []byte) int {
	c := b[0]
	var need int
	lo, hi := byte(0x80), byte(0xBF)
	switch {
	case c >= 0xC2 && c <= 0xDF:
		need = 1
	case c == 0xE0:
		need, lo = 2, 0xA0
	case c >= 0xE1 && c <= 0xEC, c == 0xEE, c == 0xEF:
		need = 2
	case c == 0xED:
		need, hi = 2, 0x9F
	case c == 0xF0:
		need, lo = 3, 0x90
	case c >= 0xF1 && c <= 0xF3:
		need = 3
	case c == 0xF4:
		need, hi = 3, 0x8F
	default:
		return 1
	}
	n := 1
	for k := 0; k < need && n < len(b); k++ {
		x := b[n]
		if k == 0 && (x < lo || x > hi) || k > 0 && (x < 0x80 || x > 0xBF) {
			break
		}
		n++
	}
	return n
}

// TokenID returns the id of an added token's content or of a vocabulary
// token given as raw text.
func (t *Tokenizer) TokenID(s string) (uint32, bool) {
	for _, a := range t.addedTable {
		if a.Content == s {
			return a.ID, true
		}
	}
	id, ok := t.model.vocab[s]
	return id, ok
}

// TokenString returns the token of id as tokenizer.json spells it: an
// added token's content, a vocabulary token in the byte-level alphabet
// ("Ġthe" for " the"), as transformers' convert_ids_to_tokens and vLLM's
// /tokenize token_strs give it; ok is false for an unknown id.
func (t *Tokenizer) TokenString(id uint32) (s string, ok bool) {
	if int(id) >= len(t.idToBytes) || t.idToBytes[id] == nil {
		return "", false
	}
	if a, ok := t.addedByID[id]; ok {
		return a.Content, true
	}
	var b strings.Builder
	for _, c := range t.idToBytes[id] {
		b.WriteRune(byteToRune[c])
	}
	return b.String(), true
}

// VocabSize is the number of ids, added tokens included (the largest id + 1).
func (t *Tokenizer) VocabSize() int { return len(t.idToBytes) }

// SpecialIDs returns the ids the post-processor adds before and after a
// sequence when Encode's addSpecial is true.
func (t *Tokenizer) SpecialIDs() (before, after []uint32) { return t.bos, t.eos }

// byteLevel alphabet: GPT-2's bytes_to_unicode (openai/gpt-2
// src/encoder.py; tokenizers/src/pre_tokenizers/byte_level.rs): printable
// Latin-1 bytes stand for themselves, the other 68 bytes for U+0100 on.
var byteToRune, runeToByte = func() ([256]rune, map[rune]byte) {
	var b2r [256]rune
	r2b := make(map[rune]byte, 256)
	n := 0
	for b := 0; b < 256; b++ {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			b2r[b] = rune(b)
		} else {
			b2r[b] = rune(256 + n)
			n++
		}
		r2b[b2r[b]] = byte(b)
	}
	return b2r, r2b
}()

// fromByteLevel maps a vocabulary string in the byte-level alphabet back
// to raw bytes; ok is false if a rune is outside the alphabet.
func fromByteLevel(s string) (string, bool) {
	out := make([]byte, 0, len(s))
	for _, r := range s {
		b, ok := runeToByte[r]
		if !ok {
			return "", false
		}
		out = append(out, b)
	}
	return string(out), true
}
