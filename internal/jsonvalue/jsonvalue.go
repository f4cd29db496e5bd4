// Package jsonvalue finds where JSON values end without decoding them: the
// one skipper shared by the request decoders that walk a body's top-level
// members (openai's flat-prompt fast path, disagg's body edits, jsonscan's
// model splice). It does not validate: callers either validated the body
// first (disagg: json.Valid; jsonscan: openai.Decode) or fall back to a
// full decoder on any doubt (openai). Every function is linear in the
// bytes it reads and iterative (no recursion, so no depth limit to
// guard): a hostile body costs one pass.
package jsonvalue

import "bytes"

// SkipSpace returns the index of the first byte of b at or after i that is
// not JSON whitespace (RFC 8259 §2: space, tab, LF, CR), len(b) if none.
func SkipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// StringEnd returns the index of the quote that closes the string whose
// opening quote is at b[open], or -1 when it is not closed. A quote is
// escaped when an odd run of backslashes precedes it; each run is counted
// once and the quotes are found with bytes.IndexByte, so the scan is
// linear.
func StringEnd(b []byte, open int) int {
	i := open + 1
	for {
		j := bytes.IndexByte(b[i:], '"')
		if j < 0 {
			return -1
		}
		q := i + j
		k := q - 1
		for k > open && b[k] == '\\' {
			k--
		}
		if (q-1-k)%2 == 0 {
			return q
		}
		i = q + 1
	}
}

// Skip returns the index just past the value starting at b[i] — a string
// (to its closing quote), an object or array (brackets counted outside
// strings), or a scalar (number or literal: up to whitespace or a
// delimiter) — or -1 when i is past the end, the value does not end
// within b, or b[i] cannot start a value (a delimiter).
func Skip(b []byte, i int) int {
	if i < 0 || i >= len(b) {
		return -1
	}
	switch b[i] {
	case '"':
		if e := StringEnd(b, i); e >= 0 {
			return e + 1
		}
		return -1
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				e := StringEnd(b, j)
				if e < 0 {
					return -1
				}
				j = e
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1
				}
			}
		}
		return -1
	}
	j := i
	for j < len(b) {
		switch b[j] {
		case ' ', '\t', '\n', '\r', ',', '}', ']', '"', '{', '[', ':':
			if j == i {
				return -1
			}
			return j
		}
		j++
	}
	return -1
}
