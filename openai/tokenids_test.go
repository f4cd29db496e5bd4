package openai

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// parseTokenIDsBefore is the token-id scanner appendTokenIDs replaced
// (2026-12-05), kept as its reference: same ids, same errors.
func parseTokenIDsBefore(b []byte) ([]uint32, error) {
	b = bytes.TrimSpace(b)
	if len(b) < 2 || b[0] != '[' || b[len(b)-1] != ']' {
		return nil, errors.New("token ids must be an array of integers")
	}
	body := b[1 : len(b)-1]
	ids := make([]uint32, 0, len(body)/6+1)
	i := 0
	skip := func() {
		for i < len(body) && (body[i] == ' ' || body[i] == '\t' || body[i] == '\n' || body[i] == '\r') {
			i++
		}
	}
	skip()
	if i == len(body) {
		return nil, errors.New("token-id array must not be empty")
	}
	for {
		skip()
		start := i
		var v uint64
		for i < len(body) && body[i] >= '0' && body[i] <= '9' {
			v = v*10 + uint64(body[i]-'0')
			if v > math.MaxUint32 {
				end := i
				for end < len(body) && body[end] >= '0' && body[end] <= '9' && end-start < 24 {
					end++
				}
				return nil, fmt.Errorf("token id %s at %d is not an integer in [0, 2^32)", body[start:end], len(ids))
			}
			i++
		}
		if i == start || (body[start] == '0' && i-start > 1) {
			end := i
			for end < len(body) && body[end] != ',' && end-start < 24 {
				end++
			}
			return nil, fmt.Errorf("token id %s at %d is not an integer in [0, 2^32)", bytes.TrimSpace(body[start:end]), len(ids))
		}
		ids = append(ids, uint32(v))
		skip()
		if i == len(body) {
			return ids, nil
		}
		if body[i] != ',' {
			return nil, fmt.Errorf("token id at %d is not an integer in [0, 2^32)", len(ids)-1)
		}
		i++
	}
}

// FuzzAppendTokenIDs: appendTokenIDs gives the ids and the error message
// of the scanner it replaced, into a fresh or a reused buffer.
func FuzzAppendTokenIDs(f *testing.F) {
	for _, s := range []string{
		`[1,2,3]`, ` [ 0 , 4294967295 ]`, "[\n1\t,\r2 ]", `[4294967296]`, `[01]`, `[-1]`, `[1.0]`, `[1e3]`,
		`[1,]`, `[,1]`, `[]`, `[ ]`, `[1 2]`, `[1,,2]`, `["1"]`, `[1]]`, `[[1]]`, `1`, `[`, `]`, ``,
		`[99999999999999999999999999999]`, `[0,00]`, `[1,2,3` + strings.Repeat(",7", 100) + `]`,
	} {
		f.Add([]byte(s), uint8(0))
		f.Add([]byte(s), uint8(5))
	}
	f.Fuzz(func(t *testing.T, b []byte, spare uint8) {
		want, werr := parseTokenIDsBefore(b)
		buf := make([]uint32, int(spare), int(spare)+int(spare%3))
		for i := range buf {
			buf[i] = 0xdead
		}
		got, gerr := appendTokenIDs(buf, b)
		if (werr == nil) != (gerr == nil) || werr != nil && werr.Error() != gerr.Error() {
			t.Fatalf("%q: error %v, want %v", b, gerr, werr)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("%q: ids %v, want %v", b, got, want)
		}
	})
}

// TestPromptReuse: a CompletionRequest Reset between decodes fills its
// flat token-id prompt into the previous decode's buffer (no allocation
// for the ids), whatever shape came between; the ids are the prompt's.
func TestPromptReuse(t *testing.T) {
	var r CompletionRequest
	body := func(ids string) []byte { return []byte(`{"model":"m","max_tokens":8,"prompt":` + ids + `}`) }
	if e := Decode(body(`[1,2,3,4,5,6,7,8]`), &r); e != nil {
		t.Fatal(e)
	}
	first := &r.Prompt.Tokens[0][0]
	r.Reset(1 << 16)
	if e := Decode(body(`[9, 10]`), &r); e != nil {
		t.Fatal(e)
	}
	if len(r.Prompt.Tokens) != 1 || !slices.Equal(r.Prompt.Tokens[0], []uint32{9, 10}) || &r.Prompt.Tokens[0][0] != first {
		t.Fatalf("reused decode: %v (same buffer %v)", r.Prompt.Tokens, &r.Prompt.Tokens[0][0] == first)
	}
	r.Reset(1 << 16)
	if e := Decode(body(`"text"`), &r); e != nil || r.Prompt.Texts[0] != "text" || r.Prompt.Tokens != nil {
		t.Fatalf("%v %+v", e, r.Prompt)
	}
	r.Reset(1 << 16) // a text prompt's Reset: no buffer kept
	if e := Decode(body(`[[1],[2,3]]`), &r); e != nil || len(r.Prompt.Tokens) != 2 || !slices.Equal(r.Prompt.Tokens[1], []uint32{2, 3}) {
		t.Fatalf("%v %+v", e, r.Prompt)
	}
	r.Reset(1) // over the bound: dropped
	if r.Prompt.spare != nil {
		t.Fatal("buffer over maxIDs kept")
	}
	if e := Decode(body(`[4,5]`), &r); e != nil || !slices.Equal(r.Prompt.Tokens[0], []uint32{4, 5}) {
		t.Fatalf("%v %+v", e, r.Prompt)
	}
	r.Reset(1 << 16)
	if e := Decode([]byte(`{"model":"m","prompt":[1,"x"]}`), &r); e == nil {
		t.Fatal("mixed prompt accepted")
	}
	r.Reset(1 << 16)
	ids := make([]string, 1024)
	for i := range ids {
		ids[i] = strconv.Itoa(1000000 + i)
	}
	b := body("[" + strings.Join(ids, ",") + "]")
	if e := Decode(b, &r); e != nil || len(r.Prompt.Tokens[0]) != 1024 || r.Prompt.Tokens[0][1023] != 1001023 {
		t.Fatalf("%v %d", e, len(r.Prompt.Tokens[0]))
	}
	if raceEnabled {
		return
	}
	fresh := testing.AllocsPerRun(20, func() {
		r = CompletionRequest{}
		if e := Decode(b, &r); e != nil {
			t.Fatal(e)
		}
	})
	reused := testing.AllocsPerRun(20, func() {
		r.Reset(1 << 16)
		if e := Decode(b, &r); e != nil {
			t.Fatal(e)
		}
	})
	if reused > fresh-2 {
		t.Errorf("a reused decode of 1,024 token ids allocates %v times, a fresh one %v: want the ids and their list saved", reused, fresh)
	}
}

// BenchmarkParseTokenIDs: 1,024 ids of 7 digits (the endpoint picker's
// completion benchmark's prompt), into a reused buffer and by the
// scanner it replaced.
func BenchmarkParseTokenIDs(b *testing.B) {
	ids := make([]string, 1024)
	for i := range ids {
		ids[i] = strconv.Itoa(1000000 + i*7919)
	}
	arr := []byte("[" + strings.Join(ids, ",") + "]")
	b.Run("append", func(b *testing.B) {
		var buf []uint32
		b.SetBytes(int64(len(arr)))
		b.ReportAllocs()
		for b.Loop() {
			buf, _ = appendTokenIDs(buf, arr)
		}
	})
	b.Run("before", func(b *testing.B) {
		b.SetBytes(int64(len(arr)))
		b.ReportAllocs()
		for b.Loop() {
			parseTokenIDsBefore(arr)
		}
	})
}

// FuzzFlatPromptAgrees: a completion body decodes to the same request and
// the same error with the one-pass reading of a flat token-id prompt as
// without it (segmentio parsing the ids, then Prompt.UnmarshalJSON), into
// a fresh request and into one Reset with a spare buffer.
func FuzzFlatPromptAgrees(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","max_tokens":8,"prompt":[1,2,3]}`,
		`{"prompt":[1,2,3],"model":"m"}`,
		`{"prompt":[1]}`, `{ "prompt" : [ 0 , 4294967295 ] , "stream" : true , "stream_options" : {"include_usage":true} }`,
		`{"model":"m","prompt":[1,2,3],}`, `{"model":"m",,"prompt":[1]}`, `{"model":"m" "prompt":[1]}`,
		`{"model":"m","prompt":[1,2,3]} x`, `{"model":"m","prompt":[1,2,3]}  `, `{"model":"m","prompt":[1,2,3]`,
		`{"model":"m","prompt":[1,2,3],"prompt":[4]}`, `{"model":"m","prompt":[1],"prompt":"x"}`,
		`{"model":"m","pr\u006fmpt":[1,2]}`, `{"model":"m","Prompt":[1,2],"prompt":[3]}`,
		`{"model":"m","prompt":[1,[2]]}`, `{"model":"m","prompt":[01]}`, `{"model":"m","prompt":[4294967296]}`,
		`{"model":"m","prompt":[1,-2]}`, `{"model":"m","prompt":[1.5]}`, `{"model":"m","prompt":[1,"a"]}`,
		`{"model":"m","prompt":[[1],[2]]}`, `{"model":"m","prompt":"text"}`, `{"model":"m","prompt":[]}`,
		`{"model":1,"prompt":[1]}`, `{"model":"m","max_tokens":"8","prompt":[1]}`, `{"model":"m","max_tokens":1.5,"prompt":[1]}`,
		`{"a":{"b":[1,{"c":"]}"}]},"prompt":[5,6],"z":null}`, `{"a":"\"prompt\":[1]","prompt":[2]}`,
		`{"a":[}],"prompt":[1]}`, `{"a":{],"prompt":[1]}`, `{"a":1"b","prompt":[1]}`, `{"a":tru,"prompt":[1]}`,
		`{"model":"m","prompt":[1],"n":2,"temperature":0.5,"top_p":1,"user":"u","cache_salt":"s","echo":true,"ignore_eos":true}`,
		`{"model":"m","stream_options":{"include_usage":true,"include_usage":false},"stream":true,"prompt":[1]}`,
		"{\"model\":\"m\",\"prompt\":[1,\n2\t,\r3 ]}", `{"model":"m\u00e9","prompt":[7]}`, "{\"model\":\"\xff\",\"prompt\":[7]}",
		`{"model":"m","prompt":[1],"x":` + strings.Repeat("[", 130) + strings.Repeat("]", 130) + `}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var slow, fast, reused CompletionRequest
		es := decode(b, &slow, false)
		ef := decode(b, &fast, true)
		reused.Prompt.spare = make([]uint32, 3, 8)
		reused.Prompt.spareList = make([][]uint32, 0, 1)
		er := decode(b, &reused, true)
		for _, c := range []struct {
			name string
			e    *Error
			r    *CompletionRequest
		}{{"fast", ef, &fast}, {"reused", er, &reused}} {
			if !reflect.DeepEqual(es, c.e) {
				t.Fatalf("%q: %s error %+v, ordinary %+v", b, c.name, c.e, es)
			}
			if es != nil {
				continue
			}
			c.r.Prompt.spare, c.r.Prompt.spareList = nil, nil
			if !reflect.DeepEqual(slow, *c.r) {
				t.Fatalf("%q: %s %+v, ordinary %+v", b, c.name, *c.r, slow)
			}
		}
	})
}

// BenchmarkDecodeCompletionIDs: Decode of a completion of 1,024 token ids
// (the endpoint picker's benchmark), into a request Reset between
// decodes, one pass over the ids or two.
func BenchmarkDecodeCompletionIDs(b *testing.B) {
	ids := make([]string, 1024)
	for i := range ids {
		ids[i] = strconv.Itoa(1000000 + i*7919)
	}
	body := []byte(`{"model":"m","max_tokens":8,"prompt":[` + strings.Join(ids, ",") + `]}`)
	for _, fast := range []bool{true, false} {
		b.Run(map[bool]string{true: "one-pass", false: "two-pass"}[fast], func(b *testing.B) {
			var r CompletionRequest
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				r.Reset(1 << 16)
				if e := decode(body, &r, fast); e != nil {
					b.Fatal(e)
				}
			}
		})
	}
}
