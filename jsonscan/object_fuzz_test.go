package jsonscan

import (
	"bytes"
	"encoding/json"
	"slices"
	"testing"
)

// FuzzObject: Object never panics, and on a valid JSON object nested at
// most maxDepth deep it walks without error, giving each member's key as
// encoding/json decodes it and its value as written.
func FuzzObject(f *testing.F) {
	for _, s := range []string{`{"a":1,"b":[true,null,{"c":"d"}],"a":-1.5e3}`, `{"k\u0041\ud83d\ude00":"v","\u00e9":{}}`,
		`{"a":01}`, `{"a":[[[[]]]]}`, `{}`, ` { "x" : "y" } `, `{"a":"\xff"}`, `[]`, `{"a":1}x`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		const maxDepth = 4
		var keys []string
		err := Object(b, maxDepth, func(m Member) bool {
			keys = append(keys, string(m.Key))
			if !json.Valid(m.Value) || !bytes.HasSuffix(m.Raw, m.Value) || !bytes.Equal(b[m.From:m.From+len(m.Value)], m.Value) {
				t.Fatalf("%q: member %q: value %q not valid JSON or spans disagree", b, m.Raw, m.Value)
			}
			return true
		})
		if !json.Valid(b) || depth(b) > maxDepth {
			return
		}
		var obj map[string]json.RawMessage
		if json.Unmarshal(b, &obj) != nil || obj == nil {
			if err == nil {
				t.Fatalf("%q: walked as an object, encoding/json disagrees", b)
			}
			return
		}
		if err != nil {
			t.Fatalf("%q: %v", b, err)
		}
		want := make([]string, 0, len(obj))
		for k := range obj {
			want = append(want, k)
		}
		slices.Sort(want)
		got := slices.Compact(slices.Sorted(slices.Values(keys)))
		if !slices.Equal(got, want) {
			t.Fatalf("%q: keys %q, encoding/json's %q", b, got, want)
		}
	})
}

// depth is the bracket nesting of valid JSON b.
func depth(b []byte) int {
	d, top, inStr, esc := 0, 0, false, false
	for _, c := range b {
		switch {
		case inStr && esc:
			esc = false
		case inStr && c == '\\':
			esc = true
		case inStr && c == '"':
			inStr = false
		case inStr:
		case c == '"':
			inStr = true
		case c == '{' || c == '[':
			d++
			top = max(top, d)
		case c == '}' || c == ']':
			d--
		}
	}
	return top
}

// FuzzAppendUint32s: never panics, leaves dst's prefix alone, keeps at most
// the limit, and accepts exactly the arrays encoding/json decodes into
// []uint32 written without sign, fraction, exponent or surrounding space.
func FuzzAppendUint32s(f *testing.F) {
	for _, s := range []string{`[null]`, `[]`, `[0,4294967295]`, `[4294967296]`, `[01]`, `[-0]`, `[1.0]`, `[1e2]`, `[1, 2 ,3 ]`, ` [1]`, `[1]x`, `null`, `[1,]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, v []byte) {
		const limit = 3
		got, ok := AppendUint32s([]uint32{7}, v, limit)
		if got[0] != 7 || len(got)-1 > limit || !ok && len(got) != 1 {
			t.Fatalf("%q: dst %v (ok %v)", v, got, ok)
		}
		var want []uint32
		wantOK := len(v) > 0 && v[0] == '[' && v[len(v)-1] == ']' && json.Unmarshal(v, &want) == nil &&
			!bytes.ContainsAny(v, "-.eEn") // no sign, fraction, exponent, or null (which encoding/json leaves as 0)
		if ok != wantOK {
			t.Fatalf("%q: ok %v, encoding/json %v", v, ok, wantOK)
		}
		if ok && !slices.Equal(got[1:], want[:min(len(want), limit)]) {
			t.Fatalf("%q: %v, encoding/json %v", v, got[1:], want)
		}
	})
}
