package gateway

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/simserver"
)

// modelEntry reads one entry of GET /v1/models (nil when absent).
func modelEntry(t *testing.T, c *http.Client, url, id string) *openai.Model {
	t.Helper()
	resp, err := c.Get(url + pathModels)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list openai.ModelList
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		t.Fatal(err)
	}
	for _, m := range list.Data {
		if m.ID == id {
			return &m
		}
	}
	return nil
}

// TestReloadAliases: aliases are part of what a reload applies: one added
// is listed and served at once, one whose models change falls back in its
// new order (its "created" kept), one removed is unknown, and a reload
// naming a model no endpoint serves is refused whole.
func TestReloadAliases(t *testing.T) {
	small, big := simFleet(t, 1, "small"), simFleet(t, 1, "big")
	cfg := fleetConfig(sched.RoundRobin, map[string]*simserver.Fleet{"small": small, "big": big})
	g, url := startGateway(t, cfg)
	c := testClient(t)
	chat := `{"model":"fast","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`
	if resp, b := post(t, c, url+pathChat, chat); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("before the alias: %d %s", resp.StatusCode, b)
	}

	cfg.Aliases = map[string][]string{"fast": {"small", "big"}}
	mustReload(t, g, cfg)
	m := modelEntry(t, c, url, "fast")
	if m == nil || m.Root != "small" {
		t.Fatalf("the added alias in /v1/models: %+v", m)
	}
	created := m.Created
	if resp, b := post(t, c, url+pathChat, chat); resp.StatusCode != 200 || resp.Header.Get(modelHeader) != "small" {
		t.Fatalf("the added alias: %d %s=%q %s", resp.StatusCode, modelHeader, resp.Header.Get(modelHeader), b)
	}

	cfg.Aliases = map[string][]string{"fast": {"big", "small"}}
	mustReload(t, g, cfg)
	if m := modelEntry(t, c, url, "fast"); m == nil || m.Root != "big" || m.Created != created {
		t.Fatalf("the changed alias in /v1/models: %+v (created %d before)", m, created)
	}
	if resp, b := post(t, c, url+pathChat, chat); resp.StatusCode != 200 || resp.Header.Get(modelHeader) != "big" {
		t.Fatalf("the changed alias: %d %s=%q %s", resp.StatusCode, modelHeader, resp.Header.Get(modelHeader), b)
	}

	bad := cfg
	bad.Aliases = map[string][]string{"fast": {"big", "huge"}}
	if err := g.Reload(bad); err == nil || !strings.Contains(err.Error(), "served by no endpoint") {
		t.Fatalf("an alias of an unserved model: %v", err)
	}
	if resp, _ := post(t, c, url+pathChat, chat); resp.Header.Get(modelHeader) != "big" {
		t.Fatal("the refused reload changed the alias")
	}

	cfg.Aliases = nil
	mustReload(t, g, cfg)
	if resp, b := post(t, c, url+pathChat, chat); resp.StatusCode != http.StatusNotFound || modelEntry(t, c, url, "fast") != nil {
		t.Fatalf("the removed alias: %d %s", resp.StatusCode, b)
	}
}

// TestReloadResponsesAffinity: the response-id affinity outlives reloads.
// A reload that keeps the engine holding a conversation (and rebuilds the
// keys, as every reload does) keeps its continuations pinned there, for the
// key that made it; once a reload removes that engine, its responses are
// not found — neither sent to the engine that took its slot, nor, for a
// request that read the configuration before the reload and picks after
// it, to whatever endpoint now has the slot.
func TestReloadResponsesAffinity(t *testing.T) {
	f := simFleet(t, 3, "m")
	cfg := fleetConfig(sched.RoundRobin, map[string]*simserver.Fleet{"m": f})
	cfg.Endpoints = cfg.Endpoints[:2]
	if err := cfg.Auth.AddKeys("alice plain:"+keyAlice, "test"); err != nil {
		t.Fatal(err)
	}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	alice := []string{"Authorization", "Bearer " + keyAlice}
	resp, b := post(t, c, url+pathResponses, `{"model":"m","input":"remember this","max_output_tokens":2}`, alice...)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	id := jsonOf[respAnswer](t, b).ID
	e, ok := g.affinity.lookup(id)
	if !ok {
		t.Fatal("the response id was not learnt")
	}
	holder := slot(t, g.state.Load().pools["m"], e.ep)
	cont := `{"model":"m","input":"and then","max_output_tokens":2,"previous_response_id":"` + id + `"}`
	get := func() (int, []byte) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, url+pathResponses+"/"+id, nil)
		req.Header.Set("Authorization", "Bearer "+keyAlice)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}

	// Kept: new pools and keys, the same endpoint.
	cfg.Routing.Policy = sched.LeastRequest
	mustReload(t, g, cfg)
	for i := range 3 {
		if resp, b := post(t, c, url+pathResponses, cont, alice...); resp.StatusCode != 200 {
			t.Fatalf("continuation %d after a reload that keeps its engine: %d %s", i, resp.StatusCode, b)
		}
	}
	if code, b := get(); code != 200 {
		t.Fatalf("retrieval after a reload that keeps its engine: %d %s", code, b)
	}

	// Removed: the third engine takes its slot.
	before := g.state.Load()
	kept := 1 - holder
	cfg.Endpoints = []EndpointConfig{cfg.Endpoints[kept], {URL: f.URLs[2], Model: "m", Kind: "sim"}}
	mustReload(t, g, cfg)
	p := g.state.Load().pools["m"]
	if p.endpoints[holder].name != f.URLs[2] {
		t.Fatalf("slot %d holds %s, want the new engine", holder, p.endpoints[holder].name)
	}
	resp, b = post(t, c, url+pathResponses, cont, alice...)
	if er := decodeError(t, b); resp.StatusCode != 404 || codeStr(er.Code) != codePreviousNotFound {
		t.Fatalf("continuation of a removed engine's response: %d %s, want the gateway's 404 %s", resp.StatusCode, b, codePreviousNotFound)
	}
	if code, b := get(); code != 404 || codeStr(decodeError(t, b).Code) != "not_found" {
		t.Fatalf("retrieval of a removed engine's response: %d %s", code, b)
	}

	// A continuation that read the configuration before the reload: its
	// pick is made in the new pool, where the slot it was pinned to is
	// the new engine's.
	req := httptest.NewRequest(http.MethodPost, pathResponses, strings.NewReader(cont))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+keyAlice)
	key := before.keys.lookup(keyAlice)
	rec := httptest.NewRecorder()
	g.serveInference(rec, req, kindResponses, key, before)
	if er := decodeError(t, rec.Body.Bytes()); rec.Code != http.StatusServiceUnavailable || codeStr(er.Code) != openai.CodeNoEndpoint ||
		!strings.Contains(er.Message, id) {
		t.Fatalf("a continuation pinned before the reload: %d %s, want 503 naming the response", rec.Code, rec.Body)
	}
}
