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
		{`[{"token_ids":[2]},01]`, []uint32{2}, nil}, // the rest of a completion render is not read
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
