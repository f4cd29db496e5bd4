package gateway

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/infergate/infergate/openai"
)

// responseEventSeeds are Responses stream events as vLLM sends them, and
// awkward variants.
var responseEventSeeds = []string{
	`{"response":{"id":"resp_1","created_at":1,"model":"m","object":"response","output":[],"status":"in_progress","usage":null},"sequence_number":0,"type":"response.created"}`,
	`{"item":{"id":"a-b","content":[],"role":"assistant","status":"in_progress","type":"message"},"output_index":0,"sequence_number":2,"type":"response.output_item.added"}`,
	`{"content_index":1,"delta":" the","item_id":"a-b","logprobs":[],"output_index":0,"sequence_number":4,"type":"response.output_text.delta"}`,
	`{"content_index":1,"delta":"","item_id":"a-b","logprobs":[],"output_index":0,"sequence_number":4,"type":"response.output_text.delta"}`,
	`{"type":"response.function_call_arguments.delta","delta":"{\"a\":","item_id":"fc_1","output_index":0,"sequence_number":5}`,
	`{"type":"response.reasoning_text.delta","delta":"hm","sequence_number":3}`,
	`{"response":{"id":"resp_1","status":"completed","output":[{"content":[{"text":"hi","type":"output_text"}]}],"usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":32,"input_tokens_per_turn":[],"cached_tokens_per_turn":[]},"output_tokens":3,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":43}},"sequence_number":9,"type":"response.completed"}`,
	`{"type":"response.incomplete","response":{"id":"resp_2","usage":{"input_tokens":1,"output_tokens":1,"total_tokens":2,"input_tokens_details":null}}}`,
	`{"type":"response.failed","response":{"id":"resp_3","error":{"code":"server_error","message":"boom"},"usage":null}}`,
	`{"type":"error","code":"ERR","message":"boom","param":null,"sequence_number":1}`,
	`{"type":"response.output_text.delta","delta":null}`,
	`{"type":"response.output_text.delta","delta":5}`,
	`{"type":"response.output_text.delta","delta":"a","delta":"b"}`,
	`{"Type":"response.output_text.delta","delta":"a"}`,
	`{"type":"response.completed","response":{"ID":"x","usage":{"input_tokens":1}}}`,
	`{"type":"response.completed","response":{"id":"x","Usage":{"input_tokens":1}}}`,
	`{"type":"response.completed","response":{"id":"x","usage":{"Input_Tokens":1}}}`,
	`{"type":"response.completed","response":{"id":"r\u00e9","usage":{"input_tokens":1.5}}}`,
	`{"type":"response.completed","response":{"id":5}}`,
	`{"type":"response.completed","response":null}`,
	`{"type":"response.completed","response":[1]}`,
	`{"t\u0079pe":"response.completed"}`,
	`{"type":"response.completed"} trailing`,
	`{"type":"response.\u006futput_text.delta","delta":"x"}`,
	`{"type":5}`,
	`[1]`,
	`null`,
	`{"type":"response.completed","response":{"id":"x","usage":{"input_tokens":1,"input_tokens_details":{"cached_tokens":null,"cached_tokens":2}}}}`,
}

func TestScanResponseEvent(t *testing.T) {
	for _, s := range responseEventSeeds {
		want, wantOK := parseResponseEvent([]byte(s))
		got, gotOK := viewResponseEvent([]byte(s))
		if gotOK != wantOK || !reflect.DeepEqual(got, want) {
			t.Errorf("%s:\n view %+v %v\n json %+v %v", s, got, gotOK, want, wantOK)
		}
	}
	// vLLM's ordinary events take the fast path, and read as they should.
	for i, s := range responseEventSeeds[:10] {
		v, d := scanResponseEvent([]byte(s))
		if !d {
			t.Errorf("not decided by the scanner: %s", s)
		}
		switch i {
		case 2, 4, 5:
			if !v.output {
				t.Errorf("no output: %s", s)
			}
		case 6:
			if !v.terminal || v.failed || v.id != "resp_1" || v.usage == nil || v.usage.PromptTokens != 40 || v.usage.Cached() != 32 || v.usage.CompletionTokens != 3 {
				t.Errorf("completed: %+v %+v", v, v.usage)
			}
		case 7:
			if !v.terminal || v.failed || v.id != "resp_2" || v.usage.TotalTokens != 2 {
				t.Errorf("incomplete: %+v", v)
			}
		case 8, 9:
			if !v.failed {
				t.Errorf("not failed: %s", s)
			}
		default:
			if v.output || v.terminal {
				t.Errorf("%+v: %s", v, s)
			}
		}
	}
}

// FuzzScanResponseEvent: whenever the scanner decides, it agrees with
// encoding/json; neither panics on anything.
func FuzzScanResponseEvent(f *testing.F) {
	for _, s := range responseEventSeeds {
		f.Add([]byte(s))
	}
	// A hostile engine's nesting, at and past the bounds, in a member the
	// scanner skips and in the response object it walks.
	at := strings.Repeat("[", openai.MaxDepth-3) + strings.Repeat("]", openai.MaxDepth-3)
	for _, v := range []string{at, deepJSON, strings.Repeat("[", 1<<16), strings.Repeat(`{"a":`, 40) + "1" + strings.Repeat("}", 40)} {
		f.Add([]byte(`{"type":"response.output_text.delta","delta":"a","x":` + v + `}`))
		f.Add([]byte(`{"type":"response.completed","response":{"id":"r","output":` + v + `,"usage":{"input_tokens":1}}}`))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got, decided := scanResponseEvent(data)
		want, ok := parseResponseEvent(data)
		if decided && (!ok || !reflect.DeepEqual(got, want)) {
			t.Fatalf("%q:\n scan %+v\n json %+v (ok %v)", data, got, want, ok)
		}
	})
}

// spliceSeeds are request bodies whose model an alias rewrites.
var spliceSeeds = []string{
	`{"model":"fast","messages":[{"role":"user","content":"hi"}]}`,
	`{"messages":[{"role":"user","content":"model"}],"model":"fast"}`,
	` { "stream" : true , "model" : "fast" } `,
	`{"x":{"model":"inner"},"model":"fast"}`,
	`{"x":[{"model":"inner"}],"y":"\"model\":","model":"fast","z":1}`,
	`{"\u006dodel":"fast","input":"x"}`,
	`{"mod\"el":"a","model":"fast"}`,
	`{"tools":` + strings.Repeat("[", 100) + strings.Repeat("]", 100) + `,"model":"fast"}`,
	`{"model":"f\u00e4st"}`,
	`{"Model":"x","model":"fast"}`,
	`{"prompt":"no model"}`,
	`{}`,
	`[]`,
	`{"model":`,
	`{"a":"unterminated`,
	`{"a":[1,2,{"b":"]"}],"model":"fast"}`,
}

// spliceCheck verifies spliceModel on body: a valid object with a unique
// top-level model gets exactly that value replaced; anything else is
// refused or, if walked, stays valid JSON.
func spliceCheck(t *testing.T, body []byte) {
	const target = `"meta-llama/Llama-3.1-8B-Instruct"`
	out, ok := spliceModel(nil, body, []byte(target))
	var in map[string]any
	valid := json.Valid(body) && json.Unmarshal(body, &in) == nil && in != nil
	_, hasModel := in["model"]
	if !valid {
		if ok && json.Valid(out) != json.Valid(body) {
			t.Fatalf("%q: spliced an invalid body into valid JSON %q", body, out)
		}
		return
	}
	if dupModel(body) {
		return // openai.Decode refuses such a body before any splice
	}
	if ok != hasModel {
		t.Fatalf("%q: spliced %v, has a model %v", body, ok, hasModel)
	}
	if !ok {
		return
	}
	var got map[string]any
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("%q → %q: %v", body, out, err)
	}
	in["model"] = "meta-llama/Llama-3.1-8B-Instruct"
	if !reflect.DeepEqual(got, in) {
		t.Fatalf("%q → %q:\n got  %v\n want %v", body, out, got, in)
	}
	from, to, _ := modelSpan(body)
	if !bytes.Equal(out[:from], body[:from]) || !bytes.Equal(out[len(out)-(len(body)-to):], body[to:]) {
		t.Fatalf("%q → %q: bytes outside the model value changed", body, out)
	}
}

// dupModel reports whether body's top-level object has "model" twice (as
// encoding/json's tokenizer reads keys).
func dupModel(body []byte) bool {
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return false
	}
	n := 0
	for dec.More() {
		k, err := dec.Token()
		if err != nil {
			return false
		}
		if k == "model" {
			n++
		}
		var skip json.RawMessage
		if dec.Decode(&skip) != nil {
			return false
		}
	}
	return n > 1
}

func TestSpliceModel(t *testing.T) {
	for _, s := range spliceSeeds {
		spliceCheck(t, []byte(s))
	}
	out, ok := spliceModel(nil, []byte(`{"messages":[], "model" : "fast" ,"n":1}`), []byte(`"m"`))
	if !ok || string(out) != `{"messages":[], "model" : "m" ,"n":1}` {
		t.Errorf("splice: %s %v", out, ok)
	}
}

// FuzzSpliceModel: spliceModel replaces exactly the top-level model value
// of any valid object, keeps every other byte, and never panics.
func FuzzSpliceModel(f *testing.F) {
	for _, s := range spliceSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) { spliceCheck(t, body) })
}
