package hftokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/nikolalohinski/gonja/v2/builtins"
	"github.com/nikolalohinski/gonja/v2/config"
	"github.com/nikolalohinski/gonja/v2/exec"
	"github.com/nikolalohinski/gonja/v2/loaders"
)

// ChatTemplate is the chat_template of a tokenizer_config.json with the
// special tokens the template may name. It renders a chat the way
// transformers' apply_chat_template does (transformers/utils/chat_template_utils.py,
// v4.5x: a sandboxed Jinja environment with trim_blocks and lstrip_blocks,
// tojson as json.dumps(ensure_ascii=False) keeping key order,
// raise_exception and strftime_now), here with gonja
// (github.com/nikolalohinski/gonja/v2), a Jinja2 implementation in Go.
// Safe for concurrent use.
type ChatTemplate struct {
	Source string
	// BOS, EOS, UNK and PAD are the special tokens' strings from the config
	// ("" when absent), passed to the template as bos_token, eos_token, ...
	BOS, EOS, UNK, PAD string
	// ContentAsString is true when the template takes a message's content
	// as a string (it never loops over it): multi-part content is then
	// flattened as vLLM flattens it for such templates (vllm/entrypoints/
	// chat_utils.py, _resolve_chat_template_content_format: "string").
	ContentAsString bool
	tpl             *exec.Template
}

// Limits on what a chat may hold, so a hostile request cannot make the
// renderer recurse or allocate without bound.
const (
	MaxChatJSONDepth  = 64      // nesting of messages and tools
	MaxRenderedBytes  = 8 << 20 // rendered prompt
	maxTemplateSource = 1 << 20
)

// ErrNoChatTemplate is returned by ParseConfig for a config without one.
var ErrNoChatTemplate = errors.New("tokenizer_config.json has no chat_template")

type configJSON struct {
	ChatTemplate json.RawMessage `json:"chat_template"`
	BOS          json.RawMessage `json:"bos_token"`
	EOS          json.RawMessage `json:"eos_token"`
	UNK          json.RawMessage `json:"unk_token"`
	PAD          json.RawMessage `json:"pad_token"`
}

// ParseConfig reads the chat template and special tokens of a
// tokenizer_config.json. chat_template may be a string or a list of
// {"name", "template"} (the one named "default" is used, as transformers
// does when no name is asked for).
func ParseConfig(raw []byte) (*ChatTemplate, error) {
	var c configJSON
	if err := json.Unmarshal(raw, &c); err != nil {
		return nil, fmt.Errorf("tokenizer_config.json: %w", err)
	}
	src, err := templateSource(c.ChatTemplate)
	if err != nil {
		return nil, err
	}
	t, err := NewChatTemplate(src)
	if err != nil {
		return nil, err
	}
	t.BOS, t.EOS, t.UNK, t.PAD = tokenString(c.BOS), tokenString(c.EOS), tokenString(c.UNK), tokenString(c.PAD)
	return t, nil
}

func templateSource(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", ErrNoChatTemplate
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var named []struct{ Name, Template string }
	if err := json.Unmarshal(raw, &named); err != nil {
		return "", fmt.Errorf("chat_template is neither a string nor a list of named templates: %w", err)
	}
	for _, n := range named {
		if n.Name == "default" {
			return n.Template, nil
		}
	}
	return "", errors.New("chat_template lists no template named \"default\"")
}

// tokenString reads a special token given as a string or as an
// AddedToken object {"content": ...}.
func tokenString(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var o struct{ Content string }
	if json.Unmarshal(raw, &o) == nil {
		return o.Content
	}
	return ""
}

// contentLoop finds a template that iterates over a message's content
// (vLLM's detection looks for the same in the template's AST).
var contentLoop = regexp.MustCompile(`for\s+\w+\s+in\s+\w+(\.content|\[\s*['"]content['"]\s*\])`)

// NewChatTemplate compiles a Jinja chat template. Templates cannot include
// or import other files.
func NewChatTemplate(source string) (*ChatTemplate, error) {
	if len(source) > maxTemplateSource {
		return nil, fmt.Errorf("chat template larger than %d bytes", maxTemplateSource)
	}
	cfg := config.New()
	cfg.TrimBlocks = true
	cfg.LeftStripBlocks = true
	cfg.KeepTrailingNewline = false
	loader, err := loaders.NewMemoryLoader(map[string]string{"/chat_template": source})
	if err != nil {
		return nil, err
	}
	tpl, err := exec.NewTemplate("/chat_template", cfg, loader, chatEnvironment)
	if err != nil {
		return nil, fmt.Errorf("chat template: %w", err)
	}
	return &ChatTemplate{Source: source, tpl: tpl, ContentAsString: !contentLoop.MatchString(source)}, nil
}

// chatEnvironment is gonja's default environment with transformers'
// additions and its tojson.
var chatEnvironment = func() *exec.Environment {
	filters := exec.NewFilterSet(map[string]exec.FilterFunction{}).Update(builtins.Filters)
	if err := filters.Replace("tojson", filterToJSON); err != nil {
		panic(err)
	}
	ctx := exec.EmptyContext().Update(builtins.GlobalFunctions).Update(builtins.GlobalVariables)
	ctx.Set("raise_exception", func(msg string) (string, error) {
		return "", fmt.Errorf("chat template raised: %s", msg)
	})
	return &exec.Environment{
		Context:           ctx,
		Filters:           filters,
		Tests:             builtins.Tests,
		ControlStructures: builtins.ControlStructures,
		Methods:           builtins.Methods,
	}
}()

// Chat is what a chat template renders: the request's messages and tools
// as raw JSON (an OpenAI chat completion request's "messages" and "tools"),
// whether to open the assistant's turn, and any extra template variables
// (chat_template_kwargs, e.g. enable_thinking).
type Chat struct {
	Messages            json.RawMessage
	Tools               json.RawMessage // nil or "null": none
	AddGenerationPrompt bool
	Extra               map[string]any
	// Now is strftime_now's clock (Llama-3.1+ templates print the date);
	// zero means time.Now. Passed in so rendering stays reproducible.
	Now time.Time
	// VLLMMessages applies vLLM's message preprocessing before rendering
	// (vllm/entrypoints/chat_utils.py, _postprocess_messages and
	// _parse_chat_message_content): an assistant's tool-call "arguments"
	// string is parsed into an object (null or "" → {}), an empty
	// "tool_calls" list is dropped, and a null "content" becomes "" — what
	// a vLLM engine renders, where transformers' apply_chat_template
	// (false) takes the messages as given.
	VLLMMessages bool
}

// Render renders c. The messages keep their keys' order (tojson prints
// them as given); multi-part content is flattened to its text parts joined
// with "\n" when ContentAsString. A rendering past MaxRenderedBytes is an
// error.
func (t *ChatTemplate) Render(c Chat) (string, error) {
	out, cut, err := t.RenderPrefix(c, MaxRenderedBytes)
	if err == nil && cut {
		err = errRenderTooLarge
	}
	if err != nil {
		return "", err
	}
	return out, nil
}

// RenderPrefix renders at most the first maxBytes bytes of c (at most
// MaxRenderedBytes): rendering stops there, and cut reports it. The
// template writes its output in order, so the text is the full
// rendering's prefix; a router that only hashes a prompt's first blocks
// pays for no more of a hostile chat than it uses.
func (t *ChatTemplate) RenderPrefix(c Chat, maxBytes int) (text string, cut bool, err error) {
	if maxBytes <= 0 || maxBytes > MaxRenderedBytes {
		maxBytes = MaxRenderedBytes
	}
	text, err = t.render(c, maxBytes)
	if errors.Is(err, errRenderTooLarge) {
		return text, true, nil
	}
	return text, false, err
}

// renderInputFactor bounds the JSON a rendering of at most maxBytes
// decodes: maxBytes × renderInputFactor bytes of the messages, the same of
// the tools. JSON text is rarely much larger than what a template makes of
// it (keys, quotes, escapes: \uXXXX is 6 bytes for at most 3); the rest of
// a larger chat cannot show in the prefix rendered, and decoding it into
// template values cost the whole body (a 14.5 MB chat of empty messages:
// 4.1 s of CPU and 2.2 GB allocated to render 512 KiB).
const renderInputFactor = 4

// errInputTooLarge: the input was decoded only in part (renderInputFactor)
// and the rendering did not reach its limit, so it may not be the full
// rendering's prefix (the template printed less than the part decoded).
var errInputTooLarge = errors.New("chat too large for the rendering asked: its rendering's prefix is unknown")

func (t *ChatTemplate) render(c Chat, maxBytes int) (string, error) {
	budget := int64(maxBytes) * renderInputFactor
	msgs, partial, err := decodeOrderedPrefix(c.Messages, budget)
	if err != nil {
		return "", fmt.Errorf("messages: %w", err)
	}
	list, ok := msgs.([]any)
	if !ok {
		return "", errors.New("messages: not an array")
	}
	if t.ContentAsString {
		flattenContent(list)
	}
	if c.VLLMMessages {
		if err := vllmMessages(list); err != nil {
			return "", err
		}
	}
	data := map[string]any{
		"messages":              list,
		"add_generation_prompt": c.AddGenerationPrompt,
	}
	// Only the special tokens the config defines, as transformers passes
	// its special_tokens_map (an absent one is undefined in the template).
	for k, v := range map[string]string{"bos_token": t.BOS, "eos_token": t.EOS, "unk_token": t.UNK, "pad_token": t.PAD} {
		if v != "" {
			data[k] = v
		}
	}
	if len(c.Tools) > 0 && string(c.Tools) != "null" {
		tools, cut, err := decodeOrderedPrefix(c.Tools, budget)
		if err != nil {
			return "", fmt.Errorf("tools: %w", err)
		}
		data["tools"], partial = tools, partial || cut
	}
	for k, v := range c.Extra {
		data[k] = v
	}
	now := c.Now
	data["strftime_now"] = func(format string) string {
		if now.IsZero() {
			return strftime(time.Now(), format)
		}
		return strftime(now, format)
	}
	var out limitedBuffer
	out.limit = maxBytes
	if err := t.tpl.Execute(&out, exec.NewContext(data)); err != nil {
		if out.full {
			return out.String(), errRenderTooLarge
		}
		return "", fmt.Errorf("chat template: %w", err)
	}
	if partial {
		return "", errInputTooLarge
	}
	return out.String(), nil
}

// limitedBuffer keeps at most limit bytes; a write past it keeps what
// fits, sets full and fails, which stops the template.
type limitedBuffer struct {
	bytes.Buffer
	limit int
	full  bool
}

var errRenderTooLarge = errors.New("rendered chat larger than its limit")

func (b *limitedBuffer) Write(p []byte) (int, error) {
	if b.Len()+len(p) > b.limit {
		b.Buffer.Write(p[:b.limit-b.Len()])
		b.full = true
		return 0, errRenderTooLarge
	}
	return b.Buffer.Write(p)
}

func (b *limitedBuffer) WriteString(s string) (int, error) {
	if b.Len()+len(s) > b.limit {
		b.Buffer.WriteString(s[:b.limit-b.Len()])
		b.full = true
		return 0, errRenderTooLarge
	}
	return b.Buffer.WriteString(s)
}

// flattenContent replaces each list content by its text parts joined with
// "\n" (vllm/entrypoints/chat_utils.py, _parse_chat_message_content_parts).
func flattenContent(msgs []any) {
	for _, m := range msgs {
		d, ok := m.(*exec.Dict)
		if !ok {
			continue
		}
		for _, p := range d.Pairs {
			if p.Key.String() != "content" {
				continue
			}
			parts, ok := p.Value.Interface().([]any)
			if !ok {
				continue
			}
			var texts []string
			for _, part := range parts {
				pd, ok := part.(*exec.Dict)
				if !ok {
					continue
				}
				if typ := pd.Get(exec.AsValue("type")); typ.String() != "text" {
					continue
				}
				if txt := pd.Get(exec.AsValue("text")); txt.IsString() {
					texts = append(texts, txt.String())
				}
			}
			p.Value = exec.AsValue(strings.Join(texts, "\n"))
		}
	}
}

// vllmMessages is vLLM's preprocessing of Chat.VLLMMessages, in place.
func vllmMessages(msgs []any) error {
	for _, m := range msgs {
		d, ok := m.(*exec.Dict)
		if !ok {
			continue
		}
		role := d.Get(exec.AsValue("role"))
		keep := d.Pairs[:0]
		for _, p := range d.Pairs {
			switch p.Key.String() {
			case "content":
				if p.Value.IsNil() {
					p.Value = exec.AsValue("")
				}
			case "tool_calls":
				calls, ok := p.Value.Interface().([]any)
				if !ok || !role.IsString() || role.String() != "assistant" {
					break
				}
				if len(calls) == 0 {
					continue // dropped
				}
				for _, c := range calls {
					if err := parseArguments(c); err != nil {
						return err
					}
				}
			}
			keep = append(keep, p)
		}
		d.Pairs = keep
	}
	return nil
}

// parseArguments turns a tool call's function.arguments string into the
// object it encodes (vLLM: json.loads; "" or null → {}).
func parseArguments(call any) error {
	c, ok := call.(*exec.Dict)
	if !ok {
		return nil
	}
	fn, ok := c.Get(exec.AsValue("function")).Interface().(*exec.Dict)
	if !ok {
		return nil
	}
	for _, p := range fn.Pairs {
		if p.Key.String() != "arguments" {
			continue
		}
		switch v := p.Value.Interface().(type) {
		case nil:
			p.Value = exec.AsValue(exec.NewDict())
		case string:
			if v == "" {
				p.Value = exec.AsValue(exec.NewDict())
				continue
			}
			obj, err := decodeOrdered([]byte(v))
			if err != nil {
				return fmt.Errorf("tool call arguments are not JSON: %w", err)
			}
			p.Value = exec.AsValue(obj)
		}
	}
	return nil
}

// decodeOrdered decodes JSON into template values that keep an object's key
// order: objects become *exec.Dict (gonja's ordered dict), arrays []any,
// numbers int or float64. Depth is bounded by MaxChatJSONDepth.
func decodeOrdered(raw []byte) (any, error) {
	v, _, err := decodeOrderedPrefix(raw, int64(len(raw)))
	return v, err
}

// decodeOrderedPrefix decodes raw as decodeOrdered does, but stops once
// more than budget bytes were read: the arrays and objects open then are
// closed with the elements decoded so far (cut true; the rest of raw is
// not read).
func decodeOrderedPrefix(raw []byte, budget int64) (v any, cut bool, err error) {
	d := prefixDecoder{Decoder: json.NewDecoder(bytes.NewReader(raw)), budget: budget}
	d.UseNumber()
	v, err = d.value(0)
	if err != nil {
		return nil, false, err
	}
	if d.cut {
		return v, true, nil
	}
	if _, err := d.Token(); err != io.EOF {
		return nil, false, errors.New("trailing data after JSON value")
	}
	return v, false, nil
}

// prefixDecoder decodes JSON into template values up to a byte budget.
type prefixDecoder struct {
	*json.Decoder
	budget int64
	cut    bool
}

// more reports whether the open array or object has another element to
// decode within the budget.
func (d *prefixDecoder) more() bool {
	if d.cut {
		return false
	}
	if d.InputOffset() > d.budget {
		d.cut = true
		return false
	}
	return d.More()
}

func (d *prefixDecoder) value(depth int) (any, error) {
	dec := d
	if depth > MaxChatJSONDepth {
		return nil, fmt.Errorf("JSON nested deeper than %d", MaxChatJSONDepth)
	}
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	switch v := tok.(type) {
	case json.Delim:
		switch v {
		case '{':
			d := exec.NewDict()
			var index map[string]int // key → its pair's index
			for dec.more() {
				kt, err := dec.Token()
				if err != nil {
					return nil, err
				}
				key, _ := kt.(string)
				val, err := dec.value(depth + 1)
				if err != nil {
					return nil, err
				}
				// A repeated key: the last value wins, in the first one's
				// place, as in Python. Looked up in a map, not by a scan of
				// the pairs: a scan made an object of n keys cost n²/2
				// comparisons, each boxing a key (40,000 keys, a 430 KB
				// body: 30 s of CPU).
				if index == nil {
					index = make(map[string]int)
				}
				if i, ok := index[key]; ok {
					d.Pairs[i].Value = exec.AsValue(val)
				} else {
					index[key] = len(d.Pairs)
					d.Pairs = append(d.Pairs, &exec.Pair{Key: exec.AsValue(key), Value: exec.AsValue(val)})
				}
			}
			if dec.cut {
				return d, nil
			}
			_, err := dec.Token() // '}'
			return d, err
		case '[':
			list := []any{}
			for dec.more() {
				val, err := dec.value(depth + 1)
				if err != nil {
					return nil, err
				}
				list = append(list, val)
			}
			if dec.cut {
				return list, nil
			}
			_, err := dec.Token() // ']'
			return list, err
		}
		return nil, fmt.Errorf("unexpected %v", v)
	case json.Number:
		if i, err := strconv.ParseInt(string(v), 10, 64); err == nil {
			return int(i), nil
		}
		f, err := v.Float64()
		if err != nil {
			return nil, err
		}
		return f, nil
	default: // string, bool, nil
		return v, nil
	}
}

// filterToJSON is transformers' tojson: json.dumps(x, ensure_ascii=False,
// indent=indent, separators=separators, sort_keys=sort_keys), keys in
// their order; with indent, the item separator is "," as in Python.
func filterToJSON(e *exec.Evaluator, in *exec.Value, params *exec.VarArgs) *exec.Value {
	if in.IsError() {
		return in
	}
	indent := -1
	ensureASCII := false
	for k, v := range params.KwArgs {
		switch k {
		case "indent":
			if !v.IsNil() {
				indent = v.Integer()
			}
		case "ensure_ascii":
			ensureASCII = v.Bool()
		default:
			return exec.AsValue(fmt.Errorf("tojson: unsupported argument %q", k))
		}
	}
	if len(params.Args) > 0 && !params.Args[0].IsNil() {
		indent = params.Args[0].Integer()
	}
	var b strings.Builder
	if err := writePyJSON(&b, in.Interface(), indent, 0, ensureASCII, 0); err != nil {
		return exec.AsValue(err)
	}
	return exec.AsSafeValue(b.String())
}

func writePyJSON(b *strings.Builder, v any, indent, level int, ascii bool, depth int) error {
	if depth > MaxChatJSONDepth {
		return fmt.Errorf("tojson: nested deeper than %d", MaxChatJSONDepth)
	}
	if b.Len() > MaxRenderedBytes {
		return errRenderTooLarge
	}
	newline := func(l int) {
		b.WriteByte('\n')
		for i := 0; i < l*indent; i++ {
			b.WriteByte(' ')
		}
	}
	itemSep := ", "
	if indent >= 0 {
		itemSep = ","
	}
	switch x := v.(type) {
	case *exec.Value:
		return writePyJSON(b, x.Interface(), indent, level, ascii, depth)
	case nil:
		b.WriteString("null")
	case bool:
		if x {
			b.WriteString("true")
		} else {
			b.WriteString("false")
		}
	case string:
		writePyString(b, x, ascii)
	case int:
		b.WriteString(strconv.Itoa(x))
	case int64:
		b.WriteString(strconv.FormatInt(x, 10))
	case float64:
		b.WriteString(pyFloat(x))
	case *exec.Dict:
		if len(x.Pairs) == 0 {
			b.WriteString("{}")
			return nil
		}
		b.WriteByte('{')
		for i, p := range x.Pairs {
			if i > 0 {
				b.WriteString(itemSep)
			}
			if indent >= 0 {
				newline(level + 1)
			}
			writePyString(b, p.Key.String(), ascii)
			b.WriteString(": ")
			if err := writePyJSON(b, p.Value, indent, level+1, ascii, depth+1); err != nil {
				return err
			}
		}
		if indent >= 0 {
			newline(level)
		}
		b.WriteByte('}')
	case exec.Dict:
		return writePyJSON(b, &x, indent, level, ascii, depth)
	case []any:
		if len(x) == 0 {
			b.WriteString("[]")
			return nil
		}
		b.WriteByte('[')
		for i, e := range x {
			if i > 0 {
				b.WriteString(itemSep)
			}
			if indent >= 0 {
				newline(level + 1)
			}
			if err := writePyJSON(b, e, indent, level+1, ascii, depth+1); err != nil {
				return err
			}
		}
		if indent >= 0 {
			newline(level)
		}
		b.WriteByte(']')
	case []*exec.Value:
		list := make([]any, len(x))
		for i, e := range x {
			list[i] = e
		}
		return writePyJSON(b, list, indent, level, ascii, depth)
	case map[string]any:
		// Not from a request (those decode to *exec.Dict): a template's own
		// dict or an Extra value; Go maps have no order, so keys sort.
		d := exec.NewDict()
		for _, k := range sortedKeys(x) {
			d.Pairs = append(d.Pairs, &exec.Pair{Key: exec.AsValue(k), Value: exec.AsValue(x[k])})
		}
		return writePyJSON(b, d, indent, level, ascii, depth)
	default:
		return fmt.Errorf("tojson: cannot serialize %T", v)
	}
	return nil
}

func sortedKeys(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	for i := 1; i < len(keys); i++ {
		for j := i; j > 0 && keys[j] < keys[j-1]; j-- {
			keys[j], keys[j-1] = keys[j-1], keys[j]
		}
	}
	return keys
}

// writePyString writes s as Python's json.dumps does: \" \\ \n \r \t \b \f
// escaped, other controls as \u00XX, everything else raw (ensure_ascii
// False) or non-ASCII as \uXXXX with surrogate pairs (True).
func writePyString(b *strings.Builder, s string, ascii bool) {
	const hex = "0123456789abcdef"
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		default:
			switch {
			case r < 0x20 || (ascii && r > 0x7e && r <= 0xffff):
				b.WriteString(`\u`)
				b.WriteByte(hex[r>>12&0xf])
				b.WriteByte(hex[r>>8&0xf])
				b.WriteByte(hex[r>>4&0xf])
				b.WriteByte(hex[r&0xf])
			case ascii && r > 0xffff:
				r -= 0x10000
				hi, lo := 0xd800+(r>>10), 0xdc00+(r&0x3ff)
				for _, u := range []rune{hi, lo} {
					b.WriteString(`\u`)
					b.WriteByte(hex[u>>12&0xf])
					b.WriteByte(hex[u>>8&0xf])
					b.WriteByte(hex[u>>4&0xf])
					b.WriteByte(hex[u&0xf])
				}
			default:
				if r == utf8.RuneError {
					b.WriteString("\uFFFD")
				} else {
					b.WriteRune(r)
				}
			}
		}
	}
	b.WriteByte('"')
}

// pyFloat formats f as Python's repr does: the shortest round-trip digits,
// a ".0" on integral values, exponents from 1e16 and below 1e-4.
func pyFloat(f float64) string {
	switch {
	case math.IsNaN(f):
		return "NaN"
	case math.IsInf(f, 1):
		return "Infinity"
	case math.IsInf(f, -1):
		return "-Infinity"
	}
	abs := math.Abs(f)
	if abs != 0 && (abs >= 1e16 || abs < 1e-4) {
		s := strconv.FormatFloat(f, 'e', -1, 64) // 1e+16, 1e-05
		mant, exp, _ := strings.Cut(s, "e")
		sign := exp[0]
		exp = strings.TrimLeft(exp[1:], "0")
		if len(exp) < 2 {
			exp = strings.Repeat("0", 2-len(exp)) + exp
		}
		return mant + "e" + string(sign) + exp
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.ContainsAny(s, ".") {
		s += ".0"
	}
	return s
}

// strftime formats t with the C conversions chat templates use (Llama-3.1:
// "%d %b %Y").
func strftime(t time.Time, format string) string {
	var b strings.Builder
	for i := 0; i < len(format); i++ {
		c := format[i]
		if c != '%' || i+1 == len(format) {
			b.WriteByte(c)
			continue
		}
		i++
		switch format[i] {
		case 'd':
			fmt.Fprintf(&b, "%02d", t.Day())
		case 'm':
			fmt.Fprintf(&b, "%02d", int(t.Month()))
		case 'Y':
			fmt.Fprintf(&b, "%04d", t.Year())
		case 'y':
			fmt.Fprintf(&b, "%02d", t.Year()%100)
		case 'b':
			b.WriteString(t.Month().String()[:3])
		case 'B':
			b.WriteString(t.Month().String())
		case 'a':
			b.WriteString(t.Weekday().String()[:3])
		case 'A':
			b.WriteString(t.Weekday().String())
		case 'H':
			fmt.Fprintf(&b, "%02d", t.Hour())
		case 'M':
			fmt.Fprintf(&b, "%02d", t.Minute())
		case 'S':
			fmt.Fprintf(&b, "%02d", t.Second())
		case 'j':
			fmt.Fprintf(&b, "%03d", t.YearDay())
		case '%':
			b.WriteByte('%')
		default:
			b.WriteByte('%')
			b.WriteByte(format[i])
		}
	}
	return b.String()
}
