package jsonscan

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

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

// spliceCheck verifies SpliceModel on body: a valid object with a unique
// top-level model gets exactly that value replaced; anything else is
// refused or, if walked, stays valid JSON.
func spliceCheck(t *testing.T, body []byte) {
	const target = `"meta-llama/Llama-3.1-8B-Instruct"`
	out, ok := SpliceModel(nil, body, []byte(target))
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
	from, to, _ := ModelSpan(body)
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
	out, ok := SpliceModel(nil, []byte(`{"messages":[], "model" : "fast" ,"n":1}`), []byte(`"m"`))
	if !ok || string(out) != `{"messages":[], "model" : "m" ,"n":1}` {
		t.Errorf("splice: %s %v", out, ok)
	}
}

// FuzzSpliceModel: SpliceModel replaces exactly the top-level model value
// of any valid object, keeps every other byte, and never panics.
func FuzzSpliceModel(f *testing.F) {
	for _, s := range spliceSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) { spliceCheck(t, body) })
}
