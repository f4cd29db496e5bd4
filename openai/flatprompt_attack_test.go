package openai

import (
	"reflect"
	"strconv"
	"strings"
	"testing"
)

// TestFlatPromptHostile holds the one-pass reading of a completion's flat
// token-id prompt (decodeFlatPrompt) to the ordinary decode on hostile
// bodies: keys spelled through escapes or hidden in strings and nested
// objects, id edges (2^31, 2^32, leading zeros, signs, exponents), a BOM,
// whitespace variants, truncations, garbage after the array or the object,
// and 10 MB of ids. Both ways give the same request or the same 400.
func TestFlatPromptHostile(t *testing.T) {
	big := strings.Repeat("4294967295,", (10<<20)/11) + "7"
	bodies := []string{
		`{"model":"m","prompt":[2147483647,2147483648,4294967295]}`,
		`{"model":"m","prompt":[4294967296]}`, `{"model":"m","prompt":[18446744073709551616]}`,
		`{"model":"m","prompt":[99999999999999999999999999999999999999]}`,
		`{"model":"m","prompt":[0,00]}`, `{"model":"m","prompt":[0]}`, `{"model":"m","prompt":[007]}`,
		`{"model":"m","prompt":[1e3]}`, `{"model":"m","prompt":[1E3]}`, `{"model":"m","prompt":[1.0]}`,
		`{"model":"m","prompt":[1,-0]}`, `{"model":"m","prompt":[+1]}`, `{"model":"m","prompt":[1,+1]}`,
		`{"model":"m","prompt":[0x10]}`, `{"model":"m","prompt":[1 2]}`, `{"model":"m","prompt":[1,,2]}`,
		`{"model":"m","prompt":[1,]}`, `{"model":"m","prompt":[1]]}`, `{"model":"m","prompt":[1]x}`,
		`{"model":"m","prompt":[1]}x`, `{"model":"m","prompt":[1]}}`, `{"model":"m","prompt":[1]}{}`,
		`{"model":"m","prompt":[1],"x":"]"}`, `{"model":"m","prompt":[1,"]"]}`,
		`{"model":"m","prompt":[1,null]}`, `{"model":"m","prompt":[1,true]}`,
		`{"model":"m","prompt":[1`, `{"model":"m","prompt":[`, `{"model":"m","prompt":`, `{"model":"m","prompt"`,
		`{"model":"m","prompt":[1]`, `{"model":"m","prompt":[1],`, `{"model":"m","prompt":[1] `,
		"\xef\xbb\xbf{\"model\":\"m\",\"prompt\":[1]}",
		"{\"model\":\"m\",\"prompt\":[1\v]}", "{\"model\":\"m\",\"prompt\":[1\f]}", "{\"model\":\"m\",\"prompt\":[1\u00a0]}",
		"{\"model\":\"m\",\"prompt\"\t:\n[\r1\r]\n}", "\n\t {\"prompt\":[1]} \n\t",
		`{"model":"m","\u0070rompt":[1]}`, `{"model":"m","pro\"mpt":[1]}`, `{"model":"m","prompt\\":[1]}`,
		`{"model":"m","prompt ":[1]}`, `{"model":"m"," prompt":[1]}`, `{"model":"m","PROMPT":[1]}`,
		`{"a":"\"prompt\":[9]","prompt":[1]}`, `{"a":"\\","prompt":[1]}`, `{"a":"\\\"","prompt":[1]}`,
		`{"a":"\u0022,\"prompt\":[9]","prompt":[1]}`, `{"a":"x\\\\\"prompt\":[9],\"b\":\"","prompt":[1]}`,
		`{"a":{"prompt":[9]},"prompt":[1]}`, `{"a":[{"prompt":[9]}],"prompt":[1]}`, `{"a":{"prompt":[9]}}`,
		`{"a":{"prompt":[9]},"model":"m"}`, `{"prompt":[1],"a":{"prompt":[9]}}`,
		`{"prompt":[1],"prompt":[1]}`, `{"prompt":[1],"prompt":null}`, `{"prompt":null,"prompt":[1]}`,
		`{"prompt":"x","prompt":[1]}`, `{"prompt":[1],"\u0070rompt":[2]}`, `{"\u0070rompt":[2],"prompt":[1]}`,
		`{"prompt":[1],"model":"m","model":"n"}`, `{"prompt":[1],"model":"m","Model":"n"}`,
		`{"prompt":[1],"max_tokens":1e400}`, `{"prompt":[1],"max_tokens":-1}`, `{"prompt":[1],"max_tokens":9223372036854775808}`,
		`{"prompt":[1],"stream_options":null}`, `{"prompt":[1],"stream_options":{"include_usage":1}}`,
		`{"prompt":[1],"n":null,"max_tokens":null,"model":null}`, `{"prompt":[1],"x":NaN}`, `{"prompt":[1],"x":-}`,
		`{"prompt":[1],"x":tru}`, `{"prompt":[1],"x":"\x01"}`, `{"prompt":[1],"x":"\q"}`, `{"prompt":[1],"x":"\u00"}`,
		`{"prompt":[1],"x":01}`, `{"prompt":[1],"x":.5}`, `{"prompt":[1],"x":1.}`, `{"prompt":[1],"x":[1,]}`,
		`{"prompt":[1],"x":{"a":1,}}`, `{"prompt":[1],"x":{1:2}}`, `{"prompt":[1],"x":[}`, `{"prompt":[1],"x":{]}`,
		`{"prompt":[1]` + strings.Repeat(`,"x":[1]`, 1000) + `}`,
		`{"x":` + strings.Repeat("[", 127) + strings.Repeat("]", 127) + `,"prompt":[1]}`,
		`{"x":` + strings.Repeat("[", 128) + strings.Repeat("]", 128) + `,"prompt":[1]}`,
		`{"x":` + strings.Repeat("[", 2000) + `,"prompt":[1]}`,
		`{"model":"m","prompt":[` + big + `]}`,
		`{"model":"m","prompt":[` + big + `]} garbage`,
		`{"model":"m","prompt":[` + big + `,4294967296]}`,
		`{"model":"m","prompt":[` + strings.Repeat(" ", 1<<20) + `1]}`,
		`{"model":"m","prompt":[1` + strings.Repeat(" ", 1<<20) + `]}`,
	}
	for _, n := range []uint64{1<<31 - 1, 1 << 31, 1<<32 - 1, 1 << 32, 1<<32 + 1, 1<<63 - 1, 1 << 63, 1<<64 - 1} {
		s := strconv.FormatUint(n, 10)
		bodies = append(bodies, `{"prompt":[`+s+`]}`, `{"prompt":[1,`+s+`]}`, `{"prompt":[0`+s+`]}`, `{"prompt":[`+s+`0]}`)
	}
	for _, b := range bodies {
		var slow, fast, reused CompletionRequest
		es := decode([]byte(b), &slow, false)
		ef := decode([]byte(b), &fast, true)
		reused.Prompt.spare = make([]uint32, 3, 8)
		reused.Prompt.spareList = make([][]uint32, 0, 1)
		er := decode([]byte(b), &reused, true)
		name := b
		if len(name) > 120 {
			name = name[:120] + "…"
		}
		for _, c := range []struct {
			name string
			e    *Error
			r    *CompletionRequest
		}{{"fast", ef, &fast}, {"reused", er, &reused}} {
			if !reflect.DeepEqual(es, c.e) {
				t.Errorf("%q: %s error %+v, ordinary %+v", name, c.name, c.e, es)
				continue
			}
			if es != nil {
				if es.Status != 400 || es.Message == "" {
					t.Errorf("%q: error %+v, want a 400 with a message", name, es)
				}
				continue
			}
			c.r.Prompt.spare, c.r.Prompt.spareList = nil, nil
			if !reflect.DeepEqual(slow, *c.r) {
				t.Errorf("%q: %s request differs from ordinary", name, c.name)
			}
		}
	}
}
