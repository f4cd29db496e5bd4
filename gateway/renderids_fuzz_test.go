package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"math"
	"slices"
	"testing"
)

// refRenderIDs is parseRenderIDs's rules over encoding/json's decoding of
// b (numbers kept as written): the reference FuzzParseRenderIDs checks it
// against. ok is false when b is not JSON.
func refRenderIDs(b []byte, limit int) (ids []uint32, err error, ok bool) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if d.Decode(&v) != nil {
		return nil, nil, false
	}
	if _, err := d.Token(); err != io.EOF { // json.Unmarshal's rule: one value, then whitespace
		return nil, nil, false
	}
	var obj map[string]any
	switch x := v.(type) {
	case map[string]any:
		obj = x
	case []any:
		if len(x) > 0 {
			switch y := x[0].(type) {
			case map[string]any:
				obj = y
			case []any:
				if len(x) > 1 {
					if z, ok := x[1].([]any); ok && len(z) > 0 {
						obj, _ = z[0].(map[string]any)
					}
				}
			}
		}
	}
	if obj == nil {
		return nil, errRenderNoIDs, true
	}
	for _, k := range renderIDKeys {
		raw, has := obj[k]
		if !has {
			continue
		}
		arr, isArr := raw.([]any)
		if !isArr {
			return nil, errRenderIDs, true
		}
		ids = []uint32{}
		for _, e := range arr {
			n, isNum := e.(json.Number)
			if !isNum {
				return nil, errRenderIDs, true
			}
			s := string(n)
			var u uint64
			for _, c := range []byte(s) {
				if c < '0' || c > '9' {
					return nil, errRenderIDs, true
				}
				if u = u*10 + uint64(c-'0'); u > math.MaxUint32 {
					return nil, errRenderIDs, true
				}
			}
			if len(ids) < limit {
				ids = append(ids, uint32(u))
			}
		}
		return ids, nil, true
	}
	return nil, errRenderNoIDs, true
}

// FuzzParseRenderIDs: the render answer parser never panics, keeps at most
// its limit, leaves dst's prefix alone, and on JSON agrees with the
// reference (ids, or an error) unless the JSON nests past its bound.
func FuzzParseRenderIDs(f *testing.F) {
	for _, s := range []string{
		`{"request_id":"chatcmpl-1","token_ids":[128000,9906,0,4294967295],"features":null,"sampling_params":{"max_tokens":5,"stop":[],"logit_bias":{"1":-1.5e3}},"model":"m","stream":false,"stream_options":null,"cache_salt":null,"priority":0,"kv_transfer_params":null}`,
		`[{"request_id":"cmpl-1","token_ids":[1,2]},{"request_id":"cmpl-2","token_ids":[3]}]`,
		`[[{"role":"user","content":"h\u00e9\"llo"}],[{"prompt_token_ids":[1, 2 ,3 ]}]]`,
		`[{"prompt_token_ids":[5],"prompt":"x"}]`,
		`{"count":2,"max_model_len":4096,"tokens":[40,41],"token_strs":null}`,
		`{"tokens":[1],"token_ids":[2]}`, `{"token_ids":[1],"token_ids":[2,3]}`, `{"token\u005fids":[9]}`,
		`{"token_ids":[1,-2]}`, `{"token_ids":[1.0]}`, `{"token_ids":[4294967296]}`, `{"token_ids":"1"}`,
		`{"token_ids":[]}`, `[]`, `[[]]`, `{}`, `null`, `{"a":[[[[[[[[[[]]]]]]]]]],"token_ids":[7]}`, `{"token_ids":[1,]}`, ` `,
		`{"token_ids":[1,2]} x`, "{\"token_ids\":[1]} \n\t", `{"token_ids":[1]}}`, `[{"token_ids":[1]}] [`, `[{"token_ids":[1]},}]`,
		`[{"token_ids":[1]},{"token_ids":[2,x]}]`, `[[],[{"prompt_token_ids":[1]}],]`, `{} {}`, `null x`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		const limit = 4
		dst := []uint32{99}
		got, err := parseRenderIDs(dst, b, limit)
		if len(got) < 1 || got[0] != 99 || len(got)-1 > limit {
			t.Fatalf("dst prefix %v or limit broken (%d ids)", got[:min(len(got), 1)], len(got)-1)
		}
		if err != nil && len(got) != 1 {
			t.Fatalf("error %v with %d ids appended", err, len(got)-1)
		}
		want, werr, isJSON := refRenderIDs(b, limit)
		if !isJSON {
			if err == nil {
				t.Fatalf("%q is not JSON: got %v, want an error", b, got[1:])
			}
			return
		}
		if errors.Is(err, errRenderDepth) {
			return
		}
		if (err == nil) != (werr == nil) || (err == nil && !slices.Equal(got[1:], want)) {
			t.Fatalf("%q: got %v (%v), reference %v (%v)", b, got[1:], err, want, werr)
		}
	})
}
