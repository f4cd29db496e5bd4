package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"strings"
	"testing"
)

// nested returns depth levels of arrays, "[[…]]" (objects when obj,
// {"a":{"a":…}}, with an empty innermost object).
func nested(depth int, obj bool) string {
	if obj {
		return strings.Repeat(`{"a":`, depth-1) + "{}" + strings.Repeat("}", depth-1)
	}
	return strings.Repeat("[", depth) + strings.Repeat("]", depth)
}

// deepBodies are request bodies with v nested where the gateway does not
// type it itself: an unknown field, tools, a tool call, content parts, the
// prompt. Each puts v at depth 2 or more; level is the depth the body
// reaches for a v of depth d.
var deepBodies = []struct {
	name  string
	body  func(v string) string
	level func(d int) int
}{
	{"unknown-field", func(v string) string {
		return `{"model":"m","messages":[{"role":"user","content":"hi"}],"x":` + v + `}`
	}, func(d int) int { return d + 1 }},
	{"tools", func(v string) string {
		return `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f","parameters":` + v + `}}]}`
	}, func(d int) int { return d + 4 }},
	{"tool-calls", func(v string) string {
		return `{"model":"m","messages":[{"role":"assistant","tool_calls":` + v + `}]}`
	}, func(d int) int { return d + 3 }},
	{"content-part", func(v string) string {
		return `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":` + v + `}]}]}`
	}, func(d int) int { return d + 5 }},
	{"prompt", func(v string) string { return `{"model":"m","prompt":` + v + `}` }, func(d int) int { return d + 1 }},
}

// TestDecodeRefusesDeepNesting: a body nested deeper than MaxDepth is a 400
// invalid_json, whatever field holds the nesting; at MaxDepth it decodes.
// Before the bound, segmentio's recursive decoder ran out of stack on the
// 2 MB bodies (fatal error: stack overflow, the whole process).
func TestDecodeRefusesDeepNesting(t *testing.T) {
	for _, tc := range deepBodies {
		for _, obj := range []bool{false, true} {
			d := MaxDepth - tc.level(0)
			for _, v := range []string{nested(d, obj), nested(d+1, obj)} {
				body := tc.body(v)
				var chat ChatRequest
				var comp CompletionRequest
				var target any = &chat
				if tc.name == "prompt" {
					target = &comp
				}
				e := Decode([]byte(body), target)
				deep := v != nested(d, obj)
				switch {
				case deep && (e == nil || e.Status != 400 || e.Code != CodeInvalidJSON || !strings.Contains(e.Message, "128 levels")):
					t.Errorf("%s obj=%v depth %d: error %+v, want 400 invalid_json (too deep)", tc.name, obj, tc.level(d+1), e)
				case !deep && e != nil && strings.Contains(e.Message, "levels"):
					t.Errorf("%s obj=%v depth %d (the limit): refused as too deep: %v", tc.name, obj, tc.level(d), e)
				}
			}
		}
		// The attack: 2 MB of "[" (unclosed, and closed).
		for _, v := range []string{strings.Repeat("[", 2<<20), nested(1<<20, false)} {
			var chat ChatRequest
			if e := Decode([]byte(tc.body(v)), &chat); e == nil || e.Status != 400 {
				t.Errorf("%s: 2 MB of nesting: error %v, want 400", tc.name, e)
			}
		}
	}
}

// refDepth is the nesting depth of valid JSON b by encoding/json's
// tokenizer (which needs no recursion).
func refDepth(b []byte) (int, bool) {
	dec := json.NewDecoder(bytes.NewReader(b))
	depth, deepest := 0, 0
	for {
		tok, err := dec.Token()
		if err != nil {
			return deepest, err.Error() == "EOF"
		}
		switch tok {
		case json.Delim('['), json.Delim('{'):
			depth++
			deepest = max(deepest, depth)
		case json.Delim(']'), json.Delim('}'):
			depth--
		}
	}
}

func TestTooDeep(t *testing.T) {
	for _, tc := range []struct {
		in   string
		deep bool
	}{
		{nested(MaxDepth, false), false},
		{nested(MaxDepth+1, false), true},
		{nested(MaxDepth+1, true), true},
		{`["` + strings.Repeat("[", 500) + `"]`, false},                        // brackets in a string
		{`["\"` + strings.Repeat("[", 500) + `"]`, false},                      // after an escaped quote
		{`["\\"` + strings.Repeat(",[", 200) + strings.Repeat("]", 200), true}, // an escaped backslash ends the string
		{strings.Repeat("[]", 1000), false},                                    // many, not deep
		{`"` + strings.Repeat("[", 500), false},                                // unterminated string
		{strings.Repeat("[", MaxDepth+1), true},                                // unclosed
	} {
		if got := TooDeep([]byte(tc.in)); got != tc.deep {
			t.Errorf("TooDeep(%.40q…) = %v, want %v", tc.in, got, tc.deep)
		}
	}
}

func FuzzTooDeep(f *testing.F) {
	for _, s := range []string{`[]`, `{"a":[1,{"b":"[["}]}`, `["\\\"[["]`, nested(MaxDepth, false), nested(MaxDepth+1, true),
		strings.Repeat("[", 300), `"` + strings.Repeat("{", 200) + `"`, strings.Repeat(`{"a":[`, 70)} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		deep := TooDeep(b)
		if !json.Valid(b) {
			return
		}
		if d, ok := refDepth(b); ok && deep != (d > MaxDepth) {
			t.Fatalf("%q: TooDeep %v, depth %d", b, deep, d)
		}
	})
}

func TestEachElement(t *testing.T) {
	for in, want := range map[string][]string{
		`[]`:                                    nil,
		` [ ] `:                                 nil,
		`[1]`:                                   {`1`},
		`[ 1 , "a,]" , [2,[3]] , {"k":[","]} ]`: {`1`, `"a,]"`, `[2,[3]]`, `{"k":[","]}`},
		`["\"",null]`:                           {`"\""`, `null`},
		`["\\",true]`:                           {`"\\"`, `true`},
	} {
		var got []string
		if err := eachElement([]byte(in), func(i int, e []byte) error {
			if i != len(got) {
				t.Fatalf("%s: index %d after %d elements", in, i, len(got))
			}
			got = append(got, string(e))
			return nil
		}); err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("eachElement(%s) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{``, `[`, `[1,]`, `[,1]`, `["a]`, `{}`, `[[1]`} {
		if err := eachElement([]byte(in), func(int, []byte) error { return nil }); err == nil {
			t.Errorf("eachElement(%s): no error", in)
		}
	}
}

func FuzzEachElement(f *testing.F) {
	for _, s := range []string{`[]`, `[1,"a",[2],{"b":[3,"]"]}]`, `["\\\"",null]`, `[` + nested(MaxDepth, true) + `]`, `[1,]`, `[[]`, ` null `} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var got [][]byte
		err := eachElement(b, func(_ int, e []byte) error { got = append(got, e); return nil })
		var ref []json.RawMessage
		if json.Unmarshal(b, &ref) != nil || ref == nil {
			// Not an array (encoding/json also takes null as an empty
			// slice; every caller decodes null before it asks for
			// elements): eachElement need not notice (the decoders
			// validate first).
			return
		}
		if err != nil || len(got) != len(ref) {
			t.Fatalf("%q: %d elements, %v; encoding/json %d", b, len(got), err, len(ref))
		}
		for i := range ref {
			if !bytes.Equal(got[i], bytes.TrimSpace(ref[i])) {
				t.Fatalf("%q: element %d %q, encoding/json %q", b, i, got[i], ref[i])
			}
		}
	})
}

// The element-wise decoders against the whole-array decoding they replace
// (refContent, refPrompt: the code before; messages as a plain slice, then
// Validate's role check): the same verdict and the same values.

type refMessage struct {
	Role       string          `json:"role"`
	Content    refContent      `json:"content"`
	Name       string          `json:"name,omitempty"`
	ToolCalls  json.RawMessage `json:"tool_calls,omitempty"`
	ToolCallID string          `json:"tool_call_id,omitempty"`
}

type refContent Content

func (c *refContent) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	switch {
	case len(b) == 0 || string(b) == "null":
		*c = refContent{Null: true, given: true}
		return nil
	case b[0] == '"':
		*c = refContent{given: true}
		return json.Unmarshal(b, &c.Text)
	case b[0] == '[':
		var parts []struct {
			Type string  `json:"type"`
			Text *string `json:"text"`
		}
		if err := unmarshalExact(b, &parts, exactKeys); err != nil {
			return err
		}
		var sb strings.Builder
		for i, p := range parts {
			if p.Type == "" || (p.Type == "text" && p.Text == nil) {
				return fmt.Errorf("part %d", i)
			}
			if p.Type == "text" {
				sb.WriteString(*p.Text)
			}
		}
		*c = refContent{Text: sb.String(), Parts: len(parts), given: true}
		return nil
	}
	return errors.New("content kind")
}

func refPrompt(b []byte) (Prompt, error) {
	var items []json.RawMessage
	if err := json.Unmarshal(b, &items); err != nil || len(items) == 0 {
		return Prompt{}, errors.New("not a non-empty array")
	}
	var p Prompt
	switch first := bytes.TrimSpace(items[0]); {
	case first[0] == '"':
		p.Texts = make([]string, len(items))
		for i, it := range items {
			if err := json.Unmarshal(it, &p.Texts[i]); err != nil {
				return Prompt{}, err
			}
		}
	case first[0] == '[':
		p.Tokens = make([][]uint32, len(items))
		for i, it := range items {
			ids, err := parseTokenIDs(it)
			if err != nil {
				return Prompt{}, err
			}
			p.Tokens[i] = ids
		}
	default:
		ids, err := parseTokenIDs(b)
		if err != nil {
			return Prompt{}, err
		}
		p.Tokens = [][]uint32{ids}
	}
	return p, nil
}

func FuzzElementDecoders(f *testing.F) {
	for _, s := range []string{
		`[{"role":"user","content":"hi"},{"role":"assistant","tool_calls":[{"id":"1"}]}]`,
		`[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]}]`,
		`[{},{}]`, `[null]`, `[1]`, `[{"role":"bot"}]`, `[{"role":"user","content":[null]}]`, `[{"role":"user","content":[1]}]`,
		`"plain text"`, `"quote \" inside"`, `"tab\there"`, `"\u00e9t\u00e9"`, "\"raw\ttab\"", "\"bad \xff utf-8\"", `"é"`, `""`,
		`["a","b"]`, `[[1,2],[3]]`, `["a",null]`, `[[1],"a"]`, `[null,1]`, `[{"type":"text","text":"x"},{"type":"y"}]`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if !json.Valid(b) || TooDeep(b) || hasCaseVariantKey(b) {
			return
		}
		// messages
		var got Messages
		gotErr := got.UnmarshalJSON(b)
		var ref []refMessage
		refErr := unmarshalExact(b, &ref, exactKeys)
		for _, m := range ref {
			if refErr == nil && !roles[m.Role] {
				refErr = errors.New("role")
			}
		}
		if (gotErr == nil) != (refErr == nil) {
			t.Fatalf("messages %q: error %v, whole-array %v", b, gotErr, refErr)
		}
		if gotErr == nil {
			if len(got) != len(ref) {
				t.Fatalf("messages %q: %d, whole-array %d", b, len(got), len(ref))
			}
			for i := range ref {
				r := ref[i]
				want := Message{Role: r.Role, Content: Content(r.Content), Name: r.Name, ToolCalls: r.ToolCalls, ToolCallID: r.ToolCallID}
				if !reflect.DeepEqual(got[i], want) {
					t.Fatalf("messages %q [%d]: %+v, whole-array %+v", b, i, got[i], want)
				}
			}
		}
		// content
		var c Content
		var rc refContent
		cErr, rcErr := c.UnmarshalJSON(b), rc.UnmarshalJSON(b)
		if (cErr == nil) != (rcErr == nil) || (cErr == nil && c != Content(rc)) {
			t.Fatalf("content %q: %+v %v, whole-array %+v %v", b, c, cErr, rc, rcErr)
		}
		// prompt (arrays; the other shapes did not change)
		if bytes.HasPrefix(bytes.TrimSpace(b), []byte("[")) {
			var p Prompt
			pErr := p.UnmarshalJSON(b)
			rp, rpErr := refPrompt(b)
			if (pErr == nil) != (rpErr == nil) || (pErr == nil && !reflect.DeepEqual(p, rp)) {
				t.Fatalf("prompt %q: %+v %v, whole-array %+v %v", b, p, pErr, rp, rpErr)
			}
		}
	})
}

// hostileBodies are 1 MiB request bodies of the shapes that cost the most
// per byte: the nesting attack and its deepest accepted form, and arrays of
// the smallest elements in each typed field (each element a struct or a
// string header of 16-104 bytes for 2-4 bytes of body).
func hostileBodies(size int) []struct {
	name string
	chat bool
	body []byte
} {
	fill := func(prefix, unit, suffix string) []byte {
		var b bytes.Buffer
		b.WriteString(prefix)
		for b.Len()+len(unit)+len(suffix) <= size {
			b.WriteString(unit)
		}
		b.WriteString(suffix)
		return b.Bytes()
	}
	deepest := nested(MaxDepth-2, false)
	chatPre := `{"model":"m","messages":[{"role":"user","content":"hi"}],`
	return []struct {
		name string
		chat bool
		body []byte
	}{
		{"nesting-attack", true, fill(chatPre+`"x":`, "[", "")},
		{"nesting-at-limit", true, fill(chatPre+`"x":[`+deepest, ","+deepest, "]}")},
		{"unknown-array", true, fill(chatPre+`"x":[[]`, ",[]", "]}")},
		{"tools", true, fill(chatPre+`"tools":[{}`, ",{}", "]}")},
		{"messages-empty", true, fill(`{"model":"m","messages":[{}`, ",{}", "]}")},
		{"messages-null", true, fill(`{"model":"m","messages":[null`, ",null", "]}")},
		{"messages-number", true, fill(`{"model":"m","messages":[1`, ",1", "]}")},
		{"messages-minimal", true, fill(`{"model":"m","messages":[{"role":"assistant"}`, `,{"role":"assistant"}`, "]}")},
		{"content-parts-empty", true, fill(`{"model":"m","messages":[{"role":"user","content":[{}`, ",{}", "]}]}")},
		{"content-parts-null", true, fill(`{"model":"m","messages":[{"role":"user","content":[null`, ",null", "]}]}")},
		{"content-parts-minimal", true, fill(`{"model":"m","messages":[{"role":"user","content":[{"type":"x"}`, `,{"type":"x"}`, "]}]}")},
		{"prompt-strings", false, fill(`{"model":"m","prompt":[""`, `,""`, "]}")},
		{"prompt-nulls", false, fill(`{"model":"m","prompt":["",null`, ",null", "]}")},
		{"prompt-token-lists", false, fill(`{"model":"m","prompt":[[1]`, ",[1]", "]}")},
		{"prompt-token-ids", false, fill(`{"model":"m","prompt":[1`, ",1", "]}")},
	}
}

// decodeCost decodes body once in a fresh goroutine and returns the bytes
// it allocated and the stack it grew to (bytes).
func decodeCost(body []byte, chat bool) (alloc, stack uint64) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		var c ChatRequest
		var p CompletionRequest
		if chat {
			Decode(body, &c)
		} else {
			Decode(body, &p)
		}
		runtime.ReadMemStats(&after) // this goroutine's stack is still grown
		alloc = after.TotalAlloc - before.TotalAlloc
		stack = after.StackInuse - min(after.StackInuse, before.StackInuse)
	}()
	<-done
	return alloc, stack
}

// TestDecodeCostBounded: no body makes Decode allocate more than 12 bytes
// (heap and stack together) per byte of body: 7.6 at most in a plain
// build (BenchmarkDecodeHostile), 10 under the race detector, whose
// allocator does not pack tiny objects. Allocation is deterministic, so
// this is no timing test. Before the element-wise decoding, 1 MiB of
// empty messages cost 130 MiB, of numbers in messages 360 MiB; before the
// depth bound, 400 KiB of "[" grew a 128 MiB stack.
func TestDecodeCostBounded(t *testing.T) {
	runtime.GC()
	for _, h := range hostileBodies(1 << 20) {
		alloc, stack := decodeCost(h.body, h.chat)
		if perByte := float64(alloc+stack) / float64(len(h.body)); perByte > 12 {
			t.Errorf("%s: %.1f bytes allocated per body byte (heap %d, stack %d for %d), want ≤ 12", h.name, perByte, alloc, stack, len(h.body))
		}
	}
}

// BenchmarkDecodeHostile reports what each hostile 1 MiB body costs Decode:
// MB/s, and alloc-B/B and stack-B/B, the heap allocated and the stack grown
// per byte of body.
func BenchmarkDecodeHostile(b *testing.B) {
	for _, h := range hostileBodies(1 << 20) {
		b.Run(h.name, func(b *testing.B) {
			b.SetBytes(int64(len(h.body)))
			var alloc, stack uint64
			for b.Loop() {
				a, s := decodeCost(h.body, h.chat)
				alloc, stack = alloc+a, max(stack, s)
			}
			b.ReportMetric(float64(alloc)/float64(b.N)/float64(len(h.body)), "alloc-B/B")
			b.ReportMetric(float64(stack)/float64(len(h.body)), "stack-B/B")
		})
	}
}
