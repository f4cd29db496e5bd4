package gateway

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

// TestParseRenderIDsStrictJSON: numbers with a leading zero are not JSON
// (encoding/json and Python's json refuse them), so an answer holding one
// is malformed, not read as if the zero stood alone; escaped keys are
// decoded wherever they are, and the nesting bound is 64.
func TestParseRenderIDsStrictJSON(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []uint32
		err  error
	}{
		{`{"n":01,"token_ids":[1]}`, nil, errRenderJSON},
		{`{"token_ids":[01]}`, nil, errRenderJSON},
		{`[{"token_ids":[2]},01]`, nil, errRenderJSON}, // the rest of a completion render is validated too
		{`[{"token_ids":[2]},{"token_ids":[3]}]`, []uint32{2}, nil},
		{`{"sampling_params":{"logit_bias":{"\u0031":-1}},"token\u005fids":[3]}`, []uint32{3}, nil},
		{`[[{"role":"user"}],[{"prompt_token_ids":[4]}]]`, []uint32{4}, nil},
		{`[[{"role":"user"}],{"prompt_token_ids":[4]}]`, nil, errRenderNoIDs},
		{`{"a":` + strings.Repeat("[", 63) + strings.Repeat("]", 63) + `,"token_ids":[5]}`, []uint32{5}, nil},
		{`{"a":` + strings.Repeat("[", 64) + strings.Repeat("]", 64) + `,"token_ids":[5]}`, nil, errRenderDepth},
	} {
		got, err := parseRenderIDs(nil, []byte(c.in), maxRenderIDs)
		if !errors.Is(err, c.err) || err == nil && !slices.Equal(got, c.want) {
			t.Errorf("%.60s: got %v, %v; want %v, %v", c.in, got, err, c.want, c.err)
		}
	}
}

// TestParseRenderIDsTrailingBytes: the answer is one JSON value; bytes
// after it other than whitespace make it malformed, as json.Unmarshal
// reads it, in every form.
func TestParseRenderIDsTrailingBytes(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []uint32
		err  error
	}{
		{`{"token_ids":[1,2]} x`, nil, errRenderJSON},
		{`{"token_ids":[1,2]}}`, nil, errRenderJSON},
		{`{"token_ids":[1,2]}{}`, nil, errRenderJSON},
		{`{} x`, nil, errRenderJSON},
		{`[{"token_ids":[1]}] [`, nil, errRenderJSON},
		{`[{"token_ids":[1]}]]`, nil, errRenderJSON},
		{`[[{"role":"user"}],[{"prompt_token_ids":[4]}]] 0`, nil, errRenderJSON},
		{"{\"token_ids\":[1,2]} \r\n\t", []uint32{1, 2}, nil},
		{" [{\"token_ids\":[3]}]\n", []uint32{3}, nil},
		{`{"tokens":[7]}`, []uint32{7}, nil},
		{`{}  `, nil, errRenderNoIDs},
	} {
		got, err := parseRenderIDs(nil, []byte(c.in), maxRenderIDs)
		if !errors.Is(err, c.err) || err == nil && !slices.Equal(got, c.want) {
			t.Errorf("%q: got %v, %v; want %v, %v", c.in, got, err, c.want, c.err)
		}
	}
}
