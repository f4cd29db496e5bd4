package openai

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
)

// MaxEventBytes bounds one SSE line, and one event's joined data, read by
// EventReader (1 MiB); more from an engine is an error, never an unbounded
// buffer.
const MaxEventBytes = 1 << 20

// ErrEventTooLarge is returned for an SSE line over the reader's limit.
var ErrEventTooLarge = errors.New("sse: event line too large")

// EventReader reads the "data:" payloads of a Server-Sent Events stream
// (WHATWG HTML §9.2) as OpenAI-compatible servers send them. Comment lines
// (":"), "id:" and "retry:" fields are skipped; an event's "event:" field
// (the Responses API's event type) is kept for Event; multi-line data is
// joined with "\n". The "[DONE]" sentinel is reported by Done.
type EventReader struct {
	r     *bufio.Reader
	max   int
	data  []byte
	event []byte
	done  bool
}

// NewEventReader returns a reader over r with a line limit of max bytes
// (MaxEventBytes if max <= 0).
func NewEventReader(r io.Reader, max int) *EventReader {
	if max <= 0 {
		max = MaxEventBytes
	}
	return &EventReader{r: bufio.NewReaderSize(r, 16<<10), max: max}
}

// Next returns the next event's data. The slice is valid until the next call.
// It returns io.EOF after [DONE] or at a clean end of stream, and
// io.ErrUnexpectedEOF if the stream ended inside an event.
func (er *EventReader) Next() ([]byte, error) {
	if er.done {
		return nil, io.EOF
	}
	er.data, er.event = er.data[:0], er.event[:0]
	have := false
	for {
		line, err := er.readLine()
		if err != nil {
			if err == io.EOF && have {
				return nil, io.ErrUnexpectedEOF
			}
			return nil, err
		}
		if len(line) == 0 { // blank line dispatches the event
			if !have {
				er.event = er.event[:0] // an event without data is not dispatched
				continue
			}
			if bytes.Equal(er.data, []byte("[DONE]")) {
				er.done = true
				return nil, io.EOF
			}
			return er.data, nil
		}
		field, value := line, []byte(nil)
		if i := bytes.IndexByte(line, ':'); i >= 0 {
			field, value = line[:i], line[i+1:]
			value = bytes.TrimPrefix(value, []byte(" "))
		}
		if string(field) == "event" {
			// The last event field of the event wins (WHATWG: the event
			// type buffer is set, not appended to).
			er.event = append(er.event[:0], value...)
			continue
		}
		if string(field) != "data" {
			continue
		}
		if len(er.data)+len(value)+1 > er.max {
			return nil, fmt.Errorf("%w (event data over %d bytes)", ErrEventTooLarge, er.max)
		}
		if have {
			er.data = append(er.data, '\n')
		}
		er.data = append(er.data, value...)
		have = true
	}
}

// Reset makes er read a new stream from r, keeping its buffers (so a pooled
// reader costs no allocation per stream).
func (er *EventReader) Reset(r io.Reader) {
	er.r.Reset(r)
	er.data, er.event = er.data[:0], er.event[:0]
	er.done = false
}

// Event returns the "event:" field of the event Next last returned (empty
// when it had none: chat and completion streams). The slice is valid until
// the next call.
func (er *EventReader) Event() []byte { return er.event }

// SetLimit sets the line and event limit (bytes; MaxEventBytes if n <= 0)
// for what is read from now on.
func (er *EventReader) SetLimit(n int) {
	if n <= 0 {
		n = MaxEventBytes
	}
	er.max = n
}

// Buffered reports the capacity of the reader's event buffer (bytes), so
// that a pool can drop a reader grown by one huge event.
func (er *EventReader) Buffered() int { return cap(er.data) }

// Done reports whether the [DONE] sentinel was read.
func (er *EventReader) Done() bool { return er.done }

// readLine returns one line without its terminator (LF or CRLF).
func (er *EventReader) readLine() ([]byte, error) {
	line, err := er.r.ReadSlice('\n')
	if err == bufio.ErrBufferFull {
		buf := append([]byte(nil), line...)
		for err == bufio.ErrBufferFull {
			if len(buf) > er.max {
				return nil, fmt.Errorf("%w (over %d bytes)", ErrEventTooLarge, er.max)
			}
			line, err = er.r.ReadSlice('\n')
			buf = append(buf, line...)
		}
		line = buf
	}
	if len(line) > er.max {
		return nil, fmt.Errorf("%w (over %d bytes)", ErrEventTooLarge, er.max)
	}
	if err != nil {
		if err == io.EOF && len(line) > 0 {
			return nil, io.ErrUnexpectedEOF
		}
		return nil, err
	}
	line = bytes.TrimSuffix(line[:len(line)-1], []byte("\r"))
	return line, nil
}
