package openai

import (
	"bytes"
	"errors"

	"github.com/infergate/infergate/internal/jsonvalue"
)

// Nesting and element bounds. A JSON body is attacker-controlled on both
// sides of the gateway (clients' requests, engines' answers), and the
// decoders it meets are recursive: segmentio/encoding/json recurses once per
// nested array or object with no limit of its own, so a 2 MB body of "["
// overflowed the goroutine stack (a fatal error that ends the process, not a
// panic that recover catches), and 500 KB of it grew a 256 MiB stack in
// 0.7 s. Every decoding path therefore checks TooDeep first, a linear scan
// that needs no stack; the typed arrays (messages, content parts, prompts)
// are decoded element by element (eachElement), so that what a body can
// make the gateway allocate is bounded by a small multiple of its size
// (BenchmarkDecodeHostile states the figures).

// MaxDepth is the deepest nesting of arrays and objects a body may have
// (the top-level object is depth 1). 128 is serde_json's recursion limit,
// with which Rust front ends (TGI's router, many OpenAI-compatible proxies)
// read the same requests; pydantic-core's jiter (vLLM's and SGLang's
// pydantic models) stops at 200, encoding/json at 10000. No OpenAI request
// needs more than a dozen levels: a tool's JSON schema nests two per
// property level.
const MaxDepth = 128

// TooDeep reports whether b nests arrays and objects deeper than MaxDepth,
// counting brackets outside strings. b need not be valid JSON: on a valid
// prefix the count is the nesting a decoder reaches there, and a decoder
// stops at the first invalid byte, so when TooDeep is false no decoder
// nests deeper than MaxDepth on b. Cost: two vectorized byte counts when b
// has at most MaxDepth brackets in all (nearly every request), else one
// pass over b that jumps from quote to quote inside strings.
func TooDeep(b []byte) bool {
	if bytes.Count(b, []byte{'['})+bytes.Count(b, []byte{'{'}) <= MaxDepth {
		return false
	}
	depth := 0
	for i := 0; i < len(b); i++ {
		switch b[i] {
		case '"':
			end := jsonvalue.StringEnd(b, i)
			if end < 0 {
				return false // unterminated: no decoder reads past it
			}
			i = end
		case '[', '{':
			if depth++; depth > MaxDepth {
				return true
			}
		case ']', '}':
			depth--
		}
	}
	return false
}

// errElements is eachElement's answer to a value that is not a
// well-formed array (the decoders validate first, so it is not expected).
var errElements = errors.New("malformed array")

// eachElement calls fn with the index and bytes (trimmed of whitespace) of
// each element of the JSON array b, in order, until fn returns an error,
// which it returns. It walks b once without recursion (strings skipped as in
// TooDeep); it does not validate the elements, which fn decodes.
func eachElement(b []byte, fn func(i int, elem []byte) error) error {
	b = bytes.TrimSpace(b)
	if len(b) < 2 || b[0] != '[' || b[len(b)-1] != ']' {
		return errElements
	}
	body := b[1 : len(b)-1]
	if len(bytes.TrimSpace(body)) == 0 {
		return nil
	}
	depth, start, n := 0, 0, 0
	for i := 0; i <= len(body); i++ {
		if i < len(body) {
			switch body[i] {
			case '"':
				end := jsonvalue.StringEnd(body, i)
				if end < 0 {
					return errElements
				}
				i = end
				continue
			case '[', '{':
				depth++
				continue
			case ']', '}':
				depth--
				continue
			case ',':
				if depth != 0 {
					continue
				}
			default:
				continue
			}
		}
		if depth != 0 {
			return errElements
		}
		elem := bytes.TrimSpace(body[start:i])
		if len(elem) == 0 {
			return errElements
		}
		if err := fn(n, elem); err != nil {
			return err
		}
		n++
		start = i + 1
	}
	return nil
}

// countElements is the number of elements of the JSON array b, as
// eachElement visits them.
func countElements(b []byte) (int, error) {
	n := 0
	err := eachElement(b, func(int, []byte) error { n++; return nil })
	return n, err
}
