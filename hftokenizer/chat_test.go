package hftokenizer

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nikolalohinski/gonja/v2/exec"
)

func render(t *testing.T, src, messages string, c Chat) (string, error) {
	t.Helper()
	tpl, err := NewChatTemplate(src)
	if err != nil {
		t.Fatal(err)
	}
	c.Messages = []byte(messages)
	return tpl.Render(c)
}

func TestToJSONIsPythons(t *testing.T) {
	msgs := `[{"role": "user", "content": "x", "z": {"b": 1, "a": [1.5, 2, null, true, "é\"\\\n\u0001"], "e": {}, "f": []}}]`
	for _, c := range []struct{ src, want string }{
		{`{{ messages[0].z | tojson }}`, `{"b": 1, "a": [1.5, 2, null, true, "é\"\\\n\u0001"], "e": {}, "f": []}`},
		{`{{ messages[0].z | tojson(indent=2) }}`, "{\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    2,\n    null,\n    true,\n    \"é\\\"\\\\\\n\\u0001\"\n  ],\n  \"e\": {},\n  \"f\": []\n}"},
		{`{{ "é😀" | tojson(ensure_ascii=true) }}`, `"\u00e9\ud83d\ude00"`},
	} {
		got, err := render(t, c.src, msgs, Chat{})
		if err != nil || got != c.want {
			t.Errorf("%s = %s (%v), want %s", c.src, got, err, c.want)
		}
	}
}

func TestPyFloat(t *testing.T) {
	for f, want := range map[float64]string{1.5: "1.5", 10: "10.0", 0.0025: "0.0025", 1e-7: "1e-07", 1e16: "1e+16", -2.5e20: "-2.5e+20", 123456789.125: "123456789.125"} {
		if got := pyFloat(f); got != want {
			t.Errorf("%v → %s, want %s", f, got, want)
		}
	}
}

func TestStrftime(t *testing.T) {
	now := time.Date(2026, 12, 5, 7, 8, 9, 0, time.UTC)
	got, err := render(t, `{{ strftime_now("%d %b %Y %H:%M:%S %%") }}`, `[]`, Chat{Now: now})
	if err != nil || got != "05 Dec 2026 07:08:09 %" {
		t.Fatalf("%q %v", got, err)
	}
}

func TestMultiPartContentFlattened(t *testing.T) {
	msgs := `[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]}]`
	got, err := render(t, `{% for m in messages %}{{ m.content }}{% endfor %}`, msgs, Chat{})
	if err != nil || got != "a\nb" {
		t.Fatalf("string template: %q %v", got, err)
	}
	// A template that loops over the parts gets them as they are.
	tpl, _ := NewChatTemplate(`{% for m in messages %}{% for p in m.content %}[{{ p.type }}]{% endfor %}{% endfor %}`)
	if tpl.ContentAsString {
		t.Fatal("a template looping over content taken for a string one")
	}
	got, err = tpl.Render(Chat{Messages: []byte(msgs)})
	if err != nil || got != "[text][image_url][text]" {
		t.Fatalf("openai template: %q %v", got, err)
	}
}

func TestVLLMMessages(t *testing.T) {
	src := `{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}{% else %}(none){% endif %};{% endfor %}`
	msgs := `[{"role":"assistant","content":null,"tool_calls":[{"function":{"name":"f","arguments":"{\"b\":1,\"a\":[2]}"}},{"function":{"name":"g","arguments":""}},{"function":{"name":"h","arguments":{"k":"v"}}}]},{"role":"assistant","content":"x","tool_calls":[]}]`
	got, err := render(t, src, msgs, Chat{VLLMMessages: true})
	if want := `assistant:{"b": 1, "a": [2]}{}{"k": "v"};assistant:x(none);`; err != nil || got != want {
		t.Errorf("vLLM: %q %v, want %q", got, err, want)
	}
	got, err = render(t, src, msgs, Chat{})
	if want := `assistant:"{\"b\":1,\"a\":[2]}"""{"k": "v"};assistant:x;`; err != nil || got != want {
		t.Errorf("transformers: %q %v, want %q", got, err, want)
	}
	if _, err := render(t, src, `[{"role":"assistant","tool_calls":[{"function":{"arguments":"{bad"}}]}]`, Chat{VLLMMessages: true}); err == nil {
		t.Error("arguments that are not JSON rendered")
	}
}

func TestRenderPrefix(t *testing.T) {
	tpl, err := NewChatTemplate(`{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}`)
	if err != nil {
		t.Fatal(err)
	}
	c := Chat{Messages: []byte(`[{"role":"user","content":"` + strings.Repeat("x", 100) + `"},{"role":"assistant","content":"yy"}]`)}
	full, err := tpl.Render(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{1, 6, 50, len(full) - 1} {
		got, cut, err := tpl.RenderPrefix(c, n)
		if err != nil || !cut || got != full[:n] {
			t.Errorf("prefix %d: %q cut=%v %v, want %q", n, got, cut, err, full[:n])
		}
	}
	if got, cut, err := tpl.RenderPrefix(c, len(full)); err != nil || cut || got != full {
		t.Errorf("exact size: %q cut=%v %v", got, cut, err)
	}
}

func TestRenderErrors(t *testing.T) {
	for name, c := range map[string]struct{ src, msgs string }{
		"raise":     {`{{ raise_exception("no system role") }}`, `[]`},
		"not array": {`x`, `{"role":"user"}`},
		"bad json":  {`x`, `[{"role":`},
		"trailing":  {`x`, `[] []`},
		"deep":      {`x`, strings.Repeat("[", 100) + strings.Repeat("]", 100)},
		"too large": {`{% for i in range(100000) %}{{ "0123456789" * 100 }}{% endfor %}`, `[]`},
	} {
		if out, err := render(t, c.src, c.msgs, Chat{}); err == nil {
			t.Errorf("%s: no error (rendered %d bytes)", name, len(out))
		}
	}
	if _, err := NewChatTemplate(`{% include "/etc/passwd" %}`); err == nil {
		if out, err := render(t, `{% include "/etc/passwd" %}`, `[]`, Chat{}); err == nil {
			t.Errorf("include read a file: %q", out)
		}
	}
	if _, err := ParseConfig([]byte(`{"bos_token": "<s>"}`)); err != ErrNoChatTemplate {
		t.Errorf("no chat_template: %v", err)
	}
	tpl, err := ParseConfig([]byte(`{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}`))
	if err != nil || tpl.Source != "D" {
		t.Errorf("named templates: %v", err)
	}
}

// FuzzRender: no message list, however hostile, panics the renderer.
func FuzzRender(f *testing.F) {
	f.Add(`[{"role":"user","content":"hi"}]`, `[{"type":"function","function":{"name":"f"}}]`)
	f.Add(`[{"role":"assistant","content":null,"tool_calls":[{"function":{"name":"f","arguments":{"a":[1,2.5e300,{}]}}}]}]`, `null`)
	f.Add(`[{"role":"tool","content":[{"type":"text","text":"x"}]},{"role":"user"}]`, ``)
	f.Add(`[1, "x", null, [], {"content": 3}]`, `{}`)
	tpl, err := NewChatTemplate(qwen3LikeTemplate)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, msgs, tools string) {
		if len(msgs)+len(tools) > 1<<16 {
			return
		}
		_, _ = tpl.Render(Chat{Messages: []byte(msgs), Tools: []byte(tools), AddGenerationPrompt: true})
	})
}

// qwen3LikeTemplate exercises what Qwen3's template uses: namespace, a
// reversed loop, tojson, string methods.
const qwen3LikeTemplate = `{%- if tools %}{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}{%- endif %}
{%- set ns = namespace(last=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
{%- if message.role == "user" and message.content is string and not message.content.startswith('<tool_response>') %}{%- set ns.last = index %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.content is string and '</think>' in message.content %}{{ message.content.split('</think>')[-1].lstrip('\n') }}{%- endif %}
{%- if message.tool_calls %}{%- for tc in message.tool_calls %}{%- if tc.function %}{%- set tc = tc.function %}{%- endif %}{{ tc.name }}{{ tc.arguments | tojson }}{%- endfor %}{%- endif %}
<|im_start|>{{ message.role }}{{ '\n' }}{{ message.content }}<|im_end|>
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant{%- endif %}`

// TestDecodeManyKeysLinear: an object's keys are checked for repeats in a
// map, not by scanning the pairs so far — the scan made a message of n keys
// cost n²/2 key comparisons (40,000 keys in a 430 KB body: 30 s of CPU on
// the pick path; the 300,000 here: about half an hour, so before the fix
// this test ends in go test's timeout; it takes well under a second now).
// A repeated key keeps its first place and takes the last value, as
// Python's json.loads.
func TestDecodeManyKeysLinear(t *testing.T) {
	const n = 300000
	var b strings.Builder
	b.WriteString(`[{"role":"user","content":"x"`)
	for i := range n {
		fmt.Fprintf(&b, `,"k%d":1`, i)
	}
	b.WriteString(`}]`)
	v, err := decodeOrdered([]byte(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	if d := v.([]any)[0].(*exec.Dict); len(d.Pairs) != n+2 {
		t.Errorf("%d keys decoded, want %d", len(d.Pairs), n+2)
	}
	v, err = decodeOrdered([]byte(`{"a":1,"b":2,"a":3}`))
	if err != nil {
		t.Fatal(err)
	}
	d := v.(*exec.Dict)
	if len(d.Pairs) != 2 || d.Pairs[0].Key.String() != "a" || d.Pairs[0].Value.String() != "3" || d.Pairs[1].Key.String() != "b" {
		t.Errorf("repeated key: %v", d.Pairs)
	}
}

// TestRenderPrefixDecodesAPrefix: RenderPrefix(c, n) decodes at most
// n × renderInputFactor bytes of the messages (and of the tools): the rest
// cannot show in n bytes of rendering, and decoding a whole 14.5 MB chat of
// empty messages into template values cost 4.1 s of CPU and 2.2 GB
// allocated for 512 KiB of rendering with Qwen3's template (0.77 s and
// 383 MB now, the same whatever the body's size). A message past the
// budget is never seen (here it would make the template raise, as it
// looks at every message before it prints); a rendering that stops short
// of n on a chat decoded in part is an error, its prefix unknown.
func TestRenderPrefixDecodesAPrefix(t *testing.T) {
	tpl, err := NewChatTemplate(`{% for m in messages %}{% if m.role == 'boom' %}{{ raise_exception('saw the last message') }}{% endif %}{% endfor %}` +
		`{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}`)
	if err != nil {
		t.Fatal(err)
	}
	msgs := "[" + strings.Repeat(`{"role":"user","content":"hello"},`, 10000) + `{"role":"boom","content":""}]`
	c := Chat{Messages: []byte(msgs)}
	const n = 1000
	got, cut, err := tpl.RenderPrefix(c, n)
	if err != nil || !cut || got != strings.Repeat("[user]hello", n/11+1)[:n] {
		t.Errorf("prefix of a long chat: %q cut=%v %v", got, cut, err)
	}
	if _, err := tpl.Render(c); err == nil || !strings.Contains(err.Error(), "saw the last message") {
		t.Errorf("full rendering: %v, want the template's exception", err)
	}
	quiet, err := NewChatTemplate(`{% for m in messages %}.{% endfor %}`)
	if err != nil {
		t.Fatal(err)
	}
	if got, _, err := quiet.RenderPrefix(c, n); err == nil {
		t.Errorf("a short rendering of a chat decoded in part: %d bytes, no error", len(got))
	}
}
