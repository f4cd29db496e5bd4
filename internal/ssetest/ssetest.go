// Package ssetest is the reference Server-Sent Events parser for tests: a
// client's view of an event stream, written as the WHATWG HTML standard
// (§9.2.5, "Parsing an event stream"; §9.2.6, "Interpreting an event
// stream") states it, step by step and without buffering tricks, so that
// the gateway's own reader (openai.EventReader) and what the gateway writes
// can be checked against what an EventSource client sees.
package ssetest

import "strings"

// Event is one dispatched event: its data (the data lines joined with
// "\n") and its type (the last "event" field; empty for the default,
// "message").
type Event struct {
	Data, Type string
}

// Events parses stream as a client does and returns the events it
// dispatches, in order. A leading U+FEFF is ignored; lines end at CRLF, a
// lone LF or a lone CR; an event without data is not dispatched; an event
// unfinished at the end of the stream is discarded.
func Events(stream []byte) []Event {
	s := strings.TrimPrefix(string(stream), "\uFEFF")
	s = strings.ReplaceAll(s, "\r\n", "\n")
	s = strings.ReplaceAll(s, "\r", "\n")
	lines := strings.Split(s, "\n")
	lines = lines[:len(lines)-1] // the text after the last line end is no line
	var (
		out       []Event
		data, typ strings.Builder
		hasData   bool
	)
	for _, line := range lines {
		if line == "" {
			if hasData {
				out = append(out, Event{Data: strings.TrimSuffix(data.String(), "\n"), Type: typ.String()})
			}
			data.Reset()
			typ.Reset()
			hasData = false
			continue
		}
		if strings.HasPrefix(line, ":") {
			continue
		}
		field, value, ok := strings.Cut(line, ":")
		if ok {
			value = strings.TrimPrefix(value, " ")
		}
		switch field {
		case "data":
			data.WriteString(value)
			data.WriteString("\n")
			hasData = true
		case "event":
			typ.Reset()
			typ.WriteString(value)
		}
	}
	return out
}
