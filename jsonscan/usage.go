package jsonscan

import (
	"encoding/json"

	"github.com/infergate/infergate/openai"
)

// Usage reads the top-level "usage" of a whole (not streamed) chat or
// completion answer, as json.Unmarshal into
// struct{ Usage *openai.Usage `json:"usage"` } reads it, errors ignored
// (nil: no usage, null, or data the decoder cannot read; a body nested
// deeper than openai.MaxDepth is not read). The common shapes are read by
// ScanUsage without encoding/json: the standard decoder's ten allocations
// per answer were half of what the endpoint picker's decision allocated
// for a chat (gateway/README.md "Endpoint picker"); anything ScanUsage
// is not sure about goes through ParseUsage, whose answer ScanUsage
// reproduces exactly (FuzzScanUsage checks it).
func Usage(data []byte) *openai.Usage {
	if u, decided := ScanUsage(data); decided {
		return u
	}
	return ParseUsage(data)
}

// ParseUsage is the reference reading of Usage, with encoding/json.
func ParseUsage(data []byte) *openai.Usage {
	if openai.TooDeep(data) {
		return nil // an engine's JSON is bounded like a client's
	}
	var u struct {
		Usage *openai.Usage `json:"usage"`
	}
	_ = json.Unmarshal(data, &u)
	return u.Usage
}

// ScanUsage reads Usage's answer without encoding/json. decided is false
// when it cannot be sure to match ParseUsage: invalid JSON, a top-level
// key that folds to "usage" without being it (or has escapes or non-ASCII
// bytes), "usage" twice, a usage of an unexpected shape (see
// scanner.usage), nesting over maxScanDepth. The other members are
// skipped, validated. At most two allocations (the usage and its
// details), none for an answer without usage.
func ScanUsage(data []byte) (u *openai.Usage, decided bool) {
	s := scanner{b: data}
	s.ws()
	if !s.is('{') {
		return nil, false
	}
	seen := false
	ok := s.object(func(key []byte) bool {
		if string(key) != "usage" {
			return !foldsTo(key, "usage") && s.skip(1)
		}
		if seen {
			return false
		}
		seen = true
		if s.literal("null") {
			u = nil
			return true
		}
		var ok bool
		u, ok = s.usage()
		return ok
	})
	if !ok {
		return nil, false
	}
	s.ws()
	if s.i != len(s.b) {
		return nil, false
	}
	return u, true
}
