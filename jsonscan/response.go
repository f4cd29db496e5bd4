package jsonscan

import (
	"encoding/json"
	"errors"
	"strings"

	"github.com/infergate/infergate/openai"
)

// ResponseView is what the relay reads from one Responses stream event.
type ResponseView struct {
	Output   bool   // a response.*.delta with a non-empty delta
	Terminal bool   // response.completed, .incomplete or .failed
	Failed   bool   // response.failed or an "error" event
	ID       string // the response's id (terminal events)
	Usage    *openai.Usage
}

// responseEvent is the reference decoding of a Responses stream event
// (encoding/json), which ScanResponse agrees with when it decides.
type responseEvent struct {
	Type     string          `json:"type"`
	Delta    json.RawMessage `json:"delta"`
	Response *struct {
		ID    string                `json:"id"`
		Usage *openai.ResponseUsage `json:"usage"`
	} `json:"response"`
}

// view is the event's ResponseView.
func (ev *responseEvent) view() ResponseView {
	v := ResponseView{}
	switch ev.Type {
	case "response.completed", "response.incomplete":
		v.Terminal = true
	case "response.failed":
		v.Terminal, v.Failed = true, true
	case "error":
		v.Failed = true
	default:
		d := string(ev.Delta)
		v.Output = strings.HasPrefix(ev.Type, "response.") && strings.HasSuffix(ev.Type, ".delta") &&
			len(d) > 2 && d[0] == '"'
	}
	if v.Terminal && ev.Response != nil {
		v.ID, v.Usage = ev.Response.ID, ev.Response.Usage.Usage()
	}
	return v
}

// ParseResponse decodes an event with encoding/json; ok is false when
// data is not a JSON object (or nests deeper than openai.MaxDepth). A field
// of an unexpected type is skipped, not fatal, as for chat chunks.
func ParseResponse(data []byte) (ResponseView, bool) {
	if openai.TooDeep(data) {
		return ResponseView{}, false
	}
	var ev responseEvent
	if err := json.Unmarshal(data, &ev); err != nil {
		var te *json.UnmarshalTypeError
		if !errors.As(err, &te) {
			return ResponseView{}, false
		}
	}
	return ev.view(), true
}

// Response reads a Responses stream event, by ScanResponse
// when it can decide, else by encoding/json.
func Response(data []byte) (ResponseView, bool) {
	if v, decided := ScanResponse(data); decided {
		return v, true
	}
	return ParseResponse(data)
}

// ScanResponse reads an event without encoding/json: the top-level
// "type" (a plain string), "delta" (any value) and, in a terminal event,
// "response"'s "id" (a plain string) and "usage" (null, or an object of
// integers input_tokens, output_tokens, total_tokens and an
// input_tokens_details whose cached_tokens is an integer or null; other
// members skipped). decided is false whenever it cannot be sure to agree
// with encoding/json (escapes in what it reads, a known key in another
// case or repeated, a type it does not expect, nesting over maxScanDepth).
func ScanResponse(data []byte) (v ResponseView, decided bool) {
	s := scanner{b: data}
	s.ws()
	if !s.is('{') {
		return v, false
	}
	var (
		typ                         []byte
		delta                       []byte
		seenType, seenDelta, seenRs bool
		id                          []byte
		usage                       *openai.Usage
	)
	ok := s.object(func(key []byte) bool {
		k, ok := knownKey(key, "type", "delta", "response")
		switch {
		case !ok:
			return false
		case k < 0:
			return s.skip(1)
		case k == 0:
			if seenType || !s.is('"') {
				return false
			}
			seenType = true
			raw, plain, ok := s.str()
			typ = raw
			return ok && plain
		case k == 1:
			if seenDelta {
				return false
			}
			seenDelta = true
			start := s.i
			if !s.skip(1) {
				return false
			}
			delta = data[start:s.i]
			return true
		}
		if seenRs {
			return false
		}
		seenRs = true
		if s.literal("null") {
			return true
		}
		if !s.is('{') {
			return false
		}
		var seenID, seenUsage bool
		return s.object(func(key []byte) bool {
			k, ok := knownKey(key, "id", "usage")
			switch {
			case !ok:
				return false
			case k < 0:
				return s.skip(2)
			case k == 0:
				if seenID {
					return false
				}
				seenID = true
				if s.literal("null") {
					return true
				}
				if !s.is('"') {
					return false
				}
				raw, plain, ok := s.str()
				id = raw
				return ok && plain
			}
			if seenUsage {
				return false
			}
			seenUsage = true
			if s.literal("null") {
				return true
			}
			u, ok := s.responseUsage()
			usage = u
			return ok
		})
	})
	if !ok {
		return ResponseView{}, false
	}
	s.ws()
	if s.i != len(s.b) {
		return ResponseView{}, false
	}
	ev := responseEvent{Type: string(typ), Delta: delta}
	v = ev.view()
	if v.Terminal {
		v.ID, v.Usage = string(id), usage
	}
	return v, true
}

// responseUsage scans a Responses usage object into chat terms (see
// openai.ResponseUsage.Usage).
func (s *scanner) responseUsage() (*openai.Usage, bool) { return s.usageObject(&responseUsageKeys, 2) }
