package openai

import (
	"reflect"
	"strings"
	"testing"
	"unsafe"
)

// TestBorrowedLayout: the types Decode reads a borrowing ChatRequest as
// (through unsafe.Pointer) have ChatRequest's and Message's layout: the
// same fields, names, tags, offsets and sizes, each of the same type or of
// one with the same underlying type.
func TestBorrowedLayout(t *testing.T) {
	for _, pair := range [][2]reflect.Type{
		{reflect.TypeFor[ChatRequest](), reflect.TypeFor[chatRequestBorrowing]()},
		{reflect.TypeFor[Message](), reflect.TypeFor[borrowedMessage]()},
		{reflect.TypeFor[Content](), reflect.TypeFor[borrowedContent]()},
		{reflect.TypeFor[Messages](), reflect.TypeFor[borrowedMessages]()},
	} {
		a, b := pair[0], pair[1]
		if a.Size() != b.Size() || a.Align() != b.Align() || a.Kind() != b.Kind() {
			t.Fatalf("%v and %v: size %d/%d, align %d/%d", a, b, a.Size(), b.Size(), a.Align(), b.Align())
		}
		if a.Kind() != reflect.Struct {
			if a.Elem() != b.Elem() {
				t.Fatalf("%v and %v: elements %v and %v", a, b, a.Elem(), b.Elem())
			}
			continue
		}
		if a.NumField() != b.NumField() {
			t.Fatalf("%v and %v: %d and %d fields", a, b, a.NumField(), b.NumField())
		}
		for i := range a.NumField() {
			fa, fb := a.Field(i), b.Field(i)
			same := fa.Type == fb.Type ||
				(fa.Type.Kind() == fb.Type.Kind() && fa.Type.Size() == fb.Type.Size() &&
					(fa.Type.Kind() == reflect.Struct || fa.Type.Elem() == fb.Type.Elem()))
			if fa.Name != fb.Name || fa.Tag != fb.Tag || fa.Offset != fb.Offset || !same {
				t.Fatalf("%v.%s (%v, %q, @%d) and %v.%s (%v, %q, @%d) differ", a, fa.Name, fa.Type, fa.Tag, fa.Offset,
					b, fb.Name, fb.Type, fb.Tag, fb.Offset)
			}
		}
	}
}

// borrowSeeds are chat bodies: ordinary, with contents to unescape, parts,
// and the failures.
var borrowSeeds = []string{
	`{"model":"m","max_tokens":16,"messages":[{"role":"system","content":"You are brief."},{"role":"user","content":"hi"}]}`,
	`{"model":"m","messages":[{"role":"user","content":"a\"b\u00e9\n"},{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},{"role":"tool","content":"x","tool_call_id":"1","name":"f"}]}`,
	`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}},{"type":"text","text":"b"}]}]}`,
	`{"model":"m","messages":[{"role":"user","content":"` + "\xff" + `"}]}`,
	`{"model":"m","messages":[{"role":"user","content":""}],"stream":true,"stream_options":{"include_usage":true},"tools":[{"type":"function"}]}`,
	`{"model":"m","messages":[{"role":"bogus","content":"x"}]}`,
	`{"model":"m","messages":[{"role":"user","content":5}]}`,
	`{"model":"m","messages":[{"role":"user","content":"x"},1]}`,
	`{"model":"m","messages":{"role":"user"}}`,
	`{"model":"m","messages":null}`,
	`{"model":"m","messages":[]}`,
	`{"model":"m","messages":[{"role":"user","content":"x"}],"messages":[{"role":"user","content":"y"}]}`,
	`{"model":"m","messages":[{"role":"user","content":"x"}]} trailing`,
	`{"model":"m","messages":[{"role":"user","content":"x"},]}`,
	`{"model":"m","max_tokens":"1","messages":[{"role":"user","content":"x"}]}`,
	`{"model":"m","messages":[{"role":"user","Content":"x","content":"y"}]}`,
}

// FuzzDecodeBorrowingAgrees: a ChatRequest decoded with borrowed contents
// (ChatRequest.Reset with borrow, as the gateway's pooled one, reused after
// a decode of another body) is the one decoded the ordinary way, value and
// error; and its borrowed contents change with the body (they are views),
// the ordinary ones do not.
func FuzzDecodeBorrowingAgrees(f *testing.F) {
	for _, s := range borrowSeeds {
		f.Add([]byte(s))
	}
	for _, h := range hostileBodies(4 << 10) {
		f.Add(h.body)
	}
	prev := []byte(`{"model":"p","messages":[{"role":"system","content":"earlier"},{"role":"user","content":"turn","name":"n"},{"role":"assistant","content":"a"}]}`)
	f.Fuzz(func(t *testing.T, b []byte) {
		var plain, borrowed ChatRequest
		ep := Decode(b, &plain)
		borrowed.Reset(64, true)
		_ = Decode(prev, &borrowed) // a pooled request has been used before
		borrowed.Reset(64, true)
		eb := Decode(b, &borrowed)
		if !reflect.DeepEqual(ep, eb) {
			t.Fatalf("%q: borrowed error %+v, ordinary %+v", b, eb, ep)
		}
		if ep != nil {
			return
		}
		if len(plain.Messages) == 0 && len(borrowed.Messages) == 0 {
			plain.Messages, borrowed.Messages = nil, nil // nil and a kept empty buffer
		}
		got := borrowed
		got.borrow = false
		if !reflect.DeepEqual(plain, got) {
			t.Fatalf("%q:\n borrowed %+v\n ordinary %+v", b, got, plain)
		}
	})
}

// TestDecodeBorrowsContents: a borrowing decode's plain contents and roles
// are views of the body (no copy), an escaped content and the model
// copies; the ordinary decode copies all.
func TestDecodeBorrowsContents(t *testing.T) {
	body := []byte(`{"model":"m","messages":[{"role":"system","content":"` + strings.Repeat("s", 100) + `"},{"role":"user","content":"esc\n"}]}`)
	inBody := func(s string) bool {
		p := uintptr(unsafe.Pointer(unsafe.StringData(s)))
		b := uintptr(unsafe.Pointer(&body[0]))
		return p >= b && p < b+uintptr(len(body))
	}
	var r ChatRequest
	r.Reset(64, true)
	if e := Decode(body, &r); e != nil {
		t.Fatal(e)
	}
	if !inBody(r.Messages[0].Content.Text) || inBody(r.Messages[1].Content.Text) || r.Messages[1].Content.Text != "esc\n" {
		t.Fatalf("borrowed: system in body %v, escaped in body %v (%q)", inBody(r.Messages[0].Content.Text),
			inBody(r.Messages[1].Content.Text), r.Messages[1].Content.Text)
	}
	if !inBody(r.Messages[0].Role) || !inBody(r.Messages[1].Role) {
		t.Fatal("a role copied")
	}
	if inBody(r.Model) {
		t.Fatal("the model borrowed")
	}
	buf := r.Messages[:1]
	r.Reset(64, false)
	if cap(r.Messages) == 0 || &r.Messages[:1][0] != &buf[0] || buf[0].Content.Text != "" {
		t.Fatal("Reset did not keep the messages' buffer, cleared")
	}
	if e := Decode(body, &r); e != nil {
		t.Fatal(e)
	}
	if inBody(r.Messages[0].Content.Text) {
		t.Fatal("the ordinary decode borrowed")
	}
	r.Reset(1, true)
	if r.Messages != nil {
		t.Fatal("Reset kept a buffer over maxMessages")
	}
}

// TestBorrowedRestSurvivesBody: after a borrowing decode, scribbling over
// the body (a pooled buffer reused, the picker's caller reusing its
// buffer) changes only the borrowed strings (the messages' plain roles,
// contents, names, tool_call_ids): the model, user, salt, tools, tool
// calls, escaped and part contents are the ordinary decode's.
func TestBorrowedRestSurvivesBody(t *testing.T) {
	src := `{"model":"mod","user":"usr","cache_salt":"salt","tools":[{"type":"function","function":{"name":"f"}}],` +
		`"messages":[{"role":"system","content":"plain"},{"role":"user","content":"esc\u00e9\n","name":"nm"},` +
		`{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function"}]},` +
		`{"role":"tool","content":"r","tool_call_id":"1"},` +
		`{"role":"user","content":[{"type":"text","text":"p1"},{"type":"text","text":"p2"}]}]}`
	var plain ChatRequest
	if e := Decode([]byte(src), &plain); e != nil {
		t.Fatal(e)
	}
	body := []byte(src)
	var r ChatRequest
	r.Reset(64, true)
	if e := Decode(body, &r); e != nil {
		t.Fatal(e)
	}
	for i := range body {
		body[i] = 'X'
	}
	if r.Model != plain.Model || r.User != plain.User || r.CacheSalt != plain.CacheSalt ||
		string(r.Tools) != string(plain.Tools) || len(r.Messages) != len(plain.Messages) {
		t.Fatalf("the request's own fields changed with the body: %+v", r)
	}
	for i, m := range r.Messages {
		p := plain.Messages[i]
		if string(m.ToolCalls) != string(p.ToolCalls) {
			t.Fatalf("messages[%d].tool_calls changed with the body: %q", i, m.ToolCalls)
		}
		if i == 1 || i == 4 { // escaped, parts: copies
			if m.Content.Text != p.Content.Text || m.Content.Text == "" {
				t.Fatalf("messages[%d] copied content changed with the body: %q", i, m.Content.Text)
			}
		}
	}
}
