package jsonscan

import (
	"reflect"
	"strings"
	"testing"

	"github.com/infergate/infergate/openai"
)

// usageSeeds are whole answers as engines send them, and awkward variants.
var usageSeeds = []string{
	`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok","tool_calls":[]},"logprobs":null,"finish_reason":"stop","stop_reason":null}],"usage":{"prompt_tokens":420,"completion_tokens":2,"total_tokens":422,"prompt_tokens_details":{"cached_tokens":400}},"prompt_logprobs":null}`,
	`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" world","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":16,"total_tokens":21,"prompt_tokens_details":null}}`,
	`{"id":"x","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,"total_tokens":43}}`,
	`{"id":"x","choices":[{"message":{"content":"\u00e9\n\"q\""}}]}`,
	`{"usage":null}`,
	`{}`,
	` { "usage" : { "prompt_tokens" : 1 , "completion_tokens" : null } } `,
	`{"usage":{"prompt_tokens":1,"extra":{"a":[1,2,{"b":null}]},"prompt_tokens_details":{"cached_tokens":1,"audio_tokens":0}}}`,
	`{"Usage":{"prompt_tokens":1}}`,
	`{"usage":{"PROMPT_TOKENS":1}}`,
	`{"us\u0061ge":{"prompt_tokens":1}}`,
	"{\"u\u017fage\":{\"prompt_tokens\":1}}",
	`{"usage":{"prompt_tokens":1},"usage":{"completion_tokens":2}}`,
	`{"usage":{"prompt_tokens":1,"prompt_tokens":2}}`,
	`{"usage":{"prompt_tokens":"x","completion_tokens":2}}`,
	`{"usage":{"prompt_tokens":1.5}}`,
	`{"usage":{"prompt_tokens":1e2}}`,
	`{"usage":{"prompt_tokens":-3}}`,
	`{"usage":{"prompt_tokens":12345678901234567890}}`,
	`{"usage":5}`,
	`{"usage":[]}`,
	`{"usage":{"prompt_tokens_details":5}}`,
	`{"usage":{"prompt_tokens":1}} trailing`,
	`{"usage":{"prompt_tokens":1},}`,
	`{"usage":{"prompt_tokens":01}}`,
	`[{"usage":{"prompt_tokens":1}}]`,
	`null`,
	`"str"`,
	``,
	`{"error":{"message":"boom","type":"BadRequestError","param":null,"code":400}}`,
	"{\"a\":\"\xff\",\"usage\":{\"prompt_tokens\":1}}",
	`{"a":"` + "\x01" + `","usage":{"prompt_tokens":1}}`,
}

func TestUsage(t *testing.T) {
	for _, s := range usageSeeds {
		want := ParseUsage([]byte(s))
		if got := Usage([]byte(s)); !reflect.DeepEqual(got, want) {
			t.Errorf("%s:\n scan %+v\n json %+v", s, got, want)
		}
	}
	// The engines' ordinary answers take the fast path.
	for _, s := range usageSeeds[:7] {
		if _, d := ScanUsage([]byte(s)); !d {
			t.Errorf("not decided by the scanner: %s", s)
		}
	}
	u, _ := ScanUsage([]byte(usageSeeds[0]))
	want := &openai.Usage{PromptTokens: 420, CompletionTokens: 2, TotalTokens: 422,
		PromptTokensDetails: &openai.PromptTokensDetails{CachedTokens: 400}}
	if !reflect.DeepEqual(u, want) {
		t.Errorf("usage %+v, want %+v", u, want)
	}
}

// FuzzScanUsage: whenever the scanner decides, it agrees with
// encoding/json.
func FuzzScanUsage(f *testing.F) {
	for _, s := range usageSeeds {
		f.Add([]byte(s))
	}
	at := strings.Repeat("[", openai.MaxDepth-2) + strings.Repeat("]", openai.MaxDepth-2)
	for _, v := range []string{at, deepJSON, strings.Repeat("[", 1<<16)} {
		f.Add([]byte(`{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2},"x":` + v + `}`))
		f.Add([]byte(`{"usage":{"prompt_tokens":1,"x":` + v + `}}`))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got, decided := ScanUsage(data)
		if !decided {
			return
		}
		if want := ParseUsage(data); !reflect.DeepEqual(got, want) {
			t.Fatalf("%q:\n scan %+v\n json %+v", data, got, want)
		}
	})
}

func BenchmarkUsage(b *testing.B) {
	data := []byte(usageSeeds[0])
	b.Run("scan", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, ok := ScanUsage(data); !ok {
				b.Fatal("undecided")
			}
		}
	})
	b.Run("json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = ParseUsage(data)
		}
	})
}
