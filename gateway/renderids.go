package gateway

import (
	"encoding/json"
	"errors"
	"math"
)

// The engine render answers' parser (render.go): bounded in depth
// (maxRenderDepth) and linear in the answer's size, which the caller bounds
// (MaxRenderResponseBytes); no value is decoded but the ids. Fuzzed against
// encoding/json (FuzzParseRenderIDs).

// maxRenderDepth bounds the nesting the scanner walks (a GenerateRequest's
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
	s := jscan{b: b}
	s.ws()
	switch {
	case s.is('{'):
		return s.idsObject(dst, limit)
	case s.is('['):
		s.i++
		s.ws()
		switch {
		case s.is('{'):
			return s.idsObject(dst, limit)
		case s.is('['): // [conversation, engine_prompts]
			if !s.skip(2) {
				return dst, s.err()
			}
			s.ws()
			if !s.is(',') {
				return dst, errRenderNoIDs
			}
			s.i++
			s.ws()
			if !s.is('[') {
				return dst, errRenderNoIDs
			}
			s.i++
			s.ws()
			if !s.is('{') {
				return dst, errRenderNoIDs
			}
			return s.idsObject(dst, limit)
		}
	}
	return dst, errRenderNoIDs
}

// idsObject reads the ids of the object at s.i.
func (s *jscan) idsObject(dst []uint32, limit int) ([]uint32, error) {
	var spans [len(renderIDKeys)][2]int
	var found [len(renderIDKeys)]bool
	m := members{s: *s}
	for m.next() {
		for k, name := range renderIDKeys {
			if string(m.key) == name {
				spans[k], found[k] = [2]int{m.from, m.s.i}, true
			}
		}
	}
	if m.bad {
		return dst, m.s.err()
	}
	for k := range renderIDKeys {
		if found[k] {
			return appendIDs(dst, s.b[spans[k][0]:spans[k][1]], limit)
		}
	}
	return dst, errRenderNoIDs
}

// appendIDs parses the JSON array of unsigned 32-bit integers v.
func appendIDs(dst []uint32, v []byte, limit int) ([]uint32, error) {
	start := len(dst)
	s := jscan{b: v}
	if !s.is('[') {
		return dst, errRenderIDs
	}
	s.i++
	s.ws()
	if s.is(']') {
		return dst, nil
	}
	for {
		n, digits := uint64(0), 0
		for s.i < len(s.b) && '0' <= s.b[s.i] && s.b[s.i] <= '9' {
			if n = n*10 + uint64(s.b[s.i]-'0'); n > math.MaxUint32 {
				return dst[:start], errRenderIDs
			}
			s.i++
			digits++
		}
		if digits == 0 {
			return dst[:start], errRenderIDs
		}
		if len(dst)-start < limit {
			dst = append(dst, uint32(n))
		}
		s.ws()
		switch {
		case s.is(','):
			s.i++
			s.ws()
		case s.is(']'):
			return dst, nil
		default:
			return dst[:start], errRenderIDs
		}
	}
}

// topMember returns the span of the value of the top-level member name of
// the JSON object b.
func topMember(b []byte, name string) (from, to int, ok bool) {
	m := members{s: jscan{b: b}}
	for m.next() {
		if string(m.key) == name {
			return m.value, m.s.i, true
		}
	}
	return 0, 0, false
}

// jscan is a JSON scanner: position i in b.
type jscan struct {
	b    []byte
	i    int
	deep bool // a value nested past maxRenderDepth was met
}

func (s *jscan) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

func (s *jscan) is(c byte) bool { return s.i < len(s.b) && s.b[s.i] == c }

func (s *jscan) err() error {
	if s.deep {
		return errRenderDepth
	}
	return errRenderJSON
}

// str scans a string at '"' and returns its raw content and whether it
// holds an escape.
func (s *jscan) str() (raw []byte, escaped, ok bool) {
	s.i++
	from := s.i
	for s.i < len(s.b) {
		for s.i < len(s.b) && plainJSONByte[s.b[s.i]] {
			s.i++
		}
		if s.i >= len(s.b) {
			break
		}
		switch c := s.b[s.i]; {
		case c == '"':
			raw = s.b[from:s.i]
			s.i++
			return raw, escaped, true
		case c == '\\':
			escaped = true
			if s.i+1 >= len(s.b) {
				return nil, false, false
			}
			switch s.b[s.i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				s.i += 2
			case 'u':
				if s.i+6 > len(s.b) {
					return nil, false, false
				}
				for _, h := range s.b[s.i+2 : s.i+6] {
					if !('0' <= h && h <= '9' || 'a' <= h && h <= 'f' || 'A' <= h && h <= 'F') {
						return nil, false, false
					}
				}
				s.i += 6
			default:
				return nil, false, false
			}
		case c < 0x20:
			return nil, false, false
		default:
			s.i++
		}
	}
	return nil, false, false
}

// plainJSONByte marks the bytes a JSON string holds as they are: all but
// control characters, '"' and '\\'.
var plainJSONByte = func() (t [256]bool) {
	for c := 0x20; c < 256; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

func (s *jscan) number() bool {
	digits := func() int {
		n := 0
		for s.i < len(s.b) && '0' <= s.b[s.i] && s.b[s.i] <= '9' {
			s.i++
			n++
		}
		return n
	}
	if s.is('-') {
		s.i++
	}
	if digits() == 0 {
		return false
	}
	if s.is('.') {
		s.i++
		if digits() == 0 {
			return false
		}
	}
	if s.is('e') || s.is('E') {
		s.i++
		if s.is('+') || s.is('-') {
			s.i++
		}
		if digits() == 0 {
			return false
		}
	}
	return true
}

func (s *jscan) literal(l string) bool {
	if len(s.b)-s.i < len(l) || string(s.b[s.i:s.i+len(l)]) != l {
		return false
	}
	s.i += len(l)
	return true
}

// skip scans the value at s.i, nested depth deep (1: a top-level member's).
func (s *jscan) skip(depth int) bool {
	if depth > maxRenderDepth {
		s.deep = true
		return false
	}
	if s.i >= len(s.b) {
		return false
	}
	switch c := s.b[s.i]; {
	case c == '{':
		s.i++
		s.ws()
		if s.is('}') {
			s.i++
			return true
		}
		for {
			if !s.is('"') {
				return false
			}
			if _, _, ok := s.str(); !ok {
				return false
			}
			s.ws()
			if !s.is(':') {
				return false
			}
			s.i++
			s.ws()
			if !s.skip(depth + 1) {
				return false
			}
			s.ws()
			switch {
			case s.is(','):
				s.i++
				s.ws()
			case s.is('}'):
				s.i++
				return true
			default:
				return false
			}
		}
	case c == '[':
		s.i++
		s.ws()
		if s.is(']') {
			s.i++
			return true
		}
		for {
			if !s.skip(depth + 1) {
				return false
			}
			s.ws()
			switch {
			case s.is(','):
				s.i++
				s.ws()
			case s.is(']'):
				s.i++
				return true
			default:
				return false
			}
		}
	case c == '"':
		_, _, ok := s.str()
		return ok
	case c == 't':
		return s.literal("true")
	case c == 'f':
		return s.literal("false")
	case c == 'n':
		return s.literal("null")
	case c == '-' || '0' <= c && c <= '9':
		return s.number()
	}
	return false
}

// members iterates over the members of the JSON object at s.i: key (its
// unescaped text), member (the raw key and value), value (where the value
// starts); bad is set when the walk stopped on malformed JSON.
type members struct {
	s       jscan
	started bool
	key     []byte
	member  []byte
	from    int // the value's start (== value)
	value   int
	bad     bool
}

func (m *members) next() bool {
	s := &m.s
	if !m.started {
		m.started = true
		s.ws()
		if !s.is('{') {
			m.bad = true
			return false
		}
		s.i++
		s.ws()
		if s.is('}') {
			return false
		}
	} else {
		s.ws()
		if !s.is(',') {
			m.bad = !s.is('}')
			return false
		}
		s.i++
		s.ws()
	}
	if !s.is('"') {
		m.bad = true
		return false
	}
	start := s.i
	key, escaped, ok := s.str()
	if !ok {
		m.bad = true
		return false
	}
	if escaped {
		var k string
		if json.Unmarshal(s.b[start:s.i], &k) != nil {
			m.bad = true
			return false
		}
		key = []byte(k)
	}
	s.ws()
	if !s.is(':') {
		m.bad = true
		return false
	}
	s.i++
	s.ws()
	m.value, m.from = s.i, s.i
	if !s.skip(2) {
		m.bad = true
		return false
	}
	m.key, m.member = key, s.b[start:s.i]
	return true
}
