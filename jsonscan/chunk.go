package jsonscan

import (
	"encoding/json"
	"errors"
	"strings"
	"unicode/utf8"

	"github.com/infergate/infergate/openai"
)

// View is what the stream relay reads from one SSE event: how many
// choices it has, whether it carries output (openai.StreamChunk.HasOutput),
// whether it is an error event, and the usage it reports.
type View struct {
	Choices int
	Output  bool
	IsError bool
	Usage   *openai.Usage
}

// Chat reads a chat or completion stream event's data. ok is false when data is not JSON the
// gateway understands (it is then relayed as is, unaccounted). The common
// shapes are read by ScanChat without encoding/json (a fifth of the
// gateway's CPU time per streamed request went to decoding chunks with it);
// anything ScanChat is not sure about goes through ParseChat, whose answer
// ScanChat reproduces exactly (FuzzScanChunk checks it).
func Chat(data []byte, scratch *openai.StreamChunk) (v View, ok bool) {
	if v, decided := ScanChat(data); decided {
		return v, true
	}
	return ParseChat(data, scratch)
}

// ParseChat is the reference reading of a chat or completion chunk, with
// encoding/json into scratch (reset first; nil: a new one): ok is false
// when data is not a JSON object (or nests deeper than openai.MaxDepth). A
// field of an unexpected type is skipped, not fatal.
func ParseChat(data []byte, scratch *openai.StreamChunk) (View, bool) {
	if scratch == nil {
		scratch = new(openai.StreamChunk)
	}
	scratch.Reset()
	if openai.TooDeep(data) {
		return View{}, false // an engine's JSON is bounded like a client's
	}
	if err := json.Unmarshal(data, scratch); err != nil {
		var te *json.UnmarshalTypeError
		if !errors.As(err, &te) {
			return View{}, false
		}
	}
	c := scratch
	return View{Choices: len(c.Choices), Output: c.HasOutput(), IsError: c.IsError(), Usage: c.Usage}, true
}

// ScanChat reads the view of a chunk without encoding/json. decided is
// false when it cannot be sure to match json.Unmarshal into
// openai.StreamChunk: invalid JSON, a known key spelled in another case or
// with escapes or non-ASCII bytes (json matches keys case-insensitively), a
// known key repeated, a known field of an unexpected type, nesting over
// maxScanDepth. The caller then decodes with encoding/json.
func ScanChat(data []byte) (v View, decided bool) {
	s := scanner{b: data}
	s.ws()
	if !s.is('{') {
		return v, false
	}
	var seenChoices, seenUsage, seenError bool
	ok := s.object(func(key []byte) bool {
		switch string(key) {
		case "choices":
			if seenChoices {
				return false
			}
			seenChoices = true
			return s.choices(&v)
		case "usage":
			if seenUsage {
				return false
			}
			seenUsage = true
			if s.literal("null") {
				v.Usage = nil
				return true
			}
			u, ok := s.usage()
			v.Usage = u
			return ok
		case "error":
			if seenError {
				return false
			}
			seenError = true
			start := s.i
			if !s.skip(1) {
				return false
			}
			raw := data[start:s.i]
			v.IsError = len(raw) > 0 && string(raw) != "null"
			return true
		}
		return !foldsTo(key, "choices", "usage", "error") && s.skip(1)
	})
	if !ok {
		return View{}, false
	}
	s.ws()
	return v, s.i == len(s.b)
}

// maxScanDepth bounds the nesting ScanChat follows (deeper: undecided).
const maxScanDepth = 32

// scanner is a validating JSON scanner over b from i. max bounds the
// nesting skip follows (0: maxScanDepth); deep records that a walk stopped
// on that bound rather than on malformed JSON.
type scanner struct {
	b    []byte
	i    int
	max  int
	deep bool
}

func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// is reports whether the next byte is c (without consuming it).
func (s *scanner) is(c byte) bool { return s.i < len(s.b) && s.b[s.i] == c }

// literal consumes lit if it is next.
func (s *scanner) literal(lit string) bool {
	if len(s.b)-s.i >= len(lit) && string(s.b[s.i:s.i+len(lit)]) == lit {
		s.i += len(lit)
		return true
	}
	return false
}

// object scans an object at '{', calling member for each key with the
// scanner at the start of the key's value (after the colon and
// whitespace); member consumes the value. Keys with escapes or non-ASCII
// bytes are refused.
func (s *scanner) object(member func(key []byte) bool) bool {
	return s.anyObject(func(key []byte, escaped bool) bool {
		if escaped {
			return false
		}
		for _, c := range key {
			if c >= 0x80 {
				return false
			}
		}
		return member(key)
	})
}

// anyObject scans an object at '{', calling member for each key (its raw
// contents, and whether they hold escapes: see scanStr) with the scanner
// at the start of the key's value; member consumes the value. Any valid
// key is walked.
func (s *scanner) anyObject(member func(key []byte, escaped bool) bool) bool {
	s.i++ // '{'
	s.ws()
	if s.is('}') {
		s.i++
		return true
	}
	for {
		if !s.is('"') {
			return false
		}
		key, escaped, ok := s.scanStr()
		if !ok {
			return false
		}
		s.ws()
		if !s.is(':') {
			return false
		}
		s.i++
		s.ws()
		if !member(key, escaped) {
			return false
		}
		if more, ok := s.sep('}'); !more {
			return ok
		}
	}
}

// sep consumes what follows a member or an element: a comma (more follow)
// or close (the end, ok). Anything else is invalid: more and ok are false.
func (s *scanner) sep(close byte) (more, ok bool) {
	s.ws()
	switch {
	case s.is(','):
		s.i++
		s.ws()
		return true, true
	case s.is(close):
		s.i++
		return false, true
	}
	return false, false
}

// str scans a string at '"' and returns its raw contents; plain is false
// when it has escapes or is not valid UTF-8 (raw is then not its decoded
// value). ok is false for an invalid string.
func (s *scanner) str() (raw []byte, plain, ok bool) {
	raw, escaped, ok := s.scanStr()
	// Invalid UTF-8 decodes to U+FFFD (encoding/json): raw is then not
	// the value, which plain promises.
	return raw, ok && !escaped && utf8.Valid(raw), ok
}

// scanStr scans a string at '"' and returns its raw contents and whether
// it has escapes, without checking its UTF-8 (skip's strings: a call of
// utf8.Valid per string cost a third of walking a chat request).
func (s *scanner) scanStr() (raw []byte, escaped, ok bool) {
	s.i++ // '"'
	start := s.i
	for s.i < len(s.b) {
		b, i := s.b, s.i // in registers: the loop runs over every byte
		for i < len(b) && plainStringByte[b[i]] {
			i++
		}
		if s.i = i; i >= len(b) {
			break
		}
		switch c := s.b[s.i]; {
		case c == '"':
			raw = s.b[start:s.i]
			s.i++
			return raw, escaped, true
		case c < 0x20:
			return nil, false, false
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
		default:
			s.i++
		}
	}
	return nil, false, false
}

// plainStringByte marks the bytes a JSON string holds as they are: all but
// control characters, '"' and '\\'.
var plainStringByte = func() (t [256]bool) {
	for c := 0x20; c < 256; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

// number scans a JSON number.
func (s *scanner) number() bool {
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
	switch {
	case s.is('0'):
		s.i++
	case digits() == 0:
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

// skip scans any value at depth (1: a top-level member's value), nested
// at most s.max deep (0: maxScanDepth). The keys of a skipped object are
// not read, so any valid key is accepted.
func (s *scanner) skip(depth int) bool {
	if s.i >= len(s.b) {
		return false
	}
	if max := s.max; depth > max && (max > 0 || depth > maxScanDepth) {
		s.deep = true
		return false
	}
	switch c := s.b[s.i]; {
	case c == '{' || c == '[':
		// One loop for both: an object's member is a key, a colon and a
		// value; an array's element a value.
		end := c + 2 // '}' or ']'
		s.i++
		s.ws()
		if s.is(end) {
			s.i++
			return true
		}
		for {
			if c == '{' {
				if !s.is('"') {
					return false
				}
				if _, _, ok := s.scanStr(); !ok {
					return false
				}
				s.ws()
				if !s.is(':') {
					return false
				}
				s.i++
				s.ws()
			}
			if !s.skip(depth + 1) {
				return false
			}
			s.ws() // sep, by hand: the call costs a fifth of a number's skip
			switch {
			case s.is(','):
				s.i++
				s.ws()
			case s.is(end):
				s.i++
				return true
			default:
				return false
			}
		}
	case c == '"':
		_, _, ok := s.scanStr()
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

// array scans an array at '[', calling elem for each element with the
// scanner at its start.
func (s *scanner) array(elem func() bool) bool {
	s.i++ // '['
	s.ws()
	if s.is(']') {
		s.i++
		return true
	}
	for {
		if !elem() {
			return false
		}
		if more, ok := s.sep(']'); !more {
			return ok
		}
	}
}

// choices scans the "choices" value: null, or an array of objects.
func (s *scanner) choices(v *View) bool {
	if s.literal("null") {
		v.Choices, v.Output = 0, false
		return true
	}
	if !s.is('[') {
		return false
	}
	n, output := 0, false
	ok := s.array(func() bool {
		if !s.is('{') {
			return false
		}
		n++
		var seenText, seenDelta, seenFinish bool
		return s.object(func(key []byte) bool {
			switch string(key) {
			case "text":
				if seenText {
					return false
				}
				seenText = true
				out, ok := s.optString()
				output = output || out
				return ok
			case "delta":
				if seenDelta {
					return false
				}
				seenDelta = true
				out, ok := s.delta()
				output = output || out
				return ok
			case "finish_reason":
				if seenFinish {
					return false
				}
				seenFinish = true
				_, ok := s.optString()
				return ok
			}
			return !foldsTo(key, "text", "delta", "finish_reason") && s.skip(3)
		})
	})
	v.Choices, v.Output = n, output
	return ok
}

// usage scans a "usage" object whose members prompt_tokens,
// completion_tokens, total_tokens (integers or null) and
// prompt_tokens_details (null, or an object whose cached_tokens is an
// integer or null) appear at most once each; other members are skipped, as
// encoding/json skips them. Anything else (a number with a fraction or
// exponent, a known key in another spelling) is left undecided.
func (s *scanner) usage() (*openai.Usage, bool) { return s.usageObject(&chatUsageKeys, 1) }

// chatUsageKeys and responseUsageKeys name a usage object's members:
// prompt, completion and total tokens, and the details object whose
// cached_tokens is read (chat: openai.Usage; Responses:
// openai.ResponseUsage, read into chat terms).
var (
	chatUsageKeys     = [4]string{"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
	responseUsageKeys = [4]string{"input_tokens", "output_tokens", "total_tokens", "input_tokens_details"}
)

// usageObject scans a usage object whose members are named by keys, at
// nesting depth (the skip depth of its unknown members is depth+1, of its
// details' depth+2).
func (s *scanner) usageObject(keys *[4]string, depth int) (*openai.Usage, bool) {
	if !s.is('{') {
		return nil, false
	}
	u := new(openai.Usage)
	var seen [4]bool
	ok := s.object(func(key []byte) bool {
		k, ok := knownKey(key, keys[:]...)
		switch {
		case !ok || (k >= 0 && seen[k]):
			return false
		case k < 0:
			return s.skip(depth + 1)
		}
		seen[k] = true
		switch k {
		case 0:
			return s.optInt(&u.PromptTokens)
		case 1:
			return s.optInt(&u.CompletionTokens)
		case 2:
			return s.optInt(&u.TotalTokens)
		}
		if s.literal("null") {
			u.PromptTokensDetails = nil
			return true
		}
		if !s.is('{') {
			return false
		}
		d := new(openai.PromptTokensDetails)
		u.PromptTokensDetails = d
		seenCached := false
		return s.object(func(key []byte) bool {
			if string(key) != "cached_tokens" {
				return !foldsTo(key, "cached_tokens") && s.skip(depth+2)
			}
			if seenCached {
				return false
			}
			seenCached = true
			return s.optInt(&d.CachedTokens)
		})
	})
	return u, ok
}

// optInt scans an integer into *dst, or null (dst unchanged, as
// encoding/json leaves it). Integers of up to 18 digits only; others are
// undecided.
func (s *scanner) optInt(dst *int) bool {
	if s.literal("null") {
		return true
	}
	neg := s.is('-')
	if neg {
		s.i++
	}
	start, n := s.i, 0
	for s.i < len(s.b) && '0' <= s.b[s.i] && s.b[s.i] <= '9' {
		n = n*10 + int(s.b[s.i]-'0')
		s.i++
	}
	digits := s.i - start
	if digits == 0 || digits > 18 || (digits > 1 && s.b[start] == '0') ||
		s.is('.') || s.is('e') || s.is('E') {
		return false
	}
	if neg {
		n = -n
	}
	*dst = n
	return true
}

// optString scans a string or null; nonEmpty reports a non-empty string
// (a string with any content decodes to a non-empty one).
func (s *scanner) optString() (nonEmpty, ok bool) {
	if s.literal("null") {
		return false, true
	}
	if !s.is('"') {
		return false, false
	}
	raw, _, ok := s.str()
	return len(raw) > 0, ok
}

// delta scans a choice's "delta": null, or an object whose content,
// reasoning and reasoning_content are strings or null and whose tool_calls
// is any value.
func (s *scanner) delta() (output, ok bool) {
	if s.literal("null") {
		return false, true
	}
	if !s.is('{') {
		return false, false
	}
	var seen [4]bool
	ok = s.object(func(key []byte) bool {
		k, ok := knownKey(key, "content", "reasoning", "reasoning_content", "tool_calls")
		switch {
		case !ok || (k >= 0 && seen[k]):
			return false
		case k < 0:
			return s.skip(4)
		}
		seen[k] = true
		if k == 3 {
			start := s.i
			if !s.skip(4) {
				return false
			}
			raw := string(s.b[start:s.i])
			output = output || (raw != "null" && raw != "[]")
			return true
		}
		out, ok := s.optString()
		output = output || out
		return ok
	})
	return output, ok
}

// knownKey returns the index of key among names, spelled exactly, or -1 for
// a key the caller skips. ok is false for a key that only folds to one of
// names (encoding/json would match it case-insensitively: the scan is then
// undecided).
func knownKey(key []byte, names ...string) (k int, ok bool) {
	for i, n := range names {
		if string(key) == n {
			return i, true
		}
	}
	return -1, !foldsTo(key, names...)
}

// foldsTo reports whether key matches one of names case-insensitively,
// as encoding/json matches keys to fields (the exact spellings were
// handled already).
func foldsTo(key []byte, names ...string) bool {
	for _, n := range names {
		// Keys are ASCII here (others are refused), so only equal lengths
		// can match.
		if len(key) == len(n) && strings.EqualFold(string(key), n) {
			return true
		}
	}
	return false
}

// MemberSpan returns the byte range [from, to) of the top-level member name
// of the JSON object data: from its key's opening quote to the end of its
// value. ok is false when data is not an object the scanner can walk (see
// object) or has no such member.
func MemberSpan(data []byte, name string) (from, to int, ok bool) {
	s := scanner{b: data}
	s.ws()
	if !s.is('{') {
		return 0, 0, false
	}
	found := false
	walked := s.object(func(key []byte) bool {
		if !found && string(key) == name {
			// key is data[from+1 : from+1+len(key)]: find from by capacity.
			from, found = cap(data)-cap(key)-1, true
			if !s.skip(1) {
				return false
			}
			to = s.i
			return true
		}
		return s.skip(1)
	})
	return from, to, walked && found
}

// WithoutMember appends to dst the JSON object data less its member spanning
// [from, to) (see MemberSpan) and the comma that separated it from a
// neighbour.
func WithoutMember(dst, data []byte, from, to int) []byte {
	end := to
	for end < len(data) && isJSONSpace(data[end]) {
		end++
	}
	if end < len(data) && data[end] == ',' {
		// A member follows: drop the comma after this one.
		end++
		for end < len(data) && isJSONSpace(data[end]) {
			end++
		}
		return append(append(dst, data[:from]...), data[end:]...)
	}
	// The last member: drop the comma before it, if any.
	start := from
	for start > 0 && isJSONSpace(data[start-1]) {
		start--
	}
	if start > 0 && data[start-1] == ',' {
		start--
	}
	return append(append(dst, data[:start]...), data[to:]...)
}

func isJSONSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }
