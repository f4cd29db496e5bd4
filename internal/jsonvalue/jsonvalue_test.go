package jsonvalue

import (
	"bytes"
	"encoding/json"
	"testing"
)

func TestSkip(t *testing.T) {
	for _, tc := range []struct {
		in   string
		i    int
		want int
	}{
		{`"a"`, 0, 3},
		{`"a\"b",`, 0, 6},
		{`"a\\"b`, 0, 5},
		{`"a\\\"b"`, 0, 8},
		{`{"a":[1,"]}"],"b":{}} x`, 0, 21},
		{`[[[]]]]`, 0, 6},
		{`123,`, 0, 3},
		{`-1.5e3}`, 0, 6},
		{`true]`, 0, 4},
		{`null `, 0, 4},
		{`nul`, 0, -1},    // a scalar must end before the body does
		{`"abc`, 0, -1},   // unclosed string
		{`{"a":1`, 0, -1}, // unclosed object
		{`[1,2`, 0, -1},
		{`,`, 0, -1}, // a delimiter starts no value
		{`:`, 0, -1},
		{``, 0, -1},
		{`1`, 5, -1},
		{`1`, -1, -1},
		{`{"a":"}"}`, 0, 9},
		{`x 1 2`, 2, 3},
	} {
		if got := Skip([]byte(tc.in), tc.i); got != tc.want {
			t.Errorf("Skip(%q, %d) = %d, want %d", tc.in, tc.i, got, tc.want)
		}
	}
}

func TestStringEnd(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
	}{
		{`""`, 1}, {`"\""`, 3}, {`"\\"`, 3}, {`"\\\""`, 5}, {`"\`, -1}, {`"`, -1}, {`"a" "b"`, 2},
	} {
		if got := StringEnd([]byte(tc.in), 0); got != tc.want {
			t.Errorf("StringEnd(%q) = %d, want %d", tc.in, got, tc.want)
		}
	}
}

func TestSkipSpace(t *testing.T) {
	if got := SkipSpace([]byte(" \t\r\n x"), 0); got != 5 {
		t.Errorf("SkipSpace = %d, want 5", got)
	}
	if got := SkipSpace([]byte("  "), 0); got != 2 {
		t.Errorf("SkipSpace of spaces = %d, want 2", got)
	}
	if got := SkipSpace([]byte("\v1"), 0); got != 0 {
		t.Errorf("SkipSpace(\\v) = %d, want 0 (not JSON whitespace)", got)
	}
}

// FuzzSkip: on any input Skip returns -1 or an index within the body,
// never panics; on a valid JSON value followed by a delimiter it returns
// the value's end exactly, as encoding/json delimits it.
func FuzzSkip(f *testing.F) {
	for _, s := range []string{`"a"`, `{"a":[1,"]}"]}`, `123`, `-0.5e-3`, `true`, `null`, `"\\\""`, `[{"x":"\u0022"}]`, `{"a`, `[`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		for i := range min(len(b), 8) {
			if j := Skip(b, i); j != -1 && (j <= i || j > len(b)) {
				t.Fatalf("Skip(%q, %d) = %d: out of range", b, i, j)
			}
		}
		v := bytes.TrimSpace(b)
		if len(v) == 0 || !json.Valid(v) {
			return
		}
		in := append(append([]byte(nil), v...), ",0"...)
		if got := Skip(in, 0); got != len(v) {
			t.Fatalf("Skip(%q) = %d, want %d (the valid value's end)", in, got, len(v))
		}
	})
}
