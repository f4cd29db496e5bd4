package disagg

import (
	"bytes"
	"encoding/json"
	"maps"
	"reflect"
	"strings"
	"testing"
)

func decodeMap(t testing.TB, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	if err := d.Decode(&m); err != nil {
		t.Fatalf("decode %s: %v", b, err)
	}
	return m
}

const chatBody = `{"model":"m","messages":[{"role":"user","content":"hi \"there\""}],"stream":true,` +
	`"stream_options":{"include_usage":true},"max_tokens":64,"max_completion_tokens":64,"min_tokens":4,` +
	`"vllm_xargs":{"a":[1,{"b":null}]},"kv_transfer_params":{"x":1},"cache_salt":"s"}`

func TestNIXLPrefillBody(t *testing.T) {
	b, err := NIXLPrefillBody(nil, []byte(chatBody))
	if err != nil {
		t.Fatal(err)
	}
	m := decodeMap(t, b)
	if m["stream"] != false || m["max_tokens"] != json.Number("1") || m["max_completion_tokens"] != json.Number("1") {
		t.Fatalf("limits: %s", b)
	}
	for _, k := range []string{"stream_options", "min_tokens", "min_completion_tokens"} {
		if _, ok := m[k]; ok {
			t.Fatalf("%s kept: %s", k, b)
		}
	}
	kv := m["kv_transfer_params"].(map[string]any)
	want := map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
	if !reflect.DeepEqual(kv, want) {
		t.Fatalf("kv_transfer_params %v", kv)
	}
	// Order and bytes of the other members kept.
	if !bytes.HasPrefix(b, []byte(`{"model":"m","messages":[{"role":"user","content":"hi \"there\""}],"stream":false,`)) ||
		!bytes.Contains(b, []byte(`"vllm_xargs":{"a":[1,{"b":null}]}`)) || !bytes.HasSuffix(b, []byte(`"cache_salt":"s"}`)) {
		t.Fatalf("order or bytes changed: %s", b)
	}
	// Without max_completion_tokens none is added.
	b, _ = NIXLPrefillBody(nil, []byte(`{"model":"m","prompt":"x"}`))
	if m := decodeMap(t, b); m["max_completion_tokens"] != nil || m["max_tokens"] != json.Number("1") {
		t.Fatalf("completion: %s", b)
	}
}

func TestNIXLDecodeBodyKeepsTheRequest(t *testing.T) {
	params := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2]],"remote_engine_id":"e","remote_request_id":"r","remote_host":"h","remote_port":5600,"tp_size":1,"future_key":{"x":[1]}}`
	b, err := NIXLDecodeBody(nil, []byte(chatBody), []byte(params))
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Replace(chatBody, `"kv_transfer_params":{"x":1}`, `"kv_transfer_params":`+params, 1)
	if string(b) != want {
		t.Fatalf("got  %s\nwant %s", b, want)
	}
}

func TestParsePrefill(t *testing.T) {
	ok := `{"id":"x","choices":[],"usage":{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":32}},` +
		`"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2],"remote_engine_id":"eng","remote_request_id":"req","remote_host":"10.0.0.1","remote_port":5601,"tp_size":1}}`
	p, err := ParsePrefill([]byte(ok))
	if err != nil {
		t.Fatal(err)
	}
	if p.EngineID != "eng" || p.RequestID != "req" || p.Host != "10.0.0.1" || p.Port != 5601 || !p.Blocks || !p.Holds() || p.Cached != 32 || !p.HasUsage {
		t.Fatalf("%+v", p)
	}
	if !bytes.HasPrefix(p.Params, []byte(`{"do_remote_prefill":true`)) || !json.Valid(p.Params) {
		t.Fatalf("params %s", p.Params)
	}
	if rb := ReleaseBody(&p); string(rb) != `{"remote_engine_id":"eng","remote_request_id":"req"}` {
		t.Fatalf("release body %s", rb)
	}
	for _, bad := range []string{
		`{}`, `[]`, `{"kv_transfer_params":null}`, `{"kv_transfer_params":{"do_remote_prefill":false,"remote_engine_id":"e"}}`,
		`{"kv_transfer_params":{"do_remote_prefill":true}}`,
		`{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[1]}}`,
		`{"kv_transfer_params":"x"}`, `not json`,
	} {
		if _, err := ParsePrefill([]byte(bad)); err == nil {
			t.Errorf("ParsePrefill(%s) accepted", bad)
		}
	}
	// No blocks (a prompt fully cached on D's side): valid, nothing held.
	p, err = ParsePrefill([]byte(`{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[]}}`))
	if err != nil || p.Holds() {
		t.Fatalf("%+v %v", p, err)
	}
}

func TestMooncakeBodies(t *testing.T) {
	id := NewTransferID()
	if !strings.HasPrefix(id, "xfer-") || len(id) != 41 {
		t.Fatalf("transfer id %q", id)
	}
	pb, err := MooncakePrefillBody(nil, []byte(chatBody), id)
	if err != nil {
		t.Fatal(err)
	}
	m := decodeMap(t, pb)
	if kv := m["kv_transfer_params"].(map[string]any); !reflect.DeepEqual(kv, map[string]any{"do_remote_prefill": false, "do_remote_decode": true, "transfer_id": id}) ||
		m["stream"] != false || m["max_tokens"] != json.Number("1") || m["stream_options"] != nil {
		t.Fatalf("prefill %s", pb)
	}
	db, _ := MooncakeDecodeBody(nil, []byte(chatBody), id, BootstrapAddr("10.0.0.1", 8998), "eng-0")
	m = decodeMap(t, db)
	want := map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": id,
		"remote_bootstrap_addr": "http://10.0.0.1:8998", "remote_engine_id": "eng-0"}
	if kv := m["kv_transfer_params"].(map[string]any); !reflect.DeepEqual(kv, want) || m["stream"] != true || m["max_tokens"] != json.Number("64") {
		t.Fatalf("decode %s", db)
	}
	e, err := ParseBootstrap([]byte(`{"0":{"engine_id":"eng-0"},"1":{"engine_id":"eng-1"}}`), 1)
	if err != nil || e != "eng-1" {
		t.Fatalf("%q %v", e, err)
	}
	if _, err := ParseBootstrap([]byte(`{"1":{"engine_id":"x"}}`), 0); err == nil {
		t.Fatal("missing rank accepted")
	}
}

func TestSGLangBody(t *testing.T) {
	b, err := SGLangBody(nil, []byte(`{"model":"m","prompt":"x","stream":true}`), "fe80::1", 8998, []uint64{7})
	if err != nil || string(b) != `{"model":"m","prompt":"x","stream":true,"bootstrap_host":"fe80::1","bootstrap_port":8998,"bootstrap_room":7}` {
		t.Fatalf("%s %v", b, err)
	}
	b, _ = SGLangBody(nil, []byte(`{"model":"m","n":2}`), "h", 0, []uint64{1, 2})
	if string(b) != `{"model":"m","n":2,"bootstrap_host":["h","h"],"bootstrap_port":[null,null],"bootstrap_room":[1,2]}` {
		t.Fatalf("batch %s", b)
	}
	for _, tc := range []struct {
		body string
		chat bool
		n    int
	}{
		{`{"n":3}`, true, 3}, {`{"n":1}`, true, 0}, {`{}`, true, 0}, {`{"prompt":"a"}`, false, 0},
		{`{"prompt":["a","b"]}`, false, 2}, {`{"prompt":[1,2,3]}`, false, 0}, {`{"prompt":[[1],[2],[3]]}`, false, 3},
	} {
		if n, err := BatchSize([]byte(tc.body), tc.chat); err != nil || n != tc.n {
			t.Errorf("BatchSize(%s) = %d, %v; want %d", tc.body, n, err, tc.n)
		}
	}
	if _, err := BatchSize([]byte(`{"n":"x"}`), true); err == nil {
		t.Error("n \"x\" accepted")
	}
	for range 100 {
		if r := NewRoom(); r > 1<<63-1 {
			t.Fatalf("room %d", r)
		}
	}
}

func TestRewriteCached(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`{"id":"c","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":9}}}`,
			`{"id":"c","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}`},
		{`{"usage":{"prompt_tokens":10,"prompt_tokens_details":null}}`, `{"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":4}}}`},
		{`{"usage":{"prompt_tokens":10}}`, `{"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":4}}}`},
		{`{"usage":{"prompt_tokens_details":{"audio_tokens":0,"cached_tokens":9}}}`, `{"usage":{"prompt_tokens_details":{"audio_tokens":0,"cached_tokens":4}}}`},
	} {
		got, ok := RewriteCached(nil, []byte(tc.in), 4)
		if !ok || string(got) != tc.want {
			t.Errorf("RewriteCached(%s) = %s, %v; want %s", tc.in, got, ok, tc.want)
		}
	}
	for _, in := range []string{`{"choices":[{"delta":{"content":"usage"}}],"usage":null}`, `{"choices":[]}`, `data`} {
		if got, ok := RewriteCached(nil, []byte(in), 4); ok || len(got) != 0 {
			t.Errorf("RewriteCached(%s) = %s, %v", in, got, ok)
		}
	}
	// P hit nothing, D says null: stays null.
	if _, ok := RewriteCached(nil, []byte(`{"usage":{"prompt_tokens_details":null}}`), 0); ok {
		t.Error("null rewritten for 0")
	}
	if got, _ := RewriteCached(nil, []byte(`{"usage":{"prompt_tokens_details":{"cached_tokens":9}}}`), 0); string(got) != `{"usage":{"prompt_tokens_details":{"cached_tokens":0}}}` {
		t.Errorf("0: %s", got)
	}
}

func TestEditRefusesHostileBodies(t *testing.T) {
	deep := strings.Repeat("[", 200) + strings.Repeat("]", 200)
	for _, in := range []string{`{"a":` + deep + `}`, `[1]`, `{"a":}`, `{"a":1}x`, ""} {
		if _, err := NIXLPrefillBody(nil, []byte(in)); err == nil {
			t.Errorf("NIXLPrefillBody(%.30s) accepted", in)
		}
	}
	// Duplicated keys: the value set wins, later duplicates dropped.
	b, err := edit(nil, []byte(`{"stream":true,"a":1,"stream":true}`), []field{{"stream", jsonFalse}})
	if err != nil || string(b) != `{"stream":false,"a":1}` {
		t.Fatalf("%s %v", b, err)
	}
	// Escaped keys are keys (Python's json decodes them).
	b, _ = edit(nil, []byte(`{"str\u0065am":true}`), []field{{"stream", jsonFalse}})
	if string(b) != `{"str\u0065am":false}` {
		t.Fatalf("escaped key: %s", b)
	}
	b, _ = edit(nil, []byte(" { } "), []field{{"a", jsonOne}})
	if string(b) != `{"a":1}` {
		t.Fatalf("empty: %s", b)
	}
}

// FuzzEdit holds edit to encoding/json: for any object it accepts, the
// result decodes to the input's members with the edits applied.
func FuzzEdit(f *testing.F) {
	for _, s := range []string{chatBody, `{}`, `{"a":"\"}{","b":[{"c":"]"}]}`, `{"stream":1,"stream":2}`, `{"str\u0065am":1}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		out, err := edit(nil, body, []field{{"stream", jsonFalse}, {"max_tokens", jsonOne}}, "stream_options")
		var in map[string]any
		if json.Unmarshal(body, &in) != nil || in == nil {
			if err == nil {
				t.Fatalf("edit accepted %q: %q", body, out)
			}
			return
		}
		if err != nil {
			if checkObject(body) == nil {
				t.Fatalf("edit refused an object %q: %v", body, err)
			}
			return
		}
		var got map[string]any
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("edit(%q) = %q: %v", body, out, err)
		}
		want := maps.Clone(in)
		delete(want, "stream_options")
		want["stream"], want["max_tokens"] = false, 1.0
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("edit(%q) = %q\ngot  %v\nwant %v", body, out, got, want)
		}
	})
}

// FuzzParsePrefill: no input panics, and accepted params are an object
// with the fields the gateway reads.
func FuzzParsePrefill(f *testing.F) {
	f.Add([]byte(`{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_request_id":"r","remote_block_ids":[1],"remote_host":"h","remote_port":1}}`))
	f.Add([]byte(`{"usage":{"prompt_tokens_details":{"cached_tokens":3}},"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e"}}`))
	f.Fuzz(func(t *testing.T, resp []byte) {
		p, err := ParsePrefill(resp)
		if err != nil {
			return
		}
		var m map[string]any
		if json.Unmarshal(p.Params, &m) != nil || p.EngineID == "" || m["do_remote_prefill"] != true {
			t.Fatalf("accepted %q: %+v", resp, p)
		}
	})
}

// FuzzRewriteCached: a rewritten chunk decodes, with cached_tokens set and
// every other top-level member as it was.
func FuzzRewriteCached(f *testing.F) {
	f.Add([]byte(`{"usage":{"prompt_tokens":3,"prompt_tokens_details":null}}`))
	f.Add([]byte(`{"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":2,"x":1}}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		out, ok := RewriteCached(nil, data, 5)
		if !ok {
			return
		}
		var in, got map[string]any
		if json.Unmarshal(data, &in) != nil {
			t.Fatalf("rewrote invalid %q", data)
		}
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("RewriteCached(%q) = %q: %v", data, out, err)
		}
		var u struct {
			Usage struct {
				D struct {
					C int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if json.Unmarshal(out, &u) != nil || u.Usage.D.C != 5 {
			t.Fatalf("RewriteCached(%q) = %q", data, out)
		}
		delete(in, "usage")
		delete(got, "usage")
		if !reflect.DeepEqual(in, got) {
			t.Fatalf("members changed: %q → %q", data, out)
		}
	})
}

// FuzzBootstrapAndBatch: the /query and batch parsers never panic, and a
// SGLang body is valid JSON with as many rooms as the batch.
func FuzzBootstrapAndBatch(f *testing.F) {
	f.Add([]byte(`{"0":{"engine_id":"e"}}`), []byte(`{"prompt":["a","b"],"n":2}`))
	f.Fuzz(func(t *testing.T, query, body []byte) {
		_, _ = ParseBootstrap(query, 0)
		n, err := BatchSize(body, len(query)%2 == 0)
		if err != nil {
			return
		}
		rooms := make([]uint64, max(n, 1))
		out, err := SGLangBody(nil, body, "h", 1, rooms)
		if err != nil {
			t.Fatalf("SGLangBody refused a body BatchSize read: %q: %v", body, err)
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(out, &m); err != nil {
			t.Fatalf("SGLangBody(%q) = %q: %v", body, out, err)
		}
		if n > 1 {
			var r []uint64
			if json.Unmarshal(m["bootstrap_room"], &r) != nil || len(r) != n {
				t.Fatalf("rooms %s for batch %d", m["bootstrap_room"], n)
			}
		}
	})
}

func TestStripClientParams(t *testing.T) {
	body := []byte(`{"model":"m","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.9.9.9"},"messages":[],"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":5,"kv\u005ftransfer_params":{}}`)
	out, ok, err := StripClientParams(nil, body)
	if err != nil || !ok {
		t.Fatalf("StripClientParams: %v %v", ok, err)
	}
	if string(out) != `{"model":"m","messages":[]}` {
		t.Fatalf("stripped: %s", out)
	}
	plain := []byte(`{"model":"m","messages":[{"role":"user","content":"kv_transfer_params"}]}`)
	out, ok, err = StripClientParams(nil, plain)
	if err != nil || ok || &out[0] != &plain[0] {
		t.Fatalf("a body without them: %s %v %v", out, ok, err)
	}
	if _, _, err := StripClientParams(nil, []byte(`[1]`)); err == nil {
		t.Fatal("an array accepted")
	}
}

// BenchmarkStripClientParams is the request path's cost for a body without
// P/D members (every chat and completion passes through it).
func BenchmarkStripClientParams(b *testing.B) {
	body := []byte(`{"model":"m","stream":true,"max_tokens":128,"messages":[{"role":"system","content":"` +
		strings.Repeat(`You are a helpful assistant.\n`, 400) + `"},{"role":"user","content":"Hi"}]}`)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, ok, err := StripClientParams(nil, body); ok || err != nil {
			b.Fatal(ok, err)
		}
	}
}
