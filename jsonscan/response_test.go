package jsonscan

import (
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
		want, wantOK := ParseResponse([]byte(s))
		got, gotOK := Response([]byte(s))
		if gotOK != wantOK || !reflect.DeepEqual(got, want) {
			t.Errorf("%s:\n view %+v %v\n json %+v %v", s, got, gotOK, want, wantOK)
		}
	}
	// vLLM's ordinary events take the fast path, and read as they should.
	for i, s := range responseEventSeeds[:10] {
		v, d := ScanResponse([]byte(s))
		if !d {
			t.Errorf("not decided by the scanner: %s", s)
		}
		switch i {
		case 2, 4, 5:
			if !v.Output {
				t.Errorf("no output: %s", s)
			}
		case 6:
			if !v.Terminal || v.Failed || v.ID != "resp_1" || v.Usage == nil || v.Usage.PromptTokens != 40 || v.Usage.Cached() != 32 || v.Usage.CompletionTokens != 3 {
				t.Errorf("completed: %+v %+v", v, v.Usage)
			}
		case 7:
			if !v.Terminal || v.Failed || v.ID != "resp_2" || v.Usage.TotalTokens != 2 {
				t.Errorf("incomplete: %+v", v)
			}
		case 8, 9:
			if !v.Failed {
				t.Errorf("not failed: %s", s)
			}
		default:
			if v.Output || v.Terminal {
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
		got, decided := ScanResponse(data)
		want, ok := ParseResponse(data)
		if decided && (!ok || !reflect.DeepEqual(got, want)) {
			t.Fatalf("%q:\n scan %+v\n json %+v (ok %v)", data, got, want, ok)
		}
	})
}
