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
// (WHATWG HTML §9.2) as OpenAI-compatible servers send them. Lines end at
// LF, CRLF or a lone CR, as in a client's parser. Comment lines
// (":"), "id:" and "retry:" fields are skipped; an event's "event:" field
// (the Responses API's event type) is kept for Event; multi-line data is
// joined with "\n". The "[DONE]" sentinel is reported by Done.
type EventReader struct {
	r     *bufio.Reader
	max   int
	data  []byte
	event []byte
	done  bool
	// skipLF: the previous line ended at a CR that was the last byte
	// buffered; a LF read next belongs to it (CRLF).
	skipLF bool
	// start: no line read yet; a UTF-8 byte order mark before the first
	// is dropped (WHATWG: "One leading U+FEFF BYTE ORDER MARK character
	// must be ignored if any are present").
	start bool
}

// bom is the UTF-8 byte order mark.
var bom = []byte("\xEF\xBB\xBF")

// LineEnd finds the end of the first line in b by the SSE rule (WHATWG
// HTML §9.2.5: LF, CRLF or a lone CR ends a line). end is the line's length
// (-1 when b holds no line end), next where the following line starts in
// b, and cr reports a CR that is b's last byte: a LF that comes after it
// is part of the same line end and must be skipped by the caller.
func LineEnd(b []byte) (end, next int, cr bool) {
	end = -1
	lf := bytes.IndexByte(b, '\n')
	upto := b
	if lf >= 0 {
		upto, end, next = b[:lf], lf, lf+1
	}
	if c := bytes.IndexByte(upto, '\r'); c >= 0 {
		end, next = c, c+1
		switch {
		case c+1 == lf:
			next = lf + 1 // CRLF
		case c+1 == len(b):
			cr = true
		}
	}
	return end, next, cr
}

// NewEventReader returns a reader over r with a line limit of max bytes
// (MaxEventBytes if max <= 0).
func NewEventReader(r io.Reader, max int) *EventReader {
	if max <= 0 {
		max = MaxEventBytes
	}
	return &EventReader{r: bufio.NewReaderSize(r, 16<<10), max: max, start: true}
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
	er.done, er.skipLF, er.start = false, false, true
}

// Continue makes er read r as the rest of the stream it was reading from
// where its last event ended: as Reset, but a byte order mark at r's start
// is not the stream's (it is part of the first line, as for a client) and a
// LF at r's start ends the previous line if that ended at a CR.
func (er *EventReader) Continue(r io.Reader) {
	skip := er.skipLF
	er.Reset(r)
	er.skipLF, er.start = skip, false
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

// readLine returns one line without its terminator: LF, CRLF or a lone CR
// (WHATWG HTML §9.2.5, "Parsing an event stream": each ends a line, as a
// client's EventSource parser reads them). A CR that is the last byte
// buffered ends its line at once, without waiting for the next byte: a LF
// that then comes first is the same line end and is skipped (skipLF).
// A line over the limit is ErrEventTooLarge; a stream that ends inside a
// line io.ErrUnexpectedEOF.
func (er *EventReader) readLine() ([]byte, error) {
	var long []byte // a line longer than the buffer, copied
	need := 1       // bytes to have buffered before looking for a line end
	from := 0       // buffered bytes already scanned: no line end in them
	for {
		if er.r.Buffered() < need {
			// Peek moves a partial line to the buffer's front and fills
			// the rest (no copy of ours while the line fits).
			if _, err := er.r.Peek(need); err != nil {
				if err == io.EOF && (len(long) > 0 || er.r.Buffered() > 0) {
					return nil, io.ErrUnexpectedEOF
				}
				return nil, err
			}
		}
		buf, _ := er.r.Peek(er.r.Buffered())
		if er.skipLF {
			er.skipLF = false
			if buf[0] == '\n' {
				_, _ = er.r.Discard(1)
				continue
			}
		}
		end, next, cr := LineEnd(buf[from:])
		if end < 0 {
			if len(long)+len(buf) > er.max {
				return nil, fmt.Errorf("%w (over %d bytes)", ErrEventTooLarge, er.max)
			}
			if len(buf) < er.r.Size() {
				need, from = len(buf)+1, len(buf)
				continue
			}
			long = append(long, buf...)
			_, _ = er.r.Discard(len(buf))
			need, from = 1, 0
			continue
		}
		end, next = end+from, next+from
		er.skipLF = cr
		line := buf[:end]
		if long != nil {
			line = append(long, line...)
		}
		if er.start {
			er.start = false
			line = bytes.TrimPrefix(line, bom)
		}
		if len(line) >= er.max {
			return nil, fmt.Errorf("%w (over %d bytes)", ErrEventTooLarge, er.max)
		}
		// line is valid until the next read: Discard only moves the
		// read position.
		_, _ = er.r.Discard(next)
		return line, nil
	}
}
