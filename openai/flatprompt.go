package openai

import (
	"bytes"
	"sync"
	"unsafe"

	"github.com/infergate/infergate/internal/jsonvalue"
	segjson "github.com/segmentio/encoding/json"
)

// A completion's prompt of token ids is read in one pass. segmentio's
// decoder hands a field's UnmarshalJSON the value's bytes only after
// parsing the whole value itself (number by number, to find its end), and
// Prompt.UnmarshalJSON then scans the ids again: for 1,024 ids, half of
// the endpoint picker's decision (gateway/README.md "Endpoint picker").
// parse therefore finds a completion body's top-level "prompt" member
// whose value is a flat array of token ids, reads the ids once
// (appendTokenIDs), and has segmentio decode the body without that member.
//
// Why the result is Decode's: the member is found by a walk that accepts
// only a well-formed top level ("key": value pairs separated by commas,
// keys without escapes, "prompt" once), and the member removed — key,
// colon, the array and one comma beside it — is well-formed JSON whose
// ids appendTokenIDs accepted exactly as Prompt.UnmarshalJSON would; every
// other byte is kept in place. So the rest decodes, or fails, as it does
// in the whole body (the walk's string and bracket lexing is JSON's on any
// body segmentio accepts), and on any failure the whole body is decoded
// again the ordinary way, for the same error as before. Any body the walk
// does not accept takes the ordinary way. FuzzFlatPromptAgrees holds both
// ways to the same request and the same error.

// parse is segjson.Parse(body, v, exactKeys), with a completion's flat
// token-id prompt read in one pass when fast (decodeFlatPrompt). rest is
// what follows the object in body.
func parse(body []byte, v any, fast bool) (rest []byte, err error) {
	if r, ok := v.(*CompletionRequest); ok && fast {
		if rest, ok := r.decodeFlatPrompt(body); ok {
			return rest, nil
		}
	}
	if r, ok := v.(*ChatRequest); ok && r.borrow {
		// The same decode, contents borrowed (ChatRequest.Reset); a
		// failure is decoded again into v by decode, as ever.
		return segjson.Parse(body, (*chatRequestBorrowing)(unsafe.Pointer(r)), exactKeys)
	}
	return segjson.Parse(body, v, exactKeys)
}

// flatScratch holds the bodies without their prompt (a body's other
// members: tens of bytes for most); buffers over maxFlatScratch are not
// kept.
var flatScratch = sync.Pool{New: func() any { return new([]byte) }}

const maxFlatScratch = 64 << 10

// decodeFlatPrompt decodes body into r when its prompt is a flat array of
// token ids (see above); ok false leaves r as it was, for the ordinary
// decode. The ids go into the buffer CompletionRequest.Reset kept.
func (r *CompletionRequest) decodeFlatPrompt(body []byte) (rest []byte, ok bool) {
	from, to, arrFrom, arrTo, ok := flatPromptMember(body)
	if !ok {
		return nil, false
	}
	ids, err := appendTokenIDs(r.Prompt.spare, body[arrFrom:arrTo])
	if err != nil {
		return nil, false
	}
	saved := *r
	bp := flatScratch.Get().(*[]byte)
	buf := append(append((*bp)[:0], body[:from]...), body[to:]...)
	rest, err = segjson.Parse(buf, r, exactKeys) // strings are copied (no DontCopy flag): buf is reused
	n := len(rest)
	if cap(buf) <= maxFlatScratch {
		*bp = buf
		flatScratch.Put(bp)
	}
	if err != nil {
		*r = saved
		return nil, false
	}
	// The object's end lies after the prompt: rest is body's own tail.
	r.Prompt = Prompt{Tokens: append(saved.Prompt.spareList[:0], ids)}
	return body[len(body)-n:], true
}

// flatPromptMember finds body's top-level "prompt" member whose value is
// an array starting with a digit: the array at body[arrFrom:arrTo] (to its
// first ']'), and the bytes [from, to) to remove with it (the member and
// the comma after it, or before it when it is the last). ok is false when
// there is none, "prompt" is given twice, a key has an escape, or the top
// level is not a well-formed object of members; the values other than
// the prompt are skipped, not validated (segmentio reads them).
func flatPromptMember(b []byte) (from, to, arrFrom, arrTo int, ok bool) {
	i := jsonvalue.SkipSpace(b, 0)
	if i == len(b) || b[i] != '{' {
		return 0, 0, 0, 0, false
	}
	i = jsonvalue.SkipSpace(b, i+1)
	found, prevComma := false, -1
	for {
		if i >= len(b) || b[i] != '"' {
			return 0, 0, 0, 0, false // also {}: no prompt
		}
		start, end := i, i+1
		for end < len(b) && b[end] != '"' && b[end] != '\\' {
			end++
		}
		if end >= len(b) || b[end] == '\\' {
			return 0, 0, 0, 0, false // an escape may spell "prompt"
		}
		isPrompt := string(b[start+1:end]) == "prompt"
		if i = jsonvalue.SkipSpace(b, end+1); i >= len(b) || b[i] != ':' {
			return 0, 0, 0, 0, false
		}
		if i = jsonvalue.SkipSpace(b, i+1); i >= len(b) {
			return 0, 0, 0, 0, false
		}
		if isPrompt {
			if found || b[i] != '[' {
				return 0, 0, 0, 0, false
			}
			if k := jsonvalue.SkipSpace(b, i+1); k >= len(b) || b[k] < '0' || b[k] > '9' {
				return 0, 0, 0, 0, false
			}
			j := bytes.IndexByte(b[i:], ']')
			if j < 0 {
				return 0, 0, 0, 0, false
			}
			found, arrFrom, arrTo = true, i, i+j+1
			from, to = start, arrTo
			if prevComma >= 0 {
				from = prevComma // the last member: its comma before it goes
			}
			i = arrTo
		} else if i = jsonvalue.Skip(b, i); i < 0 {
			return 0, 0, 0, 0, false
		}
		i = jsonvalue.SkipSpace(b, i)
		if i >= len(b) {
			return 0, 0, 0, 0, false
		}
		switch b[i] {
		case ',':
			if isPrompt {
				from, to = start, i+1 // not the last: its comma after it goes
			}
			prevComma = i
			i = jsonvalue.SkipSpace(b, i+1)
		case '}':
			return from, to, arrFrom, arrTo, found
		default:
			return 0, 0, 0, 0, false
		}
	}
}
