package jsonscan

import (
	"encoding/json"

	"github.com/infergate/infergate/internal/jsonvalue"
)

// SpliceModel appends to dst the JSON object body with the value of its
// top-level "model" member replaced by model (a JSON string), every other
// byte kept; false when body has no such member or is not an object the
// walk understands (ModelSpan).
func SpliceModel(dst, body, model []byte) ([]byte, bool) {
	from, to, ok := ModelSpan(body)
	if !ok {
		return dst, false
	}
	dst = append(dst, body[:from]...)
	dst = append(dst, model...)
	return append(dst, body[to:]...), true
}

// ModelSpan returns the byte range [from, to) of the value of the first
// top-level member of the JSON object body whose key is "model" as engines
// read keys (escapes decoded: "\u006dodel" is model to Python's json). It
// walks body once: strings with the validating scanner, values of any
// nesting by counting brackets (no recursion, so no depth limit: the body
// was bounded by openai.Decode). ok is false for a body that is not an
// object, has no model member, or breaks off.
func ModelSpan(body []byte) (from, to int, ok bool) {
	s := scanner{b: body}
	s.ws()
	if !s.is('{') {
		return 0, 0, false
	}
	s.i++
	s.ws()
	if s.is('}') {
		return 0, 0, false
	}
	for {
		if !s.is('"') {
			return 0, 0, false
		}
		k0 := s.i
		raw, plain, ok := s.str()
		if !ok {
			return 0, 0, false
		}
		isModel := plain && string(raw) == "model"
		if !plain && len(raw) <= 64 {
			var key string
			isModel = json.Unmarshal(body[k0:s.i], &key) == nil && key == "model"
		}
		s.ws()
		if !s.is(':') {
			return 0, 0, false
		}
		s.i++
		s.ws()
		v0 := s.i
		if !skipValue(&s) {
			return 0, 0, false
		}
		if isModel {
			return v0, s.i, true
		}
		if more, ok := s.sep('}'); !more || !ok {
			return 0, 0, false
		}
	}
}

// skipValue moves s past the value at s.i: a string, number or literal by
// the scanner, an object or array by counting brackets outside strings
// (jsonvalue.Skip; the body was validated by openai.Decode).
func skipValue(s *scanner) bool {
	if s.i >= len(s.b) {
		return false
	}
	if c := s.b[s.i]; c != '{' && c != '[' {
		return s.skip(1)
	}
	j := jsonvalue.Skip(s.b, s.i)
	if j < 0 {
		return false
	}
	s.i = j
	return true
}
