package gateway

import (
	"strconv"
	"time"
	"unicode/utf8"
)

// lineEncoder writes one log line in slog's layout: JSON ({"time":…,
// "level":"INFO","msg":…,"key":value…}) or text (time=… level=INFO msg=…
// key=value…, values quoted when they need it). Keys are the caller's
// constants; values are escaped, so no client byte can break the line.
type lineEncoder struct {
	buf  []byte
	json bool
}

func (e *lineEncoder) begin(t time.Time, msg string) {
	if e.json {
		e.buf = append(e.buf, `{"time":"`...)
		e.buf = t.AppendFormat(e.buf, time.RFC3339Nano)
		e.buf = append(e.buf, `","level":"INFO","msg":`...)
		e.buf = appendJSONString(e.buf, msg)
		return
	}
	e.buf = append(e.buf, "time="...)
	e.buf = t.AppendFormat(e.buf, "2006-01-02T15:04:05.000Z07:00")
	e.buf = append(e.buf, " level=INFO msg="...)
	e.buf = appendTextValue(e.buf, msg)
}

func (e *lineEncoder) key(k string) {
	if e.json {
		e.buf = append(append(append(e.buf, `,"`...), k...), `":`...)
		return
	}
	e.buf = append(append(append(e.buf, ' '), k...), '=')
}

func (e *lineEncoder) str(k, v string) {
	e.key(k)
	v = truncateUTF8(v, maxLoggedValue)
	if e.json {
		e.buf = appendJSONString(e.buf, v)
	} else {
		e.buf = appendTextValue(e.buf, v)
	}
}

func (e *lineEncoder) int(k string, v int64) {
	e.key(k)
	e.buf = strconv.AppendInt(e.buf, v, 10)
}

func (e *lineEncoder) bool(k string, v bool) {
	e.key(k)
	e.buf = strconv.AppendBool(e.buf, v)
}

// seconds writes d in seconds with microsecond resolution.
func (e *lineEncoder) seconds(k string, d time.Duration) {
	e.key(k)
	e.buf = strconv.AppendFloat(e.buf, d.Seconds(), 'f', 6, 64)
}

func (e *lineEncoder) end() []byte {
	if e.json {
		e.buf = append(e.buf, '}')
	}
	return append(e.buf, '\n')
}

// truncateUTF8 cuts s to at most n bytes, not inside a UTF-8 sequence.
func truncateUTF8(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := n
	for i > 0 && i > n-utf8.UTFMax && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i]
}

const hexDigits = "0123456789abcdef"

// appendJSONString appends s as a JSON string as encoding/json writes it
// (without HTML escaping): quotes, backslashes and control characters
// escaped, invalid UTF-8 replaced by U+FFFD byte by byte, U+2028 and
// U+2029 escaped (FuzzAppendJSONString).
func appendJSONString(dst []byte, s string) []byte {
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(append(dst, s[start:i]...), `\ufffd`...)
			i++
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			dst = append(append(dst, s[start:i]...), '\\', 'u', '2', '0', '2', hexDigits[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	return append(append(dst, s[start:]...), '"')
}

// appendTextValue appends s as slog's text handler would: as is when it is
// a non-empty run of printable ASCII without spaces, '=' or '"', else
// quoted with Go's escapes (strconv.Quote: control bytes, newlines and
// invalid UTF-8 escaped).
func appendTextValue(dst []byte, s string) []byte {
	if s == "" {
		return append(dst, `""`...)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c == '=' || c == '"' || c >= utf8.RuneSelf-1 {
			return strconv.AppendQuote(dst, s)
		}
	}
	return append(dst, s...)
}
