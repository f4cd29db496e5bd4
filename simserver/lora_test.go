package simserver

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sim"
)

func TestLoRAKVEvents(t *testing.T) {
	cfg := sim.Config{Profile: sim.Llama8BH100(), NumBlocks: 256, KVEvents: true, LoRA: sim.LoRAConfig{Adapters: []string{"a", "b"}}}
	e := sim.NewEngine(cfg)
	prompt := seqTokens(7, 40)
	must(t, e.Add(&sim.Request{ID: "x", Tokens: prompt, MaxTokens: 1, LoRA: "b", Extra: prefix.Seed("salt")}, 0))
	res := e.Step(0)
	if len(res.Events) != 1 || res.Events[0].Type != kvevents.BlockStored {
		t.Fatalf("events %+v", res.Events)
	}
	ev := res.Events[0]
	want := prefix.Hashes(nil, prompt, 16, sim.RootHash("b", prefix.Seed("salt")))
	if ev.LoRAName != "b" || ev.LoRAID != 2 || !slices.Equal(ev.BlockHashes, want) {
		t.Fatalf("BlockStored %+v, want lora b/2 and hashes %v", ev, want)
	}
	for _, enc := range []string{kvevents.EncodingMap, kvevents.EncodingArray} {
		b := decodeBatch(t, kvevents.AppendBatch(nil, 1, res.Events, 0, enc))
		f := b.events[0].fields
		if f["lora_name"] != "b" || asUint64(t, f["lora_id"]) != 2 {
			t.Fatalf("%s: lora fields %v", enc, f)
		}
		ek, _ := f["extra_keys"].([]any)
		if len(ek) != 2 {
			t.Fatalf("%s: extra_keys %v", enc, f["extra_keys"])
		}
		for _, k := range ek {
			if kk, _ := k.([]any); len(kk) != 1 || kk[0] != "b" {
				t.Fatalf("%s: extra_keys entry %v, want [b]", enc, k)
			}
		}
	}
}

func loraServer(t *testing.T, timeScale float64) (*Server, *httptest.Server) {
	t.Helper()
	return newTestServer(t, ServerConfig{TimeScale: timeScale, Engine: sim.Config{LoRA: sim.LoRAConfig{Adapters: []string{"sql-lora", "chat-lora"}}}})
}

func TestLoRAServer(t *testing.T) {
	_, ts := loraServer(t, 0)
	resp, err := http.Get(ts.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	ml := decodeJSON[openai.ModelList](t, b)
	if len(ml.Data) != 3 || ml.Data[0].ID != testModel || ml.Data[0].Parent != nil {
		t.Fatalf("/v1/models %s", b)
	}
	for i, a := range []string{"sql-lora", "chat-lora"} {
		m := ml.Data[i+1]
		if m.ID != a || m.Parent == nil || *m.Parent != testModel || m.Object != "model" || m.OwnedBy != "vllm" {
			t.Fatalf("adapter card %d: %s", i, b)
		}
	}
	if !strings.Contains(string(b), `"parent":null`) {
		t.Fatalf("base model card must carry parent null: %s", b)
	}

	prompt := strings.Repeat("the quick brown fox jumps over the lazy dog ", 12)
	complete := func(model string) (int, openai.Completion) {
		t.Helper()
		resp := post(t, ts, "/v1/completions", `{"model":"`+model+`","prompt":"`+prompt+`","max_tokens":2}`)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 {
			return resp.StatusCode, openai.Completion{}
		}
		return 200, decodeJSON[openai.Completion](t, b)
	}
	code, c := complete("sql-lora")
	if code != 200 || c.Model != "sql-lora" || c.Usage == nil || c.Usage.CompletionTokens != 2 || c.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("adapter request: %d %+v", code, c)
	}
	if _, c = complete("sql-lora"); c.Usage.PromptTokensDetails.CachedTokens == 0 {
		t.Fatal("same adapter, same prompt: no prefix hit")
	}
	if _, c = complete("chat-lora"); c.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("other adapter hit %d tokens", c.Usage.PromptTokensDetails.CachedTokens)
	}
	if _, c = complete(testModel); c.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("base model hit %d tokens of adapter blocks", c.Usage.PromptTokensDetails.CachedTokens)
	}
	if code, _ := complete("no-such-lora"); code != http.StatusNotFound {
		t.Fatalf("unknown adapter: %d, want 404", code)
	}
	if _, err := NewServer(ServerConfig{Model: "x", Engine: sim.Config{LoRA: sim.LoRAConfig{Adapters: []string{"x"}}}}); err == nil {
		t.Fatal("adapter named like the served model accepted")
	}
}

// vllm:lora_requests_info carries max_lora, the running and the waiting
// adapters, its value the wall-clock time of the last update.
func TestLoRARequestsInfo(t *testing.T) {
	s, ts := loraServer(t, 1) // real time: requests stay in flight
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream := func(model string) {
		body := `{"model":"` + model + `","prompt":[1,2,3],"stream":true,"max_tokens":2000}`
		req, _ := http.NewRequestWithContext(ctx, "POST", ts.URL+"/v1/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		go func() {
			if resp, err := http.DefaultClient.Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	stream("sql-lora")
	waitFor(t, "sql-lora running", func() bool { return s.Stats().Running == 1 })
	stream("chat-lora")
	before := float64(time.Now().UnixNano()) / 1e9
	waitFor(t, "chat-lora deferred", func() bool { st := s.Stats(); return st.Waiting == 1 && st.WaitingDeferred == 1 })
	// The snapshot is published before the gauge is set: wait for the series.
	var latest map[string]string
	var value float64
	waitFor(t, "lora_requests_info series", func() bool {
		mf := gatherOne(t, s, "vllm:lora_requests_info")
		value = 0
		for _, m := range mf.GetMetric() {
			if v := m.GetGauge().GetValue(); v > value {
				value = v
				latest = map[string]string{}
				for _, lp := range m.GetLabel() {
					latest[lp.GetName()] = lp.GetValue()
				}
			}
		}
		return latest["waiting_lora_adapters"] == "chat-lora"
	})
	if len(latest) != 3 || latest["max_lora"] != "1" || latest["running_lora_adapters"] != "sql-lora" {
		t.Fatalf("latest lora_requests_info labels %v", latest)
	}
	if now := float64(time.Now().UnixNano()) / 1e9; value < before-1 || value > now {
		t.Fatalf("lora_requests_info value %f is not the wall-clock time of the update (~%f)", value, now)
	}
	mf := gatherOne(t, s, "vllm:num_requests_waiting_by_reason")
	for _, m := range mf.GetMetric() {
		reason := ""
		for _, lp := range m.GetLabel() {
			if lp.GetName() == "reason" {
				reason = lp.GetValue()
			}
		}
		if want := map[string]float64{"capacity": 0, "deferred": 1}[reason]; m.GetGauge().GetValue() != want {
			t.Errorf("waiting_by_reason{%s} = %v, want %v", reason, m.GetGauge().GetValue(), want)
		}
	}
	cancel()
	waitFor(t, "aborts", func() bool { st := s.Stats(); return st.Running == 0 && st.Waiting == 0 })
}
