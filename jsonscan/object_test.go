package jsonscan

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestObject(t *testing.T) {
	b := []byte(` {"a" : [1, {"k\u0041":"v"}], "b\u0063":"x\u00e9" ,"n":01}`)
	var keys, values []string
	err := Object(b, 8, func(m Member) bool {
		keys = append(keys, string(m.Key))
		values = append(values, string(m.Value))
		if string(b[m.From:m.From+len(m.Value)]) != string(m.Value) || !strings.HasSuffix(string(m.Raw), string(m.Value)) {
			t.Errorf("member %q: spans disagree", m.Raw)
		}
		return true
	})
	// "n":01 is not JSON: the walk reports it after the members before it.
	if !errors.Is(err, ErrSyntax) || !slices.Equal(keys, []string{"a", "bc"}) || values[1] != `"x\u00e9"` {
		t.Fatalf("got %v %q %q", err, keys, values)
	}
	// Stopped early: no error, the rest unread (even if broken).
	n := 0
	if err := Object([]byte(`{"a":1,"b":2,"c":`), 8, func(Member) bool { n++; return n < 2 }); err != nil || n != 2 {
		t.Fatalf("stopped walk: %v after %d", err, n)
	}
	deep := `{"a":` + strings.Repeat("[", 8) + strings.Repeat("]", 8) + `}`
	if err := Object([]byte(deep), 8, func(Member) bool { return true }); !errors.Is(err, ErrDepth) {
		t.Fatalf("9 levels under a bound of 8: %v", err)
	}
	if err := Object([]byte(deep), 9, func(Member) bool { return true }); err != nil {
		t.Fatalf("9 levels under a bound of 9: %v", err)
	}
	for _, bad := range []string{``, `[]`, `{`, `{"a"}`, `{"a":1,}`, `{"a":"\x01"}`, `{"a":tru}`} {
		if err := Object([]byte(bad), 8, func(Member) bool { return true }); !errors.Is(err, ErrSyntax) {
			t.Errorf("%q: %v", bad, err)
		}
	}
}

func TestArray(t *testing.T) {
	var got []string
	err := Array([]byte(` [ {"a":[]} , "s", -1.5e3, null ]`), 8, func(v []byte) bool { got = append(got, string(v)); return true })
	if err != nil || !slices.Equal(got, []string{`{"a":[]}`, `"s"`, `-1.5e3`, `null`}) {
		t.Fatalf("%v %q", err, got)
	}
	if err := Array([]byte(`[1 2]`), 8, func([]byte) bool { return true }); !errors.Is(err, ErrSyntax) {
		t.Fatalf("[1 2]: %v", err)
	}
}

func TestAppendUint32s(t *testing.T) {
	for _, c := range []struct {
		in    string
		limit int
		want  []uint32
		ok    bool
	}{
		{`[]`, 4, []uint32{}, true},
		{`[0, 4294967295 ,7]`, 4, []uint32{0, 4294967295, 7}, true},
		{`[1,2,3,4,5]`, 2, []uint32{1, 2}, true},
		{`[4294967296]`, 4, nil, false},
		{`[01]`, 4, nil, false},
		{`[-1]`, 4, nil, false},
		{`[1.0]`, 4, nil, false},
		{`[1e2]`, 4, nil, false},
		{`[1,]`, 4, nil, false},
		{`[1] `, 4, nil, false}, // the value alone, as Member.Value gives it
		{`[1`, 4, nil, false},
		{`[] x`, 4, nil, false},
		{`"1"`, 4, nil, false},
	} {
		got, ok := AppendUint32s([]uint32{9}, []byte(c.in), c.limit)
		if ok != c.ok || got[0] != 9 || ok && !slices.Equal(got[1:], c.want) || !ok && len(got) != 1 {
			t.Errorf("%s: got %v %v", c.in, got, ok)
		}
	}
}

// BenchmarkAppendUint32s: 4,096 token ids.
func BenchmarkAppendUint32s(b *testing.B) {
	v := []byte("[")
	for i := range 4096 {
		if i > 0 {
			v = append(v, ',')
		}
		v = append(v, []byte(strings.Repeat("7", 1+i%6))...)
	}
	v = append(v, ']')
	dst := make([]uint32, 0, 4096)
	b.SetBytes(int64(len(v)))
	b.ReportAllocs()
	for b.Loop() {
		dst, _ = AppendUint32s(dst[:0], v, 1<<20)
	}
}
