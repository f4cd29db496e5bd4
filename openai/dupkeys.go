package openai

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
)

// Duplicate keys. JSON leaves a repeated object key to the reader (RFC
// 8259 §4), and Go and Python read repeats differently: Python's json (so
// vLLM, SGLang, pydantic) keeps the last value whole, while encoding/json
// and segmentio ignore a later null for a plain field and merge a later
// object into the earlier one. {"model":"a","model":null} is model "a" to
// the gateway (the key's allow-list, the pool) and the base model to vLLM;
// "stream_options":{"include_usage":true,"include_usage":null} tells the
// gateway usage is on and the engine it is off (no usage: the key's token
// limit and the metrics never see the tokens). Decode therefore refuses a
// repeated key among the fields it reads, at the top level and inside
// stream_options (the objects whose fields decide access and accounting).

// decodedKeys are the JSON names of the request fields Decode reads at the
// top level (of every request type: chat, completion, responses,
// embeddings, tokenize, detokenize); streamOptionKeys those of
// StreamOptions.
var (
	decodedKeys = jsonNames(reflect.TypeOf(ChatRequest{}), reflect.TypeOf(CompletionRequest{}),
		reflect.TypeOf(ResponsesRequest{}), reflect.TypeOf(EmbeddingRequest{}),
		reflect.TypeOf(TokenizeRequest{}), reflect.TypeOf(DetokenizeRequest{}))
	streamOptionKeys = jsonNames(reflect.TypeOf(StreamOptions{}))
	// keysByFirst indexes decodedKeys and streamOptionKeys by first byte,
	// each with its own bit, for the scan in duplicateKey.
	keysByFirst = func() (t [256][]keyBit) {
		names := make([]string, 0, len(decodedKeys)+len(streamOptionKeys))
		for k := range decodedKeys {
			names = append(names, k)
		}
		for k := range streamOptionKeys {
			if !decodedKeys[k] {
				names = append(names, k)
			}
		}
		if len(names) > 64 {
			panic("openai: more request keys than bits")
		}
		for i, k := range names {
			t[k[0]] = append(t[k[0]], keyBit{k, 1 << i})
		}
		return t
	}()
)

// keyBit is a request key and its bit in duplicateKey's set.
type keyBit struct {
	name string
	bit  uint64
}

// jsonNames returns the JSON names of the struct types' fields.
func jsonNames(types ...reflect.Type) map[string]bool {
	names := map[string]bool{}
	for _, t := range types {
		for i := 0; i < t.NumField(); i++ {
			if name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ","); name != "" && name != "-" {
				names[name] = true
			}
		}
	}
	return names
}

// duplicateKey returns a key of decodedKeys repeated in body's top-level
// object, or of streamOptionKeys repeated in its stream_options object; ""
// when there is none. body must be one valid JSON object. It costs one
// pass over body's quotes: the names are lowercase letters and '_', which
// a key can only spell differently through a \u00XX escape of one of them
// (no other escape yields them), so unless body has such an escape, or a
// name occurs more than once anywhere (as a key or as a string), no key can
// be repeated; only then is body parsed.
func duplicateKey(body []byte) string {
	if escapesKeyByte(body) {
		return duplicateKeyParsed(body)
	}
	var seen uint64 // names met once: a second meeting means "parse"
	for i := 0; ; {
		j := bytes.IndexByte(body[i:], '"')
		if j < 0 {
			return ""
		}
		i += j + 1
		if i >= len(body) {
			return ""
		}
		for _, k := range keysByFirst[body[i]] {
			if len(body) > i+len(k.name) && body[i+len(k.name)] == '"' && string(body[i:i+len(k.name)]) == k.name {
				if seen&k.bit != 0 {
					return duplicateKeyParsed(body)
				}
				seen |= k.bit
			}
		}
	}
}

// escapesKeyByte reports whether body has a \u00XX escape of a lowercase
// ASCII letter or '_' (any case of hex digits): the only way to spell a
// request key other than literally. Text escaped by ensure_ascii encoders
// (\u00e9, \u4e2d) does not count.
func escapesKeyByte(body []byte) bool {
	for i := 0; ; {
		j := bytes.Index(body[i:], []byte(`\u00`))
		if j < 0 || i+j+6 > len(body) {
			return false
		}
		i += j + 4
		hi, lo := unhex(body[i]), unhex(body[i+1])
		if hi >= 0 && lo >= 0 {
			if c := byte(hi<<4 | lo); c == '_' || (c >= 'a' && c <= 'z') {
				return true
			}
		}
	}
}

// unhex is the value of hex digit c, or -1.
func unhex(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'a' && c <= 'f':
		return int(c-'a') + 10
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}

// duplicateKeyParsed is duplicateKey by a full parse (encoding/json's
// tokenizer, which unescapes keys): the slow path, and the reference the
// fast one is fuzzed against.
func duplicateKeyParsed(body []byte) string {
	return duplicateIn(json.NewDecoder(bytes.NewReader(body)), decodedKeys)
}

// duplicateIn reads one object from dec (its '{' not yet read) and returns
// the first key of names that it repeats, descending into a
// "stream_options" object with streamOptionKeys; other values are skipped.
func duplicateIn(dec *json.Decoder, names map[string]bool) string {
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return ""
	}
	seen := map[string]bool{}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return ""
		}
		key, _ := t.(string)
		if names[key] {
			if seen[key] {
				return key
			}
			seen[key] = true
		}
		if key == "stream_options" && names[key] {
			var raw json.RawMessage
			if dec.Decode(&raw) != nil {
				return ""
			}
			if bytes.HasPrefix(bytes.TrimSpace(raw), []byte("{")) {
				if k := duplicateIn(json.NewDecoder(bytes.NewReader(raw)), streamOptionKeys); k != "" {
					return "stream_options." + k
				}
			}
			continue
		}
		var skip json.RawMessage
		if dec.Decode(&skip) != nil {
			return ""
		}
	}
	return ""
}
