package jsonscan

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/infergate/infergate/openai"
)

// chunkSeeds are events as engines send them, and awkward variants.
var chunkSeeds = []string{
	`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
	`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hel"},"logprobs":null,"finish_reason":null}]}`,
	`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" world","logprobs":null,"finish_reason":null}]}`,
	`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length","stop_reason":null}]}`,
	`{"id":"x","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,"total_tokens":43,"prompt_tokens_details":{"cached_tokens":32}}}`,
	`{"choices":[{"delta":{"reasoning":"hm"}}]}`,
	`{"choices":[{"delta":{"reasoning_content":"hm"}}]}`,
	`{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"a\":1}"}}]}}]}`,
	`{"choices":[{"delta":{"tool_calls":[]}}]}`,
	`{"choices":[{"delta":{"tool_calls":[ ]}}]}`,
	`{"choices":[{"delta":{"tool_calls":null,"content":null}}]}`,
	`{"error":{"message":"engine died","type":"InternalServerError","param":null,"code":500}}`,
	`{"error":null,"choices":null}`,
	`{"Choices":[{"text":"a"}]}`,
	`{"choices":[{"TEXT":"a"}]}`,
	`{"ch\u006fices":[{"text":"a"}]}`,
	`{"choices":[{"text":"a"}],"choices":[]}`,
	`{"choices":[{"text":"\u00e9\n"}]}`,
	`{"choices":[{"text":5}]}`,
	`{"choices":[null,{"text":"a"}]}`,
	`{"choices":"nope","usage":{"prompt_tokens":"x","completion_tokens":2}}`,
	`{"usage":5}`,
	`{"choices":[{"text":"a"}]} trailing`,
	` {"choices" : [ {"text" : "a" } ] } `,
	`[1,2]`,
	`null`,
	`"str"`,
	`{"a":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}`,
	`{"a":-0.5e+10,"b":true,"c":false,"d":"\"\\\/\b\f\n\r\t"}`,
	`{"a":01}`,
	`{"a":"` + "\x01" + `"}`,
	`{"choices":[{"text":"a",}]}`,
	"{\"choices\":[{\"text\":\"\xff\xfe\"}]}",
	`{"choices":[{"delta":{},"text":""}],"usage":null}`,
}

func TestScanChunk(t *testing.T) {
	decided := 0
	for _, s := range chunkSeeds {
		want, wantOK := ParseChat([]byte(s), nil)
		got, gotOK := Chat([]byte(s), nil)
		if gotOK != wantOK || !reflect.DeepEqual(got, want) {
			t.Errorf("%s:\n view %+v %v\n json %+v %v", s, got, gotOK, want, wantOK)
		}
		if _, d := ScanChat([]byte(s)); d {
			decided++
		}
	}
	// The engines' ordinary events must take the fast path.
	for _, s := range chunkSeeds[:12] {
		if _, d := ScanChat([]byte(s)); !d {
			t.Errorf("not decided by the scanner: %s", s)
		}
	}
	t.Logf("%d of %d seeds decided by the scanner", decided, len(chunkSeeds))
}

// FuzzScanChunk: whenever the scanner decides, it agrees with
// encoding/json.
func FuzzScanChunk(f *testing.F) {
	for _, s := range chunkSeeds {
		f.Add([]byte(s))
	}
	// A hostile engine's nesting: at, and past, openai.MaxDepth, in a
	// field the gateway reads and in one it skips.
	at := strings.Repeat("[", openai.MaxDepth-2) + strings.Repeat("]", openai.MaxDepth-2)
	for _, v := range []string{at, deepJSON, strings.Repeat("[", 1<<16)} {
		f.Add([]byte(`{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2},"x":` + v + `}`))
		f.Add([]byte(`{"choices":[{"index":0,"text":"a","logprobs":` + v + `}]}`))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got, decided := ScanChat(data)
		if !decided {
			return
		}
		want, ok := ParseChat(data, nil)
		if !ok || !reflect.DeepEqual(got, want) {
			t.Fatalf("%q:\n scan %+v\n json %+v (ok %v)", data, got, want, ok)
		}
	})
}

func BenchmarkViewChunk(b *testing.B) {
	data := []byte(chunkSeeds[1])
	b.Run("scan", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, ok := ScanChat(data); !ok {
				b.Fatal("undecided")
			}
		}
	})
	b.Run("json", func(b *testing.B) {
		b.ReportAllocs()
		var scratch openai.StreamChunk
		for b.Loop() {
			_, _ = ParseChat(data, &scratch)
		}
	})
}

func TestWithoutMember(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`{"id":"x","choices":[{"text":"a"}],"usage":{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}}`, `{"id":"x","choices":[{"text":"a"}]}`},
		{`{"usage":null, "id":"x","choices":[]}`, `{"id":"x","choices":[]}`},
		{`{"id":"x", "usage" : {"a":[1,{"b":"}"}]} , "model":"m"}`, `{"id":"x", "model":"m"}`},
		{`{"usage":{}}`, `{}`},
	} {
		from, to, ok := MemberSpan([]byte(tc.in), "usage")
		if !ok {
			t.Fatalf("%s: no usage member found", tc.in)
		}
		got := string(WithoutMember(nil, []byte(tc.in), from, to))
		if got != tc.want {
			t.Errorf("%s:\n got %s\nwant %s", tc.in, got, tc.want)
		}
		var v map[string]any
		if err := json.Unmarshal([]byte(got), &v); err != nil {
			t.Errorf("%s: result is not JSON: %v", got, err)
		}
	}
	for _, in := range []string{`{"id":"x"}`, `[1]`, `{"a":`, `{"usager":1}`, `{"x":{"usage":1}}`} {
		if _, _, ok := MemberSpan([]byte(in), "usage"); ok {
			t.Errorf("%s: found a top-level usage member", in)
		}
	}
}

// deepJSON nests one level past openai.MaxDepth.
var deepJSON = strings.Repeat("[", openai.MaxDepth+1) + strings.Repeat("]", openai.MaxDepth+1)
