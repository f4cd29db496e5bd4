package openai

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestDecodeResponsesRequest(t *testing.T) {
	var r ResponsesRequest
	body := `{"model":"m","instructions":"Be brief.","input":[` +
		`{"role":"user","content":"hello"},` +
		`{"type":"message","role":"assistant","content":[{"type":"output_text","text":"hi "},{"type":"output_text","text":"there"}]},` +
		`{"type":"function_call","call_id":"c1","name":"f","arguments":"{}"},` +
		`{"type":"function_call_output","call_id":"c1","output":"42"},` +
		`{"role":"user","content":[{"type":"input_text","text":"and"},{"type":"input_image","image_url":"x"}]}` +
		`],"max_output_tokens":16,"previous_response_id":"resp_1","store":false,"stream":true}`
	if e := Decode([]byte(body), &r); e != nil {
		t.Fatal(e)
	}
	if e := r.Validate(); e != nil {
		t.Fatal(e)
	}
	if r.Stored() || !r.Stream || r.PreviousResponseID != "resp_1" || *r.MaxOutputTokens != 16 || len(r.Input.Items) != 5 {
		t.Fatalf("%+v", r)
	}
	msgs := r.AppendMessages(nil)
	want := []struct{ role, text string }{{"system", "Be brief."}, {"user", "hello"}, {"assistant", "hi there"},
		{"function_call", `{"type":"function_call","call_id":"c1","name":"f","arguments":"{}"}`}, {"function_call_output", ""}, {"user", "and"}}
	if len(msgs) != len(want) {
		t.Fatalf("%d messages: %+v", len(msgs), msgs)
	}
	for i, w := range want {
		if msgs[i].Role != w.role || (w.text != "" && msgs[i].Content.Text != w.text) {
			t.Errorf("message %d: %s %q, want %s %q", i, msgs[i].Role, msgs[i].Content.Text, w.role, w.text)
		}
	}
	if !strings.Contains(r.Prompt(), "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>") {
		t.Errorf("prompt %q", r.Prompt())
	}
	var s ResponsesRequest
	if e := Decode([]byte(`{"model":"m","input":"hi"}`), &s); e != nil || !s.Input.IsText || s.Input.Text != "hi" || !s.Stored() {
		t.Fatalf("%+v %v", s, e)
	}
	if m := s.AppendMessages(nil); len(m) != 1 || m[0].Role != "user" || m[0].Content.Text != "hi" {
		t.Errorf("%+v", m)
	}

	for _, tc := range []struct{ body, param string }{
		{`{"input":"x"}`, "model"},
		{`{"model":"m"}`, "input"},
		{`{"model":"m","input":null}`, "input"},
		{`{"model":"m","input":5}`, "input"},
		{`{"model":"m","input":[1]}`, "input[0]"},
		{`{"model":"m","input":[{"role":"user","content":5}]}`, "input[0].content"},
		{`{"model":"m","input":[{"role":"user","content":[5]}]}`, "input[0].content"},
		{`{"model":"m","input":"x","max_output_tokens":0}`, "max_output_tokens"},
		{`{"model":"m","input":"x","temperature":3}`, "temperature"},
		{`{"model":"m","input":"x","input":"y"}`, "input"},
	} {
		var r ResponsesRequest
		e := Decode([]byte(tc.body), &r)
		if e == nil {
			e = r.Validate()
		}
		if e == nil || e.Param == nil || *e.Param != tc.param || e.Status != 400 {
			t.Errorf("%s: %+v, want 400 naming %s", tc.body, e, tc.param)
		}
	}
}

func TestDecodeEmbeddingRequest(t *testing.T) {
	var r EmbeddingRequest
	if e := Decode([]byte(`{"model":"m","input":[[1,2],[3]],"encoding_format":"base64","dimensions":8}`), &r); e != nil || r.Validate() != nil {
		t.Fatalf("%+v %v", r, e)
	}
	if r.Input.Len() != 2 || len(r.Input.Tokens[1]) != 1 {
		t.Fatalf("%+v", r.Input)
	}
	for _, tc := range []string{`{"model":"m","input":[1,-2]}`, `{"model":"m","input":["a",1]}`, `{"model":"m","input":[]}`,
		`{"model":"m"}`, `{"model":"m","input":"x","encoding_format":"hex"}`, `{"model":"m","input":"x","dimensions":0}`} {
		var r EmbeddingRequest
		e := Decode([]byte(tc), &r)
		if e == nil {
			e = r.Validate()
		}
		if e == nil || e.Param == nil || (*e.Param != "input" && *e.Param != "encoding_format" && *e.Param != "dimensions") {
			t.Errorf("%s: %+v", tc, e)
		}
	}
}

// FuzzDecodeResponses: any body decodes or is refused with a 400, never a
// panic; an accepted array input has one item per element, and its
// rendering works.
func FuzzDecodeResponses(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","input":"hi"}`,
		`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"a"}]},{"type":"reasoning","summary":[]}]}`,
		`{"model":"m","input":[{"type":"function_call_output","output":[{"type":"input_text","text":"x"}]}]}`,
		`{"model":"m","input":[` + strings.Repeat(`{},`, 1000) + `{}]}`,
		`{"model":"m","input":[` + nested(MaxDepth, true) + `]}`,
		`{"model":"m","input":[{"role":"user","content":` + nested(MaxDepth-3, false) + `}]}`,
		`{"model":"m","input":[null]}`, `{"model":"m","input":{}}`, `{"model":"m","input":[{"content":"\u0000"}]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var r ResponsesRequest
		e := Decode(b, &r)
		if e != nil {
			if e.Status != 400 {
				t.Fatalf("%q: status %d", b, e.Status)
			}
			return
		}
		_ = r.Validate()
		var ref struct {
			Input json.RawMessage `json:"input"`
		}
		var items []json.RawMessage
		if json.Unmarshal(b, &ref) == nil && json.Unmarshal(ref.Input, &items) == nil && !r.Input.IsText && len(items) != len(r.Input.Items) {
			t.Fatalf("%q: %d items, encoding/json %d", b, len(r.Input.Items), len(items))
		}
		_ = r.Prompt()
	})
}
