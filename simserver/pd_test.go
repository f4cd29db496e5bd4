package simserver

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sim"
)

// pdPrompt is a prompt of a few hundred tokens.
var pdPrompt = strings.Repeat("the quick brown fox jumps over the lazy dog ", 40)

// pdResp is a completion response with its kv_transfer_params.
type pdResp struct {
	ID      string `json:"id"`
	Choices []struct {
		Text         string `json:"text"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	Usage            openai.Usage    `json:"usage"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
}

// pdParams is kv_transfer_params as P returns it.
type pdParams struct {
	DoRemotePrefill *bool   `json:"do_remote_prefill"`
	DoRemoteDecode  *bool   `json:"do_remote_decode"`
	RemoteBlockIDs  []int32 `json:"remote_block_ids"`
	RemoteEngineID  string  `json:"remote_engine_id"`
	RemoteRequestID string  `json:"remote_request_id"`
	RemoteHost      string  `json:"remote_host"`
	RemotePort      int     `json:"remote_port"`
	TPSize          int     `json:"tp_size"`
}

// complete posts a completion body (a map, marshalled) and decodes the answer.
func complete(t *testing.T, base string, body map[string]any, header ...string) (int, pdResp, string) {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/completions", strings.NewReader(string(b)))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var r pdResp
	if resp.StatusCode == http.StatusOK {
		r = decodeJSON[pdResp](t, raw)
	}
	return resp.StatusCode, r, string(raw)
}

func pdBodyFor(maxTokens int, kv any) map[string]any {
	m := map[string]any{"model": testModel, "prompt": pdPrompt, "max_tokens": maxTokens}
	if kv != nil {
		m["kv_transfer_params"] = kv
	}
	return m
}

// counterValue returns the value of a counter (with the given label
// value, if any) of s.
func counterValue(t *testing.T, s *Server, name, label string) float64 {
	t.Helper()
	for _, m := range gatherOne(t, s, name).GetMetric() {
		if label == "" {
			return m.GetCounter().GetValue()
		}
		for _, l := range m.GetLabel() {
			if l.GetValue() == label {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("%s{%s} not found", name, label)
	return 0
}

// prefillLeg sends the proxy's P leg (PROTOCOLS.md §3.1 step 1) and
// returns P's kv_transfer_params, raw, and its response.
func prefillLeg(t *testing.T, p *httptest.Server) (json.RawMessage, pdResp) {
	t.Helper()
	status, r, raw := complete(t, p.URL, pdBodyFor(1, map[string]any{"do_remote_decode": true, "do_remote_prefill": false,
		"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil}))
	if status != http.StatusOK || len(r.KVTransferParams) == 0 {
		t.Fatalf("P leg: %d %s", status, raw)
	}
	return r.KVTransferParams, r
}

// The vLLM NIXL flow, serial (§3.1): P computes and holds; D reads what P
// holds, reports prompt − 1 cached, and P's hold is released by D's
// notification.
func TestPDNixlSerialFlow(t *testing.T) {
	ps, p := newTestServer(t, ServerConfig{})
	ds, d := newTestServer(t, ServerConfig{})

	kv, pr := prefillLeg(t, p)
	var params pdParams
	if err := json.Unmarshal(kv, &params); err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(p.URL, "http://"))
	bs := ps.EngineConfig().BlockSize
	wantBlocks := (pr.Usage.PromptTokens + bs - 1) / bs
	if params.DoRemotePrefill == nil || !*params.DoRemotePrefill || params.DoRemoteDecode == nil || *params.DoRemoteDecode ||
		len(params.RemoteBlockIDs) != wantBlocks || params.RemoteEngineID != ps.EngineID() || params.RemoteRequestID != pr.ID ||
		params.RemoteHost != "127.0.0.1" || strconv.Itoa(params.RemotePort) != port || params.TPSize != ps.EngineConfig().Profile.TensorParallel {
		t.Fatalf("P's kv_transfer_params %s (want %d blocks, engine %s, port %s)", kv, wantBlocks, ps.EngineID(), port)
	}
	if pr.Choices[0].FinishReason != "length" || pr.Usage.CompletionTokens != 1 {
		t.Fatalf("P's response %+v", pr)
	}
	if st := ps.Stats(); st.HeldRequests != 1 || st.HeldBlocks != wantBlocks {
		t.Fatalf("P after its leg: held %d requests, %d blocks", st.HeldRequests, st.HeldBlocks)
	}

	// D gets the original request and P's kv_transfer_params verbatim.
	status, dr, raw := complete(t, d.URL, pdBodyFor(5, kv))
	if status != http.StatusOK {
		t.Fatalf("D: %d %s", status, raw)
	}
	if u := dr.Usage; u.PromptTokens != pr.Usage.PromptTokens || u.CompletionTokens != 5 ||
		u.PromptTokensDetails == nil || u.PromptTokensDetails.CachedTokens != u.PromptTokens-1 {
		t.Fatalf("D's usage %+v", u)
	}
	if len(dr.KVTransferParams) != 0 {
		t.Fatalf("D answered kv_transfer_params %s", dr.KVTransferParams)
	}
	if st := ds.Stats(); st.TransferredBlocks != int64(wantBlocks) || st.PrefillTokens > 1 {
		t.Fatalf("D read %d blocks, computed %d prefill tokens", st.TransferredBlocks, st.PrefillTokens)
	}
	// D notified P before it answered.
	if st := ps.Stats(); st.HeldRequests != 0 || st.HeldBlocks != 0 || st.HeldReleased != 1 {
		t.Fatalf("P after D's read: %+v", st)
	}
	if n := counterValue(t, ds, "infergate_sim_pd_kv_transfers_total", ""); n != 1 {
		t.Fatalf("transfers = %v", n)
	}
	if c, _ := histogram(t, ds, "infergate_sim_pd_kv_transfer_seconds"); c != 1 {
		t.Fatalf("transfer histogram has %d samples", c)
	}
	for _, r := range pdRecomputeReasons {
		if n := counterValue(t, ds, "infergate_sim_pd_recompute_total", r); n != 0 {
			t.Fatalf("recompute{%s} = %v", r, n)
		}
	}
	// The same read again: P no longer holds the blocks, so D recomputes.
	status, _, raw = complete(t, d.URL, pdBodyFor(2, kv))
	if status != http.StatusOK || ds.Stats().TransferredBlocks != int64(wantBlocks) {
		t.Fatalf("second D: %d %s, %d blocks read in all", status, raw, ds.Stats().TransferredBlocks)
	}
	if n := counterValue(t, ds, "infergate_sim_pd_recompute_total", "not_held"); n != 1 {
		t.Fatalf("recompute{not_held} = %v", n)
	}
}

// P streams: kv_transfer_params ride on the last chunk.
func TestPDNixlStreamingPrefill(t *testing.T) {
	ps, p := newTestServer(t, ServerConfig{})
	body := pdBodyFor(1, map[string]any{"do_remote_decode": true})
	body["stream"] = true
	b, _ := json.Marshal(body)
	events, done := readStream(t, post(t, p, "/v1/completions", string(b)))
	if !done || len(events) == 0 {
		t.Fatalf("%d events, done %v", len(events), done)
	}
	last := decodeJSON[pdResp](t, events[len(events)-1])
	params := decodeJSON[pdParams](t, last.KVTransferParams)
	if last.Choices[0].FinishReason != "length" || params.RemoteEngineID != ps.EngineID() || len(params.RemoteBlockIDs) == 0 {
		t.Fatalf("last chunk %s", events[len(events)-1])
	}
	for _, ev := range events[:len(events)-1] {
		if strings.Contains(string(ev), "kv_transfer_params") {
			t.Fatalf("an earlier chunk has kv_transfer_params: %s", ev)
		}
	}
}

// D recomputes when P's side channel says no, or cannot be reached, or the
// parameters are incomplete; each counted by reason.
func TestPDNixlFallbacks(t *testing.T) {
	ps, p := newTestServer(t, ServerConfig{})
	ds, d := newTestServer(t, ServerConfig{})
	kv, pr := prefillLeg(t, p)
	var params map[string]any
	if err := json.Unmarshal(kv, &params); err != nil {
		t.Fatal(err)
	}
	with := func(k string, v any) map[string]any {
		m := map[string]any{}
		for k, v := range params {
			m[k] = v
		}
		if v == nil {
			delete(m, k)
		} else {
			m[k] = v
		}
		return m
	}
	prefill := func() int64 { return ds.Stats().PrefillTokens }
	recompute := func(kv map[string]any, reason string) {
		t.Helper()
		before, n := prefill(), counterValue(t, ds, "infergate_sim_pd_recompute_total", reason)
		status, dr, raw := complete(t, d.URL, pdBodyFor(2, kv))
		if status != http.StatusOK {
			t.Fatalf("D: %d %s", status, raw)
		}
		if got := prefill() - before; got < int64(pr.Usage.PromptTokens)-int64(dr.Usage.PromptTokensDetails.CachedTokens) || got < 2 {
			t.Fatalf("D computed %d prefill tokens of a %d-token prompt (%d cached)", got, pr.Usage.PromptTokens, dr.Usage.PromptTokensDetails.CachedTokens)
		}
		if m := counterValue(t, ds, "infergate_sim_pd_recompute_total", reason); m != n+1 {
			t.Fatalf("recompute{%s} %v → %v", reason, n, m)
		}
	}
	recompute(with("remote_request_id", "cmpl-bogus"), "not_held")
	recompute(with("remote_engine_id", "another-engine"), "not_held")
	recompute(with("remote_block_ids", []int{1, 2, 3}), "not_held")
	recompute(with("remote_host", nil), "invalid_params")
	recompute(with("remote_request_id", nil), "invalid_params")
	if ds.Stats().TransferredBlocks != 0 || ps.Stats().HeldRequests != 1 {
		t.Fatalf("a failed check read or released: D %+v, P %+v", ds.Stats(), ps.Stats())
	}
	// P gone: connection refused.
	ps.Close()
	p.Close()
	recompute(params, "unreachable")
}

// A gateway releases a hold whose D never came; releasing twice is a 404.
func TestPDClientRelease(t *testing.T) {
	ps, p := newTestServer(t, ServerConfig{})
	kv, _ := prefillLeg(t, p)
	params := decodeJSON[pdParams](t, kv)
	release := func(body string) int {
		resp := post(t, p, "/infergate/pd/v1/release", body)
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	if st := release(`{"remote_engine_id":"other","remote_request_id":"` + params.RemoteRequestID + `"}`); st != http.StatusNotFound {
		t.Fatalf("release naming another engine: %d", st)
	}
	if st := release(`{"remote_engine_id":"` + params.RemoteEngineID + `","remote_request_id":"` + params.RemoteRequestID + `"}`); st != http.StatusOK {
		t.Fatalf("release: %d", st)
	}
	if st := ps.Stats(); st.HeldRequests != 0 || st.HeldReleased != 1 {
		t.Fatalf("after release: %+v", st)
	}
	if st := release(`{"remote_request_id":"` + params.RemoteRequestID + `"}`); st != http.StatusNotFound {
		t.Fatalf("second release: %d", st)
	}
	// By Mooncake transfer id.
	status, _, raw := complete(t, p.URL, pdBodyFor(1, map[string]any{"do_remote_decode": true, "transfer_id": "xfer-1"}))
	if status != http.StatusOK || ps.Stats().HeldRequests != 1 {
		t.Fatalf("Mooncake P leg: %d %s", status, raw)
	}
	if st := release(`{"transfer_id":"xfer-1"}`); st != http.StatusOK || ps.Stats().HeldRequests != 0 {
		t.Fatalf("release by transfer id: %d, %+v", st, ps.Stats())
	}
	if st := release(`{}`); st != http.StatusBadRequest {
		t.Fatalf("release naming nothing: %d", st)
	}
}

// An idle P expires a hold at the abort timeout.
func TestPDAbortTimeoutOnIdleServer(t *testing.T) {
	ps, p := newTestServer(t, ServerConfig{Engine: sim.Config{PD: sim.PDConfig{AbortTimeout: 50 * time.Millisecond}}})
	kv, _ := prefillLeg(t, p)
	waitFor(t, "the hold to expire", func() bool { st := ps.Stats(); return st.HeldExpired == 1 && st.HeldRequests == 0 })
	params := decodeJSON[pdParams](t, kv)
	b, _ := json.Marshal(map[string]any{"remote_engine_id": params.RemoteEngineID, "remote_request_id": params.RemoteRequestID, "remote_block_ids": params.RemoteBlockIDs})
	resp := post(t, p, "/infergate/pd/v1/read", string(b))
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound || ps.pdReg.len() != 0 {
		t.Fatalf("read after expiry: %d, registry %d", resp.StatusCode, ps.pdReg.len())
	}
	if n := counterValue(t, ps, "infergate_sim_pd_held_expired_total", ""); n != 1 {
		t.Fatalf("expired counter %v", n)
	}
}

// pdPair starts a P with a bootstrap listener and a D of the given roles.
func pdPair(t *testing.T, pcfg, dcfg PDConfig) (*Server, *httptest.Server, *Server, *httptest.Server) {
	t.Helper()
	pcfg.BootstrapAddr = "127.0.0.1:0"
	ps, p := newTestServer(t, ServerConfig{PD: pcfg})
	ds, d := newTestServer(t, ServerConfig{PD: dcfg})
	return ps, p, ds, d
}

// legs sends the D body first, waits until D waits on P, then the P body;
// it returns both responses.
func legs(t *testing.T, ps *Server, p, d *httptest.Server, pbody, dbody map[string]any) (pr, dr pdResp) {
	t.Helper()
	var wg sync.WaitGroup
	var status int
	var raw string
	wg.Add(1)
	go func() {
		defer wg.Done()
		status, dr, raw = complete(t, d.URL, dbody)
	}()
	waitFor(t, "D to wait on P", func() bool { return ps.pdReg.numWaiters() == 1 })
	pstatus, pr, praw := complete(t, p.URL, pbody)
	wg.Wait()
	if pstatus != http.StatusOK || status != http.StatusOK {
		t.Fatalf("P: %d %s; D: %d %s", pstatus, praw, status, raw)
	}
	return pr, dr
}

// The vLLM Mooncake flow (§3.2): both legs at once; D waits for P's hold
// on P's bootstrap listener, reads it and releases it.
func TestPDMooncakeConcurrentFlow(t *testing.T) {
	ps, p, ds, d := pdPair(t, PDConfig{}, PDConfig{})
	resp := mustGet(t, "http://"+ps.BootstrapAddr()+"/query")
	q := decodeJSON[map[string]map[string]string](t, func() []byte { b, _ := io.ReadAll(resp.Body); resp.Body.Close(); return b }())
	if q["0"]["engine_id"] != ps.EngineID() {
		t.Fatalf("/query = %v", q)
	}
	boot := "http://" + ps.BootstrapAddr()
	pbody := pdBodyFor(1, map[string]any{"do_remote_prefill": false, "do_remote_decode": true, "transfer_id": "xfer-42"})
	dbody := pdBodyFor(4, map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": "xfer-42",
		"remote_bootstrap_addr": boot, "remote_engine_id": q["0"]["engine_id"]})
	pr, dr := legs(t, ps, p, d, pbody, dbody)
	if u := dr.Usage; u.CompletionTokens != 4 || u.PromptTokensDetails.CachedTokens != pr.Usage.PromptTokens-1 {
		t.Fatalf("D's usage %+v (P's prompt %d)", u, pr.Usage.PromptTokens)
	}
	if st := ps.Stats(); st.HeldRequests != 0 || st.HeldReleased != 1 {
		t.Fatalf("P after D's read: %+v", st)
	}
	if n := counterValue(t, ds, "infergate_sim_pd_kv_transfers_total", ""); n != 1 {
		t.Fatalf("transfers %v", n)
	}

	// Another engine's id: D recomputes.
	dbody["kv_transfer_params"].(map[string]any)["remote_engine_id"] = "not-p"
	pbody["kv_transfer_params"].(map[string]any)["transfer_id"] = "xfer-43"
	dbody["kv_transfer_params"].(map[string]any)["transfer_id"] = "xfer-43"
	legs(t, ps, p, d, pbody, dbody)
	if n := counterValue(t, ds, "infergate_sim_pd_recompute_total", "engine_mismatch"); n != 1 {
		t.Fatalf("recompute{engine_mismatch} %v", n)
	}
}

// A concurrent D whose P never holds the transfer waits PDConfig.Wait,
// then recomputes.
func TestPDMooncakeWaitTimeout(t *testing.T) {
	ps, _, ds, d := pdPair(t, PDConfig{}, PDConfig{Wait: time.Millisecond})
	status, _, raw := complete(t, d.URL, pdBodyFor(2, map[string]any{"do_remote_prefill": true, "transfer_id": "never",
		"remote_bootstrap_addr": "http://" + ps.BootstrapAddr(), "remote_engine_id": ps.EngineID()}))
	if status != http.StatusOK {
		t.Fatalf("%d %s", status, raw)
	}
	if n := counterValue(t, ds, "infergate_sim_pd_recompute_total", "not_held"); n != 1 || ds.Stats().TransferredBlocks != 0 {
		t.Fatalf("recompute{not_held} %v, transferred %d", n, ds.Stats().TransferredBlocks)
	}
}

// The SGLang flow (§3.3): the same body to a prefill-mode and a
// decode-mode server; P generates one token and holds by room, D waits for
// the room on P's bootstrap port, reads and releases. Scalars and arrays
// of one.
func TestPDSGLangFlow(t *testing.T) {
	ps, p, ds, d := pdPair(t, PDConfig{Role: RolePrefill}, PDConfig{Role: RoleDecode})
	_, port, _ := net.SplitHostPort(ps.BootstrapAddr())
	portN, _ := strconv.Atoi(port)
	for i, fields := range []map[string]any{
		{"bootstrap_host": "127.0.0.1", "bootstrap_port": portN, "bootstrap_room": int64(1<<63 - 1)},
		{"bootstrap_host": []string{"127.0.0.1"}, "bootstrap_port": []int{portN}, "bootstrap_room": []int{7}},
	} {
		body := pdBodyFor(6, nil)
		for k, v := range fields {
			body[k] = v
		}
		pr, dr := legs(t, ps, p, d, body, body)
		if pr.Usage.CompletionTokens != 1 || len(pr.KVTransferParams) != 0 {
			t.Fatalf("P generated %d tokens, kv_transfer_params %s", pr.Usage.CompletionTokens, pr.KVTransferParams)
		}
		if u := dr.Usage; u.CompletionTokens != 6 || u.PromptTokensDetails.CachedTokens != pr.Usage.PromptTokens-1 {
			t.Fatalf("D's usage %+v", u)
		}
		if st := ps.Stats(); st.HeldRequests != 0 || st.HeldReleased != int64(i+1) {
			t.Fatalf("P after D's read: %+v", st)
		}
	}
	if n := counterValue(t, ds, "infergate_sim_pd_kv_transfers_total", ""); n != 2 {
		t.Fatalf("transfers %v", n)
	}
	// A server in null mode serves the body as usual.
	bs, b := newTestServer(t, ServerConfig{})
	body := pdBodyFor(3, nil)
	body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"] = "127.0.0.1", portN, 9
	if status, r, raw := complete(t, b.URL, body); status != http.StatusOK || r.Usage.CompletionTokens != 3 || bs.Stats().HeldRequests != 0 {
		t.Fatalf("null mode: %d %s", status, raw)
	}
}

// Hostile P/D fields get OpenAI-format 400s, never a panic or a hold.
func TestPDHostileFields(t *testing.T) {
	ps, p := newTestServer(t, ServerConfig{PD: PDConfig{Role: RolePrefill, BootstrapAddr: "127.0.0.1:0"}})
	ds, d := newTestServer(t, ServerConfig{PD: PDConfig{Role: RoleDecode}})
	huge := "[" + strings.Repeat("1,", MaxRemoteBlockIDs) + "1]"
	long := `"` + strings.Repeat("x", maxPDString+1) + `"`
	cases := []string{
		`"kv_transfer_params":"x"`,
		`"kv_transfer_params":[]`,
		`"kv_transfer_params":5`,
		`"kv_transfer_params":{"do_remote_decode":"yes"}`,
		`"kv_transfer_params":{"do_remote_decode":1}`,
		`"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":"a"}`,
		`"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1.5]}`,
		`"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[-1]}`,
		`"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[4294967296]}`,
		`"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[[1]]]}`,
		`"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":` + huge + `}`,
		`"kv_transfer_params":{"remote_port":-1}`,
		`"kv_transfer_params":{"remote_port":70000}`,
		`"kv_transfer_params":{"remote_port":"80"}`,
		`"kv_transfer_params":{"remote_engine_id":5}`,
		`"kv_transfer_params":{"remote_engine_id":` + long + `}`,
		`"kv_transfer_params":{"tp_size":0}`,
		`"kv_transfer_params":{"remote_bootstrap_addr":"ftp://x:1"}`,
		`"kv_transfer_params":{"remote_bootstrap_addr":"http://"}`,
		`"bootstrap_room":-1`,
		`"bootstrap_room":9223372036854775808`,
		`"bootstrap_room":"1"`,
		`"bootstrap_room":1.5`,
		`"bootstrap_room":[]`,
		`"bootstrap_room":[1,2]`,
		`"bootstrap_room":[1],"bootstrap_host":["a","b"]`,
		`"bootstrap_room":[` + strings.Repeat("1,", maxBootstrapBatch) + `1]`,
		`"bootstrap_room":1,"bootstrap_port":0`,
		`"bootstrap_room":1,"bootstrap_port":-5`,
		`"bootstrap_room":1,"bootstrap_host":5`,
		`"bootstrap_port":8998`, // a prefill server needs the room
	}
	for _, c := range cases {
		body := `{"model":"` + testModel + `","prompt":"hi","max_tokens":2,` + c + `}`
		for _, ts := range []*httptest.Server{p, d} {
			resp := post(t, ts, "/v1/completions", body)
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusBadRequest {
				if ts == d && c == `"bootstrap_port":8998` {
					continue // a decode server recomputes a body without a room
				}
				t.Fatalf("%s: %d %s", c, resp.StatusCode, b)
			}
			if e := decodeJSON[openai.ErrorResponse](t, b); e.Error == nil || e.Error.Message == "" {
				t.Fatalf("%s: not an OpenAI error: %s", c, b)
			}
		}
	}
	// The side channel's own input.
	side := []struct{ method, path, body string }{
		{"POST", "/infergate/pd/v1/read", `[]`},
		{"POST", "/infergate/pd/v1/read", `{"remote_request_id":5}`},
		{"POST", "/infergate/pd/v1/read", `{"remote_request_id":"x","remote_block_ids":{}}`},
		{"POST", "/infergate/pd/v1/release", `{"bootstrap_room":-3}`},
		{"POST", "/infergate/pd/v1/release", `{"transfer_id":` + long + `}`},
		{"GET", "/infergate/pd/v1/transfer?room=-1", ``},
		{"GET", "/infergate/pd/v1/transfer?room=1&transfer_id=x", ``},
		{"GET", "/infergate/pd/v1/transfer?room=1&wait_ms=-1", ``},
		{"GET", "/infergate/pd/v1/transfer", ``},
	}
	for _, c := range side {
		req, _ := http.NewRequest(c.method, p.URL+c.path, strings.NewReader(c.body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("%s %s %s: %d", c.method, c.path, c.body, resp.StatusCode)
		}
	}
	for path, limit := range map[string]int64{"/infergate/pd/v1/read": ps.pdReadBody, "/infergate/pd/v1/release": maxPDBody} {
		resp := post(t, p, path, `{"x":"`+strings.Repeat("a", int(limit))+`"}`)
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Fatalf("an oversized side-channel body on %s: %d", path, resp.StatusCode)
		}
	}
	if ps.Stats().HeldRequests != 0 || ds.Stats().TransferredBlocks != 0 {
		t.Fatal("a rejected request held or read")
	}
	// Unknown keys are ignored; null is absent.
	if status, _, raw := complete(t, p.URL, pdBodyFor(1, map[string]any{"remote_num_tokens": 5, "transfer_mode": "pull", "do_remote_decode": nil})); status != http.StatusOK {
		t.Fatalf("unknown keys: %d %s", status, raw)
	}
}

// With API keys the side channel is guarded, and D sends P the key its
// own request came with.
func TestPDAPIKeys(t *testing.T) {
	keys := []string{"k1"}
	ps, p := newTestServer(t, ServerConfig{APIKeys: keys})
	ds, d := newTestServer(t, ServerConfig{APIKeys: keys})
	for _, path := range []string{"/infergate/pd/v1/read", "/infergate/pd/v1/release"} {
		resp := post(t, p, path, `{}`)
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("%s without a key: %d", path, resp.StatusCode)
		}
	}
	status, pr, raw := complete(t, p.URL, pdBodyFor(1, map[string]any{"do_remote_decode": true}), "Authorization", "Bearer k1")
	if status != http.StatusOK {
		t.Fatalf("P: %d %s", status, raw)
	}
	status, dr, raw := complete(t, d.URL, pdBodyFor(2, pr.KVTransferParams), "Authorization", "Bearer k1")
	if status != http.StatusOK || dr.Usage.PromptTokensDetails.CachedTokens != dr.Usage.PromptTokens-1 {
		t.Fatalf("D: %d %s", status, raw)
	}
	if ps.Stats().HeldRequests != 0 || ds.Stats().TransferredBlocks == 0 {
		t.Fatalf("P %+v, D %+v", ps.Stats(), ds.Stats())
	}
}

func TestPDInfoAndConfig(t *testing.T) {
	ps, p := newTestServer(t, ServerConfig{PD: PDConfig{Role: RolePrefill, BootstrapAddr: "127.0.0.1:0", EngineID: "eng-1"}})
	resp := mustGet(t, p.URL+"/infergate/pd/v1/info")
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	info := decodeJSON[PDInfo](t, b)
	if info != ps.PDInfo() || info.EngineID != "eng-1" || info.Role != RolePrefill || info.BootstrapAddr == "" {
		t.Fatalf("info %+v", info)
	}
	// /query is on the bootstrap listener, not the main one unless asked.
	resp = mustGet(t, p.URL+"/query")
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Fatalf("/query on main: %d", resp.StatusCode)
	}
	_, m := newTestServer(t, ServerConfig{PD: PDConfig{BootstrapOnMain: true}})
	resp = mustGet(t, m.URL+"/query")
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/query with BootstrapOnMain: %d", resp.StatusCode)
	}
	for _, c := range []PDConfig{{Role: "both-ish"}, {Wait: -1}, {AdvertiseAddr: "nohost"}, {BootstrapAddr: "256.0.0.1:1"}} {
		if s, err := NewServer(ServerConfig{PD: c}); err == nil {
			s.Close()
			t.Fatalf("%+v accepted", c)
		}
	}
	if a, b := newUUID(), newUUID(); a == b || len(a) != 36 {
		t.Fatalf("uuids %s %s", a, b)
	}
}

// FuzzPDParams feeds arbitrary bodies to the P/D field parsers (the
// generation requests' and the side channel's): 400s or a well-formed
// request, never a panic, and the bounds hold.
func FuzzPDParams(f *testing.F) {
	for _, s := range []string{
		`{"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`,
		`{"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3],"remote_engine_id":"e","remote_request_id":"r","remote_host":"::1","remote_port":5600,"tp_size":4}}`,
		`{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1,2],[3]],"remote_engine_id":"e","remote_request_id":"r","remote_host":"h","remote_port":1}}`,
		`{"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"transfer_id":"xfer-1","remote_bootstrap_addr":"http://127.0.0.1:8998","remote_engine_id":"e"}}`,
		`{"kv_transfer_params":{"do_remote_prefill":false,"do_remote_decode":true,"transfer_id":"xfer-1"}}`,
		`{"bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":12345}`,
		`{"bootstrap_host":["fe80::1"],"bootstrap_port":[null],"bootstrap_room":[9223372036854775807]}`,
		`{"bootstrap_room":[1,2],"bootstrap_host":["a"]}`,
		`{"kv_transfer_params":"x","bootstrap_room":-1}`,
		`{"remote_request_id":"r","remote_block_ids":[1],"transfer_id":"t","bootstrap_room":3}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		if !json.Valid(body) || openai.TooDeep(body) {
			return
		}
		for _, role := range []Role{RoleBoth, RolePrefill, RoleDecode} {
			pd, e := parsePD(body, role)
			if e != nil {
				if e.Status != http.StatusBadRequest || e.Message == "" {
					t.Fatalf("error %+v", e)
				}
				continue
			}
			if pd == nil {
				continue
			}
			if pd.oneToken && (role != RolePrefill || !pd.hold) {
				t.Fatalf("role %s: %+v", role, pd)
			}
			if src := pd.src; src != nil {
				if len(src.blockIDs) > MaxRemoteBlockIDs || !strings.HasPrefix(src.base, "http") ||
					(src.flow == "nixl") != (len(src.blockIDs) > 0) || (src.flow == "sglang" && role != RoleDecode) {
					t.Fatalf("role %s: source %+v", role, src)
				}
			}
		}
		var kb pdKeyBody
		if err := json.Unmarshal(body, &kb); err == nil {
			if key, _, e := kb.key(); e == nil && key == "" {
				t.Fatal("no error and no key")
			}
			if ids, e := parseBlockIDs(kb.RemoteBlockIDs, "remote_block_ids"); e == nil && len(ids) > MaxRemoteBlockIDs {
				t.Fatal("too many block ids")
			}
		}
	})
}

// A P/D fleet: prefill engines with bootstrap listeners, decode engines;
// the members say what a gateway needs, and the SGLang flow runs between
// them.
func TestPDFleet(t *testing.T) {
	before := runtimeGoroutines()
	f, err := StartPDFleet(1, 2, ServerConfig{TimeScale: 1000, PD: PDConfig{EngineID: "sim"},
		Engine: sim.Config{PD: sim.PDConfig{DecodeMaxNumBatchedTokens: 384}}})
	if err != nil {
		t.Fatal(err)
	}
	if len(f.Members) != 3 || len(f.URLs) != 3 {
		t.Fatalf("members %+v", f.Members)
	}
	// The decode engines take their own token budget, the prefill engine the default.
	for i, want := range []int{sim.DefaultMaxNumBatchedTokens, 384, 384} {
		if got := f.Servers[i].EngineConfig().MaxNumBatchedTokens; got != want {
			t.Fatalf("engine %d budget %d, want %d", i, got, want)
		}
	}
	for i, m := range f.Members {
		wantRole := RoleDecode
		if i == 0 {
			wantRole = RolePrefill
		}
		if m.URL != f.URLs[i] || m.Role != wantRole || (m.BootstrapAddr != "") != (i == 0) || m.EngineID != fmt.Sprintf("sim-%d", i) {
			t.Fatalf("member %d: %+v", i, m)
		}
	}
	host, port, _ := net.SplitHostPort(f.Members[0].BootstrapAddr)
	portN, _ := strconv.Atoi(port)
	body := pdBodyFor(3, nil)
	body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"] = host, portN, 77
	var wg sync.WaitGroup
	var dr pdResp
	var dstatus int
	wg.Add(1)
	go func() { defer wg.Done(); dstatus, dr, _ = complete(t, f.URLs[2], body) }()
	waitFor(t, "D to wait on P", func() bool { return f.Servers[0].pdReg.numWaiters() == 1 })
	if status, _, raw := complete(t, f.URLs[0], body); status != http.StatusOK {
		t.Fatalf("P: %d %s", status, raw)
	}
	wg.Wait()
	if dstatus != http.StatusOK || dr.Usage.PromptTokensDetails.CachedTokens != dr.Usage.PromptTokens-1 || f.Servers[0].Stats().HeldRequests != 0 {
		t.Fatalf("D: %d %+v; P %+v", dstatus, dr.Usage, f.Servers[0].Stats())
	}
	f.Close()
	http.DefaultClient.CloseIdleConnections()
	waitFor(t, "fleet goroutines to exit", func() bool { return runtimeGoroutines() <= before })
	if _, err := StartPDFleet(0, 1, ServerConfig{}); err == nil {
		t.Fatal("a P/D fleet without prefill engines accepted")
	}
	if got := offsetAddrPort("127.0.0.1:8998", 2); got != "127.0.0.1:9000" {
		t.Fatalf("offset %s", got)
	}
	if got := offsetAddrPort("127.0.0.1:0", 2); got != "127.0.0.1:0" {
		t.Fatalf("offset of port 0: %s", got)
	}
}

func runtimeGoroutines() int { return runtime.NumGoroutine() }
