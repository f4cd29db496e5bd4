package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/infergate/infergate/internal/ssetest"
)

func TestPromptShapes(t *testing.T) {
	for _, tc := range []struct {
		in     string
		texts  int
		tokens []int // lengths
		bad    bool
	}{
		{in: `"hello"`, texts: 1},
		{in: `["a","b"]`, texts: 2},
		{in: `[1,2,3]`, tokens: []int{3}},
		{in: `[[1,2],[3]]`, tokens: []int{2, 1}},
		{in: `[]`, bad: true},
		{in: `[[]]`, bad: true},
		{in: `["a",1]`, bad: true},
		{in: `[1,"a"]`, bad: true},
		{in: `[-1]`, bad: true},
		{in: `[1.5]`, bad: true},
		{in: `[4294967296]`, bad: true},
		{in: `[4294967295]`, tokens: []int{1}},
		{in: `{}`, bad: true},
		{in: `12`, bad: true},
		{in: `null`, bad: true},
		{in: ` [ 1 , 2 ] `, tokens: []int{2}},
		{in: `[1,]`, bad: true},
		{in: `[1 2]`, bad: true},
		{in: `[01]`, bad: true},
		{in: `[-0]`, bad: true},
		{in: `[1e3]`, bad: true},
		{in: `[0]`, tokens: []int{1}},
		{in: `[[1, 2] ,[3]]`, tokens: []int{2, 1}},
	} {
		var p Prompt
		err := json.Unmarshal([]byte(tc.in), &p)
		if tc.bad {
			if err == nil {
				t.Errorf("%s: want error, got %+v", tc.in, p)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tc.in, err)
			continue
		}
		if len(p.Texts) != tc.texts || len(p.Tokens) != len(tc.tokens) {
			t.Errorf("%s: got %+v", tc.in, p)
		}
		for i, n := range tc.tokens {
			if len(p.Tokens[i]) != n {
				t.Errorf("%s: prompt %d has %d ids", tc.in, i, len(p.Tokens[i]))
			}
		}
		// Round trip.
		b, _ := json.Marshal(p)
		var q Prompt
		if err := json.Unmarshal(b, &q); err != nil || q.Len() != p.Len() {
			t.Errorf("%s: round trip %s: %v", tc.in, b, err)
		}
	}
}

func TestContentShapes(t *testing.T) {
	var m Message
	if err := json.Unmarshal([]byte(`{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]}`), &m); err != nil {
		t.Fatal(err)
	}
	if m.Content.Text != "ab" || m.Content.Parts != 3 {
		t.Fatalf("%+v", m.Content)
	}
	if err := json.Unmarshal([]byte(`{"role":"assistant","content":null}`), &m); err != nil || !m.Content.Null {
		t.Fatalf("null content: %v %+v", err, m.Content)
	}
	if err := json.Unmarshal([]byte(`{"role":"user","content":5}`), &m); err == nil {
		t.Fatal("numeric content accepted")
	}
	if err := json.Unmarshal([]byte(`{"role":"user","content":[{"text":"x"}]}`), &m); err == nil {
		t.Fatal("part without type accepted")
	}
}

func TestDecodeAndValidate(t *testing.T) {
	for _, tc := range []struct {
		body  string
		param string
		ok    bool
	}{
		{body: `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, ok: true},
		{body: ``, param: ""},
		{body: `[1]`, param: ""},
		{body: `{"model":"m",`, param: ""},
		{body: `{"model":"m","messages":[]}`, param: "messages"},
		{body: `{"messages":[{"role":"user","content":"hi"}]}`, param: "model"},
		{body: `{"model":"m","messages":[{"role":"wizard","content":"hi"}]}`, param: "messages[0].role"},
		{body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":0}`, param: "max_tokens"},
		{body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":"x"}`, param: "max_tokens"},
		{body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":3}`, param: "temperature"},
		{body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream_options":{"include_usage":true}}`, param: "stream_options"},
		{body: `{"model":"m","messages":[{"role":"user","content":"hi"}]} {}`, param: ""},
		{body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"x":1}],"kv_transfer_params":{}}`, ok: true},
	} {
		var r ChatRequest
		e := Decode([]byte(tc.body), &r)
		if e == nil {
			e = r.Validate()
		}
		if tc.ok {
			if e != nil {
				t.Errorf("%s: unexpected %v", tc.body, e.Message)
			}
			continue
		}
		if e == nil {
			t.Errorf("%s: accepted", tc.body)
			continue
		}
		if e.Status != http.StatusBadRequest {
			t.Errorf("%s: status %d", tc.body, e.Status)
		}
		got := ""
		if e.Param != nil {
			got = *e.Param
		}
		if got != tc.param {
			t.Errorf("%s: param %q, want %q (%s)", tc.body, got, tc.param, e.Message)
		}
	}
	var c CompletionRequest
	if e := Decode([]byte(`{"model":"m","prompt":[1,-2]}`), &c); e == nil || e.Param == nil || *e.Param != "prompt" {
		t.Fatalf("bad token id: %+v", e)
	}
	if e := Decode([]byte(`{"model":"m","prompt":[1,2],"stream":true,"max_tokens":3}`), &c); e != nil || c.Validate() != nil {
		t.Fatalf("valid completion rejected: %v", e)
	}
}

func TestWriteError(t *testing.T) {
	rec := httptest.NewRecorder()
	WriteError(rec, NewError(http.StatusNotFound, "The model `x` does not exist.", "model", CodeModelNotFound))
	if rec.Code != 404 || rec.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("%d %v", rec.Code, rec.Header())
	}
	var body struct {
		Error struct {
			Message, Type string
			Param, Code   *string
		}
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatal(err)
	}
	if body.Error.Type != "invalid_request_error" || *body.Error.Code != CodeModelNotFound || *body.Error.Param != "model" {
		t.Fatalf("%s", rec.Body)
	}
	rec = httptest.NewRecorder()
	WriteError(rec, NewError(503, "none", "", ""))
	if !strings.Contains(rec.Body.String(), `"param":null`) || !strings.Contains(rec.Body.String(), `"code":null`) {
		t.Fatalf("%s", rec.Body)
	}
}

func TestRenderChatPrefixProperty(t *testing.T) {
	tools := json.RawMessage(`[ {"type": "function", "function": {"name": "search"}} ]`)
	turn1 := []Message{{Role: "system", Content: Content{Text: "be brief"}}, {Role: "user", Content: Content{Text: "hi"}}}
	turn2 := append(append([]Message{}, turn1...),
		Message{Role: "assistant", Content: Content{Null: true}, ToolCalls: json.RawMessage(`[{"id":"c1","type":"function","function":{"name":"search","arguments":"{}"}}]`)},
		Message{Role: "tool", Content: Content{Text: "result"}, ToolCallID: "c1"},
		Message{Role: "user", Content: Content{Text: "more"}})
	a, b := RenderChat(tools, turn1), RenderChat(tools, turn2)
	if !strings.HasPrefix(b, a) {
		t.Fatalf("turn 2 rendering does not extend turn 1:\n%q\n%q", a, b)
	}
	if !strings.Contains(a, `[{"type":"function","function":{"name":"search"}}]`) || !strings.Contains(b, `"arguments":"{}"`) {
		t.Fatalf("tools or tool calls not rendered compactly: %q", b)
	}
	if RenderChat(nil, turn1) == a {
		t.Fatal("tools do not change the rendering")
	}
	req := ChatRequest{Messages: turn1, Tools: tools}
	if req.Prompt() != a {
		t.Fatal("ChatRequest.Prompt differs from RenderChat")
	}
}

func TestEventReader(t *testing.T) {
	in := ": comment\n\nevent: x\ndata: {\"a\":1}\n\ndata: line1\r\ndata: line2\r\n\r\ndata:[DONE]\n\ndata: after\n\n"
	er := NewEventReader(strings.NewReader(in), 0)
	var got []string
	for {
		d, err := er.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, string(d))
	}
	if len(got) != 2 || got[0] != `{"a":1}` || got[1] != "line1\nline2" || !er.Done() {
		t.Fatalf("got %q done=%v", got, er.Done())
	}
	// Truncated stream.
	er = NewEventReader(strings.NewReader("data: {\"a\":1}\n\ndata: {\"b\""), 0)
	if _, err := er.Next(); err != nil {
		t.Fatal(err)
	}
	if _, err := er.Next(); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("truncated: %v", err)
	}
	// Oversized line.
	er = NewEventReader(strings.NewReader("data: "+strings.Repeat("x", 5000)+"\n\n"), 1024)
	if _, err := er.Next(); !errors.Is(err, ErrEventTooLarge) {
		t.Fatalf("oversized: %v", err)
	}
	// Clean EOF without [DONE].
	er = NewEventReader(strings.NewReader("data: 1\n\n"), 0)
	er.Next()
	if _, err := er.Next(); err != io.EOF || er.Done() {
		t.Fatalf("clean eof: %v", err)
	}
}

func TestStreamChunkLenient(t *testing.T) {
	for _, tc := range []struct {
		in     string
		output bool
		cached int
	}{
		{`{"choices":[{"index":0,"delta":{"content":"x"}}]}`, true, 0},
		{`{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`, false, 0},
		{`{"choices":[{"index":0,"text":"y"}]}`, true, 0},
		{`{"choices":null,"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":8}}}`, false, 8},
		{`{"usage":{"prompt_tokens":10}}`, false, 0},
	} {
		var c StreamChunk
		if err := json.Unmarshal([]byte(tc.in), &c); err != nil {
			t.Fatalf("%s: %v", tc.in, err)
		}
		if c.HasOutput() != tc.output || c.Usage.Cached() != tc.cached {
			t.Errorf("%s: output %v cached %d", tc.in, c.HasOutput(), c.Usage.Cached())
		}
	}
}

func BenchmarkPromptTokenIDs12k(b *testing.B) {
	var sb strings.Builder
	sb.WriteString("[")
	for i := range 12000 {
		if i > 0 {
			sb.WriteString(",")
		}
		sb.WriteString("12345")
	}
	sb.WriteString("]")
	in := []byte(sb.String())
	b.SetBytes(int64(len(in)))
	b.ReportAllocs()
	for b.Loop() {
		var p Prompt
		if err := p.UnmarshalJSON(in); err != nil {
			b.Fatal(err)
		}
	}
}

func FuzzPrompt(f *testing.F) {
	for _, s := range []string{`"x"`, `["a","b"]`, `[1,2]`, `[[1],[2,3]]`, `[]`, `[1.0e3]`, `[[1],"a"]`,
		`["a",null]`, `[null,1]`, nested(MaxDepth+1, false), "[" + nested(MaxDepth, true) + "]", strings.Repeat("[", 4096)} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var p Prompt
		if err := json.Unmarshal(b, &p); err != nil {
			return
		}
		if p.Len() == 0 || (len(p.Texts) > 0 && len(p.Tokens) > 0) {
			t.Fatalf("accepted %q as %+v", b, p)
		}
		for _, ids := range p.Tokens {
			if len(ids) == 0 {
				t.Fatalf("empty token list accepted from %q", b)
			}
		}
		// Whatever the scanner accepts, encoding/json must read the same ids.
		if len(p.Tokens) > 0 {
			var ref any
			if err := json.Unmarshal(b, &ref); err != nil {
				t.Fatalf("accepted invalid JSON %q", b)
			}
		}
	})
}

func FuzzChatRequest(f *testing.F) {
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}`))
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]}`))
	for _, tc := range deepBodies { // the nesting attack, in every field that holds it
		f.Add([]byte(tc.body(nested(MaxDepth, false))))
		f.Add([]byte(tc.body(nested(MaxDepth+1, true))))
		f.Add([]byte(tc.body(strings.Repeat("[", 8192))))
	}
	for _, h := range hostileBodies(4 << 10) {
		f.Add(h.body)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var r ChatRequest
		if e := Decode(b, &r); e != nil {
			if e.Status != 400 {
				t.Fatalf("decode error status %d", e.Status)
			}
			return
		}
		if e := r.Validate(); e != nil && e.Status != 400 {
			t.Fatalf("validate status %d", e.Status)
		}
		_ = r.Prompt()
	})
}

// readAll reads every event of r with a limit of max bytes: the events
// up to [DONE] (as the reference parser gives them), whether [DONE] was
// read, and the error that ended the reading.
func readAll(r io.Reader, max int) ([]ssetest.Event, bool, error) {
	er := NewEventReader(r, max)
	var got []ssetest.Event
	for {
		d, err := er.Next()
		if err != nil {
			return got, er.Done(), err
		}
		got = append(got, ssetest.Event{Data: string(d), Type: string(er.Event())})
	}
}

// clientView is what an EventSource client dispatches of stream up to
// [DONE], and whether it saw [DONE].
func clientView(stream []byte) ([]ssetest.Event, bool) {
	evs := ssetest.Events(stream)
	for i, e := range evs {
		if e.Data == "[DONE]" {
			return evs[:i], true
		}
	}
	return evs, false
}

// TestEventReaderLineEnds: a lone CR ends a line as LF and CRLF do
// (WHATWG HTML §9.2.5), also when a CRLF is split across reads, and a
// leading byte order mark is ignored. Before, lone CRs were kept inside
// the line: "data: a\r\rdata: [DONE]\r\r\n\n" was one event whose data
// held the "[DONE]" a client reads as the end of the stream.
func TestEventReaderLineEnds(t *testing.T) {
	for _, in := range []string{
		"data: a\r\rdata: [DONE]\r\r\n\n",
		"data: a\r\rdata: b\r\n\r\ndata: c\n\r\n",
		"event: x\rdata: a\rdata: b\r\r: c\r\revent: y\r\n\rdata: z\r\r",
		"\xEF\xBB\xBFdata: a\r\r\xEF\xBB\xBFdata: b\r\r",
		"data: a\r\r\r\n\n\rdata: b\n\r",
		"data: " + strings.Repeat("x", 40<<10) + "\rdata: y\r\r" + strings.Repeat(":", 16<<10-1) + "\r\ndata: z\r\r",
	} {
		want, wantDone := clientView([]byte(in))
		for _, r := range []io.Reader{strings.NewReader(in), iotest.OneByteReader(strings.NewReader(in)), iotest.HalfReader(strings.NewReader(in))} {
			got, done, err := readAll(r, 0)
			if err != io.EOF || done != wantDone || !slices.Equal(got, want) {
				t.Errorf("%q: %+v done=%v (%v), want %+v done=%v", in, got, done, err, want, wantDone)
			}
		}
	}
}

// FuzzEventReader: the reader terminates within its limit, and with a
// limit the input cannot reach it dispatches exactly the events a
// client's parser does (internal/ssetest, the WHATWG steps), up to [DONE],
// however the stream is split across reads.
func FuzzEventReader(f *testing.F) {
	f.Add([]byte("data: {}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("data: a\r\ndata: b\r\n\r\n:c\n\n"))
	f.Add([]byte("data: a\r\rdata: [DONE]\r\r\n\n"))
	f.Add([]byte("event: x\rdata: a\rdata: b\r\r: c\r\revent: y\r\n\rdata: z\r\r"))
	f.Add([]byte("\xEF\xBB\xBFdata: a\r\r\xEF\xBB\xBFdata: b\r\r"))
	f.Add([]byte("data\n\ndata:\r\revent\rdata:x\r\n\r\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		er := NewEventReader(strings.NewReader(string(b)), 256)
		ended := false
		for i := 0; i < len(b)+2; i++ {
			d, err := er.Next()
			if err != nil {
				ended = true
				break
			}
			if len(d) > len(b) {
				t.Fatalf("event longer than input")
			}
		}
		if !ended {
			t.Fatalf("reader did not terminate")
		}
		want, wantDone := clientView(b)
		for _, r := range []io.Reader{bytes.NewReader(b), iotest.OneByteReader(bytes.NewReader(b))} {
			got, done, err := readAll(r, len(b)+2)
			if err != io.EOF && err != io.ErrUnexpectedEOF {
				t.Fatalf("%q: %v", b, err)
			}
			if done != wantDone || !slices.Equal(got, want) {
				t.Fatalf("%q: read %+v done=%v, a client reads %+v done=%v", b, got, done, want, wantDone)
			}
		}
	})
}

func TestAppendChatSegmentsConcatenates(t *testing.T) {
	msgs := []Message{{Role: "system", Content: Content{Text: "Be brief."}}, {Role: "user", Content: Content{Text: "Hi"}},
		{Role: "assistant", Content: Content{Text: "Hello"}, ToolCalls: json.RawMessage(`[{"id":"1"}]`)}}
	tools := json.RawMessage(`[{"type":"function","function":{"name":"f"}}]`)
	for _, tl := range []json.RawMessage{nil, tools} {
		segs := AppendChatSegments(nil, tl, msgs)
		if len(segs) != len(msgs)+2 {
			t.Fatalf("%d segments for %d messages", len(segs), len(msgs))
		}
		if got, want := strings.Join(segs, ""), RenderChat(tl, msgs); got != want {
			t.Fatalf("segments join to\n%q\nnot\n%q", got, want)
		}
	}
}

// stdDecode is the reference for Decode: encoding/json, which rejects
// anything after the object. (Decode used json.Decoder and More before it
// moved to segmentio's drop-in decoder, and so accepted a stray "]" or "}"
// after the object: More reports false there.)
func stdDecode(body []byte, v any) error { return json.Unmarshal(body, v) }

// FuzzDecodeAgreesWithStdlib checks that Decode accepts exactly the request
// bodies encoding/json accepts and reads them into the same values.
func FuzzDecodeAgreesWithStdlib(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"m","messages":[{"role":"system","content":[{"type":"text","text":"a"}]},{"role":"user","content":"b","name":"x"}],"max_tokens":5,"temperature":0.5,"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]}`,
		`{"model":"m","prompt":[1,2,3],"max_tokens":8,"stream":true,"ignore_eos":true}`,
		`{"model":"m","prompt":"hello","n":2,"top_p":1,"user":"u","cache_salt":"s"}`,
		`{"MODEL":"m","Prompt":["a","b"],"model":"n"}`,
		`{"model":"m","prompt":[[1],[2,3]],"max_tokens":1e2}`,
		`{"model":"m\u00e9\ud800","prompt":"\xff"}`,
		`{"model":1}`, `{"model":"m"} {}`, `{"model":"m",}`, `[]`, `{"stream":"yes"}`,
		`{"model":"m","messages":[{},null,1]}`, `{"model":"m","prompt":["a",null]}`,
	} {
		f.Add([]byte(s))
	}
	for _, tc := range deepBodies {
		f.Add([]byte(tc.body(nested(MaxDepth-tc.level(0), true))))
		f.Add([]byte(tc.body(nested(MaxDepth+1, false))))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if TooDeep(b) {
			// Refused by Decode, read by encoding/json up to 10000 levels
			// (TestDecodeRefusesDeepNesting).
			var r ChatRequest
			if e := Decode(b, &r); e == nil {
				t.Fatalf("%.64q: nested deeper than %d, accepted", b, MaxDepth)
			}
			return
		}
		if json.Valid(b) && bytes.HasPrefix(bytes.TrimSpace(b), []byte("{")) {
			if fast, slow := duplicateKey(b), duplicateKeyParsed(b); fast != slow {
				t.Fatalf("%q: duplicateKey %q, parsed %q", b, fast, slow)
			}
			if duplicateKeyParsed(b) != "" {
				return // refused by Decode, read by encoding/json (TestDecodeRefusesDuplicateKeys)
			}
		}
		if hasCaseVariantKey(b) {
			return // Decode matches keys exactly, encoding/json in any case (TestDecodeMatchesKeysExactly)
		}
		if bytes.Equal(bytes.TrimSpace(b), []byte("null")) {
			// A body must be an object: Decode refuses null, which
			// encoding/json reads into a struct as nothing at all.
			if Decode(b, &ChatRequest{}) == nil {
				t.Fatal("Decode accepted a null body")
			}
			return
		}
		var chat, chatRef ChatRequest
		var comp, compRef CompletionRequest
		for _, c := range []struct {
			got, want any
		}{{&chat, &chatRef}, {&comp, &compRef}} {
			e := Decode(b, c.got)
			err := stdDecode(b, c.want)
			if (e == nil) != (err == nil) {
				t.Fatalf("%q: Decode error %v, encoding/json error %v", b, e, err)
			}
			if e == nil && !reflect.DeepEqual(c.got, c.want) {
				t.Fatalf("%q:\n Decode        %+v\n encoding/json %+v", b, c.got, c.want)
			}
		}
	})
}

// requestKeys are the JSON names of every field Decode can fill, at any
// depth (content parts' "type" and "text" included).
var requestKeys = func() map[string]bool {
	keys := map[string]bool{"type": true, "text": true}
	seen := map[reflect.Type]bool{}
	var walk func(t reflect.Type)
	walk = func(t reflect.Type) {
		for t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice {
			t = t.Elem()
		}
		if t.Kind() != reflect.Struct || seen[t] {
			return
		}
		seen[t] = true
		for i := 0; i < t.NumField(); i++ {
			f := t.Field(i)
			if name, _, _ := strings.Cut(f.Tag.Get("json"), ","); name != "" && name != "-" {
				keys[name] = true
			}
			walk(f.Type)
		}
	}
	walk(reflect.TypeOf(ChatRequest{}))
	walk(reflect.TypeOf(CompletionRequest{}))
	return keys
}()

// hasCaseVariantKey reports whether b (if valid JSON) has an object key, at
// any depth, that encoding/json would match to a field in another case
// ("Model", "MAX_TOKENS", or with the Kelvin sign for "k").
func hasCaseVariantKey(b []byte) bool {
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.UseNumber()
	var objects []bool // per open container: is it an object?
	expectKey := false // the next token is an object key
	inObject := func() bool { return len(objects) > 0 && objects[len(objects)-1] }
	for {
		tok, err := dec.Token()
		if err != nil {
			return false
		}
		switch v := tok.(type) {
		case json.Delim:
			if v == '{' || v == '[' {
				objects = append(objects, v == '{')
				expectKey = v == '{'
				continue
			}
			objects = objects[:len(objects)-1]
			expectKey = inObject() // the closed container was a value
		case string:
			if expectKey {
				for k := range requestKeys {
					if v != k && strings.EqualFold(v, k) {
						return true
					}
				}
				expectKey = false
				continue
			}
			expectKey = inObject()
		default:
			expectKey = inObject()
		}
	}
}

// Keys match fields by exact name, as the engines (Python's json, pydantic)
// read them: a case variant is an unknown field, ignored and passed on, so
// the gateway and the engine see the same model, limits and stream mode.
func TestDecodeMatchesKeysExactly(t *testing.T) {
	var c CompletionRequest
	if e := Decode([]byte(`{"model":"m1","Model":"m2","prompt":"hi","max_tokens":5000,"Max_Tokens":1,"stream":true,"Stream":false,"MODEL":7}`), &c); e != nil {
		t.Fatal(e)
	}
	if c.Model != "m1" || c.MaxTokens == nil || *c.MaxTokens != 5000 || !c.Stream {
		t.Fatalf("got model %q, max_tokens %v, stream %v; want m1, 5000, true", c.Model, c.MaxTokens, c.Stream)
	}
	var r ChatRequest
	if e := Decode([]byte(`{"mod\u0065l":"n","messages":[{"role":"user","content":"x","Content":"y"},{"role":"user","content":[{"type":"text","text":"a","Text":"b"}]}]}`), &r); e != nil {
		t.Fatal(e)
	}
	if r.Model != "n" || r.Messages[0].Content.Text != "x" || r.Messages[1].Content.Text != "a" {
		t.Fatalf("got model %q, contents %q, %q; want n, x, a", r.Model, r.Messages[0].Content.Text, r.Messages[1].Content.Text)
	}
	for _, b := range []string{`{"Model":"m"}`, `{"model":"m","stream":true,"STREAM":false}`} {
		if !hasCaseVariantKey([]byte(b)) {
			t.Errorf("hasCaseVariantKey(%s) = false", b)
		}
	}
	for _, b := range []string{`{"model":"Model"}`, `{"model":"m","x":{"a":["Model"]},"messages":[]}`, `{"model":`} {
		if hasCaseVariantKey([]byte(b)) {
			t.Errorf("hasCaseVariantKey(%s) = true", b)
		}
	}
}

// A key Decode reads, repeated at the top level or in stream_options, is
// refused: Go and Python read repeats differently ({"model":"a","model":null}
// is "a" to encoding/json, the base model to vLLM).
func TestDecodeRefusesDuplicateKeys(t *testing.T) {
	for body, key := range map[string]string{
		`{"model":"lora-a","model":null,"messages":[{"role":"user","content":"x"}]}`:                            "model",
		`{"model":"a","mod\u0065l":null,"prompt":"x"}`:                                                          "model",
		`{"m\u006Fdel":"a","prompt":"caf\u00e9","model":null}`:                                                  "model",
		`{"model":"a","prompt":"x","stream":true,"stream_options":{"include_usage":true},"stream_options":{}}`:  "stream_options",
		`{"model":"a","prompt":"x","stream":true,"stream_options":{"include_usage":true,"include_usage":null}}`: "stream_options.include_usage",
		`{"model":"a","prompt":"x","stream_options":{"include_usag\u0065":true,"include_usage":null}}`:          "stream_options.include_usage",
		`{"model":"a","prompt":"x","max_tokens":5,"x":1,"max_tokens":null}`:                                     "max_tokens",
	} {
		for _, v := range []any{&ChatRequest{}, &CompletionRequest{}} {
			e := Decode([]byte(body), v)
			if e == nil || e.Code != CodeInvalidValue || e.Param == nil || *e.Param != key {
				t.Errorf("%s into %T: %+v, want invalid_value for %q", body, v, e, key)
			}
		}
	}
	// Not repeats of a key Decode reads: accepted.
	for _, body := range []string{
		`{"model":"model","prompt":["model","stream"],"x":{"model":1,"model":2},"y":1,"y":2}`,
		`{"model":"a","prompt":"\"model\": \u0041","stream_options":{"include_usage":true,"z":1,"z":2},"include_usage":false}`,
		`{"model":"a","prompt":"caf\u00e9 \u4e2d \u006d","x":"model"}`,
		`{"model":"a","messages":[{"role":"user","content":"model"}],"tools":[{"type":"function","function":{"name":"model","parameters":{"model":{"type":"string"}}}}]}`,
	} {
		var r ChatRequest
		if e := Decode([]byte(body), &r); e != nil && e.Code == CodeInvalidValue {
			t.Errorf("%s: %v", body, e)
		}
	}
}

// A valid JSON value the request may not have is invalid_value naming its
// field; a message without content is refused like one with null content.
func TestDecodeValueErrors(t *testing.T) {
	for body, param := range map[string]string{
		`{"model":"m","prompt":[-1]}`:                                         "prompt",
		`{"model":"m","prompt":[]}`:                                           "prompt",
		`{"model":"m","prompt":[[1],[4294967296]]}`:                           "prompt",
		`{"model":"m","prompt":5}`:                                            "prompt",
		`{"model":"m","messages":[{"role":"user","content":5}]}`:              "messages.content",
		`{"model":"m","messages":[{"role":"user","content":[{"text":"a"}]}]}`: "messages.content",
		`{"model":"m","messages":[{"role":"user","content":[5]}]}`:            "messages.content",
	} {
		var v any = &CompletionRequest{}
		if strings.Contains(body, "messages") {
			v = &ChatRequest{}
		}
		e := Decode([]byte(body), v)
		if e == nil || e.Code != CodeInvalidValue || e.Param == nil || *e.Param != param {
			t.Errorf("%s: got %+v, want invalid_value for %q", body, e, param)
		}
	}
	for body, bad := range map[string]bool{
		`{"model":"m","messages":[{"role":"user"}]}`:                      true,
		`{"model":"m","messages":[{"role":"user","content":null}]}`:       true,
		`{"model":"m","messages":[{"role":"user","content":""}]}`:         false,
		`{"model":"m","messages":[{"role":"assistant","tool_calls":[]}]}`: false,
	} {
		var r ChatRequest
		if e := Decode([]byte(body), &r); e != nil {
			t.Fatalf("%s: %v", body, e)
		}
		if e := r.Validate(); (e != nil) != bad {
			t.Errorf("%s: Validate() = %v, want error %v", body, e, bad)
		}
	}
}

// Decode's messages come from encoding/json (see Decode): field names,
// JSON kinds and offsets, never raw input.
func TestDecodeErrorMessages(t *testing.T) {
	for body, want := range map[string]string{
		`{"model":1}`:                           `invalid type for "model": expected a string, got number`,
		`{"model":"m","messages":[{"role":7}]}`: `invalid type for "messages.role": expected a string, got number`,
		`{"model":"m",}`:                        `request body is not valid JSON (offset 14)`,
		`{"model":"m"`:                          `request body is not valid JSON (offset 12): unexpected end of JSON input`,
		`{"model":"m"}]`:                        `request body has data after the JSON object`,
		`{"model":"m","messages":[]} {"x":1}`:   `request body has data after the JSON object`,
	} {
		var r ChatRequest
		e := Decode([]byte(body), &r)
		if e == nil || !strings.HasPrefix(e.Message, want) {
			t.Errorf("%s: error %v, want %q", body, e, want)
		}
	}
}

// TestAppendChatSegmentsIn: the segments rendered into one buffer are
// AppendChatSegments', with and without tools or tool calls, into a
// buffer reused from a longer and a shorter chat; a chat without tools
// makes no string of its own once the buffer is large enough.
func TestAppendChatSegmentsIn(t *testing.T) {
	long := strings.Repeat("You are a helpful assistant. ", 80)
	chats := [][]Message{
		{{Role: "system", Content: Content{Text: long}}, {Role: "user", Content: Content{Text: "Hi"}}},
		{{Role: "user", Content: Content{Text: "é ∑ \x00 <|eot_id|>"}}},
		{{Role: "system", Content: Content{Text: "Be brief."}}, {Role: "user", Content: Content{Text: "Hi"}},
			{Role: "assistant", Content: Content{Text: "Hello"}, ToolCalls: json.RawMessage(`[ {"id": "1"} ]`)}},
		{{Role: "assistant", Content: Content{Null: true}}},
		nil,
	}
	tools := json.RawMessage(`[{"type": "function", "function":{"name":"f"}}]`)
	var buf []byte
	var segs []string
	for round := range 2 {
		for i, msgs := range chats {
			for _, tl := range []json.RawMessage{nil, tools} {
				want := AppendChatSegments(nil, tl, msgs)
				buf, segs = AppendChatSegmentsIn(buf, segs[:0], tl, msgs)
				if !slices.Equal(segs, want) {
					t.Fatalf("round %d chat %d tools %v:\n%q\nwant\n%q", round, i, tl != nil, segs, want)
				}
			}
		}
	}
	if raceEnabled {
		return
	}
	buf, _ = AppendChatSegmentsIn(buf, segs[:0], nil, chats[0])
	if n := testing.AllocsPerRun(50, func() { buf, segs = AppendChatSegmentsIn(buf, segs[:0], nil, chats[0]) }); n != 0 {
		t.Errorf("a chat's segments into a reused buffer allocate %v times", n)
	}
}

// BenchmarkEventReader reads a 1000-token chat stream (vLLM's chunks, LF
// line ends) as the relay does: bytes per second of stream.
func BenchmarkEventReader(b *testing.B) {
	chunk := `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" word"},"logprobs":null,"finish_reason":null}]}` + "\n\n"
	stream := []byte(strings.Repeat(chunk, 1000) + "data: [DONE]\n\n")
	r := bytes.NewReader(stream)
	er := NewEventReader(r, 0)
	b.SetBytes(int64(len(stream)))
	b.ReportAllocs()
	for b.Loop() {
		r.Reset(stream)
		er.Reset(r)
		for {
			if _, err := er.Next(); err != nil {
				break
			}
		}
	}
}
