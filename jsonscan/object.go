package jsonscan

import (
	"encoding/json"
	"errors"
	"math"
	"unicode/utf8"
)

// Walks over JSON values for callers that read a few members of a larger
// answer (the gateway's engine render answers): bounded in nesting by the
// caller, linear in the input, allocation-free unless a key has escapes.

var (
	// ErrSyntax: the input is not the JSON value the walk expects.
	ErrSyntax = errors.New("malformed JSON")
	// ErrDepth: a value nests past the walk's bound.
	ErrDepth = errors.New("JSON nested too deep")
)

// Member is one member of an object walked by Object.
type Member struct {
	// Key is the member's key with its escapes decoded (as encoding/json
	// decodes a map key: invalid UTF-8 becomes U+FFFD).
	Key []byte
	// Raw is the member as written, `"key":value` (whitespace kept).
	Raw []byte
	// Value is the member's value as written; From is its offset in the
	// walked input.
	Value []byte
	From  int
}

// Object walks the JSON object at the start of b (after whitespace),
// calling member for each member in order until it returns false. b's
// object is nesting level 1; a value nested deeper than maxDepth stops the
// walk with ErrDepth, anything not JSON with ErrSyntax. Bytes after the
// object are not read. Every value is validated as it is skipped, so a nil
// error means the object, up to where member stopped it, was valid JSON.
func Object(b []byte, maxDepth int, member func(m Member) bool) error {
	s := scanner{b: b, max: maxDepth}
	s.ws()
	if !s.is('{') {
		return ErrSyntax
	}
	stopped := false
	ok := s.anyObject(func(raw []byte, escaped bool) bool {
		k0 := s.i // the value's start (raw, the key, lies before the colon)
		start := cap(b) - cap(raw) - 1
		key := raw
		if escaped || !utf8.Valid(raw) {
			var k string
			if json.Unmarshal(b[start:start+len(raw)+2], &k) != nil {
				return false
			}
			key = []byte(k)
		}
		if !s.skip(2) || !s.endsValue('}') {
			return false
		}
		if !member(Member{Key: key, Raw: b[start:s.i], Value: b[k0:s.i], From: k0}) {
			stopped = true
			return false
		}
		return true
	})
	return s.walkErr(ok, stopped)
}

// Array walks the JSON array at the start of b (after whitespace), calling
// elem with each element as written (validated, nested at most maxDepth
// levels counting b's array as 1) until it returns false. Errors as
// Object's.
func Array(b []byte, maxDepth int, elem func(v []byte) bool) error {
	s := scanner{b: b, max: maxDepth}
	s.ws()
	if !s.is('[') {
		return ErrSyntax
	}
	stopped := false
	ok := s.array(func() bool {
		from := s.i
		if !s.skip(2) || !s.endsValue(']') {
			return false
		}
		if !elem(b[from:s.i]) {
			stopped = true
			return false
		}
		return true
	})
	return s.walkErr(ok, stopped)
}

// walkErr is a walk's error: none when it ended (ok) or its callback
// stopped it, ErrDepth when it went too deep, else ErrSyntax.
func (s *scanner) walkErr(ok, stopped bool) error {
	switch {
	case ok || stopped:
		return nil
	case s.deep:
		return ErrDepth
	}
	return ErrSyntax
}

// endsValue reports whether a value just scanned is followed, after
// whitespace, by a comma or close (so "01" is not taken for 0 before the
// walk finds the 1); it consumes nothing.
func (s *scanner) endsValue(close byte) bool {
	i := s.i
	for i < len(s.b) && isJSONSpace(s.b[i]) {
		i++
	}
	return i < len(s.b) && (s.b[i] == ',' || s.b[i] == close)
}

// AppendUint32s appends to dst the elements of v, a JSON array of integers
// in [0, 2^32) written without sign, fraction or exponent (token ids),
// keeping at most limit of them (the rest are checked, not kept). v holds
// the array alone, as Member.Value gives it. ok is false, and dst returned
// as it came, when v is anything else.
func AppendUint32s(dst []uint32, v []byte, limit int) (_ []uint32, ok bool) {
	start := len(dst)
	s := scanner{b: v}
	if !s.is('[') {
		return dst, false
	}
	s.i++
	s.ws()
	if s.is(']') {
		return dst, s.i+1 == len(v)
	}
	for {
		from := s.i
		n := uint64(0)
		for s.i < len(s.b) && '0' <= s.b[s.i] && s.b[s.i] <= '9' {
			if n = n*10 + uint64(s.b[s.i]-'0'); n > math.MaxUint32 {
				return dst[:start], false
			}
			s.i++
		}
		if digits := s.i - from; digits == 0 || digits > 1 && v[from] == '0' {
			return dst[:start], false
		}
		if len(dst)-start < limit {
			dst = append(dst, uint32(n))
		}
		s.ws() // sep, by hand (hot)
		switch {
		case s.is(','):
			s.i++
			s.ws()
		case s.is(']') && s.i+1 == len(v):
			return dst, true
		default:
			return dst[:start], false
		}
	}
}
