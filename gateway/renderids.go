package gateway

import (
	"errors"

	"github.com/infergate/infergate/jsonscan"
)

// The engine render answers' parser (render.go), on jsonscan's walks:
// bounded in depth (maxRenderDepth) and linear in the answer's size, which
// the caller bounds (MaxRenderResponseBytes, 16 MiB) as it bounds the ids
// kept (maxRenderIDs, 1 Mi); no value is decoded but the ids, and nothing
// is allocated unless a key has escapes. The answer is one JSON value with
// only whitespace after it, as encoding/json reads it: every element of an
// array answer is validated, not only the one holding the ids, and bytes
// after the value are refused. Fuzzed against encoding/json
// (FuzzParseRenderIDs).

// maxRenderDepth bounds the nesting the walks follow (a GenerateRequest's
// sampling_params and features are 2–4 deep).
const maxRenderDepth = 64

var (
	errRenderJSON  = errors.New("render answer: malformed JSON")
	errRenderDepth = errors.New("render answer: nested too deep")
	errRenderNoIDs = errors.New("render answer: no token ids")
	errRenderIDs   = errors.New("render answer: token ids not an array of integers in [0, 2^32)")
)

// renderIDKeys are the members that hold the ids, by preference: vLLM's
// GenerateRequest.token_ids (render, v0.18 on), the engine prompt's
// prompt_token_ids (render before vllm#35684), /tokenize's tokens.
var renderIDKeys = [...]string{"token_ids", "prompt_token_ids", "tokens"}

// parseRenderIDs appends to dst the prompt ids of a render or /tokenize
// answer b, keeping at most limit (the rest is checked, not kept). Forms:
//
//	{"token_ids": [...], ...}                        chat render; /tokenize's {"tokens": [...]}
//	[{"token_ids": [...]}, ...]                      completion render (the first prompt)
//	[[conversation...], [{"prompt_token_ids": [...]}, ...]]  chat render before vllm#35684
//
// In an object the first of renderIDKeys present is read (a repeated key:
// its last value, as encoding/json).
func parseRenderIDs(dst []uint32, b []byte, limit int) ([]uint32, error) {
	obj, top, err := renderIDsObject(b)
	if err != nil {
		return dst, err
	}
	var ids [len(renderIDKeys)][]byte
	end := 1 // where the object's last member ends (after '{' if none)
	err = jsonscan.Object(obj, maxRenderDepth, func(m jsonscan.Member) bool {
		for k, name := range renderIDKeys {
			if string(m.Key) == name {
				ids[k] = m.Value
			}
		}
		end = m.From + len(m.Value)
		return true
	})
	if err != nil {
		return dst, renderErr(err)
	}
	if top && !closesInput(obj, end, '}') {
		return dst, errRenderJSON
	}
	for _, v := range ids {
		if v != nil {
			out, ok := jsonscan.AppendUint32s(dst, v, limit)
			if !ok {
				return dst, errRenderIDs
			}
			return out, nil
		}
	}
	return dst, errRenderNoIDs
}

// renderIDsObject returns the object of b that holds the ids: b itself
// (top: the caller checks that nothing follows it), the first element of an
// array b, or, when that first element is an array (the older chat
// render's [conversation, engine_prompts] pair), the first element of the
// second. An array b is walked whole: its elements are validated and
// nothing but whitespace may follow it.
func renderIDsObject(b []byte) (obj []byte, top bool, err error) {
	v := trimJSONSpace(b)
	if len(v) > 0 && v[0] == '[' {
		first, second, err := firstElements(v, maxRenderDepth, true)
		if err != nil {
			return nil, false, err
		}
		switch {
		case first != nil && first[0] == '{':
			return first, false, nil
		case first != nil && first[0] == '[' && second != nil && second[0] == '[':
			if v, _, err = firstElements(second, maxRenderDepth-1, false); err != nil {
				return nil, false, err
			}
			if len(v) > 0 && v[0] == '{' {
				return v, false, nil
			}
		}
		return nil, false, errRenderNoIDs
	}
	if len(v) == 0 || v[0] != '{' {
		return nil, false, errRenderNoIDs
	}
	return v, true, nil
}

// firstElements returns the first element of the JSON array a and, when
// that is an array, the second (nil where a has fewer). With whole, the
// rest of a is walked too (validated) and nothing but whitespace may
// follow a's close; without, the rest of a is not read.
func firstElements(a []byte, maxDepth int, whole bool) (first, second []byte, err error) {
	end := 1 // where a's last element walked ends (after '[' if none)
	err = jsonscan.Array(a, maxDepth, func(e []byte) bool {
		end = cap(a) - cap(e) + len(e)
		switch {
		case first == nil:
			first = e
			return whole || e[0] == '['
		case second == nil:
			second = e
			return whole
		}
		return true
	})
	if err == nil && whole && !closesInput(a, end, ']') {
		err = jsonscan.ErrSyntax
	}
	return first, second, renderErr(err)
}

// closesInput reports whether b from offset i holds, after whitespace,
// the byte close (none when 0) and then only whitespace.
func closesInput(b []byte, i int, close byte) bool {
	b = trimJSONSpace(b[i:])
	if close != 0 {
		if len(b) == 0 || b[0] != close {
			return false
		}
		b = trimJSONSpace(b[1:])
	}
	return len(b) == 0
}

// renderErr maps a jsonscan walk's error to the render answer's.
func renderErr(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, jsonscan.ErrDepth):
		return errRenderDepth
	}
	return errRenderJSON
}

// trimJSONSpace returns b less its leading JSON whitespace.
func trimJSONSpace(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t' || b[0] == '\n' || b[0] == '\r') {
		b = b[1:]
	}
	return b
}

// topMember returns the span of the value of the top-level member name of
// the JSON object b (a key with escapes is matched by its decoded text).
func topMember(b []byte, name string) (from, to int, ok bool) {
	_ = jsonscan.Object(b, maxRenderDepth, func(m jsonscan.Member) bool {
		if string(m.Key) == name {
			from, to, ok = m.From, m.From+len(m.Value), true
			return false
		}
		return true
	})
	return from, to, ok
}
